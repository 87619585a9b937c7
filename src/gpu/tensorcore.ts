// Tensor cores through WebGPU: Dawn's experimental `chromium-experimental-subgroup-matrix` feature maps WGSL's
// subgroup matrices onto Vulkan cooperative matrices (NVIDIA's tensor cores) and Metal's simdgroup matrices. A
// subgroup holds an m x k `left`, a k x n `right` and an m x n `result` matrix spread over its lanes, and
// subgroupMatrixMultiplyAccumulate computes result += left · right in one instruction sequence.
//
// The engine's tensor-core GEMM (src/ops/gemm.ts) takes the adapter's f16 x f16 -> f32 shape and assumes:
//   - every subgroup has 32 lanes (subgroupMinSize == subgroupMaxSize == 32), so a workgroup of 32·S invocations
//     holds S subgroups and subgroup s is invocations [32s, 32s + 32) of a one-dimensional workgroup;
//   - subgroupMatrixLoad/Store work on workgroup memory with a padded row stride.
// Before the engine uses it, checkTensorCores runs a small kernel built on exactly those assumptions (4 subgroups,
// operands staged in workgroup memory, results through a workgroup scratch) and compares it with the exact
// product of small integers. Any compile error, validation error or wrong element turns the path off, with the
// reason kept for reports: the engine then runs its SIMT kernels, never a wrong result.

/** One subgroup-matrix shape: left m x k, right k x n, result m x n. */
export interface MatrixShape {
  M: number;
  N: number;
  K: number;
}

interface AdapterMatrixConfig {
  componentType?: string;
  resultComponentType?: string;
  M?: number;
  N?: number;
  K?: number;
}

export const SUBGROUP_LANES = 32;

/**
 * The f16 x f16 -> f32 shape the engine uses on this adapter (16x16x16 preferred, then the largest), or why none:
 * from the adapter's info (`subgroupMatrixConfigs`, `subgroupMinSize`, `subgroupMaxSize`) and its features.
 */
export function chooseMatrixShape(features: ReadonlySet<string>, info: Record<string, unknown>): { shape: MatrixShape | null; note: string } {
  if (!features.has('chromium-experimental-subgroup-matrix')) return { shape: null, note: 'the adapter offers no subgroup matrices' };
  if (!features.has('shader-f16')) return { shape: null, note: 'subgroup matrices need shader-f16, which the device lacks' };
  if (!features.has('subgroups')) return { shape: null, note: 'subgroup matrices need the subgroups feature, which the device lacks' };
  const min = Number(info.subgroupMinSize);
  const max = Number(info.subgroupMaxSize);
  if (min !== SUBGROUP_LANES || max !== SUBGROUP_LANES)
    return { shape: null, note: `the tensor-core kernels need ${SUBGROUP_LANES}-lane subgroups; the adapter has ${min}-${max}` };
  const configs = ((info.subgroupMatrixConfigs as AdapterMatrixConfig[] | undefined) ?? [])
    .filter((c) => c.componentType === 'f16' && c.resultComponentType === 'f32')
    .map((c) => ({ M: Number(c.M), N: Number(c.N), K: Number(c.K) }))
    .filter((c) => [c.M, c.N, c.K].every((d) => Number.isInteger(d) && d > 0 && d % 8 === 0 && d <= 32));
  if (!configs.length) return { shape: null, note: 'the adapter lists no f16 x f16 -> f32 subgroup-matrix config' };
  const square = configs.find((c) => c.M === 16 && c.N === 16 && c.K === 16);
  const shape = square ?? [...configs].sort((a, b) => b.M * b.N * b.K - a.M * a.N * a.K)[0];
  return { shape, note: `f16 x f16 -> f32 subgroup matrices ${shape.M}x${shape.N}x${shape.K}` };
}

