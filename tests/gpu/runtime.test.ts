// The GPU runtime itself: limits and features, byte accounting, typed errors, device loss,
// pipeline cache, specialisation, and tensors larger than one storage binding.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { GpuDeviceLostError, GpuOutOfMemoryError, GpuValidationError, NoWebGpuError, ShapeError } from '../../src/gpu/errors.ts';
import { Gpu } from '../../src/gpu/device.ts';
import { adapterFacts, isSoftwareAdapter } from '../../src/gpu/adapter.ts';
import { NVIDIA_H200, summaryOf } from '../../src/gpu/profile.ts';
import { kernel } from '../../src/gpu/kernel.ts';
import { tensorCoresFromEnv } from '../../src/gpu/node.ts';
import { checkTensorCores, tensorCoreDecision, type MatrixShape, type TensorCoreInputs } from '../../src/gpu/tensorcore.ts';
import { specialise } from '../../src/gpu/shaders.ts';
import { nodeShaderSource } from '../../src/gpu/shaders-node.ts';
import { add, cast } from '../../src/ops/elementwise.ts';
import { testGpu } from '../helpers.ts';

const MiB = 1 << 20;

/** A kernel of the project's own shaders for runtime checks: elementwise's convert (out = U(x)). */
const COPY = kernel({
  shader: 'elementwise',
  entry: 'convert',
  uniforms: [{ name: 'n', type: 'u32' }],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'out', type: 'U', access: 'read_write' },
  ],
});

