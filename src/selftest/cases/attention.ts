// Flash attention forward (out, LSE) and backward (dq, dk, dv) for head dims 40/64/80/160, self-
// and cross-attention (77 keys), both layouts, against PyTorch (float64 goldens) and the TS
// reference; naive attention likewise; finite differences of the GPU op in f32.
import { roundToF16 } from '../../util/half.ts';
import type { DType } from '../../gpu/tensor.ts';
import type { Gpu } from '../../gpu/device.ts';
import {
  attentionPlan,
  attentionRef,
  backwardTiling,
  flashAttention,
  flashAttentionBackward,
  forwardTiling,
  naiveAttention,
  naiveAttentionBackward,
  type AttentionKernelChoice,
  type AttentionLayout,
  type AttentionPlan,
} from '../../ops/attention.ts';
import { prefetchRefusal } from '../../ops/tiles.ts';
import { compare, randomValues, type Check, type KernelCase, type Tolerance } from '../check.ts';
import { finiteDiff, sampleIndices } from './matmul.ts';

/**
 * f32: dot products of D <= 160 and softmax sums of <= 77 terms in f32, vs float64.
 * f16: outputs and gradients rounded to f16 (4.9e-4 relative) of values up to ~3, and the f16
 * rounding of `out` feeding Delta in the backward.
 */
function tol(dtype: DType): Tolerance {
  return dtype === 'f32' ? { atol: 2e-5, rtol: 2e-4 } : { atol: 4e-3, rtol: 1e-2 };
}

interface GoldenAttn {
  name: string;
  B: number;
  H: number;
  N: number;
  M: number;
  D: number;
  layout: AttentionLayout;
  causal?: boolean;
}

const GOLDEN: GoldenAttn[] = [
  { name: 'self40', B: 1, H: 2, N: 37, M: 37, D: 40, layout: 'bhnd' },
  { name: 'cross40', B: 2, H: 1, N: 19, M: 77, D: 40, layout: 'bhnd' },
  { name: 'self64', B: 1, H: 2, N: 45, M: 45, D: 64, layout: 'bnhd' },
  { name: 'cross80', B: 1, H: 1, N: 21, M: 77, D: 80, layout: 'bnhd' },
  { name: 'self160', B: 1, H: 1, N: 33, M: 33, D: 160, layout: 'bhnd' },
  { name: 'cross160', B: 1, H: 1, N: 9, M: 77, D: 160, layout: 'bnhd' },
  { name: 'causal64', B: 1, H: 2, N: 77, M: 77, D: 64, layout: 'bnhd', causal: true },
];

function flashCase(c: GoldenAttn): KernelCase {
  const kind = c.causal ? 'causal self' : c.N === c.M ? 'self' : 'cross';
  return {
    family: 'attention',
    name: `flash ${kind} B${c.B} H${c.H} N${c.N} M${c.M} D${c.D} ${c.layout}: out, lse, dq, dk, dv (golden)`,
    async run({ gpu, dtype, golden }) {
      const g = (k: string) => golden.get(`${c.name}.${k}`);
      const [q, k, v, dout] = ['q', 'k', 'v', 'dout'].map(g);
      const up = (t: typeof q) => gpu.upload(t.data, t.shape, dtype);
      const [tq, tk, tv, tdo] = [q, k, v, dout].map(up);
      const opts = { layout: c.layout, causal: c.causal };
      const f = flashAttention(gpu, tq, tk, tv, opts);
      const gr = flashAttentionBackward(gpu, tq, tk, tv, f.out, f.lse, tdo, opts);
      const ref = attentionRef(q.data, k.data, v.data, dout.data, { ...c });
      const t = tol(dtype);
      const out = await gpu.read(f.out);
      const lse = await gpu.read(f.lse);
      const dq = await gpu.read(gr.dq);
      const dk = await gpu.read(gr.dk);
      const dv = await gpu.read(gr.dv);
      const checks: Check[] = [
        compare('out vs torch', out, g('out').data, t),
        compare('out vs ts ref', out, ref.out, t),
        compare('lse vs torch', lse, g('lse').data, { atol: 1e-5, rtol: 1e-5 }),
        compare('dq vs torch', dq, g('dq').data, t),
        compare('dq vs ts ref', dq, ref.dq, t),
        compare('dk vs torch', dk, g('dk').data, t),
        compare('dk vs ts ref', dk, ref.dk, t),
        compare('dv vs torch', dv, g('dv').data, t),
        compare('dv vs ts ref', dv, ref.dv, t),
      ];
      gpu.free(tq, tk, tv, tdo, f.out, f.lse, gr.dq, gr.dk, gr.dv);
      return checks;
    },
  };
}

