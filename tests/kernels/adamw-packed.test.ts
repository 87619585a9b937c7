// The compact optimizer state (issue 14): bitsandbytes' dynamic maps and blockwise quantisation against goldens
// written from its algorithm in PyTorch (tests/fixtures/kernels/gen_adamw8bit.py), the adamw_packed kernel
// against its plain-TS reference in every layout it runs in (8-bit or f32 moments; fp32 master, f16 weight +
// extension, or the f32 weight as the master), its check and statistics, and the compact master's precision
// against an fp32 master over 200 small steps.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { adamw, adamwParam, type AdamWConfig } from '../../src/ops/adamw.ts';
import {
  adamwPacked,
  adamwPackedRef,
  CODES,
  dynamicMap,
  extOf,
  f16Of,
  mastersOf,
  momentsOf,
  quantiseRef,
  QBLOCK,
  ZERO_M,
  ZERO_V,
  type PackedHostState,
  packedSignals,
  packedStorageBuffers,
} from '../../src/ops/adamw-packed.ts';
import { readFlag } from '../../src/ops/reduce.ts';
import { randomValues } from '../../src/selftest/check.ts';
import { hostState, initialBytes, packChunk, packedViews, type OptimizerMode } from '../../src/train/packed-state.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { FIXTURES, testGpu } from '../helpers.ts';

const golden = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'kernels/adamw8bit.safetensors'))));
const g = (k: string) => golden.tensors.get(k)!.data;
const meta = golden.metadata;
const GOLDEN_CFG: AdamWConfig = {
  lr: Number(meta.lr),
  beta1: Number(meta.beta1),
  beta2: Number(meta.beta2),
  eps: Number(meta.eps),
  weightDecay: Number(meta.weight_decay),
};

/** Index of the midpoint nearest x / a between neighbouring codes, as a distance relative to the code gap. */
function tieDistance(x: number, a: number, table: Float32Array): number {
  let best = Infinity;
  for (let k = 0; k + 1 < 256; k++) {
    const mid = ((table[k] + table[k + 1]) / 2) * a;
    best = Math.min(best, Math.abs(x - mid) / Math.max((table[k + 1] - table[k]) * a, 1e-45));
  }
  return best;
}

describe('bitsandbytes dynamic maps and blockwise quantisation (PyTorch goldens)', () => {
  it("create_dynamic_map signed and unsigned: 256 sorted codes equal to the generator's to f32 rounding", () => {
    for (const [signed, key] of [
      [true, 'code_signed'],
      [false, 'code_unsigned'],
    ] as const) {
      const ours = dynamicMap(signed);
      const want = g(key);
      assert.equal(ours.length, 256);
      // torch builds the map in f32 (linspace, midpoints, scaling): a few f32 roundings apart from ours (float64 once).
      for (let i = 0; i < 256; i++) assert.ok(Math.abs(ours[i] - want[i]) <= 4e-7 * Math.abs(want[i]), `${key}[${i}]: ${ours[i]} vs ${want[i]}`);
      for (let i = 1; i < 256; i++) assert.ok(ours[i] > ours[i - 1], `${key} sorted and distinct at ${i}`);
    }
    assert.equal(CODES[ZERO_M], 0);
    assert.equal(CODES[256 + ZERO_V], 0);
    assert.equal(CODES[255], 1);
    assert.equal(CODES[511], 1);
  });

  it('nearest code per block of 256 (quantize_blockwise): the same codes except at exact-tie roundings', () => {
    const x = g('q_x');
    const codes = g('q_codes');
    const absmax = g('q_absmax');
    const signed = CODES.subarray(0, 256);
    let differ = 0;
    for (let i = 0; i < x.length; i++) {
      const b = Math.floor(i / QBLOCK);
      const a = absmax[b];
      assert.equal(a, Math.max(...x.subarray(b * QBLOCK, (b + 1) * QBLOCK).map(Math.abs)), `block ${b} absmax`);
      const q = quantiseRef(x[i], a, signed, ZERO_M);
      if (a === 0) {
        assert.equal(signed[q] * a, 0);
        continue;
      }
      if (q !== codes[i]) {
        differ++;
        // torch divides by absmax, we compare against scaled codes: they may disagree only within f32 rounding of a midpoint.
        assert.ok(Math.abs(q - codes[i]) === 1 && tieDistance(x[i], a, signed) < 1e-5, `element ${i}: code ${q} vs ${codes[i]}`);
      }
    }
    assert.ok(differ <= 2, `${differ} codes differ at ties`);
  });
});

