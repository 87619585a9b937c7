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
//   HAS_BIAS         add bias[n] in the epilogue
//   ACCUMULATE       C += result instead of C = result (gradient accumulation, split-K chunks)
//
// Addressing is BLAS-like: element (r, c) of a row-major operand is base + r * ld + c, where base is
// an element offset into the bound window plus batch * batch stride. The host binds windows of
// tensors (never more than one storage binding), so a huge operand is walked in row or K chunks.
//
// Each invocation owns TM rows x TN columns of the output tile, interleaved so that neighbouring
// invocations read neighbouring vec4s of the shared tiles (no bank conflicts) and write neighbouring
// vec4s of C (coalesced): row block i of invocation (tx, ty) covers rows (i * WG_Y + ty) * 4 + 0..3,
// column block j covers columns (j * WG_X + tx) * 4 + 0..3.

// Uniforms and bindings are declared per entry point in src/ops/matmul.ts (src/gpu/kernel.ts generates
// them): matmul reads a, b (and bias with HAS_BIAS) and writes c; M, N, K, leading dimensions lda/ldb/ldc,
// element offsets off_* of each operand inside its bound window, batch strides stride_* (0 broadcasts).

//#entry matmul matmul_tc
// op(A)[m, k] of this batch, 0 outside the matrix.
fn load_a(base: u32, m: u32, k: u32) -> f32 {
  if (m >= p.M || k >= p.K) { return 0.0; }
  if (TRANS_A) { return f32(a[base + k * p.lda + m]); }
  return f32(a[base + m * p.lda + k]);
}

// op(B)[k, n] of this batch, 0 outside the matrix.
fn load_b(base: u32, k: u32, n: u32) -> f32 {
  if (k >= p.K || n >= p.N) { return 0.0; }
  if (TRANS_B) { return f32(b[base + n * p.ldb + k]); }
  return f32(b[base + k * p.ldb + n]);
}

//#entry matmul
const VM = TM / 4u;            // vec4 row blocks per invocation
const VN = TN / 4u;            // vec4 column blocks per invocation
const WG_X = BN / TN;
const WG_Y = BM / TM;
const WG_SIZE = WG_X * WG_Y;
const A_GROUPS = BM * BK / 4u; // the A tile is loaded as vec4 groups of 4 consecutive rows
const B_GROUPS = BK * BN / 4u; // the B tile as vec4 groups of 4 consecutive columns

// Shared tiles in f32, k-major: tile_a[k][m/4], tile_b[k][n/4]. 4 * (BM + BN) * BK bytes.
var<workgroup> tile_a: array<vec4<f32>, BK * BM / 4u>;
var<workgroup> tile_b: array<vec4<f32>, BK * BN / 4u>;