/** Directives every tensor-core module starts with. */
export const MATRIX_DIRECTIVES = [
  'enable f16;',
  'enable subgroups;',
  'enable chromium_experimental_subgroup_matrix;',
  // Fragment offsets derive from local_invocation_index / 32, which the uniformity analysis cannot prove
  // subgroup-uniform; with 32-lane subgroups packed in order (checked at start-up) they are.
  'diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);',
];

/**
 * The start-up check: C[2m, 2n] = A[2m, 2k] · B[2k, 2n] by one workgroup of 4 subgroups, subgroup s owning result
 * fragment (s / 2, s % 2), both operands staged in workgroup memory with padded strides, results stored to a
 * per-subgroup workgroup scratch and written out lane by lane: the same moves as the engine's kernels.
 */
function checkWgsl(s: MatrixShape): string {
  const [M, N, K] = [2 * s.M, 2 * s.N, 2 * s.K];
  const sa = K + 8;
  const sb = N + 8;
  return `${MATRIX_DIRECTIVES.join('\n')}
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
var<workgroup> ta: array<f16, ${M * sa}>;
var<workgroup> tb: array<f16, ${K * sb}>;
var<workgroup> tc: array<f32, ${4 * s.M * s.N}>;
@compute @workgroup_size(${4 * SUBGROUP_LANES})
fn main(@builtin(local_invocation_index) tid: u32) {
  for (var i = tid; i < ${M * K}u; i += ${4 * SUBGROUP_LANES}u) { ta[(i / ${K}u) * ${sa}u + i % ${K}u] = f16(a[i]); }
  for (var i = tid; i < ${K * N}u; i += ${4 * SUBGROUP_LANES}u) { tb[(i / ${N}u) * ${sb}u + i % ${N}u] = f16(b[i]); }
  workgroupBarrier();
  let sg = tid / ${SUBGROUP_LANES}u;
  let lane = tid % ${SUBGROUP_LANES}u;
  let r0 = (sg / 2u) * ${s.M}u;
  let c0 = (sg % 2u) * ${s.N}u;
  var acc = subgroup_matrix_result<f32, ${s.N}, ${s.M}>();
  for (var k0 = 0u; k0 < ${K}u; k0 += ${s.K}u) {
    let l = subgroupMatrixLoad<subgroup_matrix_left<f16, ${s.K}, ${s.M}>>(&ta, r0 * ${sa}u + k0, false, ${sa}u);
    let r = subgroupMatrixLoad<subgroup_matrix_right<f16, ${s.N}, ${s.K}>>(&tb, k0 * ${sb}u + c0, false, ${sb}u);
    acc = subgroupMatrixMultiplyAccumulate(l, r, acc);
  }
  subgroupMatrixStore(&tc, sg * ${s.M * s.N}u, acc, false, ${s.N}u);
  workgroupBarrier();
  for (var e = lane; e < ${s.M * s.N}u; e += ${SUBGROUP_LANES}u) {
    c[(r0 + e / ${s.N}u) * ${N}u + c0 + e % ${s.N}u] = tc[sg * ${s.M * s.N}u + e];
  }
}`;
}

/** Small integers in [-3, 3]: every product and sum is exact in f16 inputs and f32 accumulation. */
function smallInts(n: number, seed: number): Float32Array {
  const out = new Float32Array(n);
  let x = seed >>> 0;
  for (let i = 0; i < n; i++) {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    out[i] = (x >>> 29) - 3;
  }
  return out;
}