/** One parameter's packed state on the GPU and on the host, in a mode. */
function setup(gpu: Gpu, n: number, mode: OptimizerMode, dtype: DType, init: Float32Array) {
  const pack = packChunk([n], mode, dtype);
  const p = pack.params[0];
  const w16 = dtype === 'f16' ? init.map(f16Of) : undefined;
  const bytes = initialBytes(pack, [init], [w16], extOf);
  const buf = gpu.tensor([pack.bytes / 4], 'f32', 'optimizer');
  gpu.writeRaw(buf, bytes);
  const weight = gpu.upload(dtype === 'f16' ? w16! : init, [n], dtype, 'weights');
  const host = hostState(bytes, p, w16 ? Float32Array.from(w16) : undefined);
  // Compact with f32 compute: the host's master is the weight.
  if (!host.master && !host.ext) host.master = Float32Array.from(init);
  return { pack, p, buf, weight, host, views: packedViews(buf, p, weight) };
}

async function readState(gpu: Gpu, s: ReturnType<typeof setup>): Promise<PackedHostState> {
  const bytes = new Uint8Array(await gpu.readBytes(s.buf.buffer, s.buf.byteOffset, s.pack.bytes));
  const w = await gpu.read(s.weight);
  const st = hostState(bytes, s.p, s.p.ext >= 0 ? w : undefined);
  if (!st.master && !st.ext) st.master = w;
  return st;
}

function assertCodesClose(got: Uint8Array, want: Uint8Array, what: string): void {
  let differ = 0;
  for (let i = 0; i < want.length; i++)
    if (got[i] !== want[i]) {
      differ++;
      assert.equal(Math.abs(got[i] - want[i]), 1, `${what}[${i}]: code ${got[i]} vs ${want[i]} (not a neighbour)`);
    }
  // Neighbouring codes only where the f32 value sits on a midpoint (the GPU may fuse a multiply-add): rare.
  assert.ok(differ <= Math.max(2, want.length / 200), `${what}: ${differ} of ${want.length} codes differ`);
}

function assertClose(got: ArrayLike<number>, want: ArrayLike<number>, atol: number, rtol: number, what: string): void {
  for (let i = 0; i < want.length; i++) assert.ok(Math.abs(got[i] - want[i]) <= atol + rtol * Math.abs(want[i]), `${what}[${i}]: ${got[i]} vs ${want[i]}`);
}

const CFG: AdamWConfig = { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };

