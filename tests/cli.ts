// The command line as the tests start it: `node ...cliArgs(...)` runs src/cli/main.ts.
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
let bundle: string | undefined;

function build(): string {
  const parent = join(root, '.cache');
  mkdirSync(parent, { recursive: true });
  const dir = mkdtempSync(join(parent, 'cli-'));
  process.on('exit', () => rmSync(dir, { recursive: true, force: true }));
  const outfile = join(dir, 'main.mjs');
  buildSync({
    entryPoints: [join(root, 'src/cli/main.ts')],
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

/** Node's arguments that run the command line with `args`. */
export function cliArgs(...args: string[]): string[] {
  if (process.env.DBS_CLI_TSX === '1') return ['--import', import.meta.resolve('tsx'), join(root, 'src/cli/main.ts'), ...args];
  bundle ??= build();
  return [bundle, ...args];
}