/** Runs the check kernel; null when it computed the exact product, else what went wrong. */
export async function checkTensorCores(device: GPUDevice, s: MatrixShape): Promise<string | null> {
  const [M, N, K] = [2 * s.M, 2 * s.N, 2 * s.K];
  const av = smallInts(M * K, 1);
  const bv = smallInts(K * N, 2);
  const buffers: GPUBuffer[] = [];
  const storage = (data: Float32Array | null, bytes: number, extra = 0) => {
    const buf = device.createBuffer({ size: bytes, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | extra });
    if (data) device.queue.writeBuffer(buf, 0, data);
    buffers.push(buf);
    return buf;
  };
  try {
    device.pushErrorScope('validation');
    const module = device.createShaderModule({ code: checkWgsl(s) });
    const pipeline = device.createComputePipeline({ layout: 'auto', compute: { module, entryPoint: 'main' } });
    const a = storage(av, av.byteLength);
    const b = storage(bv, bv.byteLength);
    const c = storage(null, M * N * 4, GPUBufferUsage.COPY_SRC);
    const read = device.createBuffer({ size: M * N * 4, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    buffers.push(read);
    const group = device.createBindGroup({
      layout: pipeline.getBindGroupLayout(0),
      entries: [a, b, c].map((buffer, binding) => ({ binding, resource: { buffer } })),
    });
    const enc = device.createCommandEncoder();
    const pass = enc.beginComputePass();
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, group);
    pass.dispatchWorkgroups(1);
    pass.end();
    enc.copyBufferToBuffer(c, 0, read, 0, M * N * 4);
    device.queue.submit([enc.finish()]);
    const err = await device.popErrorScope();
    if (err) return `the check kernel did not validate: ${err.message.split('\n')[0]}`;
    await read.mapAsync(GPUMapMode.READ);
    const got = new Float32Array(read.getMappedRange().slice(0));
    read.unmap();
    let wrong = 0;
    for (let i = 0; i < M; i++)
      for (let j = 0; j < N; j++) {
        let ref = 0;
        for (let k = 0; k < K; k++) ref += av[i * K + k] * bv[k * N + j];
        if (got[i * N + j] !== ref) wrong++;
      }
    return wrong ? `the check kernel got ${wrong} of ${M * N} elements of an exact ${M}x${N}x${K} product wrong` : null;
  } catch (e) {
    return `the check kernel failed: ${String((e as Error)?.message ?? e).split('\n')[0]}`;
  } finally {
    for (const b of buffers) b.destroy();
  }
}

/** What decides whether f16 GEMMs use tensor cores on a device (tensorCoreDecision). */
export interface TensorCoreInputs {
  /** The host's choice: undefined or true asks for them (the default), false turns them off. */
  asked: boolean | undefined;
  /** How the host turns them off, for the note (e.g. "DBS_TENSOR_CORES=0"). */
  optOut: string;
  disableF16: boolean;
  /** Memory planning: nothing runs, so no check either. */
  dryRun: boolean;
  /** The device's features and the adapter's info (chooseMatrixShape reads them). */
  features: ReadonlySet<string>;
  info: Record<string, unknown>;
  /** The start-up check on this device: null when it passed, else what went wrong (checkTensorCores). */
  check: (shape: MatrixShape) => Promise<string | null>;
}

/**
 * Tensor cores are on by default where the adapter offers an f16 subgroup-matrix shape the kernels fit and the
 * start-up check passes on this device; the host may turn them off. Otherwise they are off and the note says why:
 * the opt-out, f16 off, what the adapter lacks (the check is then skipped), or the check's failure (the path is
 * refused and named). The check is the gate: nothing but its pass turns them on.
 */
export async function tensorCoreDecision(i: TensorCoreInputs): Promise<{ shape: MatrixShape | null; note: string }> {
  if (i.asked === false) return { shape: null, note: `tensor cores off: turned off by the host (${i.optOut})` };
  if (i.disableF16) return { shape: null, note: 'tensor cores off: f16 is turned off' };
  const chosen = chooseMatrixShape(i.features, i.info);
  if (!chosen.shape) return { shape: null, note: `tensor cores off: ${chosen.note}; start-up check skipped` };
  if (i.dryRun) return { shape: null, note: 'tensor cores off: memory planning (nothing runs)' };
  const shape = chosen.shape;
  const failure = await i.check(shape);
  if (failure)
    return { shape: null, note: `tensor cores refused: the ${shape.M}x${shape.N}x${shape.K} subgroup-matrix GEMM path failed its start-up check (${failure})` };
  return { shape, note: `tensor cores on: ${chosen.note}, start-up check passed` };
}