describe('adamw_packed against the references', () => {
  it('8-bit moments + fp32 master, 3 steps vs the PyTorch 8-bit Adam golden (f32 weight copy)', async () => {
    const gpu = await testGpu();
    const n = g('adam_p0').length;
    const s = setup(gpu, n, { optimizer: 'adamw8bit', master: 'fp32' }, 'f32', Float32Array.from(g('adam_p0')));
    // The weight copy is a separate f32 tensor here (an fp32 master with f32 compute copies it).
    const { flag, ...signals } = packedSignals(gpu);
    const run = { codes: gpu.upload(CODES, [512], 'f32'), ...signals, check: false };
    for (let t = 1; t <= 3; t++) {
      const grad = gpu.upload(g(`adam_g${t}`), [n], 'f32');
      adamwPacked(gpu, s.views, grad, GOLDEN_CFG, { step: t, lossScale: 1, flag }, run);
      adamwPackedRef(s.host, n, g(`adam_g${t}`), GOLDEN_CFG, t);
      const st = await readState(gpu, s);
      // f32 against torch's f32 (a different order of a few operations): 1e-6 relative; the codes as above.
      assertClose(st.master!, g(`adam_p${t}`), 1e-7, 1e-6, `step ${t} master vs torch`);
      assertClose(st.absm!, g(`adam_am${t}`), 0, 1e-6, `step ${t} absmax m vs torch`);
      assertClose(st.absv!, g(`adam_av${t}`), 0, 1e-6, `step ${t} absmax v vs torch`);
      assertCodesClose(st.m8!, Uint8Array.from(g(`adam_qm${t}`)), `step ${t} m codes vs torch`);
      assertCodesClose(st.v8!, Uint8Array.from(g(`adam_qv${t}`)), `step ${t} v codes vs torch`);
      // And the TS reference of the same operations: the same state.
      assertClose(st.master!, s.host.master!, 0, 2 ** -22, `step ${t} master vs TS`);
      assertCodesClose(st.m8!, s.host.m8!, `step ${t} m codes vs TS`);
      assertClose(await gpu.read(s.weight), st.master!, 0, 0, `step ${t} weight copy = master`);
      gpu.free(grad);
    }
  });

  for (const [name, mode, dtype, n] of [
    ['8-bit moments + compact master (f16 weight + extension)', { optimizer: 'adamw8bit', master: 'compact' }, 'f16', 5000],
    ['f32 moments + compact master (f16 weight + extension)', { optimizer: 'adamw', master: 'compact' }, 'f16', 1000],
    ['8-bit moments + compact master with f32 compute (the weight is the master)', { optimizer: 'adamw8bit', master: 'compact' }, 'f32', 4100],
  ] as const)
    it(`${name}: 3 clipped, loss-scaled steps vs the TS reference; statistics; tails of a block`, async () => {
      const gpu = await testGpu();
      const init = randomValues(n, 77, 2);
      const s = setup(gpu, n, mode, dtype, init);
      const { flag, updateFlag, stats, norm } = packedSignals(gpu);
      const run = { codes: gpu.upload(CODES, [512], 'f32'), updateFlag, stats, check: false };
      const scale = 256;
      gpu.write(norm, [3]);
      for (let t = 1; t <= 3; t++) {
        // Gradients over 4 decades, block by block, so blocks have very different absmax.
        const gv = roundToF16(randomValues(n, 100 + t, 0.05 * scale).map((x, i) => x * 10 ** -((i >> 8) % 4)));
        const grad = gpu.upload(gv, [n], dtype);
        gpu.write(stats, [0, 0, 0, 0]);
        adamwPacked(gpu, s.views, grad, CFG, { step: t, lossScale: scale, flag, clip: { norm, maxNorm: 1 } }, run);
        const want = adamwPackedRef(s.host, n, gv, CFG, t, scale, Math.min(1, 1 / (3 + 1e-6)));
        const st = await readState(gpu, s);
        // Masters: the same f32 operations; an ulp or two where the GPU contracts a multiply-add.
        const tol = dtype === 'f16' ? 2 ** -26 : 2 ** -22; // compact: the master's 27 bits; f32: f32's 24
        assertClose(mastersOf(st, n), mastersOf(s.host, n), 1e-12, tol, `step ${t} master`);
        const a = momentsOf(st, n);
        const b = momentsOf(s.host, n);
        if (st.m8) {
          assertCodesClose(st.m8, s.host.m8!, `step ${t} m codes`);
          assertCodesClose(st.v8!, s.host.v8!, `step ${t} v codes`);
          assertClose(st.absm!, s.host.absm!, 0, 1e-6, `step ${t} absmax m`);
          assertClose(st.absv!, s.host.absv!, 0, 1e-6, `step ${t} absmax v`);
        } else {
          assertClose(a.m, b.m, 0, 1e-6, `step ${t} m`);
          assertClose(a.v, b.v, 0, 1e-6, `step ${t} v`);
        }
        if (st.ext) assertClose(st.weight16!, s.host.weight16!, 0, 2 ** -10, `step ${t} f16 weight`);
        const got = await gpu.read(stats);
        const wantStats = [want.maxAbsMaster, want.maxAbsM, want.maxV, want.maxRatio];
        got.forEach((x, i) => assert.ok(Math.abs(x - wantStats[i]) <= 1e-3 * wantStats[i], `step ${t} stat ${i}: ${x} vs ${wantStats[i]}`));
        gpu.free(grad);
      }
    });

  it('past a small storage binding (4 KiB: ranges of 768 elements): 8-bit moments + compact master over 7 ranges = the TS reference', async () => {
    const gpu = await testGpu({ bindingLimit: 4096 });
    try {
      const n = 5000;
      const init = randomValues(n, 41, 2);
      const s = setup(gpu, n, { optimizer: 'adamw8bit', master: 'compact' }, 'f16', init);
      const { flag, updateFlag, stats } = packedSignals(gpu);
      const run = { codes: gpu.upload(CODES, [512], 'f32'), updateFlag, stats, check: false };
      for (let t = 1; t <= 2; t++) {
        const gv = roundToF16(randomValues(n, 50 + t, 0.05).map((x, i) => x * 10 ** -((i >> 8) % 4)));
        const grad = gpu.upload(gv, [n], 'f16');
        gpu.write(stats, [0, 0, 0, 0]);
        adamwPacked(gpu, s.views, grad, CFG, { step: t, lossScale: 1, flag }, run);
        const want = adamwPackedRef(s.host, n, gv, CFG, t);
        const st = await readState(gpu, s);
        assertClose(mastersOf(st, n), mastersOf(s.host, n), 1e-12, 2 ** -26, `step ${t} master`);
        assertCodesClose(st.m8!, s.host.m8!, `step ${t} m codes`);
        assertCodesClose(st.v8!, s.host.v8!, `step ${t} v codes`);
        assertClose(st.absm!, s.host.absm!, 0, 1e-6, `step ${t} absmax m`);
        const got = await gpu.read(stats);
        assert.ok(Math.abs(got[1] - want.maxAbsM) <= 1e-3 * want.maxAbsM, `step ${t}: max |m| over every range ${got[1]} vs ${want.maxAbsM}`);
        gpu.free(grad);
      }
    } finally {
      gpu.destroy();
    }
  });

  it('the check raises its flag for an update past f16 and writes nothing; a normal step passes it', async () => {
    const gpu = await testGpu();
    const n = 4096;
    const init = randomValues(n, 5, 1);
    init[4000] = 65000;
    const s = setup(gpu, n, { optimizer: 'adamw8bit', master: 'compact' }, 'f16', init);
    const { flag, updateFlag, stats } = packedSignals(gpu);
    const run = { codes: gpu.upload(CODES, [512], 'f32'), updateFlag, stats, check: true };
    const gv = randomValues(n, 6, 0.1);
    gv[4000] = -0.05; // Adam moves it up by ~lr
    const grad = gpu.upload(gv, [n], 'f16');
    const before = await gpu.readBytes(s.buf.buffer, 0, s.pack.bytes);
    const w0 = await gpu.read(s.weight);
    adamwPacked(gpu, s.views, grad, { ...CFG, lr: 1e-3 }, { step: 1, lossScale: 1, flag }, run);
    assert.equal(await readFlag(gpu, updateFlag), false, 'lr 1e-3 stays below 65504');
    adamwPacked(gpu, s.views, grad, { ...CFG, lr: 1000, weightDecay: 0 }, { step: 1, lossScale: 1, flag }, run);
    assert.equal(await readFlag(gpu, updateFlag), true, 'lr 1000 pushes 65000 past 65504');
    assert.deepEqual(new Uint8Array(await gpu.readBytes(s.buf.buffer, 0, s.pack.bytes)), new Uint8Array(before), 'state untouched');
    assert.deepEqual(await gpu.read(s.weight), w0, 'weights untouched');
  });
});

