// Batched, tiled matmul  C[b] = op(A[b]) · op(B[b]) (+ bias) (+ C[b] when accumulating), f32 accumulation.
//
// Specialised by (defs, chosen per problem by src/ops/matmul.ts):
//   T                storage type of A, B and bias (f16 or f32)
//   TC               storage type of C: T, or f32 for f32 gradient buffers fed by f16 operands
//   BM, BN, BK       workgroup tile: BM rows x BN columns of C, stepping BK along the reduction
//   TM, TN           register block of one invocation (multiples of 4): the workgroup is (BN/TN) x (BM/TM)
//   TRANS_A/TRANS_B  A stored [K, M] / B stored [N, K] instead of [M, K] / [K, N]
//   VEC_A/VEC_B      the operand is bound as vec4<T> and staged with one 16-byte load per group of 4
//                    contiguous elements (the host's choice when ld, offsets, batch stride and the
//                    contiguous dimension are multiples of 4)
//   CHECK_M/N/K      bounds checks along that dimension; false when it is a multiple of the tile
//   HAS_BIAS         add bias[n] in the epilogue;  ACCUMULATE  C += result instead of C = result
//
// Addressing is BLAS-like: element (r, c) of a row-major operand is base + r * ld + c, where base is
// an element offset into the bound window plus batch * batch stride (0 broadcasts an operand).
//
// The tile loop, the register micro-kernel and the staging are generated per tile shape by
// `gemmCode` in src/ops/matmul.ts (`gemm_tile`), so every register (accumulators, A and B fragments,
// the prefetched next tile) is a named variable: nothing indexes a register array with a loop counter
// (software adapters would keep such arrays in memory). Shared tiles hold f32 vec4s copied as stored:
// the contiguous dimension of each operand is the vec4 axis, so staging never transposes; a tile whose
// vec4s run along K has its rows padded by one vec4 (conflict-free reads down a column). While one
// BK-deep tile is multiplied, the next is loaded into registers.
//
// Invocation (tx, ty) owns rows (i * WG_Y + ty) * 4 + 0..3 for i < TM / 4 and columns
// (j * WG_X + tx) * 4 + 0..3 for j < TN / 4, so neighbouring invocations touch neighbouring vec4s.
//
// Split-K: `matmul_partial` runs the same tile over the K range [z * k_split, (z + 1) * k_split) of
// workgroup z and writes f32 partial sums [splits, M, N]; `matmul_reduce` adds them in parallel (one
// invocation per output element) and applies bias, accumulation and the conversion to TC.
//
// Uniforms and bindings are declared per entry point in src/ops/matmul.ts (src/gpu/kernel.ts generates
// them).

//#entry matmul
fn store_c1(row_base: u32, n: u32, s: f32) {
  if (CHECK_N && n >= p.N) { return; }
  var t = s;
  if (HAS_BIAS) { t += f32(bias[p.off_bias + n]); }
  let idx = row_base + n;
  if (ACCUMULATE) { t += f32(c[idx]); }
  c[idx] = TC(t);
}

// Columns n..n+3 of row m (masked at the matrix edges).
fn store_out(base_c: u32, m: u32, n: u32, v: vec4<f32>) {
  if (CHECK_M && m >= p.M) { return; }
  let rb = base_c + m * p.ldc;
  store_c1(rb, n, v.x);
  store_c1(rb, n + 1u, v.y);
  store_c1(rb, n + 2u, v.z);
  store_c1(rb, n + 3u, v.w);
}

@compute @workgroup_size(BN / TN, BM / TM)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
          @builtin(local_invocation_index) tid: u32) {
  gemm_tile(wg.y * BM, wg.x * BN, p.off_a + wg.z * p.stride_a, p.off_b + wg.z * p.stride_b,
            p.off_c + wg.z * p.stride_c, 0u, p.K, lid.x, lid.y, tid);
}

//#entry matmul_partial
fn store_p1(row_base: u32, n: u32, s: f32) {
  if (CHECK_N && n >= p.N) { return; }
  partial[row_base + n] = s;
}

fn store_out(base_c: u32, m: u32, n: u32, v: vec4<f32>) {
  if (CHECK_M && m >= p.M) { return; }
  let rb = base_c + m * p.N;
  store_p1(rb, n, v.x);
  store_p1(rb, n + 1u, v.y);
  store_p1(rb, n + 2u, v.z);
  store_p1(rb, n + 3u, v.w);
}

// Workgroup z multiplies the K range [z * k_split, min(K, (z + 1) * k_split)) into partial[z].
@compute @workgroup_size(BN / TN, BM / TM)
fn matmul_partial(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
                  @builtin(local_invocation_index) tid: u32) {
  let k_begin = wg.z * p.k_split;
  gemm_tile(wg.y * BM, wg.x * BN, p.off_a, p.off_b, wg.z * p.M * p.N, k_begin, min(p.K, k_begin + p.k_split),
            lid.x, lid.y, tid);
}

//#entry matmul_reduce
// C[m, n] = Σ_z partial[z, m, n] (+ bias[n]) (+ C[m, n]), one invocation per element.
@compute @workgroup_size(64, 4)
fn matmul_reduce(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n = gid.x;
  let m = gid.y;
  if (n >= p.N || m >= p.M) { return; }
  var t = 0.0;
  for (var z = 0u; z < p.splits; z++) { t += partial[(z * p.M + m) * p.N + n]; }
  if (HAS_BIAS) { t += f32(bias[p.off_bias + n]); }
  let idx = p.off_c + m * p.ldc + n;
  if (ACCUMULATE) { t += f32(c[idx]); }
  c[idx] = TC(t);
}

// ---- column sums (bias gradient): out[n] = sum over rows r of x[r, n] ----------------------------
// x: p.rows rows x p.cols columns at element p.off_x (row pitch p.cols); out at p.off_out.
// Pass 1 (col_sum_partial): a workgroup of SUM_COLS column lanes x ROW_LANES row lanes sums rows
// [blk * ROWS_PER_WG, (blk + 1) * ROWS_PER_WG) into partial[p.part_row0 + blk, n] (f32).
// Pass 2 (col_sum_finish): out[n] = sum of the first p.parts partial rows (+ out[n] with ACCUMULATE);
// T is x's storage type, TO out's.

//#entry col_sum_partial col_sum_finish
const SUM_COLS = 64u;
const ROW_LANES = 4u;
const ROWS_PER_WG = 256u;

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
  if (ACCUMULATE) { t += f32(out[idx]); }
  out[idx] = TO(t);
}
