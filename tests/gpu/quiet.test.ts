// Dawn's "artificially reduced" limit notices (printed by native code straight to fd 2 when the first
// adapter is discovered) do not reach users; other stderr output still does. Each case runs in a child
// process, as a user's command would, and looks at what lands on its real stderr.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { closeSync, mkdtempSync, openSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { pathToFileURL } from 'node:url';
import { withoutLines } from '../../src/gpu/native-stderr.ts';
import { DAWN_LIMIT_NOTICE } from '../../src/gpu/node.ts';

const src = (file: string) => pathToFileURL(join(import.meta.dirname, '../../src/gpu', file)).href;
const NOTICE = 'Warning: maxDynamicUniformBuffersPerPipelineLayout artificially reduced from 1000000 to 16 to fit dynamic offset allocation limit.';

const NODE = `"${process.execPath}" --import tsx --input-type=module -e "$CODE"`;
const LINUX = process.platform === 'linux';

/** Runs an ES module snippet (TypeScript imports allowed) in a child node, its stderr piped through a
 * shell pipe (as in `npm run cli ... 2>&1 | tee log`); returns what came out of stderr. */
function viaShellPipe(code: string): string {
  const r = spawnSync('bash', ['-c', `set -o pipefail; ${NODE} 2>&1 >/dev/null | cat`], {
    encoding: 'utf8',
    env: { ...process.env, CODE: code },
    timeout: 120_000,
  });
  assert.equal(r.status, 0, `child failed: ${r.stdout}${r.stderr}`);
  return r.stdout;
}

/** The same on a terminal (util-linux script gives it a pty); stdout and stderr both show, with \r\n. */
function onTerminal(code: string): string {
  const r = spawnSync('script', ['-qec', NODE, '/dev/null'], { encoding: 'utf8', env: { ...process.env, CODE: code }, timeout: 120_000 });
  assert.equal(r.status, 0, `child failed: ${r.stdout}${r.stderr}`);
  return r.stdout.replace(/\r\n/g, '\n');
}

/** The same with stderr a socket, which Node's own spawn 'pipe' gives: returns the child's stderr. */
function viaNodeSpawn(code: string): string {
  const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', code], { encoding: 'utf8', timeout: 120_000 });
  assert.equal(r.status, 0, `child failed: ${r.stderr}`);
  return r.stderr;
}

// Stands in for native code: writeSync(2) is the same write(2) on fd 2 that Dawn's fprintf(stderr) makes.
const nativePrints = `
  import { writeSync } from 'node:fs';
  import { filterNativeStderr } from '${src('native-stderr.ts')}';
  import { DAWN_LIMIT_NOTICE } from '${src('node.ts')}';
  console.error('before');
  const out = filterNativeStderr(() => {
    writeSync(2, '${NOTICE}\\nERROR: a real driver problem\\n');
    writeSync(2, '${NOTICE.replace('Uniform', 'Storage')}\\n');
    return 42;
  }, DAWN_LIMIT_NOTICE);
  console.error(\`after \${out}\`);
  writeSync(2, 'fd 2 is stderr again\\n');
`;

const FILTERED = 'before\nERROR: a real driver problem\nafter 42\nfd 2 is stderr again\n';
const UNFILTERED = `before\n${NOTICE}\nERROR: a real driver problem\n${NOTICE.replace('Uniform', 'Storage')}\nafter 42\nfd 2 is stderr again\n`;

describe('Dawn limit notices are kept from stderr', () => {
  it('nodeGpu(): no "artificially reduced" on stderr; what is printed around it still shows', () => {
    const err = viaShellPipe(`
      import { nodeGpu } from '${src('node.ts')}';
      console.error('before');
      const gpu = await nodeGpu();
      console.error('after');
      gpu.destroy();
      process.exit(0);
    `);
    assert.doesNotMatch(err, /artificially reduced/);
    assert.match(err, /^before\n(.*\n)*after\n$/);
  });

  it('through a pipe and on a terminal: the notices are dropped, other native output passes, in order, and stderr works after', () => {
    // Linux only (the filter reopens descriptors through /proc); elsewhere the text passes unchanged.
    assert.equal(viaShellPipe(nativePrints), LINUX ? FILTERED : UNFILTERED);
    assert.equal(onTerminal(`${nativePrints}\nconsole.log('stdout line');`), `${LINUX ? FILTERED : UNFILTERED}stdout line\n`);
  });

  it('into a log opened for appending, shared with stdout (>>log 2>&1): filtered, and no line overwrites another', () => {
    const log = join(mkdtempSync(join(tmpdir(), 'dbs-quiet-')), 'run.log');
    writeFileSync(log, 'earlier run\n');
    const fd = openSync(log, 'a');
    try {
      spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', `${nativePrints}\nconsole.log('stdout line');`], {
        stdio: ['ignore', fd, fd],
        timeout: 120_000,
      });
    } finally {
      closeSync(fd);
    }
    assert.equal(readFileSync(log, 'utf8'), `earlier run\n${LINUX ? FILTERED : UNFILTERED}stdout line\n`);
  });

  it("where stderr cannot be reopened (a socket, as Node's spawn gives), everything passes unchanged and stderr keeps working", () => {
    assert.equal(viaNodeSpawn(nativePrints), UNFILTERED);
  });

  it('the notice pattern matches both notices and nothing else', () => {
    const text = `${NOTICE}\r\nWarning: something else\n${NOTICE.replace('Uniform', 'Storage')}\nError: device lost\n`;
    assert.equal(withoutLines(text, DAWN_LIMIT_NOTICE), 'Warning: something else\nError: device lost\n');
  });
});
