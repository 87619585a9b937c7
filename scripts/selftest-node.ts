// Runs every kernel case (the page's self-test) in Node on whatever GPU Dawn finds, f32 and f16
// where supported, against the golden fixtures. Exit code 1 on any failure.
// Usage: bash scripts/gpu-env.sh npx tsx scripts/selftest-node.ts   (DBS_SYSTEM_VULKAN=1 for a real GPU)
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { nodeGpu } from '../src/gpu/node.ts';
import { describeCheck } from '../src/selftest/check.ts';
import { ALL_CASES } from '../src/selftest/cases/index.ts';
import { EMPTY_GOLDEN, goldenFromBytes } from '../src/selftest/golden.ts';
import { dtypesFor, notRunReason, runCase } from '../src/selftest/runner.ts';

const fixtures = process.env.DBS_FIXTURES_DIR ?? join(process.cwd(), 'tests', 'fixtures', 'kernels');
const gpu = await nodeGpu();
console.log(`adapter: ${gpu.adapter.vendor} ${gpu.adapter.description}; f16: ${gpu.hasF16}; tensor cores: ${gpu.tensorCoreNote}`);
let failed = 0;
let passed = 0;
let notRun = 0;
for (const c of ALL_CASES) {
  const reason = notRunReason(gpu, c);
  if (reason) {
    notRun++;
    console.log(`not run ${c.family} / ${c.name}: ${reason}`);
    continue;
  }
  const path = join(fixtures, `${c.family}.safetensors`);
  const golden = existsSync(path) ? goldenFromBytes(c.family, new Uint8Array(readFileSync(path))) : EMPTY_GOLDEN;
  for (const dtype of dtypesFor(gpu, c)) {
    const r = await runCase(gpu, c, dtype, golden);
    if (r.pass) passed++;
    else failed++;
    console.log(`${r.pass ? 'ok  ' : 'FAIL'} ${c.family} / ${c.name} [${dtype}] ${r.ms.toFixed(0)} ms`);
    if (!r.pass) for (const k of r.checks.filter((x) => !x.pass)) console.log(`     ${describeCheck(k)}`);
    if (r.error) console.log(`     ${r.error.split('\n')[0]}`);
  }
}
console.log(`selftest: ${passed} passed, ${failed} failed, ${notRun} cases not run on this device`);
gpu.destroy();
process.exit(failed ? 1 : 0);
