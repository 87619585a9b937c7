// Batched, tiled matmul  C[b] = op(A[b]) · op(B[b]) (+ bias) (+ C[b] when accumulating).
//
// Specialised by:
//   T                storage type of A, B and bias (f16 or f32); every product is accumulated in f32
//   TC               storage type of C: T, or f32 for f32 gradient buffers fed by f16 operands
//   BM, BN, BK       workgroup tile: BM rows x BN columns of C, stepping BK along the reduction
//   TM, TN           register block of one invocation (both multiples of 4), so the workgroup is
//                    (BN/TN) x (BM/TM) invocations
//   TRANS_A          A is stored [K, M] (op(A) = Aᵀ) instead of [M, K]
//   TRANS_B          B is stored [N, K] (op(B) = Bᵀ) instead of [K, N]
//   FITS             the tile divides M, N and K: loads skip their bounds checks
//   B_INT8           B is a frozen int8 weight: bytes bq (4 per u32) and per-row f32 scales bs, dequantized in f32 as
//                    loaded (b_elem); B_PLAIN = neither B_VEC4 nor B_INT8 (b is bound)
//   A_VEC4, B_VEC4   the operand is bound as array<vec4<T>> (a4 / b4, the same window) and read in whole aligned
//                    vec4s along its contiguous index, which its length, leading dimension, offset and batch stride
//                    are multiples of: one vec4 load instead of 4 scalar ones. Along m or n (Aᵀ stored [K, M], B
//                    [K, N]) that is a group gemm_a4 / gemm_b4 returns; along k (A [M, K], Bᵀ stored [N, K]: the
//                    forward x·Wᵀ) the core stages 4x4 quads through gemm_ak4 / gemm_bk4 (defs A_QUADS, B_QUADS)
// and at run time by the uniform p.epilogue (src/ops/gemm.ts EPILOGUE, read through epi_<name>()): add bias[n] in the
// epilogue (epi_bias), bias[m] instead (epi_bias_rows: a 1x1 convolution's per-channel bias), C += result instead of
// C = result (epi_accumulate: gradient accumulation, K chunks; the result is rounded to C's type first, so this equals
// the GEMM into a new buffer followed by an add).
//
// Addressing is BLAS-like: element (r, c) of a row-major operand is base + r * ld + c, where base is
// an element offset into the bound window plus batch * batch stride. The host binds windows of
// tensors (never more than one storage binding), so a huge operand is walked in row or K chunks.
//
// The entry points' bodies are generated per tile by src/ops/gemm.ts (the SIMT core `matmul`: register blocks
// as named variables; the tensor-core core `matmul_tc`; `matmul_split_reduce`, which sums split-K partials);
// this file holds what they call: the loaders and the epilogue below.

// Uniforms and bindings are declared per entry point in src/ops/matmul.ts (src/gpu/kernel.ts generates
// them): matmul reads a, b (or a4, b4 with A_VEC4, B_VEC4) and bias and writes c, or with SPLIT_K its partials to part
// (src/ops/gemm.ts); M, N, K, leading dimensions lda/ldb/ldc, element offsets off_* of each operand inside its
// bound window, batch strides stride_* (0 broadcasts), k_splits and k_chunk of split-K, epilogue. Without a bias the
// bias binding is any small read-only window, never read.
// matmul_split_reduce reads part and writes c (+ bias) with the same uniforms.

//#entry matmul matmul_tc
// op(A)[m, k] of this batch, 0 outside the matrix.
fn load_a(base: u32, m: u32, k: u32) -> f32 {
  if (!FITS && (m >= p.M || k >= p.K)) { return 0.0; }
  if (TRANS_A) { return f32(a[base + k * p.lda + m]); }
  return f32(a[base + m * p.lda + k]);
}

// op(B)[k, n] of this batch, 0 outside the matrix.
fn load_b(base: u32, k: u32, n: u32) -> f32 {
  if (!FITS && (k >= p.K || n >= p.N)) { return 0.0; }
  if (TRANS_B) { return b_elem(base + n * p.ldb + k); }
  return b_elem(base + k * p.ldb + n);
}

// Element i of the stored B: T, or with B_INT8 (a frozen int8 weight, src/ops/int8.ts; never batched, bound
// whole) the signed byte i of bq times the f32 scale of its stored row i / ldb (the weight's output channel).
fn b_elem(i: u32) -> f32 {
  if (B_INT8) { return f32(extractBits(bitcast<i32>(bq[i >> 2u]), (i & 3u) * 8u, 8u)) * bs[i / p.ldb]; }
  return f32(b[i]);
}

// The GEMM interface both generated cores call (src/ops/gemm.ts: the SIMT core `matmul`, the tensor-core core
// `matmul_tc`): dimensions, groups of 4 elements of op(A) and op(B) for batch z (0 outside the matrix), and the
// epilogue of one element of C (bias, accumulation into C, conversion to TC).
const A_K_FAST = !TRANS_A; // staging order: A [M, K] is contiguous in k, Aᵀ stored [K, M] in m
const B_N_FAST = !TRANS_B; // B [K, N] is contiguous in n, Bᵀ stored [N, K] in k

