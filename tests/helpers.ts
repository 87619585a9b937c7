// Node test helpers: one Gpu per test process on Dawn + lavapipe, golden fixtures from disk,
// and node:test registration of a family's kernel cases for f32 and f16.
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { after, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { fileURLToPath } from 'node:url';
import type { Gpu, GpuOptions } from '../src/gpu/device.ts';
import { nodeGpu } from '../src/gpu/node.ts';
import type { Defs } from '../src/gpu/shaders.ts';
import { describeCheck, type Check, type GoldenSet } from '../src/selftest/check.ts';
import { FAMILIES } from '../src/selftest/cases/index.ts';
import { EMPTY_GOLDEN, goldenFromBytes } from '../src/selftest/golden.ts';
import { dtypesFor, notRunReason, runCase } from '../src/selftest/runner.ts';

export const FIXTURES = join(dirname(fileURLToPath(import.meta.url)), 'fixtures');

let shared: Promise<Gpu> | null = null;

/** The process-wide test Gpu (closed after the file's tests). */
export function testGpu(opts: Partial<GpuOptions> = {}): Promise<Gpu> {
  if (Object.keys(opts).length) return nodeGpu(opts);
  if (!shared) shared = nodeGpu();
  return shared;
}

// Close the shared device when the file's tests end (registered on the root test), so the
// process exits.
after(async () => {
  if (shared) (await shared).destroy();
});

/** Runs `f` with every dispatch's kernel entry and defs recorded (gpu.run wrapped, then restored). */
export function recordDispatches(gpu: Gpu, f: () => void): { entry: string; defs: Defs }[] {
  const seen: { entry: string; defs: Defs }[] = [];
  const run = gpu.run;
  gpu.run = (k, call) => {
    seen.push({ entry: k.entry, defs: { ...call.defs } });
    return run.call(gpu, k, call);
  };
  try {
    f();
  } finally {
    gpu.run = run;
  }
  return seen;
}

export function loadGolden(family: string): GoldenSet {
  const path = join(FIXTURES, 'kernels', `${family}.safetensors`);
  return existsSync(path) ? goldenFromBytes(family, new Uint8Array(readFileSync(path))) : EMPTY_GOLDEN;
}

export function assertChecks(checks: Check[]): void {
  assert.ok(checks.length > 0, 'case produced no checks');
  const bad = checks.filter((c) => !c.pass);
  assert.equal(bad.length, 0, bad.map(describeCheck).join('\n'));
}

/** Registers every case of a family as node:test tests, once per dtype the device supports. */
export function defineCaseTests(family: string): void {
  const cases = FAMILIES[family];
  describe(`${family} kernels`, () => {
    it('has cases', () => assert.ok(cases.length > 0, `family ${family} has no cases`));
    for (const c of cases)
      for (const dtype of c.dtypes ?? (['f32', 'f16'] as const))
        it(`${c.name} [${dtype}]`, async (t) => {
          const gpu = await testGpu();
          const reason = notRunReason(gpu, c);
          if (reason) {
            // a path this machine lacks (tensor cores on lavapipe): reported as skipped with the reason, not passed
            t.skip(`not run here: ${reason}`);
            return;
          }
          if (!dtypesFor(gpu, c).includes(dtype)) {
            assert.fail(`device lacks ${dtype}: the Node suite needs shader-f16 (lavapipe from bookworm-backports has it)`);
          }
          const r = await runCase(gpu, c, dtype, loadGolden(family));
          if (r.error) assert.fail(r.error);
          for (const k of r.checks) t.diagnostic(describeCheck(k));
          assertChecks(r.checks);
        });
  });
}
