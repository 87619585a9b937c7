// LyCORIS network types (nn/lycoris.ts): each type's adapted weight W + s ΔW, the layer's output and every factor's
// gradient against PyTorch autograd (tests/fixtures/train/gen_lycoris.py), LyCORIS' factorization table, training
// on the tiny UNet, and the exports merged by ComfyUI's rule against the trained model's own adapted weights.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { writeLycoris } from '../../src/export/lycoris.ts';
import { mergedLycorisProvider, mergeLycoris } from '../../src/export/merge.ts';
import { kohyaName } from '../../src/export/lora.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { doraScale, doraScaleBackward, doraScaleBackwardRef, doraScaleRef } from '../../src/ops/dora.ts';
import { attachNetwork, factorization, networkShapes, networkWeight, type NetworkSpec, type NetworkType } from '../../src/nn/lycoris.ts';
import { Ops, Tape } from '../../src/nn/ops.ts';
import { defaultSettings, refuseInactive, SettingsError, validateSettings } from '../../src/pipeline/settings.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { networkSpecOf, trainableSpec } from '../../src/train/trainable.ts';
import { DreamBoothTrainer } from '../../src/train/trainer.ts';
import { INFO, memorySink } from '../export/fixtures.ts';
import { FIXTURES, testGpu } from '../helpers.ts';
import { base, fixture } from './tiny-trainer.ts';

interface Arr {
  shape: number[];
  data: number[];
}
interface Case {
  name: string;
  kind: 'linear' | 'conv';
  base: Arr;
  x: Arr;
  g: Arr;
  scale: number;
  factors: Record<string, Arr & { grad: number[] }>;
  adapted: number[];
  y: number[];
}
const golden = JSON.parse(readFileSync(join(FIXTURES, 'train/lycoris.json'), 'utf8')) as { cases: Case[]; factorization: number[][] };

/** The spec whose layer scale is the case's (see gen_lycoris.py's per-case alpha / rank). */
const SPECS: Record<string, NetworkSpec> = {
  'locon conv': { type: 'locon', rank: 4, alpha: 4, convRank: 2, convAlpha: 3, factor: -1 },
  'loha linear': { type: 'loha', rank: 2, alpha: 1, convRank: 2, convAlpha: 1, factor: -1 },
  'loha conv': { type: 'loha', rank: 2, alpha: 1, convRank: 3, convAlpha: 4, factor: -1 },
  'lokr linear': { type: 'lokr', rank: 1, alpha: 2, convRank: 1, convAlpha: 1, factor: -1 },
  'lokr linear full w2': { type: 'lokr', rank: 4, alpha: 7, convRank: 1, convAlpha: 1, factor: -1 },
  'lokr conv': { type: 'lokr', rank: 1, alpha: 1, convRank: 1, convAlpha: 0.5, factor: -1 },
  'dora locon linear': { type: 'locon', rank: 2, alpha: 3, convRank: 2, convAlpha: 1, factor: -1, dora: true },
  'dora locon conv': { type: 'locon', rank: 4, alpha: 4, convRank: 2, convAlpha: 3, factor: -1, dora: true },
  'dora loha conv': { type: 'loha', rank: 2, alpha: 1, convRank: 3, convAlpha: 4, factor: -1, dora: true },
  'dora lokr linear': { type: 'lokr', rank: 1, alpha: 2, convRank: 1, convAlpha: 1, factor: -1, dora: true },
};

/** Largest |a - b| over the largest |b|: f32 GEMMs of <= 36-term sums sit near 1e-7 of the scale. */
function relErr(a: ArrayLike<number>, b: ArrayLike<number>): number {
  assert.equal(a.length, b.length);
  let [err, mag] = [0, 0];
  for (let i = 0; i < b.length; i++) {
    err = Math.max(err, Math.abs(a[i] - b[i]));
    mag = Math.max(mag, Math.abs(b[i]));
  }
  return err / mag;
}

