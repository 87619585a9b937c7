// The benchmark page: our kernels, onnxruntime-web's WebGPU execution provider and
// @tensorflow/tfjs-backend-webgpu on the same shapes in the same page, all timed the same way: R
// back-to-back runs per measurement (R fills targetMs), submit to completion, divided by R; median of
// `reps` measurements. Ours also records GPU timestamps around its R runs.
import * as tf from '@tensorflow/tfjs-core';
import '@tensorflow/tfjs-backend-webgpu';
// tf.grads needs the gradient registry, which tfjs-core keeps out of its main entry.
import '@tensorflow/tfjs-core/dist/register_all_gradients';
import * as ort from 'onnxruntime-web/webgpu';
import { Gpu } from '../src/gpu/device.ts';
import { viteShaderSource } from '../src/gpu/shaders-vite.ts';
import { benchOurs, convKernel, firstLine, flops, median, type Measurement, type Pass, type ShapeCase } from './core.ts';
import shapes from './shapes.json';

const models = import.meta.glob('/bench/models/*.onnx', { query: '?url', import: 'default', eager: true }) as Record<string, string>;

const log = (s: string) => {
  document.getElementById('log')!.textContent += `${s}\n`;
};

interface PeerTiming {
  all: number[];
  repeat: number;
}

/**
 * Times `run` (enqueues one op and returns what to dispose) like timeOurs: a warm-up, one calibrating run,
 * then measurements of R back-to-back runs and one wait for the queue; per-run ms = measurement / R.
 */
async function timePeer(run: () => Promise<() => void> | (() => void), done: () => Promise<void>, reps: number, targetMs: number): Promise<PeerTiming> {
  (await run())();
  await done();
  const measure = async (n: number) => {
    const t0 = performance.now();
    const disposers: (() => void)[] = [];
    for (let i = 0; i < n; i++) disposers.push(await run());
    await done();
    const ms = performance.now() - t0;
    disposers.forEach((d) => d());
    return ms;
  };
  const one = await measure(1);
  const repeat = Math.max(1, Math.min(500, Math.floor(targetMs / Math.max(one, 1e-3))));
  const all: number[] = repeat === 1 ? [one] : []; // the calibrating run was a measurement of one run
  while (all.length < reps) all.push((await measure(repeat)) / repeat);
  return { all, repeat };
}

/** timePeer, or the error that stopped it (one pass of a peer failing leaves its others measured). */
async function timePeerOrFail(...a: Parameters<typeof timePeer>): Promise<PeerTiming | { error: string }> {
  try {
    return await timePeer(...a);
  } catch (e) {
    return { error: firstLine((e as Error).message) };
  }
}

function randn(n: number): Float32Array {
  const a = new Float32Array(n);
  for (let i = 0; i < n; i++) a[i] = (Math.random() * 2 - 1) * 0.5;
  return a;
}

function inputShapes(c: ShapeCase): { name: string; dims: number[] }[] {
  if (c.op === 'matmul')
    return [
      { name: 'a', dims: [c.M!, c.K!] },
      { name: 'b', dims: [c.K!, c.N!] },
    ];
  if (c.op === 'conv')
    return [
      { name: 'x', dims: [1, c.C!, c.H!, c.W!] },
      { name: 'w', dims: [c.C!, c.C!, convKernel(c), convKernel(c)] },
      { name: 'b', dims: [c.C!] },
    ];
  return [
    { name: 'q', dims: [c.H!, c.N!, c.D!] },
    { name: 'k', dims: [c.H!, c.M!, c.D!] },
    { name: 'v', dims: [c.H!, c.M!, c.D!] },
  ];
}

function measurement(c: ShapeCase, impl: string, pass: Pass, t: PeerTiming, note?: string): Measurement {
  const ms = median(t.all);
  const how = `${t.repeat} runs per measurement`;
  return {
    id: c.id,
    label: c.label,
    impl,
    dtype: 'f32',
    pass,
    ms,
    all: t.all,
    repeat: t.repeat,
    gflops: flops(c, pass) / ms / 1e6,
    note: note ? `${note}; ${how}` : how,
  };
}

async function benchOrt(c: ShapeCase, size: string, reps: number, targetMs: number): Promise<Measurement> {
  const url = models[`/bench/models/${size}-${c.id}.onnx`];
  if (!url) throw new Error(`no ONNX model for ${size}-${c.id} (run bench/peers/make_onnx.py)`);
  const bytes = new Uint8Array(await (await fetch(url)).arrayBuffer());
  const session = await ort.InferenceSession.create(bytes, { executionProviders: ['webgpu'], preferredOutputLocation: 'gpu-buffer' });
  const device = (await (ort.env.webgpu as unknown as { device: GPUDevice | Promise<GPUDevice> }).device) as GPUDevice;
  // Inputs live on the GPU, outputs stay there: no transfers inside the timed region.
  const feeds: Record<string, ort.Tensor> = {};
  const buffers: GPUBuffer[] = [];
  for (const s of inputShapes(c)) {
    const data = randn(s.dims.reduce((a, b) => a * b, 1));
    const buf = device.createBuffer({ size: data.byteLength, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST });
    device.queue.writeBuffer(buf, 0, data);
    buffers.push(buf);
    feeds[s.name] = ort.Tensor.fromGpuBuffer(buf, { dataType: 'float32', dims: s.dims });
  }
  const t = await timePeer(
    async () => {
      const out = await session.run(feeds);
      return () => Object.values(out).forEach((x) => x.dispose());
    },
    () => device.queue.onSubmittedWorkDone(),
    reps,
    targetMs,
  );
  await session.release();
  buffers.forEach((b) => b.destroy());
  return measurement(c, 'onnxruntime-web (webgpu)', 'fwd', t, 'gpu-buffer inputs/outputs');
}