@compute @workgroup_size(WG_X, WG_Y)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
          @builtin(local_invocation_index) tid: u32) {
  let row0 = wg.y * BM;
  let col0 = wg.x * BN;
  let base_a = p.off_a + wg.z * p.stride_a;
  let base_b = p.off_b + wg.z * p.stride_b;
  let base_c = p.off_c + wg.z * p.stride_c;

  var acc: array<vec4<f32>, TM * VN>; // acc[row r][column block j], zero-initialised

  for (var k0 = 0u; k0 < p.K; k0 += BK) {
    // Stage the A tile. The memory-contiguous index runs fastest across invocations (k when A is
    // [M, K], m when A is [K, M]) so a workgroup's reads coalesce.
    for (var g = tid; g < A_GROUPS; g += WG_SIZE) {
      var k: u32;
      var m4: u32;
      if (TRANS_A) { m4 = g % (BM / 4u); k = g / (BM / 4u); } else { k = g % BK; m4 = g / BK; }
      let m = row0 + m4 * 4u;
      tile_a[k * (BM / 4u) + m4] = vec4<f32>(load_a(base_a, m, k0 + k), load_a(base_a, m + 1u, k0 + k),
                                             load_a(base_a, m + 2u, k0 + k), load_a(base_a, m + 3u, k0 + k));
    }
    // Stage the B tile the same way (n fastest for [K, N], k fastest for [N, K]).
    for (var g = tid; g < B_GROUPS; g += WG_SIZE) {
      var k: u32;
      var n4: u32;
      if (TRANS_B) { k = g % BK; n4 = g / BK; } else { n4 = g % (BN / 4u); k = g / (BN / 4u); }
      let n = col0 + n4 * 4u;
      tile_b[k * (BN / 4u) + n4] = vec4<f32>(load_b(base_b, k0 + k, n), load_b(base_b, k0 + k, n + 1u),
                                             load_b(base_b, k0 + k, n + 2u), load_b(base_b, k0 + k, n + 3u));
    }
    workgroupBarrier();

    // Rank-1 updates of the register block, one per k of the tile.
    for (var k = 0u; k < BK; k++) {
      var bv: array<vec4<f32>, VN>;
      for (var j = 0u; j < VN; j++) { bv[j] = tile_b[k * (BN / 4u) + j * WG_X + lid.x]; }
      for (var i = 0u; i < VM; i++) {
        let av = tile_a[k * (BM / 4u) + i * WG_Y + lid.y];
        for (var j = 0u; j < VN; j++) {
          acc[(i * 4u + 0u) * VN + j] = fma(vec4<f32>(av.x), bv[j], acc[(i * 4u + 0u) * VN + j]);
          acc[(i * 4u + 1u) * VN + j] = fma(vec4<f32>(av.y), bv[j], acc[(i * 4u + 1u) * VN + j]);
          acc[(i * 4u + 2u) * VN + j] = fma(vec4<f32>(av.z), bv[j], acc[(i * 4u + 2u) * VN + j]);
          acc[(i * 4u + 3u) * VN + j] = fma(vec4<f32>(av.w), bv[j], acc[(i * 4u + 3u) * VN + j]);
        }
      }
    }
    workgroupBarrier();
  }

  // Epilogue: bias, accumulation into C, conversion to T; masked at the matrix edges.
  for (var i = 0u; i < VM; i++) {
    for (var r = 0u; r < 4u; r++) {
      let m = row0 + (i * WG_Y + lid.y) * 4u + r;
      if (m >= p.M) { continue; }
      for (var j = 0u; j < VN; j++) {
        let n0 = col0 + (j * WG_X + lid.x) * 4u;
        let v = acc[(i * 4u + r) * VN + j];
        for (var q = 0u; q < 4u; q++) {
          let n = n0 + q;
          if (n >= p.N) { break; }
          var s = v[q];
          if (HAS_BIAS) { s += f32(bias[p.off_bias + n]); }
          let idx = base_c + m * p.ldc + n;
          if (ACCUMULATE) { s += f32(c[idx]); }
          c[idx] = TC(s);
        }
      }
    }
  }
}

//#entry matmul_tc
// The tensor-core path (f16 only): the GEMM core is generated by src/ops/tensorcore.ts, which calls these.
const TC_A_K_FAST = !TRANS_A; // A [M, K] is contiguous in k, Aᵀ stored [K, M] in m
const TC_B_N_FAST = !TRANS_B; // B [K, N] is contiguous in n, Bᵀ stored [N, K] in k

fn tc_dims() -> vec3<u32> { return vec3<u32>(p.M, p.N, p.K); }

fn tc_a4(z: u32, m: u32, k: u32) -> vec4<f32> {
  let base = p.off_a + z * p.stride_a;
  return vec4<f32>(load_a(base, m, k), load_a(base, m + 1u, k), load_a(base, m + 2u, k), load_a(base, m + 3u, k));
}

fn tc_b4(z: u32, k: u32, n: u32) -> vec4<f32> {
  let base = p.off_b + z * p.stride_b;
  return vec4<f32>(load_b(base, k, n), load_b(base, k, n + 1u), load_b(base, k, n + 2u), load_b(base, k, n + 3u));
}

fn tc_out(z: u32, m: u32, n: u32, v: f32) {
  var s = v;
  if (HAS_BIAS) { s += f32(bias[p.off_bias + n]); }
  let idx = p.off_c + z * p.stride_c + m * p.ldc + n;
  if (ACCUMULATE) { s += f32(c[idx]); }
  c[idx] = TC(s);
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