describe('compact master precision against an fp32 master', () => {
  it('200 small steps: f16 + extension stays within the stated bound of fp32; pure f16 does not move at all', async () => {
    const gpu = await testGpu();
    const n = 1000;
    const steps = 200;
    // Weights ~U(-1, 1) as f16 values, lr 1e-4: an Adam step (~lr) is below half of f16's spacing near 1 (4.9e-4).
    const init = roundToF16(randomValues(n, 9, 1));
    const cfg: AdamWConfig = { ...CFG, lr: 1e-4 };
    const compact = setup(gpu, n, { optimizer: 'adamw', master: 'compact' }, 'f16', init);
    const fp32 = adamwParam(gpu, gpu.upload(init, [n], 'f16'), init);
    const { flag, norm, ...signals } = packedSignals(gpu);
    gpu.write(norm, [0.5]);
    const run = { codes: gpu.upload(CODES, [512], 'f32'), ...signals, check: false };
    const pure = Float32Array.from(init);
    const pm = new Float32Array(n);
    const pv = new Float32Array(n);
    for (let t = 1; t <= steps; t++) {
      const gv = roundToF16(randomValues(n, 1000 + t, 0.01));
      const grad = gpu.upload(gv, [n], 'f16');
      const s = { step: t, lossScale: 1, flag, clip: { norm, maxNorm: 1 } };
      adamw(gpu, fp32, grad, cfg, s);
      adamwPacked(gpu, compact.views, grad, cfg, s, run);
      // Pure f16 weights: the same update, rounded to f16 every step (no master at all).
      pureF16Step(pure, pm, pv, gv, cfg, t);
      gpu.free(grad);
    }
    const a = await gpu.read(fp32.master);
    const b = mastersOf(await readState(gpu, compact), n);
    const maxW = Math.max(...a.map(Math.abs));
    // Bound: per step the fp32 master rounds its product with the f32 decay factor (1 - lr wd has an error up to
    // 2^-25) and its result (2^-24 |w|); the compact master keeps 27 bits (2^-27 |w|, plus f32 rounding of the
    // small update). Both see the same gradients and moments, so they differ by at most
    // steps * (2^-25 + 2^-24 + 2^-27) * max|w| < steps * 2^-23 * max|w|.
    const bound = steps * 2 ** -23 * maxW;
    let dev = 0;
    let pureDev = 0;
    let moved = 0;
    for (let i = 0; i < n; i++) {
      dev = Math.max(dev, Math.abs(a[i] - b[i]));
      pureDev = Math.max(pureDev, Math.abs(a[i] - pure[i]));
      moved = Math.max(moved, Math.abs(a[i] - init[i]));
    }
    console.log(
      `compact vs fp32 master after ${steps} steps: ${dev.toExponential(2)} (bound ${bound.toExponential(2)}); pure f16 ${pureDev.toExponential(2)}; largest change ${moved.toExponential(2)}`,
    );
    assert.ok(dev <= bound, `compact deviates ${dev} > ${bound}`);
    assert.ok(moved > 100 * bound, 'the weights really moved');
    assert.ok(pureDev > 100 * bound, `pure f16 deviates only ${pureDev}`);
  });

  it('binds at most 10 storage buffers in every mode (SwiftShader allows 10; the flags and statistics share one)', () => {
    const modes = {
      '8-bit + compact, f16': { q8: true, ext: true, master: false, copy: false },
      '8-bit + compact, f32 (the weight is the master)': { q8: true, ext: false, master: true, copy: false },
      '8-bit + fp32 master': { q8: true, ext: false, master: true, copy: true },
      'f32 moments + compact, f16': { q8: false, ext: true, master: false, copy: false },
    };
    const counts = Object.fromEntries(Object.entries(modes).map(([k, m]) => [k, packedStorageBuffers(m)]));
    assert.deepEqual(counts, {
      // grad, weight, ext, m8, v8, absm, absv, codes, inputs (flag, norm), signals (update flag, statistics)
      '8-bit + compact, f16': 10,
      // grad, master, m8, v8, absm, absv, codes, inputs, signals
      '8-bit + compact, f32 (the weight is the master)': 9,
      // grad, weight, master, m8, v8, absm, absv, codes, inputs, signals
      '8-bit + fp32 master': 10,
      // grad, weight, ext, m, v, inputs, signals
      'f32 moments + compact, f16': 7,
    });
  });
});

/** One AdamW step with f16 weights and no master (the update rounded to f16 each step), float64 math. */
function pureF16Step(w: Float32Array, m: Float32Array, v: Float32Array, grad: ArrayLike<number>, cfg: AdamWConfig, t: number): void {
  const bc1 = 1 - cfg.beta1 ** t;
  const bc2 = 1 - cfg.beta2 ** t;
  for (let i = 0; i < w.length; i++) {
    m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * grad[i];
    v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * grad[i] * grad[i];
    const p = w[i] * (1 - cfg.lr * cfg.weightDecay) - (cfg.lr / bc1) * (m[i] / (Math.sqrt(v[i]) / Math.sqrt(bc2) + cfg.eps));
    w[i] = f16Of(p);
  }
}
