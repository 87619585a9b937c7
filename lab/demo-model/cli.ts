// The lab's command line: `npm run lab:pretrain -- ...` pretrains the demo model (pretrain-cli.ts) on the same
// engine, flag parser, run lock and stop signals as the product's `npm run cli` (src/cli/), which knows nothing of it.
// `--help` (or -h) prints the usage and every flag with its default and range, before any work, and exits 0.
import { flagsHelp } from '../../src/cli/args.ts';
import { userMessage } from '../../src/cli/errors.ts';
import { wantsHelp } from '../../src/cli/help.ts';
import { withGpu } from '../../src/cli/with-gpu.ts';

const args = process.argv.slice(2);
try {
  if (wantsHelp(args)) {
    const { USAGE, FLAGS } = await import('./pretrain-cli.ts');
    console.log([USAGE, '', 'flags:', ...flagsHelp(FLAGS)].join('\n'));
  } else await withGpu(async () => (await import('./pretrain-cli.ts')).pretrainCommand, args);
} catch (e) {
  console.error(`error: ${userMessage(e)}`);
  process.exitCode = 1;
}
// Dawn keeps the event loop alive: leave once the command is done.
process.exit(process.exitCode ?? 0);
