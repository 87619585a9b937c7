// The benchmark page: our kernels, onnxruntime-web's WebGPU execution provider and
// @tensorflow/tfjs-backend-webgpu on the same shapes in the same page. Peers are timed like ours:
// a batch of back-to-back runs per queue submission, divided by the batch size.
import * as tf from '@tensorflow/tfjs-core';
import '@tensorflow/tfjs-backend-webgpu';
import * as ort from 'onnxruntime-web/webgpu';
import { Gpu } from '../src/gpu/device.ts';
import { viteShaderSource } from '../src/gpu/shaders-vite.ts';
import { benchOurs, flops, median, type Measurement, type ShapeCase } from './core.ts';
import shapes from './shapes.json';

const models = import.meta.glob('/bench/models/*.onnx', { query: '?url', import: 'default', eager: true }) as Record<string, string>;

const log = (s: string) => {
  document.getElementById('log')!.textContent += `${s}\n`;
};

/** Times `run` (which enqueues one op and returns what to dispose) in batches, exactly like timeOurs. */
async function timePeer(run: () => Promise<() => void> | (() => void), done: () => Promise<void>, reps: number, deadline: number): Promise<number[]> {
  (await run())();
  await done();
  const t0 = performance.now();
  (await run())();
  await done();
  const single = performance.now() - t0;
  const inner = Math.max(1, Math.min(50, Math.floor(50 / Math.max(single, 0.01))));
  const all: number[] = inner === 1 ? [single] : []; // a run that long was timed like a batch of one
  while (all.length < reps && (all.length === 0 || performance.now() < deadline)) {
    const t1 = performance.now();
    const disposers: (() => void)[] = [];
    for (let i = 0; i < inner; i++) disposers.push(await run());
    await done();
    all.push((performance.now() - t1) / inner);
    disposers.forEach((d) => d());
  }
  return all;
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
      { name: 'w', dims: [c.C!, c.C!, 3, 3] },
      { name: 'b', dims: [c.C!] },
    ];
  return [
    { name: 'q', dims: [c.H!, c.N!, c.D!] },
    { name: 'k', dims: [c.H!, c.M!, c.D!] },
    { name: 'v', dims: [c.H!, c.M!, c.D!] },
  ];
}

async function benchOrt(c: ShapeCase, size: string, reps: number, deadline: number): Promise<Measurement> {
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
  const all = await timePeer(
    async () => {
      const out = await session.run(feeds);
      return () => Object.values(out).forEach((t) => t.dispose());
    },
    () => device.queue.onSubmittedWorkDone(),
    reps,
    deadline,
  );
  await session.release();
  buffers.forEach((b) => b.destroy());
  const ms = median(all);
  return { id: c.id, label: c.label, impl: 'onnxruntime-web (webgpu)', dtype: 'f32', ms, all, gflops: flops(c) / ms / 1e6, note: 'gpu-buffer inputs/outputs' };
}

async function benchTf(c: ShapeCase, reps: number, deadline: number): Promise<Measurement> {
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
  let op: () => tf.Tensor;
  const keep: tf.Tensor[] = [];
  const t = (dims: number[]) => {
    const x = tf.tensor(randn(dims.reduce((a, b) => a * b, 1)), dims);
    keep.push(x);
    return x;
  };
  if (c.op === 'matmul') {
    const [a, b] = [t([c.M!, c.K!]), t([c.K!, c.N!])];
    op = () => tf.matMul(a, b);
  } else if (c.op === 'conv') {
    // tfjs convolutions are NHWC with HWIO filters: the same arithmetic as NCHW/OIHW.
    const [x, w, bias] = [t([1, c.H!, c.W!, c.C!]), t([3, 3, c.C!, c.C!]), t([c.C!])];
    op = () => tf.add(tf.conv2d(x as tf.Tensor4D, w as tf.Tensor4D, 1, 'same'), bias);
  } else {
    const [q, k, v] = [t([c.H!, c.N!, c.D!]), t([c.H!, c.M!, c.D!]), t([c.H!, c.M!, c.D!])];
    const scale = 1 / Math.sqrt(c.D!);
    op = () => tf.tidy(() => tf.matMul(tf.softmax(tf.mul(tf.matMul(q, k, false, true), scale)), v));
  }
  const all = await timePeer(
    () => {
      const y = op();
      flush();
      return () => y.dispose();
    },
    () => backend.device.queue.onSubmittedWorkDone(),
    reps,
    deadline,
  );
  keep.forEach((x) => x.dispose());
  const ms = median(all);
  return { id: c.id, label: c.label, impl: 'tfjs-webgpu', dtype: 'f32', ms, all, gflops: flops(c) / ms / 1e6 };
}

async function run(opts: { size: 'full' | 'quick'; reps: number; budgetMs: number; naiveMaxScoreBytes: number; only?: string[] }) {
  const gpu = await Gpu.create(navigator.gpu, { shaders: viteShaderSource() });
  const planner = await Gpu.create(navigator.gpu, { shaders: viteShaderSource(), dryRun: true });
  ort.env.wasm.wasmPaths = '/ort/';
  ort.env.wasm.numThreads = 1;
  await tf.setBackend('webgpu');
  await tf.ready();
  const results: Measurement[] = [];
  const errors: string[] = [];
  for (const c of (shapes as Record<string, ShapeCase[]>)[opts.size]) {
    if (opts.only && !opts.only.includes(c.id)) continue;
    const deadline = () => performance.now() + opts.budgetMs;
    for (const [name, f] of [
      ['ours', () => benchOurs(gpu, c, { reps: opts.reps, budgetMs: opts.budgetMs, planner, naiveMaxScoreBytes: opts.naiveMaxScoreBytes })],
      ['ort', async () => [await benchOrt(c, opts.size, opts.reps, deadline())]],
      ['tfjs', async () => [await benchTf(c, opts.reps, deadline())]],
    ] as const) {
      try {
        const ms = await f();
        results.push(...ms);
        for (const m of ms) log(`${m.label} | ${m.impl}: ${m.ms.toFixed(2)} ms${m.note ? ` (${m.note})` : ''}`);
      } catch (e) {
        errors.push(`${c.id} ${name}: ${(e as Error).message}`);
        log(`${c.id} ${name} failed: ${(e as Error).message}`);
      }
    }
  }
  planner.destroy();
  return { adapter: gpu.adapter, computeDType: gpu.computeDType, results, errors };
}

(window as unknown as { __bench: unknown }).__bench = { run };
log('ready');
