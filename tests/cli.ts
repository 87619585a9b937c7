// The command line as the tests start it: `node ...cliArgs(...)` runs src/cli/main.ts; `cliArgs('lab:pretrain', ...)`
// runs the demo-model lab's entry (lab/demo-model/cli.ts, `npm run lab:pretrain -- ...`) instead.
//
// Under tsx every start compiles the CLI's modules one by one (about 1.2 s of CPU before main runs), and the suite
// starts the CLI several hundred times. So each test process bundles src/cli/main.ts once, with esbuild (the
// compiler tsx itself uses, on the same sources), and starts the bundle (about 0.3 s). The bundle is rebuilt in
// every test process, so it can never be older than the sources under test.
//
// It sits two folders below the root, as the sources do, so the paths the code finds from its own location (the
// shaders, the CLIP vocabulary) resolve to the same files; npm packages stay external and load from node_modules.
// DBS_CLI_TSX=1 starts the sources through tsx instead, to rule the bundle out.
import { mkdtempSync, mkdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { buildSync } from 'esbuild';

const root = join(import.meta.dirname, '..');
/** The entry each command line starts from: the product's CLI, and the lab's pretraining (its first argument 'lab:pretrain'). */
const ENTRIES = { cli: 'src/cli/main.ts', 'lab:pretrain': 'lab/demo-model/cli.ts' } as const;
const bundles = new Map<keyof typeof ENTRIES, string>();
let dir: string | undefined;

function build(entry: keyof typeof ENTRIES): string {
  if (!dir) {
    const parent = join(root, '.cache');
    mkdirSync(parent, { recursive: true });
    const made = mkdtempSync(join(parent, 'cli-'));
    process.on('exit', () => rmSync(made, { recursive: true, force: true }));
    dir = made;
  }
  const outfile = join(dir, entry === 'cli' ? 'main.mjs' : 'lab-pretrain.mjs');
  buildSync({
    entryPoints: [join(root, ENTRIES[entry])],
    bundle: true,
    platform: 'node',
    format: 'esm',
    target: 'node20',
    packages: 'external',
    outfile,
    logLevel: 'error',
  });
  return outfile;
}

/** Node's arguments that run the command line with `args` (the lab's pretraining when args[0] is 'lab:pretrain'). */
export function cliArgs(...args: string[]): string[] {
  const entry = args[0] === 'lab:pretrain' ? 'lab:pretrain' : 'cli';
  const rest = entry === 'cli' ? args : args.slice(1);
  if (process.env.DBS_CLI_TSX === '1') return ['--import', import.meta.resolve('tsx'), join(root, ENTRIES[entry]), ...rest];
  let bundle = bundles.get(entry);
  if (!bundle) bundles.set(entry, (bundle = build(entry)));
  return [bundle, ...rest];
}