void describe('network settings', () => {
  void it('an option that does nothing for the network is refused by name, flags and values alike', () => {
    const lora = defaultSettings('lora');
    const given =
      (...flags: string[]) =>
      (spec: { flag: string | null }) =>
        flags.includes(spec.flag ?? '');
    assert.throws(() => refuseInactive(lora, given('conv-rank')), /--conv-rank sets the ResNet convs' adapters/);
    assert.throws(() => refuseInactive({ ...lora, network: 'loha' }, given('lokr-factor')), /--lokr-factor is for --network lokr only/);
    refuseInactive({ ...lora, network: 'locon' }, given('conv-rank', 'conv-alpha'));
    refuseInactive({ ...lora, network: 'lokr' }, given('lokr-factor'));
    // the studio's values: a conv rank with plain LoRA is refused; with locon it stands
    assert.throws(
      () => validateSettings({ ...lora, convRank: 4 }),
      (e: Error) => e instanceof SettingsError && /--conv-rank 4 sets LyCORIS conv adapters/.test(e.message),
    );
    validateSettings({ ...lora, network: 'locon', convRank: 4 });
    assert.throws(() => validateSettings({ ...lora, network: 'lokr', lokrFactor: 0 }), /--lokr-factor must be -1 or a positive whole number, got 0/);
    assert.throws(() => validateSettings({ ...lora, network: 'dora' as never }), /--network must be lora or locon or loha or lokr/);
    // DoRA: a LyCORIS option here; with plain LoRA refused as a flag and as a value, with locon it stands
    assert.throws(() => refuseInactive(lora, given('dora')), /--dora is LyCORIS' weight decomposition \(dora_wd\): add --network locon/);
    assert.throws(() => validateSettings({ ...lora, dora: true }), /--dora is LyCORIS' weight decomposition: choose --network locon, loha or lokr/);
    refuseInactive({ ...lora, network: 'loha', dora: true }, given('dora'));
    validateSettings({ ...lora, network: 'loha', dora: true });
    assert.throws(() => refuseInactive(defaultSettings('full'), given('dora')), /--dora/);
  });

  void it('DoRA magnitude scale kernel: c = m / (sqrt(ss) + eps) and its gradients, 0 for ss = 0', async () => {
    const gpu = await testGpu();
    const [m, ss, dc] = [
      [0.5, -1.25, 2, 3],
      [4, 0.01, 0, 9],
      [1, -2, 0.5, 0.25],
    ];
    const up = (v: number[]) => gpu.upload(v, [1, 4], 'f32', 'weights', 'v');
    const [tm, tss, tdc] = [up(m), up(ss), up(dc)];
    const c = doraScale(gpu, tm, tss);
    const g = doraScaleBackward(gpu, tm, tss, tdc);
    // f32 sqrt and division: within 1e-6 relative; a missing 1/2 or sign is off by half or all of each value
    assert.ok(relErr(await gpu.read(c), doraScaleRef(m, ss)) < 1e-6);
    const ref = doraScaleBackwardRef(m, ss, dc);
    assert.ok(relErr(await gpu.read(g.dm), ref.dm) < 1e-6);
    assert.ok(relErr(await gpu.read(g.dss), ref.dss) < 1e-6);
    // the reference by hand at ss = 0.01: -dc m / n^2 / (2 sqrt(ss)) = -(-2)(-1.25) / 0.01 / 0.2 (n = 0.1 + 1.2e-7)
    assert.equal(ref.dss[2], 0);
    assert.ok(Math.abs(ref.dss[1] / (-2.5 / 0.01 / 0.2) - 1) < 1e-5, `dss ${ref.dss[1]}`);
    gpu.free(tm, tss, tdc, c, g.dm, g.dss);
  });
});

void describe('LyCORIS delta-W against PyTorch', () => {
  void it("LyCORIS' factorization", () => {
    for (const [d, f, m, n] of golden.factorization) assert.deepEqual(factorization(d, f), [m, n], `factorization(${d}, ${f})`);
  });

  for (const c of golden.cases)
    void it(`${c.name}: adapted weight, output and factor gradients`, async () => {
      const gpu = await testGpu();
      const spec = SPECS[c.name];
      const w = new Map<string, Tensor>();
      w.set('l.weight', gpu.upload(c.base.data, c.base.shape, 'f32', 'weights', 'l.weight'));
      // the factor shapes the engine plans for this base weight are the golden's
      const shapes = networkShapes(['l'], new Map([['l.weight', c.base.shape]]), spec);
      assert.deepEqual(
        [...shapes.keys()].sort(),
        Object.keys(c.factors)
          .map((k) => `l.${k}`)
          .sort(),
      );
      const factors = new Map<string, Tensor>();
      for (const [k, f] of Object.entries(c.factors)) {
        assert.deepEqual(shapes.get(`l.${k}`), f.shape, `${k}'s shape`);
        factors.set(k, gpu.upload(f.data, f.shape, 'f32', 'weights', k));
        w.set(`l.${k}`, factors.get(k)!);
      }
      attachNetwork(w, spec);
      const x = gpu.upload(c.x.data, c.x.shape, 'f32', 'activations', 'x');
      const tape = new Tape(gpu, new Set(factors.values()));
      tape.noGrad(x);
      const F = new Ops(gpu, tape);
      const adapted = networkWeight(F, w, 'l');
      assert.ok(adapted, 'no adapted weight');
      const y = c.kind === 'linear' ? F.linear(x, adapted) : F.conv(x, adapted, null, { stride: 1, padding: 1 });
      // ΔW is up to ~10x W here, so an error in the scale or a factor's layout shows far above 1e-5
      assert.ok(relErr(await gpu.read(adapted), c.adapted) < 1e-5, 'adapted weight');
      assert.ok(relErr(await gpu.read(y), c.y) < 1e-5, 'output');
      tape.backward(y, gpu.upload(c.g.data, c.g.shape, 'f32', 'gradients', 'g'));
      for (const [k, t] of factors) {
        const g = tape.take(t);
        assert.ok(g, `${k}: no gradient`);
        const e = relErr(await gpu.read(g), c.factors[k].grad);
        assert.ok(e < 1e-5, `${k} gradient off by ${e} of its largest value`);
        gpu.free(g);
      }
      tape.dropGrads();
      gpu.free(...w.values(), x);
    });
});

void describe("a LyCORIS run's full-export merge (export/merge.ts) against PyTorch", () => {
  void it('every case: the merged weight is the golden adapted weight', () => {
    for (const c of golden.cases) {
      const factors = new Map(Object.entries(c.factors).map(([k, f]) => [k, Float32Array.from(f.data)]));
      const merged = mergeLycoris(Float32Array.from(c.base.data), c.base.shape, SPECS[c.name], (f) => factors.get(f));
      // f64 sums stored in f32: within 1e-6 of the largest value; ΔW is up to ~10x W here, so a wrong scale,
      // layout or DoRA axis is off by O(1)
      const e = relErr(merged, c.adapted);
      assert.ok(e < 1e-6, `${c.name}: merged weight off by ${e} of its largest value`);
    }
    // a factor missing or of the wrong size is named, not merged
    const c = golden.cases.find((x) => x.name === 'loha linear')!;
    const f =
      (drop: string, short = '') =>
      (k: string) =>
        k === drop ? undefined : k === short ? new Float32Array(1) : c.factors[k] && Float32Array.from(c.factors[k].data);
    assert.throws(
      () => mergeLycoris(Float32Array.from(c.base.data), c.base.shape, SPECS[c.name], f('hada_w2_b')),
      /needs hada_w1_a, .*hada_w2_b; it has hada_w1_a/,
    );
    assert.throws(
      () => mergeLycoris(Float32Array.from(c.base.data), c.base.shape, SPECS[c.name], f('', 'hada_w1_b')),
      /hada_w1_b has 1 values, the layer's \[2,\d+\] needs/,
    );
  });
});

/** ComfyUI's merge of one module (comfy/weight_adapter lora, loha, lokr: W + (alpha / r) ΔW), in f64. */
function comfyMerge(w: Float32Array, shape: readonly number[], t: (k: string) => { shape: number[]; data: Float32Array } | undefined): Float64Array {
  const mm = (a: { shape: number[]; data: ArrayLike<number> }, b: { shape: number[]; data: ArrayLike<number> }) => {
    const [m, k] = [a.shape[0], a.data.length / a.shape[0]];
    const n = b.data.length / b.shape[0];
    assert.equal(b.shape[0], k);
    const out = new Float64Array(m * n);
    for (let i = 0; i < m; i++) for (let p = 0; p < k; p++) for (let j = 0; j < n; j++) out[i * n + j] += a.data[i * k + p] * b.data[p * n + j];
    return { shape: [m, n], data: out };
  };
  const alpha = t('alpha')!.data[0];
  let diff: ArrayLike<number>;
  let scale: number;
  if (t('lora_down.weight')) {
    const down = t('lora_down.weight')!;
    diff = mm({ shape: [t('lora_up.weight')!.shape[0], down.shape[0]], data: t('lora_up.weight')!.data }, down).data;
    scale = alpha / down.shape[0];
  } else if (t('hada_w1_a')) {
    const [a, b] = [mm(t('hada_w1_a')!, t('hada_w1_b')!), mm(t('hada_w2_a')!, t('hada_w2_b')!)];
    diff = a.data.map((v, i) => v * b.data[i]);
    scale = alpha / t('hada_w1_b')!.shape[0];
  } else {
    const w1 = t('lokr_w1')!;
    const w2 = t('lokr_w2') ? { shape: t('lokr_w2')!.shape, data: t('lokr_w2')!.data } : mm(t('lokr_w2_a')!, t('lokr_w2_b')!);
    scale = t('lokr_w2') ? 1 : alpha / t('lokr_w2_b')!.shape[0];
    const [m, n] = [w1.shape[0], w1.shape[1]];
    const [p, q] = [w2.shape[0], w2.data.length / w2.shape[0]];
    const k = new Float64Array(m * p * n * q);
    for (let i = 0; i < m; i++)
      for (let j = 0; j < n; j++)
        for (let a = 0; a < p; a++) for (let b = 0; b < q; b++) k[(i * p + a) * n * q + j * q + b] = w1.data[i * n + j] * w2.data[a * q + b];
    diff = k;
  }
  assert.equal(diff.length, w.length, `ΔW has ${diff.length} elements for a weight of shape [${shape}]`);
  const v = Float64Array.from(w, (x, i) => x + scale * diff[i]);
  const m = t('dora_scale');
  if (!m) return v;
  // weight_decompose: dora_scale [1, in(, 1, 1)] is not out long, so the norm is per input channel (over the
  // outputs and kernel taps), plus float32's eps
  const [out, inC] = shape;
  const taps = w.length / (out * inC);
  assert.deepEqual(m.shape, shape.length === 4 ? [1, inC, 1, 1] : [1, inC]);
  const norm = new Float64Array(inC);
  for (let i = 0; i < v.length; i++) norm[Math.floor(i / taps) % inC] += v[i] * v[i];
  return v.map((x, i) => (x * m.data[Math.floor(i / taps) % inC]) / (Math.sqrt(norm[Math.floor(i / taps) % inC]) + 2 ** -23));
}

/** A DoRA network's first adapted weights are the base model's: m starts at W's norms and ΔW at 0. */
async function startsAtBase(gpu: Awaited<ReturnType<typeof testGpu>>, weights: Map<string, Tensor>, layers: string[]): Promise<void> {
  const F = new Ops(gpu);
  for (const layer of layers) {
    const own = networkWeight(F, weights, layer);
    assert.ok(own, `${layer}: DoRA runs with a materialised weight`);
    // W (|W| / (|W| + 1.2e-7)): within 1e-5 of W's largest element (f32 GEMM sums); a wrong axis or m is off by O(1)
    assert.ok(relErr(await gpu.read(own), base.tensors.get(`${layer}.weight`)!.data) < 1e-5, `${layer} does not start at W`);
    gpu.free(own);
  }
}

const NETWORKS: { type: NetworkType; over: Partial<NetworkSpec> }[] = [
  { type: 'locon', over: { convRank: 2, convAlpha: 1 } },
  { type: 'locon', over: { convRank: 2, convAlpha: 1, dora: true } },
  { type: 'loha', over: {} },
  { type: 'lokr', over: {} },
];

void describe('LyCORIS networks train on the tiny UNet and export as the loaders merge them', () => {
  for (const { type, over } of NETWORKS)
    void it(`${type}${over.dora ? ' + DoRA' : ''}: the loss falls; the export merged by ComfyUI's rule is the trained model's weight`, async () => {
      const gpu = await testGpu();
      const fx = fixture('lora');
      const weights = new Map<string, Tensor>();
      for (const [k, t] of base.tensors)
        if (!['sample', 'timestep', 'encoder_hidden_states', 'out'].includes(k)) weights.set(k, gpu.upload(t.data, t.shape, 'f32', 'weights', k));
      const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));
      const settings = { ...fx.settings, steps: 6, lr: 1e-2, network: type, convRank: over.convRank, convAlpha: over.convAlpha, dora: over.dora };
      const model = { config: cfg, weights, schedule: { ...SD_SCHEDULE, prediction: fx.prediction } };
      const trainer = await DreamBoothTrainer.create(gpu, model, fx.data, settings, new MemoryChunkStore(), 'run');
      if (over.dora) await startsAtBase(gpu, weights, trainableSpec(cfg, undefined, settings)[0].layers);
      const m0 = over.dora ? await trainer.trainedValues() : null;
      const losses: number[] = [];
      for (let i = 0; i < settings.steps; i++) losses.push((await trainer.trainStep(fx.inputs[0])).loss);
      // the same sample each step: a working gradient lowers its loss (2% is far above the f32 steps' noise, ~1e-6);
      // a zero gradient leaves it, a wrong sign raises it
      assert.ok(losses.at(-1)! < 0.98 * losses[0], `${type} losses ${losses.map((l) => l.toFixed(5)).join(' ')} do not fall by 2%`);
      const [group] = trainableSpec(cfg, undefined, settings);
      assert.ok(
        group.layers.some((l) => l.includes('.resnets.')),
        'no ResNet conv adapted',
      );

      const values = await trainer.trainedValues();
      if (m0) {
        // m trains: its largest change is far above f32 noise (the factors alone would leave it at W's norms)
        let moved = 0;
        for (const [n, v] of values) if (n.endsWith('.dora_scale')) moved = Math.max(moved, ...v.map((x, i) => Math.abs(x - m0.get(n)![i])));
        assert.ok(moved > 1e-4, `dora_scale moved ${moved}`);
      }
      const provider = {
        names: () => [...values.keys()],
        shape: (n: string) => [...trainer.trainable.get(n)!.shape],
        read: async (n: string) => values.get(n)!,
      };
      const spec = networkSpecOf(settings);
      const sink = memorySink();
      await writeLycoris(
        sink,
        { rank: settings.rank, alpha: settings.alpha, unet: provider, network: spec, baseShape: (_c, l) => weights.get(`${l}.weight`)!.shape },
        INFO,
      );
      const file = readSafetensors(sink.bytes());
      assert.equal(file.metadata.ss_network_module, 'lycoris.kohya');
      assert.match(file.metadata.ss_network_args, new RegExp(`"algo": "${type}"`));
      assert.equal(/"dora_wd": "True"/.test(file.metadata.ss_network_args), !!over.dora, 'dora_wd in ss_network_args');
      const F = new Ops(gpu);
      // the full exports' merge (export/merge.ts, on the CPU from the f32 factors): layer by layer below
      const full = mergedLycorisProvider(
        { shape: (n) => base.tensors.get(n)!.shape, read: async (n) => Float32Array.from(base.tensors.get(n)!.data) },
        values,
        spec,
      );
      assert.deepEqual(full.names().sort(), group.layers.map((l) => `${l}.weight`).sort(), 'the full export merges every adapted layer');
      let [worst, worstFull] = [0, 0];
      for (const layer of group.layers) {
        const k = kohyaName('unet', layer);
        const shape = weights.get(`${layer}.weight`)!.shape;
        const merged = comfyMerge(base.tensors.get(`${layer}.weight`)!.data, shape, (n) => file.tensors.get(`${k}.${n}`));
        // the engine's own adapted weight (a LoCon linear layer: W + s B A from its thin matmuls' factors)
        const own = networkWeight(F, weights, layer);
        const trained = own ? await gpu.read(own) : null;
        if (own) gpu.free(own);
        const w = base.tensors.get(`${layer}.weight`)!.data;
        // a LoCon linear layer runs loraLinear (W + alpha / rank B A, tested with plain LoRA) on its f32 factors
        const ab = (n: string) => ({ shape: [...trainer.trainable.get(`${layer}.${n}`)!.shape], data: values.get(`${layer}.${n}`)! });
        const thin = (n: string) =>
          n === 'alpha'
            ? { shape: [], data: Float32Array.of(spec.alpha) }
            : { 'lora_down.weight': ab('lora_A.weight'), 'lora_up.weight': ab('lora_B.weight') }[n];
        const expect = trained ?? comfyMerge(w, shape, thin);
        const fullW = await full.read(`${layer}.weight`);
        let [err, errFull, delta] = [0, 0, 0];
        for (let i = 0; i < w.length; i++) {
          err = Math.max(err, Math.abs(merged[i] - expect[i]));
          errFull = Math.max(errFull, Math.abs(fullW[i] - expect[i]));
          delta = Math.max(delta, Math.abs(expect[i] - w[i]));
        }
        worstFull = Math.max(worstFull, errFull / delta);
        // the file's factors are f16 (relative rounding 2^-11 each, products of two or four): within 1% of the
        // trained ΔW's largest element; a wrong scale, layout or rule is off by its whole size
        assert.ok(delta > 1e-4, `${layer}: the training left ΔW at ${delta}`);
        worst = Math.max(worst, err / delta);
      }
      assert.ok(worst < 1e-2, `${type}: the merged export is ${worst} of ΔW from the trained weights`);
      // f64 sums on the CPU against the GPU's f32 GEMMs of the same f32 factors (measured: 4e-7 to 3e-6 of ΔW);
      // a wrong scale, layout or DoRA axis is off by O(1)
      assert.ok(worstFull < 1e-4, `${type}: the full export's merge is ${worstFull} of ΔW from the trained weights`);
      trainer.destroy();
      gpu.free(...weights.values());
    });
});
