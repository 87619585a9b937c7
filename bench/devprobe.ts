// npm run bench:devprobe — what a GPU adapter offers our engine, and a first tensor-core GEMM on it.
// Prints the adapter (vendor, architecture, subgroup sizes, features) and, where the adapter offers
// `chromium-experimental-subgroup-matrix` (Vulkan cooperative matrices: NVIDIA's tensor cores), its
// subgroup-matrix configs; then, for the first f16 x f16 -> f32 config, builds a GEMM out of subgroup-matrix
// multiply-accumulates (C[M,N] = A[M,K] B[K,N], row-major, each subgroup owning a BM x BN block of C in
// (BM/m) x (BN/n) result fragments, operands loaded straight from storage), checks it against a CPU product
// on a small ragged-free shape (tolerance: f16 operands rounded on the host, f32 accumulation in both, so the
// only difference is summation order: 1e-3 relative), and times it at SD 1.5 shapes against our f16 matmul
// (src/ops/matmul.ts), GPU timestamps around R dispatches in one pass, median of 10.
// Writes bench/results/devprobe-<adapter>.json (or --out FILE). Where the feature is absent it says so and
// writes the adapter facts with `subgroupMatrix: "not offered"`: nothing is reported as passed that did not run.
import { mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { dawnFlags, nodeGpu } from '../src/gpu/node.ts';
import { matmul } from '../src/ops/matmul.ts';
import { roundToF16, toF16Bits } from '../src/util/half.ts';
import { adapterSlug } from './core.ts';

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const quick = args.includes('--quick'); // M / 64: for software adapters
const shapes = [
  { id: 'mm320', M: 4096, N: 320, K: 320 },
  { id: 'geglu', M: 4096, N: 2560, K: 320 },
  { id: 'ffout', M: 4096, N: 320, K: 1280 },
  { id: 'conv', M: 4096, N: 320, K: 2880 },
].map((s) => (quick ? { ...s, M: s.M / 64 } : s));

interface MatrixConfig {
  componentType: string;
  resultComponentType: string;
  M: number;
  N: number;
  K: number;
}

const gpu = await nodeGpu();
const device = gpu.device;
const info = await adapterInfo();
const configs = ((info.subgroupMatrixConfigs as MatrixConfig[] | undefined) ?? []).map((c) => ({
  componentType: c.componentType,
  resultComponentType: c.resultComponentType,
  M: c.M,
  N: c.N,
  K: c.K,
}));
const facts = {
  vendor: gpu.adapter.vendor,
  architecture: gpu.adapter.architecture,
  description: gpu.adapter.description,
  subgroupMinSize: info.subgroupMinSize,
  subgroupMaxSize: info.subgroupMaxSize,
  features: gpu.adapter.features,
  maxStorageBufferBindingSize: gpu.adapter.limits.maxStorageBufferBindingSize,
  maxComputeWorkgroupStorageSize: gpu.adapter.limits.maxComputeWorkgroupStorageSize,
  subgroupMatrixConfigs: configs,
};
console.log(JSON.stringify(facts, null, 1));

const out: Record<string, unknown> = { date: new Date().toISOString(), ...facts };
const file = arg('--out') ?? join(here, 'results', `devprobe-${adapterSlug(gpu.adapter)}.json`);
/** Written after every variant too, so a run stopped by a time limit keeps what it measured. */
function save(): void {
  mkdirSync(dirname(file), { recursive: true });
  writeFileSync(file, JSON.stringify(out, null, 2) + '\n');
}
const hasMatrix = gpu.adapter.features.includes('chromium-experimental-subgroup-matrix');
// The adapter's configs where its info lists them; else the shapes NVIDIA's cooperative matrices take (tried in turn).
const listed = configs.filter((c) => c.componentType === 'f16' && c.resultComponentType === 'f32');
const candidates: MatrixConfig[] = listed.length ? listed : [16, 8].map((n) => ({ componentType: 'f16', resultComponentType: 'f32', M: 16, N: n, K: 16 }));
if (!hasMatrix) {
  out.subgroupMatrix = 'not offered';
  console.log(`subgroup matrix: ${out.subgroupMatrix}; tensor-core GEMM not run`);
  out.oursOnly = await timeOurs(shapes);
} else {
  out.subgroupMatrix = { listed: configs, tried: candidates };
  out.gemm = [];
  for (const cfg of candidates) {
    const entry: Record<string, unknown> = { config: cfg };
    (out.gemm as unknown[]).push(entry);
    await probeGemm(cfg, entry);
  }
}
save();
console.log(`wrote ${file}`);
gpu.destroy();
process.exit(0);

interface Variant {
  /** fragments per subgroup down M and across N */
  fm: number;
  fn: number;
  /** subgroups per workgroup down M and across N */
  sgM: number;
  sgN: number;
}

/** The adapter's info (subgroup sizes, subgroup-matrix configs), from an adapter of our own: Gpu keeps a summary. */
async function adapterInfo(): Promise<Record<string, unknown>> {
  const deviceInfo = (device as unknown as { adapterInfo?: Record<string, unknown> }).adapterInfo;
  const webgpu = (await import('webgpu')) as unknown as { create: (flags: string[]) => GPU };
  const adapter = await webgpu.create(dawnFlags()).requestAdapter({ powerPreference: 'high-performance' });
  const raw = (adapter?.info ?? deviceInfo ?? {}) as unknown as Record<string, unknown>;
  const pick: Record<string, unknown> = {};
  for (const k of ['vendor', 'architecture', 'subgroupMinSize', 'subgroupMaxSize', 'subgroupMatrixConfigs']) pick[k] = raw[k] ?? deviceInfo?.[k];
  return pick;
}

/** WGSL for one GEMM variant: each subgroup owns fm x fn result fragments of m x n; sgM x sgN subgroups per workgroup. */
function gemmWgsl(c: MatrixConfig, v: Variant, subgroupSize: number, sgBuiltin: boolean): string {
  const { fm, fn, sgM, sgN } = v;
  const { M: m, N: n, K: k } = c;
  const lines: string[] = [];
  lines.push('enable f16;', 'enable subgroups;', 'enable chromium_experimental_subgroup_matrix;');
  // the offsets below derive from the subgroup's index, which the uniformity analysis cannot prove subgroup-uniform
  lines.push('diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);');
  lines.push('struct Dims { M: u32, N: u32, K: u32, pad: u32 }');
  lines.push('@group(0) @binding(0) var<uniform> dims: Dims;');
  lines.push('@group(0) @binding(1) var<storage, read> a: array<f16>;');
  lines.push('@group(0) @binding(2) var<storage, read> b: array<f16>;');
  lines.push('@group(0) @binding(3) var<storage, read_write> c: array<f32>;');
  lines.push(`@compute @workgroup_size(${subgroupSize * sgM * sgN})`);
  // subgroup_id where the compiler has it, else the invocation index / subgroup size (NVIDIA packs subgroups linearly)
  if (sgBuiltin) lines.push('fn main(@builtin(workgroup_id) wg: vec3u, @builtin(subgroup_id) sg: u32) {');
  else lines.push('fn main(@builtin(workgroup_id) wg: vec3u, @builtin(local_invocation_index) lii: u32) {', `  let sg = lii / ${subgroupSize}u;`);
  lines.push(`  let row0 = (wg.y * ${sgM}u + sg / ${sgN}u) * ${fm * m}u;`);
  lines.push(`  let col0 = (wg.x * ${sgN}u + sg % ${sgN}u) * ${fn * n}u;`);
  for (let i = 0; i < fm; i++) for (let j = 0; j < fn; j++) lines.push(`  var acc${i}_${j} = subgroup_matrix_result<f32, ${n}, ${m}>();`);
  lines.push(`  for (var kk = 0u; kk < dims.K; kk += ${k}u) {`);
  for (let i = 0; i < fm; i++)
    lines.push(`    let l${i} = subgroupMatrixLoad<subgroup_matrix_left<f16, ${k}, ${m}>>(&a, (row0 + ${i * m}u) * dims.K + kk, false, dims.K);`);
  for (let j = 0; j < fn; j++)
    lines.push(`    let r${j} = subgroupMatrixLoad<subgroup_matrix_right<f16, ${n}, ${k}>>(&b, kk * dims.N + col0 + ${j * n}u, false, dims.N);`);
  for (let i = 0; i < fm; i++) for (let j = 0; j < fn; j++) lines.push(`    acc${i}_${j} = subgroupMatrixMultiplyAccumulate(l${i}, r${j}, acc${i}_${j});`);
  lines.push('  }');
  for (let i = 0; i < fm; i++)
    for (let j = 0; j < fn; j++) lines.push(`  subgroupMatrixStore(&c, (row0 + ${i * m}u) * dims.N + col0 + ${j * n}u, acc${i}_${j}, false, dims.N);`);
  lines.push('}');
  return lines.join('\n');
}

async function probeGemm(c: MatrixConfig, entry: Record<string, unknown>): Promise<void> {
  const subgroupSize = Number(info.subgroupMaxSize ?? 32);
  // tiles that divide SD's 320-wide layers at 16 x 16 fragments: N tiles of 32, 64 and 160
  const variants: Variant[] = [
    { fm: 2, fn: 2, sgM: 2, sgN: 2 },
    { fm: 4, fn: 2, sgM: 2, sgN: 2 },
    { fm: 2, fn: 2, sgM: 4, sgN: 1 },
    { fm: 4, fn: 4, sgM: 2, sgN: 1 },
    { fm: 2, fn: 5, sgM: 2, sgN: 2 },
    { fm: 1, fn: 1, sgM: 1, sgN: 1 },
  ];
  const results: Record<string, unknown>[] = [];
  entry.variants = results;
  for (const v of variants) {
    const tileM = v.fm * c.M * v.sgM;
    const tileN = v.fn * c.N * v.sgN;
    let pipeline: GPUComputePipeline | undefined;
    const errors: string[] = [];
    for (const sgBuiltin of [true, false]) {
      try {
        device.pushErrorScope('validation');
        const module = device.createShaderModule({ code: gemmWgsl(c, v, subgroupSize, sgBuiltin) });
        const p = device.createComputePipeline({ layout: 'auto', compute: { module, entryPoint: 'main' } });
        const err = await device.popErrorScope();
        if (err) throw new Error(err.message);
        pipeline = p;
        break;
      } catch (e) {
        errors.push(`${sgBuiltin ? 'subgroup_id' : 'lii'}: ${(e as Error).message.split('\n').slice(0, 8).join(' | ')}`);
      }
    }
    if (errors.length) console.log(`variant ${JSON.stringify(v)}: ${errors.join(' // ')}`);
    if (!pipeline) {
      results.push({ variant: v, error: errors.join(' // ') });
      continue;
    }
    // correctness at a shape that tiles exactly
    const check = { M: tileM * 2, N: tileN * 2, K: c.K * 8 };
    const maxErr = await runCheck(pipeline, check, tileM, tileN);
    console.log(`variant ${JSON.stringify(v)} tile ${tileM}x${tileN}: max |err| / max |ref| = ${maxErr.toExponential(2)} at ${JSON.stringify(check)}`);
    const timed: Record<string, unknown>[] = [];
    for (const s of shapes) {
      if (s.M % tileM || s.N % tileN || s.K % c.K) {
        timed.push({ ...s, skipped: `does not tile by ${tileM}x${tileN}x${c.K}` });
        continue;
      }
      const ms = await timeGemm(pipeline, s, tileM, tileN);
      const tflops = (2 * s.M * s.N * s.K) / (ms * 1e-3) / 1e12;
      console.log(`  ${s.id} ${s.M}x${s.N}x${s.K}: ${ms.toFixed(4)} ms, ${tflops.toFixed(1)} TFLOP/s`);
      timed.push({ ...s, ms, tflops });
    }
    results.push({ variant: v, tile: [tileM, tileN, c.K], relErr: maxErr, pass: maxErr < 1e-3, timed });
    save();
  }
  entry.oursF16 = await timeOurs(shapes);
  save();
}

/** Our f16 matmul (f32 where the adapter lacks shader-f16) at the probe's shapes, for the ratio. */
async function timeOurs(shapes: { id: string; M: number; N: number; K: number }[]) {
  const dtype = gpu.computeDType;
  const ours: Record<string, unknown>[] = [];
  for (const s of shapes) {
    const a = gpu.upload(randomF16(s.M * s.K), [s.M, s.K], dtype);
    const b = gpu.upload(randomF16(s.K * s.N), [s.K, s.N], dtype);
    const reps = quick ? 2 : 20;
    const all: number[] = [];
    for (let t = 0; t < (quick ? 3 : 11); t++) {
      const ms = await gpu.gpuTime(() => {
        for (let r = 0; r < reps; r++) gpu.free(matmul(gpu, a, b));
      });
      if (t > 0) all.push(ms / reps);
    }
    const ms = median(all);
    console.log(`  ours ${dtype} ${s.id}: ${ms.toFixed(4)} ms, ${((2 * s.M * s.N * s.K) / (ms * 1e-3) / 1e12).toFixed(1)} TFLOP/s`);
    ours.push({ ...s, dtype, ms });
    gpu.free(a, b);
  }
  return ours;
}

function randomF16(n: number): Float32Array {
  const x = new Float32Array(n);
  for (let i = 0; i < n; i++) x[i] = Math.random() * 2 - 1;
  return roundToF16(x);
}

function median(xs: number[]): number {
  const s = [...xs].sort((p, q) => p - q);
  return s[Math.floor(s.length / 2)];
}

function f16Buffer(values: Float32Array): GPUBuffer {
  const half = toF16Bits(values.length % 2 ? [...values, 0] : values); // a whole number of 4-byte words
  const buf = device.createBuffer({ size: half.byteLength, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST });
  device.queue.writeBuffer(buf, 0, half);
  return buf;
}

function bindings(pipeline: GPUComputePipeline, s: { M: number; N: number; K: number }, a: GPUBuffer, b: GPUBuffer, c: GPUBuffer) {
  const dims = device.createBuffer({ size: 16, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST });
  device.queue.writeBuffer(dims, 0, new Uint32Array([s.M, s.N, s.K, 0]));
  return device.createBindGroup({
    layout: pipeline.getBindGroupLayout(0),
    entries: [
      { binding: 0, resource: { buffer: dims } },
      { binding: 1, resource: { buffer: a } },
      { binding: 2, resource: { buffer: b } },
      { binding: 3, resource: { buffer: c } },
    ],
  });
}

async function runCheck(pipeline: GPUComputePipeline, s: { M: number; N: number; K: number }, tileM: number, tileN: number): Promise<number> {
  const av = randomF16(s.M * s.K);
  const bv = randomF16(s.K * s.N);
  const a = f16Buffer(av);
  const b = f16Buffer(bv);
  const c = device.createBuffer({ size: s.M * s.N * 4, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC });
  const read = device.createBuffer({ size: s.M * s.N * 4, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const enc = device.createCommandEncoder();
  const pass = enc.beginComputePass();
  pass.setPipeline(pipeline);
  pass.setBindGroup(0, bindings(pipeline, s, a, b, c));
  pass.dispatchWorkgroups(s.N / tileN, s.M / tileM);
  pass.end();
  enc.copyBufferToBuffer(c, 0, read, 0, s.M * s.N * 4);
  device.queue.submit([enc.finish()]);
  await read.mapAsync(GPUMapMode.READ);
  const got = new Float32Array(read.getMappedRange().slice(0));
  read.unmap();
  let maxErr = 0;
  let maxRef = 0;
  for (let i = 0; i < s.M; i++)
    for (let j = 0; j < s.N; j++) {
      let ref = 0;
      for (let k = 0; k < s.K; k++) ref += av[i * s.K + k] * bv[k * s.N + j];
      maxErr = Math.max(maxErr, Math.abs(ref - got[i * s.N + j]));
      maxRef = Math.max(maxRef, Math.abs(ref));
    }
  for (const x of [a, b, c, read]) x.destroy();
  return Number.isFinite(maxErr) ? maxErr / maxRef : Infinity;
}

async function timeGemm(pipeline: GPUComputePipeline, s: { M: number; N: number; K: number }, tileM: number, tileN: number): Promise<number> {
  const a = f16Buffer(randomF16(s.M * s.K));
  const b = f16Buffer(randomF16(s.K * s.N));
  const c = device.createBuffer({ size: s.M * s.N * 4, usage: GPUBufferUsage.STORAGE });
  const group = bindings(pipeline, s, a, b, c);
  const qs = device.createQuerySet({ type: 'timestamp', count: 2 });
  const resolve = device.createBuffer({ size: 16, usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC });
  const read = device.createBuffer({ size: 16, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const reps = 50;
  const all: number[] = [];
  for (let t = 0; t < 11; t++) {
    const enc = device.createCommandEncoder();
    const pass = enc.beginComputePass({ timestampWrites: { querySet: qs, beginningOfPassWriteIndex: 0, endOfPassWriteIndex: 1 } });
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, group);
    for (let r = 0; r < reps; r++) pass.dispatchWorkgroups(s.N / tileN, s.M / tileM);
    pass.end();
    enc.resolveQuerySet(qs, 0, 2, resolve, 0);
    enc.copyBufferToBuffer(resolve, 0, read, 0, 16);
    device.queue.submit([enc.finish()]);
    await read.mapAsync(GPUMapMode.READ);
    const ts = new BigUint64Array(read.getMappedRange().slice(0));
    read.unmap();
    if (t > 0) all.push(Number(ts[1] - ts[0]) / 1e6 / reps);
  }
  for (const x of [a, b, c, resolve, read]) x.destroy();
  qs.destroy();
  return median(all);
}