// ---- each kernel path, with ragged sizes --------------------------------------------------------------

interface PathShape {
  B: number;
  H: number;
  N: number;
  M: number;
  D: number;
  layout?: AttentionLayout;
  causal?: boolean;
}

/**
 * Sizes at the tiles' edges: one query and one key; a head dim of 7 (not a multiple of 4); 65 query rows (one
 * past the tiled forward's 64-row block) against 33 keys (one past its 32- and 16-key tiles); exact tiles; a
 * causal mask across several key tiles; a query-split dK/dV (300 queries, 20 keys); head dim 256 (Q staged in
 * chunks, 8-key tiles). f32 only: the golden cases run the device's default path in f16 too, and the loaders'
 * conversion is the same on every path; each new head dim costs lavapipe seconds of pipeline compiles.
 */
const PATH_SHAPES: PathShape[] = [
  { B: 1, H: 1, N: 1, M: 1, D: 7 },
  { B: 2, H: 3, N: 65, M: 33, D: 7, layout: 'bnhd' },
  { B: 1, H: 2, N: 64, M: 32, D: 40 },
  { B: 1, H: 2, N: 70, M: 70, D: 64, layout: 'bnhd', causal: true },
  { B: 1, H: 2, N: 300, M: 20, D: 40 },
  { B: 1, H: 1, N: 5, M: 9, D: 256 },
];

type PathExpect = (plan: AttentionPlan, s: PathShape, gpu: Gpu) => string | null;

/**
 * flashAttention and its backward with `kernels` pinned, against the float64 reference on PATH_SHAPES; `expect`
 * checks the plan actually in force (so a silent fallback fails the case instead of testing another path).
 */
function pathCase(label: string, kernels: (s: PathShape) => AttentionKernelChoice, expect: PathExpect, extra: Partial<KernelCase> = {}): KernelCase {
  return {
    family: 'attention',
    name: `flash kernel path: ${label}; ragged and edge sizes (ts ref)`,
    dtypes: ['f32'],
    ...extra,
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      for (const [n, s] of PATH_SHAPES.entries()) {
        const { B, H, N, M, D } = s;
        const layout = s.layout ?? 'bhnd';
        const opts = { layout, causal: s.causal, kernels: kernels(s) };
        const why = expect(attentionPlan(gpu, s, opts.kernels), s, gpu);
        const tag = `B${B} H${H} N${N} M${M} D${D}${s.causal ? ' causal' : ''}`;
        checks.push({
          label: `${tag}: ${why ?? 'the plan in force is the one named'}`,
          pass: why === null,
          maxAbs: 0,
          maxRel: 0,
          tol: { atol: 0, rtol: 0 },
          n: 1,
        });
        const qShape = layout === 'bhnd' ? [B, H, N, D] : [B, N, H, D];
        const kShape = layout === 'bhnd' ? [B, H, M, D] : [B, M, H, D];
        const q = roundToF16(randomValues(B * H * N * D, 11 + n));
        const k = roundToF16(randomValues(B * H * M * D, 23 + n));
        const v = roundToF16(randomValues(B * H * M * D, 37 + n));
        const dout = roundToF16(randomValues(B * H * N * D, 41 + n));
        const [tq, tk, tv, tdo] = [
          [q, qShape],
          [k, kShape],
          [v, kShape],
          [dout, qShape],
        ].map(([x, shape]) => gpu.upload(x as Float32Array, shape as number[], dtype));
        const f = flashAttention(gpu, tq, tk, tv, opts);
        const gr = flashAttentionBackward(gpu, tq, tk, tv, f.out, f.lse, tdo, opts);
        const ref = attentionRef(q, k, v, dout, { ...s, layout });
        // As the golden cases, plus sums over up to 300 query rows (dK, dV) in f32.
        const t = dtype === 'f32' ? { atol: 5e-5, rtol: 2e-4 } : { atol: 8e-3, rtol: 1e-2 };
        checks.push(
          compare(`${tag} out`, await gpu.read(f.out), ref.out, t),
          compare(`${tag} lse`, await gpu.read(f.lse), ref.lse, { atol: 1e-5, rtol: 1e-5 }),
          compare(`${tag} dq`, await gpu.read(gr.dq), ref.dq, t),
          compare(`${tag} dk`, await gpu.read(gr.dk), ref.dk, t),
          compare(`${tag} dv`, await gpu.read(gr.dv), ref.dv, t),
        );
        gpu.free(tq, tk, tv, tdo, f.out, f.lse, gr.dq, gr.dk, gr.dv);
      }
      return checks;
    },
  };
}

