// The census instrument (src/gpu/recording.ts under an adapter profile) and its cost model (bench/costmodel.ts):
// the recording device sees exactly the dispatches the engine issues on a real device, decodes their work (FLOPs
// checked against hand counts of a known GEMM and convolution), and the model calibrated on the committed H200
// profile of commit 2756811 reproduces its conv2d, matmul and attention GPU ms within 15 %.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { Gpu } from '../../src/gpu/device.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import { NVIDIA_H200, profileOf, type AdapterProfile } from '../../src/gpu/profile.ts';
import { recordingGpu, type RecordedDispatch } from '../../src/gpu/recording.ts';
import { nodeShaderSource } from '../../src/gpu/shaders-node.ts';
import { conv2d } from '../../src/ops/conv2d.ts';
import { matmul } from '../../src/ops/matmul.ts';
import { flashAttention } from '../../src/ops/attention.ts';
import type { StepRecord } from '../../bench/census-record.ts';
import { calibrate, H200, measuredProfile, modelStep, workOf } from '../../bench/costmodel.ts';

const results = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bench', 'results');

/** A recording Gpu on `profile` and the dispatches it has seen. */
async function recorder(profile: AdapterProfile): Promise<{ gpu: Gpu; seen: RecordedDispatch[] }> {
  const seen: RecordedDispatch[] = [];
  const gpu = await Gpu.create(
    recordingGpu(profile, (d) => seen.push(d)),
    { shaders: nodeShaderSource(), dryRun: true, recording: true },
  );
  return { gpu, seen };
}

/** A GEMM, a 3x3 convolution and an attention call, the same on any Gpu. */
function work(gpu: Gpu): void {
  const dt = gpu.computeDType;
  const a = gpu.tensor([64, 96], dt, 'activations');
  const b = gpu.tensor([96, 80], dt, 'activations');
  gpu.free(matmul(gpu, a, b));
  const x = gpu.tensor([2, 8, 6, 6], dt, 'activations');
  const w = gpu.tensor([16, 8, 3, 3], dt, 'weights');
  gpu.free(conv2d(gpu, x, w, null, { stride: 1, padding: 1 }));
  const q = gpu.tensor([1, 2, 32, 8], dt, 'activations');
  const r = flashAttention(gpu, q, q, q);
  gpu.free(r.out, r.lse);
}

describe('census: the recording device', () => {
  it("records the H200 profile's GEMM and conv with hand-counted FLOPs, grids and bound bytes", async () => {
    const { gpu, seen } = await recorder(NVIDIA_H200);
    assert.equal(gpu.computeDType, 'f16', 'the profile offers shader-f16');
    assert.equal(gpu.facts.software, false);
    work(gpu);
    await gpu.sync();
    const mm = seen.filter((d) => d.shader === 'matmul' && d.entry === 'matmul');
    const conv = seen.filter((d) => d.shader === 'conv2d' && d.entry === 'conv_gemm');
    assert.equal(mm.length, 1);
    assert.equal(conv.length, 1);
    const m = workOf({ ...mm[0], count: 1 });
    assert.equal(m.flops, 2 * 64 * 80 * 96, 'GEMM FLOPs = 2 M N K');
    assert.deepEqual([mm[0].uniforms.M, mm[0].uniforms.N, mm[0].uniforms.K], [64, 80, 96], 'uniforms decoded from the ring');
    const t = mm[0].defs as Record<string, number>;
    assert.equal(m.threads, (t.BM / t.TM) * (t.BN / t.TN), "@workgroup_size parsed from the module = the tile's invocations");
    assert.deepEqual(mm[0].workgroups, [Math.ceil(80 / t.BN), Math.ceil(64 / t.BM), 1]);
    assert.equal(m.bytesRead, 64 * 96 * 2 + 96 * 80 * 2, 'f16 operands bound at their real size');
    assert.equal(m.kSteps, Math.ceil(96 / t.BK));
    const c = workOf({ ...conv[0], count: 1 });
    assert.equal(c.flops, 2 * 2 * 16 * 36 * (8 * 9), 'conv FLOPs = 2 N Co Ho Wo Ci KH KW');
    assert.equal(c.kSteps, Math.ceil((8 * 9) / (conv[0].defs.BK as number)));
    gpu.destroy();
  });

  it('sees exactly the dispatches a real device runs (lavapipe, its own profile)', async () => {
    const real = await nodeGpu({ poison: false });
    const before = real.stats.dispatches;
    work(real);
    await real.sync();
    const ran = real.stats.dispatches - before;
    const { gpu, seen } = await recorder(profileOf(real));
    real.destroy();
    assert.equal(gpu.facts.software, true, "lavapipe's profile makes the same CPU-adapter choices");
    work(gpu);
    await gpu.sync();
    assert.ok(ran >= 3, `ran ${ran} dispatches`);
    assert.equal(seen.length, ran);
    gpu.destroy();
  });
});

describe('census: the cost model', () => {
  const record = JSON.parse(readFileSync(join(results, 'census-records', '2756811-lora-128-2-step1.json'), 'utf8')) as StepRecord;
  const measured = measuredProfile(JSON.parse(readFileSync(join(results, 'step-nvidia-h200.json'), 'utf8')), '2756811');

  it("the recorded 2756811 step has the profiled step's dispatches, family by family", () => {
    const step = modelStep(
      H200,
      { loadLatencyS: 1e-6, stepLatencyS: 0, floorS: 0, arrayFmaCycles: 1, hostPerDispatchS: 0, warmOverProfiled: 1 },
      record.kernels,
    );
    assert.equal(step.dispatches, 3587);
    for (const f of ['conv2d', 'matmul', 'attention', 'other'] as const) assert.equal(step.byFamily[f].dispatches, measured.families[f].dispatches, f);
  });

  it('calibrated on the 2756811 profile, reproduces its conv2d, matmul and attention GPU ms within 15 %', () => {
    const fit = calibrate(H200, [{ kernels: record.kernels, measured }]);
    for (const f of ['conv2d', 'matmul', 'attention'] as const) {
      const ratio = fit.steps[0].byFamily[f].ms / measured.families[f].ms;
      assert.ok(Math.abs(ratio - 1) <= 0.15, `${f}: modelled ${fit.steps[0].byFamily[f].ms.toFixed(1)} ms vs ${measured.families[f].ms} measured`);
    }
    // The fit is not free to be anything: twice the load latency moves conv2d well past the tolerance.
    const off = modelStep(H200, { ...fit.params, loadLatencyS: 2 * fit.params.loadLatencyS }, record.kernels);
    assert.ok(off.byFamily.conv2d.ms / measured.families.conv2d.ms > 1.5);
  });
});