fn gemm_a4(z: u32, m: u32, k: u32) -> vec4<f32> {
  let base = p.off_a + z * p.stride_a;
  if (A_VEC4) {                                   // Aᵀ[k, m .. m+3]: M % 4 == 0, so the group is all in or all out
    if (!FITS && (m >= p.M || k >= p.K)) { return vec4<f32>(0.0); }
    return vec4<f32>(a4[(base + k * p.lda + m) / 4u]);
  }
  return vec4<f32>(load_a(base, m, k), load_a(base, m + 1u, k), load_a(base, m + 2u, k), load_a(base, m + 3u, k));
}

fn gemm_b4(z: u32, k: u32, n: u32) -> vec4<f32> {
  let base = p.off_b + z * p.stride_b;
  if (B_VEC4) {                                   // B[k, n .. n+3]: N % 4 == 0, so the group is all in or all out
    if (!FITS && (k >= p.K || n >= p.N)) { return vec4<f32>(0.0); }
    return vec4<f32>(b4[(base + k * p.ldb + n) / 4u]);
  }
  return vec4<f32>(load_b(base, k, n), load_b(base, k, n + 1u), load_b(base, k, n + 2u), load_b(base, k, n + 3u));
}

// op(A)[m, k .. k+3] and op(B)[k .. k+3, n] for the quad staging (A_QUADS: A [M, K] with A_VEC4; B_QUADS: Bᵀ
// stored [N, K] with B_VEC4). K % 4 == 0 there, so a group along k is all in or all out.
fn gemm_ak4(z: u32, m: u32, k: u32) -> vec4<f32> {
  if (!FITS && (m >= p.M || k >= p.K)) { return vec4<f32>(0.0); }
  return vec4<f32>(a4[(p.off_a + z * p.stride_a + m * p.lda + k) / 4u]);
}

fn gemm_bk4(z: u32, k: u32, n: u32) -> vec4<f32> {
  if (!FITS && (k >= p.K || n >= p.N)) { return vec4<f32>(0.0); }
  return vec4<f32>(b4[(p.off_b + z * p.stride_b + n * p.ldb + k) / 4u]);
}

//#entry matmul matmul_tc matmul_split_reduce
fn gemm_dims() -> vec3<u32> { return vec3<u32>(p.M, p.N, p.K); }

fn gemm_out(z: u32, m: u32, n: u32, v: f32) {
  var s = v;
  if (epi_bias()) { s += f32(bias[p.off_bias + select(n, m, epi_bias_rows())]); }
  let idx = p.off_c + z * p.stride_c + m * p.ldc + n;
  // the result rounded to TC first, then added: C += result is bit for bit the GEMM into a new buffer and an add
  if (epi_accumulate()) { s = select(s, round_f16(s), TC_IS_F16) + f32(c[idx]); }
  c[idx] = TC(s);
}

// ---- column sums (bias gradient): out[n] = sum over rows r of x[r, n] ----------------------------
// x: p.rows rows x p.cols columns at element p.off_x (row pitch p.cols); out at p.off_out.
// Pass 1 (col_sum_partial): a workgroup of SUM_COLS column lanes x ROW_LANES row lanes sums rows
// [blk * ROWS_PER_WG, (blk + 1) * ROWS_PER_WG) into partial[p.part_row0 + blk, n] (f32).
// Pass 2 (col_sum_finish): out[n] = sum of the first p.parts partial rows (+ out[n] with ACCUMULATE);
// T is x's storage type, TO out's.

//#entry col_sum_partial col_sum_finish
// SUM_COLS, ROW_LANES and ROWS_PER_WG are defs from src/ops/matmul.ts (COL_SUM), which sizes the grid by them.

//#entry col_sum_partial
var<workgroup> lane_sums: array<f32, SUM_COLS * ROW_LANES>;

@compute @workgroup_size(SUM_COLS, ROW_LANES)
fn col_sum_partial(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let n = wg.x * SUM_COLS + lid.x;
  let r0 = wg.y * ROWS_PER_WG;
  let r1 = min(r0 + ROWS_PER_WG, p.rows);
  var s = 0.0;
  if (n < p.cols) {
    for (var r = r0 + lid.y; r < r1; r += ROW_LANES) { s += f32(x[p.off_x + r * p.cols + n]); }
  }
  lane_sums[lid.y * SUM_COLS + lid.x] = s;
  workgroupBarrier();
  if (lid.y == 0u && n < p.cols) {
    var t = 0.0;
    for (var l = 0u; l < ROW_LANES; l++) { t += lane_sums[l * SUM_COLS + lid.x]; }
    partial[(p.part_row0 + wg.y) * p.cols + n] = t;
  }
}

//#entry col_sum_finish
@compute @workgroup_size(SUM_COLS)
fn col_sum_finish(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n = gid.x;
  if (n >= p.cols) { return; }
  var t = 0.0;
  for (var q = 0u; q < p.parts; q++) { t += partial[q * p.cols + n]; }
  let idx = p.off_out + n;
  if (ACCUMULATE) { t = select(t, round_f16(t), TO_IS_F16) + f32(out[idx]); }
  out[idx] = TO(t);
}
