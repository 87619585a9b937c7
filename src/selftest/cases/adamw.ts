// AdamW against torch.optim.AdamW over 5 steps on two parameters (clip_grad_norm_ over both on
// steps 3-5), with loss-scaled gradients in f16 or f32; skip-on-overflow leaves every buffer
// bit-identical and the loss scaler halves; the master-only path (no weight copy); the update check
// (adamw_check) against its plain-TS reference in the cases that blow the weights up, writing nothing;
// the state statistics (adamw_stats) against plain TS.
import type { Gpu } from '../../gpu/device.ts';
import { roundToF16 } from '../../util/half.ts';
import type { DType, Tensor } from '../../gpu/tensor.ts';
import {
  adamw,
  adamwAll,
  adamwCheck,
  adamwCheckRef,
  adamwParam,
  adamwRef,
  adamwStateStats,
  adamwStats,
  clipFactorRef,
  masterLimit,
  type AdamWConfig,
  type AdamWParam,
} from '../../ops/adamw.ts';
import {
  adamwPacked,
  adamwPackedRef,
  CODES,
  mastersOf,
  momentsOf,
  packedSignals,
  QBLOCK,
  ZERO_M,
  ZERO_V,
  type PackedHostState,
  type PackedParam,
} from '../../ops/adamw-packed.ts';
import { DynamicLossScaler } from '../../ops/lossscale.ts';
import { checkFinite, clearFlag, globalNormRef, newFlag, readFlag } from '../../ops/reduce.ts';
import { compare, randomValues, type Check, type KernelCase } from '../check.ts';

const EXACT = { atol: 0, rtol: 0 };

/** Raw bits of a tensor, for bit-exact comparisons (compare() treats 0 and -0 as equal). */
async function bits(gpu: Gpu, t: Tensor): Promise<Uint32Array> {
  const raw = await gpu.readBytes(t.buffer, t.byteOffset, Math.ceil(t.byteSize / 4) * 4);
  return new Uint32Array(raw);
}

function bitsCheck(label: string, after: Uint32Array, before: Uint32Array): Check {
  return compare(label, Float64Array.from(after), Float64Array.from(before), EXACT);
}

interface RefState {
  master: Float32Array;
  m: Float32Array;
  v: Float32Array;
}

function refState(init: ArrayLike<number>): RefState {
  return { master: Float32Array.from(init), m: new Float32Array(init.length), v: new Float32Array(init.length) };
}