const tiledWith =
  (subgroups: boolean, prefetch: boolean): PathExpect =>
  (plan) =>
    !plan.forward
      ? 'the tiled forward did not run'
      : plan.forward.subgroups !== subgroups
        ? `subgroup reductions ${plan.forward.subgroups}, wanted ${subgroups}`
        : plan.forward.prefetch !== prefetch
          ? `prefetch ${plan.forward.prefetch}, wanted ${prefetch}`
          : !plan.backward
            ? 'the fused backward did not run'
            : null;

/** Why the subgroup row reductions cannot run here, or null. */
function subgroupRefusal(gpu: Gpu): string | null {
  return forwardTiling(gpu, 40, { subgroups: true })?.subgroups ? null : `no subgroups of at least 8 lanes (min ${gpu.facts.subgroupMinSize})`;
}

/** One b*head of dQ scratch per dispatch: the fused backward runs in B*H slices. */
const oneBhScratch = (s: PathShape) => Math.ceil(s.M / 64) * s.N * s.D * 4;

const PATH_CASES: KernelCase[] = [
  pathCase(
    'one query row per invocation, separate dQ and dK/dV kernels',
    () => ({ forward: 'rows', backward: 'separate' }),
    (plan) => (plan.forward || plan.backward || plan.tiledBackward ? 'a tiled forward or a fused or tiled backward ran' : null),
  ),
  pathCase(
    'tiled forward, register-tiled dK/dV and dQ kernels',
    () => ({ forward: 'tiled', subgroups: true, prefetch: false, backward: 'tiled' }),
    // Where no tile fits the device's workgroup memory (D256 on lavapipe's 32 KiB) the fused kernel runs instead.
    (plan, s, gpu) =>
      !plan.forward
        ? 'the tiled forward did not run'
        : !plan.forward.subgroups || plan.forward.prefetch
          ? 'wanted subgroup reductions without prefetch (the forward of the subgroup case: no pipelines of its own)'
          : backwardTiling(gpu, s.D)
            ? plan.tiledBackward
              ? null
              : 'the tiled backward did not run'
            : plan.backward
              ? null
              : 'no tile fits and the fused backward did not run',
    // GPUs' default backward for self-attention: f16 too.
    { dtypes: ['f32', 'f16'], requires: subgroupRefusal },
  ),
  pathCase(
    'tiled forward, row reductions by subgroup shuffles',
    () => ({ forward: 'tiled', subgroups: true, prefetch: false, backward: 'fused' }),
    tiledWith(true, false),
    {
      // GPUs' default path (CPU adapters default to the row and separate kernels): f16 too.
      dtypes: ['f32', 'f16'],
      requires: subgroupRefusal,
    },
  ),
  pathCase(
    'tiled forward with the next K/V tile prefetched',
    () => ({ forward: 'tiled', subgroups: false, prefetch: true, backward: 'fused' }),
    tiledWith(false, true),
    {
      requires: prefetchRefusal,
    },
  ),
  pathCase(
    'fused backward in b*head slices (one per dispatch)',
    (s) => ({ backward: 'fused', dqScratchBytes: oneBhScratch(s) }),
    (plan, s) =>
      plan.backward?.bhPerDispatch === 1 || s.B * s.H === 1 ? null : `b*heads per dispatch ${plan.backward?.bhPerDispatch ?? 'none (separate)'}, wanted 1`,
  ),
];