/** tfjs-webgpu on case `c`: the forward, and for attention also forward + backward (tf.grads). */
async function benchTf(c: ShapeCase, reps: number, targetMs: number): Promise<Measurement[]> {
  const backend = tf.backend() as unknown as {
    device: GPUDevice;
    commandEncoder: GPUCommandEncoder | null;
    endComputePassEncoder(): void;
    submitQueue(): void;
  };
  // tfjs records lazily: end its pass and submit, as its own read-back path does.
  const flush = () => {
    backend.endComputePassEncoder();
    if (backend.commandEncoder) backend.submitQueue();
  };
  const keep: tf.Tensor[] = [];
  const t = (dims: number[]) => {
    const x = tf.tensor(randn(dims.reduce((a, b) => a * b, 1)), dims);
    keep.push(x);
    return x;
  };
  const ops: [Pass, () => tf.Tensor[]][] = [];
  if (c.op === 'matmul') {
    const [a, b] = [t([c.M!, c.K!]), t([c.K!, c.N!])];
    ops.push(['fwd', () => [tf.matMul(a, b)]]);
  } else if (c.op === 'conv') {
    // tfjs convolutions are NHWC with HWIO filters: the same arithmetic as NCHW/OIHW.
    const r = convKernel(c);
    const [x, w, bias] = [t([1, c.H!, c.W!, c.C!]), t([r, r, c.C!, c.C!]), t([c.C!])];
    ops.push(['fwd', () => [tf.tidy(() => tf.add(tf.conv2d(x as tf.Tensor4D, w as tf.Tensor4D, 1, 'same'), bias))]]);
  } else {
    const [q, k, v, dy] = [t([c.H!, c.N!, c.D!]), t([c.H!, c.M!, c.D!]), t([c.H!, c.M!, c.D!]), t([c.H!, c.N!, c.D!])];
    const scale = 1 / Math.sqrt(c.D!);
    const attention = (q: tf.Tensor, k: tf.Tensor, v: tf.Tensor) => tf.matMul(tf.softmax(tf.mul(tf.matMul(q, k, false, true), scale)), v);
    const grads = tf.grads(attention as (...xs: tf.Tensor[]) => tf.Tensor);
    ops.push(['fwd', () => [tf.tidy(() => attention(q, k, v))]]);
    ops.push(['fwdbwd', () => tf.tidy(() => grads([q, k, v], dy))]);
  }
  const out: Measurement[] = [];
  for (const [pass, op] of ops) {
    const timing = await timePeerOrFail(
      () => {
        const ys = op();
        flush();
        return () => ys.forEach((y) => y.dispose());
      },
      () => backend.device.queue.onSubmittedWorkDone(),
      reps,
      targetMs,
    );
    if ('error' in timing)
      out.push({ id: c.id, label: c.label, impl: 'tfjs-webgpu', dtype: 'f32', pass, ms: NaN, all: [], gflops: NaN, note: `failed: ${timing.error}` });
    else out.push(measurement(c, 'tfjs-webgpu', pass, timing, pass === 'fwdbwd' ? 'tf.grads of the naive attention' : undefined));
  }
  keep.forEach((x) => x.dispose());
  return out;
}

interface RunOptions {
  size: 'full' | 'quick';
  reps: number;
  naiveReps: number;
  targetMs: number;
  budgetMs: number;
  naiveMaxScoreBytes: number;
  only?: string[];
}

async function run(opts: RunOptions) {
  const gpu = await Gpu.create(navigator.gpu, { shaders: viteShaderSource() });
  const planner = await Gpu.create(navigator.gpu, { shaders: viteShaderSource(), dryRun: true });
  ort.env.wasm.wasmPaths = '/ort/';
  ort.env.wasm.numThreads = 1;
  await tf.setBackend('webgpu');
  await tf.ready();
  const results: Measurement[] = [];
  const errors: string[] = [];
  const rawNs: number[] = [];
  for (const c of (shapes as Record<string, ShapeCase[]>)[opts.size]) {
    if (opts.only && !opts.only.includes(c.id)) continue;
    for (const [name, f] of [
      [
        'ours',
        () =>
          benchOurs(
            gpu,
            c,
            {
              reps: opts.reps,
              naiveReps: opts.naiveReps,
              budgetMs: opts.budgetMs,
              targetMs: opts.targetMs,
              planner,
              naiveMaxScoreBytes: opts.naiveMaxScoreBytes,
            },
            rawNs,
          ),
      ],
      ['ort', async () => [await benchOrt(c, opts.size, opts.reps, opts.targetMs)]],
      ['tfjs', () => benchTf(c, opts.reps, opts.targetMs)],
    ] as const) {
      try {
        const ms = await f();
        results.push(...ms);
        for (const m of ms)
          log(
            `${m.label} | ${m.impl}${m.pass === 'fwdbwd' && !m.impl.includes('fwd+bwd') ? ' fwd+bwd' : ''}: ${m.ms.toFixed(2)} ms${m.note ? ` (${m.note})` : ''}`,
          );
      } catch (e) {
        errors.push(`${c.id} ${name}: ${firstLine((e as Error).message)}`);
        log(`${c.id} ${name} failed: ${firstLine((e as Error).message)}`);
      }
    }
  }
  planner.destroy();
  return { adapter: gpu.adapter, computeDType: gpu.computeDType, results, errors, rawNs };
}

(window as unknown as { __bench: unknown }).__bench = { run };
log('ready');