describe('gpu runtime', () => {
  it('requests the adapter maximum limits and the features we use', async () => {
    const gpu = await testGpu();
    const l = gpu.device.limits;
    assert.ok(l.maxStorageBufferBindingSize >= 128 * MiB, `binding limit ${l.maxStorageBufferBindingSize}`);
    assert.ok(l.maxBufferSize > l.maxStorageBufferBindingSize, 'maxBufferSize raised past one binding');
    assert.ok(l.maxComputeWorkgroupStorageSize >= 16384);
    // Mesa lavapipe 25.x (bookworm-backports) exposes all three; the f16 suite depends on it.
    for (const f of ['shader-f16', 'subgroups', 'timestamp-query']) assert.ok(gpu.device.features.has(f), `missing ${f}`);
    assert.equal(gpu.hasF16, true);
    assert.equal(gpu.computeDType, 'f16');
    assert.ok(gpu.adapter.features.includes('shader-f16'));
  });

  it("one adapter profile (src/gpu/adapter.ts): the live device's facts, and the same for a named or SwiftShader adapter", async () => {
    const gpu = await testGpu();
    const f = gpu.facts;
    assert.equal(f.software, isSoftwareAdapter(gpu.adapter));
    assert.equal(f.f16, gpu.device.features.has('shader-f16'));
    assert.equal(f.subgroups, gpu.device.features.has('subgroups'));
    assert.equal(f.maxBinding, gpu.device.limits.maxStorageBufferBindingSize);
    assert.equal(f.maxWorkgroupStorage, gpu.device.limits.maxComputeWorkgroupStorageSize);
    assert.equal(adapterFacts(gpu.adapter, { bindingLimit: MiB }).maxBinding, MiB, 'a forced binding limit');
    assert.equal(adapterFacts(gpu.adapter, { disableF16: true }).f16, false, 'f16 turned off');
    // Mesa's lavapipe (this machine's adapter) is a software adapter: CPU defaults (8x8 blocks, direct core).
    const lavapipe = adapterFacts({ ...gpu.adapter, vendor: 'mesa', device: 'llvmpipe (LLVM 19.1.7, 256 bits)', description: 'Mesa 25.0' });
    assert.deepEqual([lavapipe.software, lavapipe.swiftShader, lavapipe.gemmDefaults.registerBlock, lavapipe.gemmDefaults.direct], [true, false, 8, true]);
    assert.equal(lavapipe.bindGroupCacheMax, 1 << 13);
    // SwiftShader: software too, and its compiler is never given the direct or prefetching GEMM core.
    const swift = adapterFacts({ ...gpu.adapter, vendor: 'google', description: 'SwiftShader Device (Subzero)' });
    assert.deepEqual([swift.software, swift.swiftShader, swift.directGemm, swift.prefetchGemm, swift.gemmDefaults.direct], [true, true, false, false, false]);
    // The census's named H200 profile goes through the same builder: a GPU with f16, 32-lane subgroups, GPU defaults.
    const h200 = adapterFacts(summaryOf(NVIDIA_H200));
    assert.deepEqual([h200.software, h200.f16, h200.subgroups, h200.subgroupMinSize, h200.gemmDefaults.registerBlock], [false, true, true, 32, 4]);
    assert.deepEqual([h200.maxBinding, h200.maxWorkgroupStorage, h200.bindGroupCacheMax], [2147483644, 49152, 1 << 16]);
  });

  it('f32 path when f16 is disabled, and f16 tensors are refused there', async () => {
    const gpu = await testGpu({ disableF16: true });
    assert.equal(gpu.computeDType, 'f32');
    assert.throws(() => gpu.tensor([4], 'f16', 'scratch'), /shader-f16/);
    gpu.destroy();
  });

  it('no WebGPU gives a typed, readable error', async () => {
    await assert.rejects(
      Gpu.create(undefined, { shaders: nodeShaderSource() }),
      (e: Error) => e instanceof NoWebGpuError && /WebGPU is not available/.test(e.message),
    );
  });

  it('accounts every byte by tag, current and peak', async () => {
    const gpu = await testGpu();
    const before = gpu.allocator.report();
    const w = gpu.tensor([1000], 'f32', 'weights', 'w');
    const a = gpu.tensor([1001], 'f16', 'activations', 'a'); // 2002 bytes -> rounded to 2004
    const g = gpu.tensor([10], 'f32', 'gradients', 'g');
    let r = gpu.allocator.report();
    assert.equal(r.current - before.current, 4000 + 2004 + 40);
    assert.equal(r.byTag.weights.current - before.byTag.weights.current, 4000);
    assert.equal(r.byTag.activations.current - before.byTag.activations.current, 2004);
    assert.equal(r.live - before.live, 3);
    gpu.free(a);
    gpu.free(a); // double free is a no-op, not a double count
    r = gpu.allocator.report();
    assert.equal(r.byTag.activations.current, before.byTag.activations.current);
    assert.ok(r.byTag.activations.peak >= before.byTag.activations.current + 2004);
    assert.ok(r.peak >= before.current + 6044);
    const view = w.reshape([10, 100]);
    gpu.free(view); // views do not own the buffer
    assert.equal(gpu.allocator.report().byTag.weights.current - before.byTag.weights.current, 4000);
    gpu.free(w, g);
    assert.equal(gpu.allocator.report().current, before.current);
  });

  it('an allocation past maxBufferSize throws GpuOutOfMemoryError naming tag and label', async () => {
    const gpu = await testGpu();
    const huge = gpu.device.limits.maxBufferSize + 4;
    assert.throws(
      () => gpu.tensor([huge / 4], 'f32', 'optimizer', 'adam-m'),
      (e: Error) => e instanceof GpuOutOfMemoryError && e.tag === 'optimizer' && /adam-m/.test(e.message),
    );
    await assert.rejects(gpu.tensorChecked([huge / 4], 'f32', 'weights', 'unet'), GpuOutOfMemoryError);
  });

  it('tensor cores: on by default only where the start-up check passes; off with the reason otherwise', async () => {
    // An adapter that offers what the kernels need (an H200's report), with the start-up check injected.
    const offered: Omit<TensorCoreInputs, 'check'> = {
      asked: undefined,
      optOut: 'DBS_TENSOR_CORES=0',
      disableF16: false,
      dryRun: false,
      features: new Set(['shader-f16', 'subgroups', 'chromium-experimental-subgroup-matrix']),
      info: { subgroupMinSize: 32, subgroupMaxSize: 32, subgroupMatrixConfigs: [{ componentType: 'f16', resultComponentType: 'f32', M: 16, N: 16, K: 16 }] },
    };
    const checked: MatrixShape[] = [];
    const passes = async (s: MatrixShape) => (checked.push(s), null);
    const on = await tensorCoreDecision({ ...offered, check: passes });
    assert.deepEqual(on.shape, { M: 16, N: 16, K: 16 }, on.note);
    assert.match(on.note, /^tensor cores on: .*start-up check passed/);
    assert.equal(checked.length, 1, 'the check ran once, on the chosen shape');
    // A failing check refuses the path and names it: nothing but a pass turns them on.
    const refused = await tensorCoreDecision({ ...offered, check: async () => 'the check kernel got 3 of 1024 elements wrong' });
    assert.equal(refused.shape, null);
    assert.match(refused.note, /refused: the 16x16x16 subgroup-matrix GEMM path failed its start-up check \(the check kernel got 3 of 1024/);
    // The opt-out, f16 off, a dry run and an adapter without the feature: off, the reason said, the check never run.
    const skipped = async (): Promise<string | null> => assert.fail('the start-up check ran where it must not');
    const optOut = await tensorCoreDecision({ ...offered, asked: false, check: skipped });
    assert.deepEqual([optOut.shape, optOut.note], [null, 'tensor cores off: turned off by the host (DBS_TENSOR_CORES=0)']);
    assert.match((await tensorCoreDecision({ ...offered, disableF16: true, check: skipped })).note, /f16 is turned off/);
    assert.match((await tensorCoreDecision({ ...offered, dryRun: true, check: skipped })).note, /memory planning/);
    const absent = await tensorCoreDecision({ ...offered, features: new Set(['shader-f16', 'subgroups']), check: skipped });
    assert.deepEqual([absent.shape, absent.note], [null, 'tensor cores off: the adapter offers no subgroup matrices; start-up check skipped']);
    // The real check on a device without subgroup matrices (lavapipe) fails, so a path it gates is refused.
    const gpu = await testGpu();
    const real = await tensorCoreDecision({ ...offered, check: (s) => checkTensorCores(gpu.device, s) });
    assert.equal(real.shape, null);
    assert.match(real.note, /refused: the 16x16x16 subgroup-matrix GEMM path failed its start-up check \(the check kernel/);
    // This device (default options): off, the reason in its adapter facts.
    assert.equal(gpu.tensorCores, null);
    assert.equal(gpu.facts.tensorCoreNote, 'tensor cores off: the adapter offers no subgroup matrices; start-up check skipped');
    // The Node host's switch: unset or 1 on, 0 off, anything else refused by name.
    assert.deepEqual([undefined, '', '1', '0'].map(tensorCoresFromEnv), [true, true, true, false]);
    assert.throws(() => tensorCoresFromEnv('yes'), /DBS_TENSOR_CORES=yes: use 0 to turn tensor cores off or 1/);
  });

  it('caches pipelines by shader, entry and defs', async () => {
    const gpu = await testGpu();
    const p1 = gpu.pipeline(COPY, { T: 'f32', U: 'f32', WG: 64 });
    const n = gpu.pipelineCount;
    assert.equal(gpu.pipeline(COPY, { WG: 64, U: 'f32', T: 'f32' }), p1, 'same defs in another order: the cached pipeline');
    assert.equal(gpu.pipelineCount, n);
    assert.notEqual(gpu.pipeline(COPY, { T: 'f16', U: 'f32', WG: 64 }), p1);
    assert.equal(gpu.pipelineCount, n + 1);
  });

  it('specialises WGSL by dtype and constants, without copying the source', () => {
    const s = specialise('fn f() {}', { T: 'f16', U: 'f32', TILE: 64, HAS_BIAS: true });
    assert.match(s, /^enable f16;/);
    assert.match(s, /alias T = f16;/);
    assert.match(s, /alias U = f32;/);
    assert.match(s, /const TILE: u32 = 64u;/);
    assert.match(s, /const HAS_BIAS: bool = true;/);
    assert.doesNotMatch(specialise('', { T: 'f32' }), /enable f16/);
    assert.throws(() => specialise('', { X: 1.5 }), /non-negative integers/);
  });

  it('reports WGSL validation errors at sync instead of returning garbage', async () => {
    const gpu = await testGpu();
    const x = gpu.upload([1, 2, 3, 4], [4], 'f32');
    // Binding a tensor where the shader expects another dtype's layout is caught by the op...
    assert.throws(
      () => add(gpu, x, gpu.upload([1, 2, 3, 4], [4], 'f16')),
      (e: Error) => e instanceof ShapeError && /add: dtype mismatch: f32\[4\] vs f16\[4\]/.test(e.message),
    );
    assert.throws(() => add(gpu, x, gpu.upload([1, 2, 3], [3], 'f32')), /add: shapes differ: a \[4\] vs b \[3\]/);
    // ...and a dispatch the device rejects (one buffer bound as both read-only and writable storage) surfaces
    // as GpuValidationError.
    gpu.run(COPY, { defs: { T: 'f32', U: 'f32', WG: 64, PER: 1 }, uniforms: { n: 4 }, bindings: { x, out: x }, workgroups: [1] });
    await assert.rejects(gpu.sync(), (e: Error) => e instanceof GpuValidationError && /writable|aliasing|usage/i.test(e.message));
  });

  it('splits element-wise work over tensors larger than one storage binding (forced small limit)', async () => {
    const gpu = await testGpu({ bindingLimit: 4096 });
    const n = 10_000; // 40 KB of f32: ten bindings' worth
    const a = Float32Array.from({ length: n }, (_, i) => i * 0.5);
    const b = Float32Array.from({ length: n }, (_, i) => -i);
    const out = await gpu.read(add(gpu, gpu.upload(a, [n], 'f32'), gpu.upload(b, [n], 'f32'), 2));
    for (let i = 0; i < n; i += 997) assert.equal(out[i], a[i] + 2 * b[i]);
    assert.equal(out[n - 1], a[n - 1] + 2 * b[n - 1]);
    gpu.destroy();
  });

  it('handles a real tensor larger than maxStorageBufferBindingSize', async () => {
    const gpu = await testGpu();
    const limit = gpu.device.limits.maxStorageBufferBindingSize;
    const n = limit / 4 + 4 * 1024 * 1024 + 3; // just over one binding of f32, odd length
    const x = gpu.tensor([n], 'f32', 'activations', 'big');
    const ones = new Float32Array(n).fill(1);
    gpu.write(x, ones);
    const h = cast(gpu, x, 'f16'); // f32 input spans two bindings, f16 output one
    const y = add(gpu, x, x, 2); // every binding spans the limit
    const yv = await gpu.read(y);
    assert.equal(yv.length, n);
    assert.equal(yv[0], 3);
    assert.equal(yv[limit / 4 - 1], 3);
    assert.equal(yv[limit / 4], 3);
    assert.equal(yv[n - 1], 3);
    const hv = await gpu.read(h);
    assert.equal(hv[n - 1], 1);
    gpu.free(x, h, y);
  });

  it('surfaces device loss to listeners and to every later call', async () => {
    const gpu = await testGpu({ powerPreference: 'low-power' });
    let seen = null as GpuDeviceLostError | null;
    gpu.onLost((e) => (seen = e));
    gpu.device.destroy();
    await gpu.device.lost;
    await new Promise((r) => setTimeout(r, 0));
    assert.ok(seen instanceof GpuDeviceLostError);
    assert.throws(() => gpu.tensor([4], 'f32', 'scratch'), GpuDeviceLostError);
  });
});