export const cases: KernelCase[] = [
  ...GOLDEN.map(flashCase),
  ...PATH_CASES,
  {
    family: 'attention',
    name: 'flash cross-attention with the query-split dK/dV path: N300 M77 D40 and N100 M77 D160 (ts ref)',
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      for (const [N, D] of [
        [300, 40],
        [100, 160],
      ]) {
        const [B, H, M] = [1, 2, 77];
        const q = roundToF16(randomValues(B * H * N * D, N));
        const k = roundToF16(randomValues(B * H * M * D, N + 1));
        const v = roundToF16(randomValues(B * H * M * D, N + 2));
        const dout = roundToF16(randomValues(B * H * N * D, N + 3));
        const tq = gpu.upload(q, [B, H, N, D], dtype);
        const tk = gpu.upload(k, [B, H, M, D], dtype);
        const tv = gpu.upload(v, [B, H, M, D], dtype);
        const tdo = gpu.upload(dout, [B, H, N, D], dtype);
        const f = flashAttention(gpu, tq, tk, tv);
        const gr = flashAttentionBackward(gpu, tq, tk, tv, f.out, f.lse, tdo);
        const ref = attentionRef(q, k, v, dout, { B, H, N, M, D });
        // dK/dV sum over 300 query rows: f32 partial sums per split, then the splits.
        const t = dtype === 'f32' ? { atol: 5e-5, rtol: 2e-4 } : { atol: 8e-3, rtol: 1e-2 };
        checks.push(
          compare(`N${N} D${D} out`, await gpu.read(f.out), ref.out, t),
          compare(`N${N} D${D} dq`, await gpu.read(gr.dq), ref.dq, t),
          compare(`N${N} D${D} dk`, await gpu.read(gr.dk), ref.dk, t),
          compare(`N${N} D${D} dv`, await gpu.read(gr.dv), ref.dv, t),
        );
        gpu.free(tq, tk, tv, tdo, f.out, f.lse, gr.dq, gr.dk, gr.dv);
      }
      return checks;
    },
  },
  {
    family: 'attention',
    name: 'naive (materialised) attention self D40 and cross D80: out, dq, dk, dv (golden)',
    async run({ gpu, dtype, golden }) {
      const checks: Check[] = [];
      for (const name of ['self40', 'cross40']) {
        const g = (k: string) => golden.get(`${name}.${k}`);
        const [tq, tk, tv, tdo] = ['q', 'k', 'v', 'dout'].map((k) => gpu.upload(g(k).data, g(k).shape, dtype));
        const f = naiveAttention(gpu, tq, tk, tv);
        const gr = naiveAttentionBackward(gpu, tq, tk, tv, f.probs, tdo);
        const t = tol(dtype);
        checks.push(
          compare(`${name} out vs torch`, await gpu.read(f.out), g('out').data, t),
          compare(`${name} dq vs torch`, await gpu.read(gr.dq), g('dq').data, t),
          compare(`${name} dk vs torch`, await gpu.read(gr.dk), g('dk').data, t),
          compare(`${name} dv vs torch`, await gpu.read(gr.dv), g('dv').data, t),
        );
        gpu.free(tq, tk, tv, tdo, f.out, f.probs, gr.dq, gr.dk, gr.dv);
      }
      return checks;
    },
  },
  {
    family: 'attention',
    name: 'finite differences of sum(out*r) vs flash dq/dk/dv, B1 H2 N11 M13 D40 bnhd (f32)',
    dtypes: ['f32'],
    async run({ gpu }) {
      const [B, H, N, M, D] = [1, 2, 11, 13, 40];
      const opts = { layout: 'bnhd' as const };
      const q = roundToF16(randomValues(B * N * H * D, 1));
      const k = roundToF16(randomValues(B * M * H * D, 2));
      const v = roundToF16(randomValues(B * M * H * D, 3));
      const r = roundToF16(randomValues(B * N * H * D, 4));
      const tq = gpu.upload(q, [B, N, H, D], 'f32');
      const tk = gpu.upload(k, [B, M, H, D], 'f32');
      const tv = gpu.upload(v, [B, M, H, D], 'f32');
      const tr = gpu.upload(r, [B, N, H, D], 'f32');
      const f = flashAttention(gpu, tq, tk, tv, opts);
      const gr = flashAttentionBackward(gpu, tq, tk, tv, f.out, f.lse, tr, opts);
      const loss = async () => {
        const o = flashAttention(gpu, tq, tk, tv, opts);
        const y = await gpu.read(o.out);
        gpu.free(o.out, o.lse);
        return y.reduce((s, x, i) => s + x * r[i], 0);
      };
      // Central differences, h = 1e-2: truncation O(h^2) plus f32 rounding of a ~10-term loss / h.
      const fdTol = { atol: 2e-3, rtol: 2e-2 };
      const checks: Check[] = [];
      for (const [name, t, vals, grad] of [
        ['dq', tq, q, gr.dq],
        ['dk', tk, k, gr.dk],
        ['dv', tv, v, gr.dv],
      ] as const) {
        const analytic = await gpu.read(grad);
        const idx = sampleIndices(vals.length, 5, name.length * 7);
        checks.push(
          compare(
            `${name} vs central difference`,
            idx.map((i) => analytic[i]),
            await finiteDiff(gpu, t, vals, idx, 1e-2, loss),
            fdTol,
          ),
        );
      }
      gpu.free(tq, tk, tv, tr, f.out, f.lse, gr.dq, gr.dk, gr.dv);
      return checks;
    },
  },
];