export const cases: KernelCase[] = [
  {
    family: 'adamw',
    name: 'AdamW 5 steps, 2 params vs torch.optim.AdamW, clip_grad_norm_ on steps 3-5, grads x 1024 (golden)',
    async run({ gpu, dtype, golden }) {
      const [lr, beta1, beta2, eps, weightDecay, scale] = golden.get('config').data;
      const maxNorms = golden.get('max_norm').data;
      const cfg: AdamWConfig = { lr, beta1, beta2, eps, weightDecay };
      const names = ['p0', 'p1'];
      const init = names.map((k) => golden.get(`${k}.0`));
      const weights = init.map((p) => gpu.upload(p.data, p.shape, dtype, 'weights'));
      const params: AdamWParam[] = init.map((p, i) => adamwParam(gpu, weights[i], p.data));
      const refs = init.map((p) => refState(p.data));
      const flag = newFlag(gpu);
      const checks: Check[] = [];
      // master and the moments are f32 in both variants (f16 and f32 gradients hold the same
      // f16-exact values): differences are f32 rounding of ~10 operations per step, against float64
      // torch. Magnitudes: master ~1, m ~1e-2, v ~1e-4.
      const tMaster = { atol: 1e-6, rtol: 1e-5 };
      const tM = { atol: 1e-8, rtol: 1e-5 };
      const tV = { atol: 1e-10, rtol: 1e-5 };
      for (let step = 1; step <= 5; step++) {
        const gData = names.map((k) => golden.get(`${k}.grad${step}`));
        const grads = gData.map((g) => gpu.upload(g.data, g.shape, dtype, 'gradients'));
        const maxNorm = maxNorms[step - 1] || undefined;
        const norm = adamwAll(gpu, params, grads, cfg, { step, lossScale: scale, flag, maxNorm });
        checks.push(compare(`step ${step} flag clear`, [(await readFlag(gpu, flag)) ? 1 : 0], [0], EXACT));
        let clip = 1;
        if (norm) {
          const n = await gpu.read(norm);
          // sqrt of an f32 sum of 377 squares, divided by the scale.
          checks.push(compare(`step ${step} norm vs torch`, n, golden.get(`norm${step}`).data, { atol: 1e-7, rtol: 1e-5 }));
          checks.push(
            compare(
              `step ${step} norm vs ts ref`,
              n,
              [
                globalNormRef(
                  gData.map((g) => g.data),
                  scale,
                ),
              ],
              { atol: 1e-7, rtol: 1e-5 },
            ),
          );
          clip = clipFactorRef(
            globalNormRef(
              gData.map((g) => g.data),
              scale,
            ),
            maxNorm!,
          );
        }
        for (let k = 0; k < names.length; k++) {
          const key = names[k];
          adamwRef(refs[k].master, refs[k].m, refs[k].v, gData[k].data, cfg, step, scale, clip);
          const master = await gpu.read(params[k].master);
          const m = await gpu.read(params[k].m);
          const v = await gpu.read(params[k].v);
          checks.push(
            compare(`step ${step} ${key} master vs torch`, master, golden.get(`${key}.${step}`).data, tMaster),
            compare(`step ${step} ${key} master vs ts ref`, master, refs[k].master, tMaster),
            compare(`step ${step} ${key} exp_avg vs torch`, m, golden.get(`${key}.m${step}`).data, tM),
            compare(`step ${step} ${key} exp_avg vs ts ref`, m, refs[k].m, tM),
            compare(`step ${step} ${key} exp_avg_sq vs torch`, v, golden.get(`${key}.v${step}`).data, tV),
            compare(`step ${step} ${key} exp_avg_sq vs ts ref`, v, refs[k].v, tV),
            compare(
              `step ${step} ${key} ${dtype} weight = ${dtype === 'f16' ? 'round-to-f16(master)' : 'master'}`,
              await gpu.read(weights[k]),
              dtype === 'f16' ? roundToF16(master) : master,
              EXACT,
            ),
          );
        }
        gpu.free(...grads, norm);
      }
      gpu.free(flag, ...weights, ...params.flatMap((p) => [p.master, p.m, p.v]));
      return checks;
    },
  },
  {
    family: 'adamw',
    name: 'overflow: an inf / NaN gradient sets the flag, the step is skipped bit-exactly, the scaler halves, the retry matches the reference',
    async run({ gpu, dtype }) {
      const n = 1000;
      const cfg: AdamWConfig = { lr: 1e-2, beta1: 0.85, beta2: 0.99, eps: 1e-7, weightDecay: 0.1 };
      const init = [roundToF16(randomValues(n, 1)), roundToF16(randomValues(37, 2))];
      const weights = init.map((v) => gpu.upload(v, [v.length], dtype, 'weights'));
      const params = init.map((v, i) => adamwParam(gpu, weights[i], v));
      const refs = init.map(refState);
      const flag = newFlag(gpu);
      const scaler = new DynamicLossScaler({ initScale: 256 });
      const grad = (seed: number, len: number) => roundToF16(randomValues(len, seed, 0.05 * scaler.scale));
      const checks: Check[] = [];
      // Step 1: clean, so m and v are non-zero.
      const g1 = [grad(3, n), grad(4, 37)];
      let tg = g1.map((g) => gpu.upload(g, [g.length], dtype, 'gradients'));
      adamwAll(gpu, params, tg, cfg, { step: 1, lossScale: scaler.scale, flag, maxNorm: 1 });
      let clip = clipFactorRef(globalNormRef(g1, scaler.scale), 1);
      g1.forEach((g, k) => adamwRef(refs[k].master, refs[k].m, refs[k].v, g, cfg, 1, scaler.scale, clip));
      checks.push(compare('step 1 applied', [(await scaler.updateFromFlag(gpu, flag)) ? 1 : 0], [1], EXACT));
      gpu.free(...tg);
      const state = params.flatMap((p, k) => [p.master, p.m, p.v, weights[k]]);
      const before = await Promise.all(state.map((t) => bits(gpu, t)));
      // Step 2: an inf in the first gradient and a NaN in the second.
      const bad = [grad(5, n), grad(6, 37)];
      bad[0][777] = Infinity;
      bad[1][3] = NaN;
      tg = bad.map((g) => gpu.upload(g, [g.length], dtype, 'gradients'));
      adamwAll(gpu, params, tg, cfg, { step: 2, lossScale: scaler.scale, flag, maxNorm: 1 });
      checks.push(compare('flag set (1.0)', await gpu.read(flag), [1], EXACT));
      const applied = await scaler.updateFromFlag(gpu, flag);
      checks.push(compare('scaler: step not applied', [applied ? 1 : 0], [0], EXACT));
      checks.push(compare('scaler: scale halved 256 -> 128', [scaler.scale], [128], EXACT));
      const after = await Promise.all(state.map((t) => bits(gpu, t)));
      const what = ['master', 'm', 'v', 'weight'];
      after.forEach((a, i) => checks.push(bitsCheck(`param ${i >> 2} ${what[i & 3]} bit-identical after the skipped step`, a, before[i])));
      gpu.free(...tg);
      // Step 2 again (t stays 2: the skipped step did not count) with clean gradients at the new scale.
      const g2 = [grad(7, n), grad(8, 37)];
      tg = g2.map((g) => gpu.upload(g, [g.length], dtype, 'gradients'));
      adamwAll(gpu, params, tg, cfg, { step: 2, lossScale: scaler.scale, flag, maxNorm: 1 });
      clip = clipFactorRef(globalNormRef(g2, scaler.scale), 1);
      g2.forEach((g, k) => adamwRef(refs[k].master, refs[k].m, refs[k].v, g, cfg, 2, scaler.scale, clip));
      checks.push(compare('retried step applied', [(await scaler.updateFromFlag(gpu, flag)) ? 1 : 0], [1], EXACT));
      for (let k = 0; k < 2; k++) {
        const master = await gpu.read(params[k].master);
        checks.push(
          compare(`param ${k} master after the retry vs ts ref`, master, refs[k].master, { atol: 1e-6, rtol: 1e-5 }),
          compare(`param ${k} m vs ts ref`, await gpu.read(params[k].m), refs[k].m, { atol: 1e-8, rtol: 1e-5 }),
          compare(`param ${k} v vs ts ref`, await gpu.read(params[k].v), refs[k].v, { atol: 1e-10, rtol: 1e-5 }),
          compare(`param ${k} weight = ${dtype}(master)`, await gpu.read(weights[k]), dtype === 'f16' ? roundToF16(master) : master, EXACT),
        );
      }
      gpu.free(flag, ...tg, ...state);
      return checks;
    },
  },
  {
    family: 'adamw',
    name: 'master-only update (no weight copy, or the weight is the master) and no clipping',
    dtypes: ['f32'],
    async run({ gpu }) {
      const n = 300;
      const cfg: AdamWConfig = { lr: 5e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };
      const init = roundToF16(randomValues(n, 21));
      const g = roundToF16(randomValues(n, 22, 8));
      const a = adamwParam(gpu, gpu.zeros([n], 'f32'), init);
      delete a.weight;
      const b = adamwParam(gpu, gpu.zeros([n], 'f32'), init);
      b.weight = b.master;
      const flag = newFlag(gpu);
      const tg = gpu.upload(g, [n], 'f32');
      clearFlag(gpu, flag);
      checkFinite(gpu, [tg], flag);
      const ref = refState(init);
      const checks: Check[] = [];
      for (let step = 1; step <= 3; step++) {
        for (const p of [a, b]) adamw(gpu, p, tg, cfg, { step, lossScale: 8, flag });
        adamwRef(ref.master, ref.m, ref.v, g, cfg, step, 8);
        checks.push(
          compare(`step ${step} no copy: master vs ts ref`, await gpu.read(a.master), ref.master, { atol: 1e-6, rtol: 1e-5 }),
          compare(`step ${step} weight is master: master vs ts ref`, await gpu.read(b.master), ref.master, { atol: 1e-6, rtol: 1e-5 }),
        );
      }
      gpu.free(flag, tg, a.master, a.m, a.v, b.master, b.m, b.v);
      return checks;
    },
  },
  {
    family: 'adamw',
    name: 'update check vs plain-TS reference: the flag rises where the update would leave a non-finite master, m or v or an f16 copy past 65504, and nothing is written',
    async run({ gpu, dtype }) {
      const n = 700;
      const base: AdamWConfig = { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };
      // A state with some history (two reference steps), uploaded as is so the kernel and the reference
      // see the same inputs.
      const init = roundToF16(randomValues(n, 51));
      const hist = refState(init);
      for (let t = 1; t <= 2; t++) adamwRef(hist.master, hist.m, hist.v, roundToF16(randomValues(n, 52 + t, 0.1)), base, t);
      const grad = roundToF16(randomValues(n, 60, 0.1));
      // Element 600: at 65500 with a negative gradient and no history, a learning rate of 10 moves it by
      // about +7.4 (step 2, no decay): past f16's 65504, finite in f32.
      const nearMax = { master: Float32Array.from(hist.master), m: Float32Array.from(hist.m), v: Float32Array.from(hist.v) };
      nearMax.master[600] = 65500;
      nearMax.m[600] = 0;
      nearMax.v[600] = 0;
      const nearMaxGrad = Float32Array.from(grad);
      nearMaxGrad[600] = -0.05;
      const isF16 = dtype === 'f16';
      const scenarios: { label: string; state: RefState; grad: Float32Array; cfg: AdamWConfig; lossScale: number; gradFlag?: boolean; expect: boolean }[] = [
        { label: 'lr 1e-3', state: hist, grad, cfg: base, lossScale: 1, expect: false },
        // 1 - lr*wd = -1e28 times |master| ~ 1: past 65504, not past f32's 3.4e38.
        { label: 'lr 1e30 (weight decay overflows f16 only)', state: hist, grad, cfg: { ...base, lr: 1e30 }, lossScale: 1, expect: isF16 },
        // The step size lr / (1 - b1^2) is inf as f32.
        { label: 'lr 1e39 (the step size overflows f32)', state: hist, grad, cfg: { ...base, lr: 1e39 }, lossScale: 1, expect: true },
        {
          label: 'one master pushed from 65500 past 65504',
          state: nearMax,
          grad: nearMaxGrad,
          cfg: { ...base, lr: 10, weightDecay: 0 },
          lossScale: 1,
          expect: isF16,
        },
        // 60000 / 1e-20 = 6e24: g * g overflows, so v would be inf.
        {
          label: 'a 6e24 unscaled gradient (v overflows)',
          state: hist,
          grad: grad.map((x, i) => (i === 5 ? 60000 : x)),
          cfg: base,
          lossScale: 1e-20,
          expect: true,
        },
        // Like the update, the check stands down when the gradients' flag is set (that step is skipped anyway).
        { label: 'lr 1e39 with the gradient flag set', state: hist, grad, cfg: { ...base, lr: 1e39 }, lossScale: 1, gradFlag: true, expect: false },
      ];
      const checks: Check[] = [];
      for (const sc of scenarios) {
        const weight = gpu.upload(sc.state.master, [n], dtype, 'weights');
        const p: AdamWParam = {
          master: gpu.upload(sc.state.master, [n], 'f32', 'optimizer'),
          m: gpu.upload(sc.state.m, [n], 'f32', 'optimizer'),
          v: gpu.upload(sc.state.v, [n], 'f32', 'optimizer'),
          weight,
        };
        const tg = gpu.upload(sc.grad, [n], dtype, 'gradients');
        const flag = newFlag(gpu);
        if (sc.gradFlag) gpu.write(flag, [1]);
        const updateFlag = newFlag(gpu);
        const state = [p.master, p.m, p.v, weight];
        const before = await Promise.all(state.map((t) => bits(gpu, t)));
        adamwCheck(gpu, p, tg, sc.cfg, { step: 2, lossScale: sc.lossScale, flag }, updateFlag);
        const raised = await readFlag(gpu, updateFlag);
        const ref = sc.gradFlag ? false : adamwCheckRef(sc.state.master, sc.state.m, sc.state.v, sc.grad, sc.cfg, 2, masterLimit(dtype as DType), sc.lossScale);
        checks.push(
          compare(`${sc.label}: the scenario is what it claims (reference ${ref})`, [ref ? 1 : 0], [sc.expect ? 1 : 0], EXACT),
          compare(`${sc.label}: update flag vs ts ref`, [raised ? 1 : 0], [ref ? 1 : 0], EXACT),
        );
        const after = await Promise.all(state.map((t) => bits(gpu, t)));
        ['master', 'm', 'v', 'weight'].forEach((what, i) => checks.push(bitsCheck(`${sc.label}: ${what} bit-identical after the check`, after[i], before[i])));
        gpu.free(tg, flag, updateFlag, ...state);
      }
      // A check that stays clear changes nothing the update then computes: check + update equals update alone.
      const pair = [0, 1].map(() => adamwParam(gpu, gpu.zeros([n], dtype, 'weights'), hist.master));
      for (const p of pair) {
        gpu.write(p.m, hist.m);
        gpu.write(p.v, hist.v);
      }
      const tg = gpu.upload(grad, [n], dtype, 'gradients');
      const flag = newFlag(gpu);
      const updateFlag = newFlag(gpu);
      const s = { step: 3, lossScale: 1, flag };
      adamwCheck(gpu, pair[0], tg, base, s, updateFlag);
      for (const p of pair) adamw(gpu, p, tg, base, s);
      checks.push(compare('normal step: check stays clear', [(await readFlag(gpu, updateFlag)) ? 1 : 0], [0], EXACT));
      const [a, b] = await Promise.all(pair.map((p) => Promise.all([p.master, p.m, p.v, p.weight!].map((t) => bits(gpu, t)))));
      ['master', 'm', 'v', 'weight'].forEach((what, i) => checks.push(bitsCheck(`check then update = update alone: ${what}`, a[i], b[i])));
      gpu.free(tg, flag, updateFlag, ...pair.flatMap((p) => [p.master, p.m, p.v, p.weight]));
      return checks;
    },
  },
  {
    family: 'adamw',
    name: 'state statistics (max |master|, |m|, v, |m| / (sqrt(v) + eps)) vs plain TS, accumulated over two states',
    dtypes: ['f32'],
    async run({ gpu }) {
      const cfg: AdamWConfig = { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };
      const make = (n: number, seed: number) => {
        const master = randomValues(n, seed, 3);
        const m = randomValues(n, seed + 1, 1e-3);
        const v = randomValues(n, seed + 2, 1e-6).map(Math.abs);
        for (let i = 0; i < n; i += 7) m[i] = 0;
        for (let i = 3; i < n; i += 11) v[i] = 0; // m without v: the ratio's eps decides it
        return { master, m, v };
      };
      const states = [make(1500, 71), make(333, 81)];
      states[1].master[100] = -50; // the largest |master| sits in the second state
      const out = gpu.tensor([4], 'f32', 'scratch', 'stats');
      gpu.write(out, [0, 0, 0, 0]);
      const checks: Check[] = [];
      const want = [0, 0, 0, 0];
      const tol = { atol: 0, rtol: 1e-6 }; // f32 sqrt and division against float64
      for (const [k, st] of states.entries()) {
        const t = {
          master: gpu.upload(st.master, [st.master.length], 'f32'),
          m: gpu.upload(st.m, [st.m.length], 'f32'),
          v: gpu.upload(st.v, [st.v.length], 'f32'),
        };
        adamwStats(gpu, t, cfg, out);
        const r = adamwStateStats(st.master, st.m, st.v, cfg);
        [r.maxAbsMaster, r.maxAbsM, r.maxV, r.maxRatio].forEach((x, i) => (want[i] = Math.max(want[i], x)));
        checks.push(compare(`after state ${k + 1}: maxima vs ts ref`, await gpu.read(out), want, tol));
        gpu.free(t.master, t.m, t.v);
      }
      checks.push(compare('the largest |master| came from the second state', [want[0]], [50], EXACT));
      gpu.free(out);
      return checks;
    },
  },
  {
    family: 'adamw',
    name: 'compact state (adamw_packed): 8-bit blockwise moments with the compact master (f16: weight + extension; f32: the weight itself), 3 clipped steps vs plain TS',
    async run({ gpu, dtype }) {
      // 4500 elements: 18 blocks of 256, the last one partly used; gradients over 4 decades block by block.
      const n = 4500;
      const blocks = Math.ceil(n / QBLOCK);
      const cfg: AdamWConfig = { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };
      const init = roundToF16(randomValues(n, 61, 2));
      const weight = gpu.upload(init, [n], dtype, 'weights');
      const words = (count: number, fill: number) => gpu.upload(new Float32Array(new Uint32Array(count).fill(fill).buffer), [count], 'f32', 'optimizer');
      // The zero codes of m (127 in the signed map) and v (0), four to a word; absmax 0; extension words 0.
      const zeroM = ZERO_M * 0x01010101;
      const p: PackedParam = {
        numel: n,
        weight,
        ...(dtype === 'f16' ? { ext: words(blocks * (QBLOCK / 2), 0) } : { master: weight }),
        m8: words(blocks * (QBLOCK / 4), zeroM),
        v8: words(blocks * (QBLOCK / 4), ZERO_V * 0x01010101),
        absm: words(blocks, 0),
        absv: words(blocks, 0),
      };
      const host: PackedHostState = {
        ...(dtype === 'f16' ? { weight16: Float32Array.from(init), ext: new Int16Array(blocks * QBLOCK) } : { master: Float32Array.from(init) }),
        m8: new Uint8Array(blocks * QBLOCK).fill(ZERO_M),
        v8: new Uint8Array(blocks * QBLOCK).fill(ZERO_V),
        absm: new Float32Array(blocks),
        absv: new Float32Array(blocks),
      };
      const codes = gpu.upload(CODES, [CODES.length], 'f32');
      const { buffers, updateFlag, stats, flag, norm } = packedSignals(gpu);
      gpu.write(norm, [3]);
      const run = { codes, updateFlag, stats, check: false };
      const checks: Check[] = [];
      const bytesOf = async (t: Tensor) => new Uint8Array(await gpu.readBytes(t.buffer, t.byteOffset, t.byteSize));
      for (let step = 1; step <= 3; step++) {
        const g = roundToF16(randomValues(n, 70 + step, 0.05 * 64).map((x, i) => x * 10 ** -((i >> 8) % 4)));
        const grad = gpu.upload(g, [n], dtype, 'gradients');
        adamwPacked(gpu, p, grad, cfg, { step, lossScale: 64, flag, clip: { norm, maxNorm: 1 } }, run);
        adamwPackedRef(host, n, g, cfg, step, 64, Math.min(1, 1 / (3 + 1e-6)));
        const got: PackedHostState = {
          m8: await bytesOf(p.m8!),
          v8: await bytesOf(p.v8!),
          absm: await gpu.read(p.absm!),
          absv: await gpu.read(p.absv!),
          ...(dtype === 'f16' ? { weight16: await gpu.read(weight), ext: new Int16Array((await bytesOf(p.ext!)).buffer) } : { master: await gpu.read(weight) }),
        };
        const a = momentsOf(got, n);
        const b = momentsOf(host, n);
        // f32 operations in the same order (a GPU may fuse a multiply-add: an ulp); the compact master holds 27
        // bits, the f32 weight 24. A value on a code midpoint may round to the neighbouring code: codes within one,
        // dequantised moments within that code's spacing (the dynamic map's neighbours differ by at most ~10%
        // outside its lowest decade, where values are below 1e-6 of the block maximum).
        // CPU adapters (lavapipe, SwiftShader) evaluate f32 with correctly rounded division and sqrt and no
        // contraction, so the master matches to its own precision (27 bits compact, 24 f32). A GPU driver may fuse
        // multiply-adds and divides to WGSL's 2.5 ulp (NVIDIA: measured 1-2 f32 ulps of the largest weights, |w| <= 2,
        // and a few ulps of the update where it cancels the weight): 2 ulps of max |w| in absolute terms, which a
        // wrong update (lr = 1e-2 times an O(1) ratio) or a lost extension (f16's 2^-11) still exceeds 1000-fold.
        const wMax = Math.max(...mastersOf(host, n).map(Math.abs));
        const masterTol = gpu.facts.software ? { atol: 1e-12, rtol: dtype === 'f16' ? 2 ** -26 : 2 ** -22 } : { atol: 2 ** -22 * wMax, rtol: 2 ** -22 };
        checks.push(
          compare(`step ${step} master`, mastersOf(got, n), mastersOf(host, n), masterTol),
          compare(`step ${step} m codes within one`, got.m8!, host.m8!, { atol: 1, rtol: 0 }),
          compare(`step ${step} v codes within one`, got.v8!, host.v8!, { atol: 1, rtol: 0 }),
          compare(`step ${step} block absmax of m`, got.absm!, host.absm!, { atol: 0, rtol: 1e-6 }),
          compare(`step ${step} block absmax of v`, got.absv!, host.absv!, { atol: 0, rtol: 1e-6 }),
          compare(`step ${step} m dequantised`, a.m, b.m, { atol: 1e-6 * Math.max(...host.absm!), rtol: 0.1 }),
          compare(`step ${step} v dequantised`, a.v, b.v, { atol: 1e-6 * Math.max(...host.absv!), rtol: 0.1 }),
        );
        gpu.free(grad);
      }
      gpu.free(weight, codes, ...buffers, p.m8, p.v8, p.absm, p.absv, p.ext);
      return checks;
    },
  },
];
