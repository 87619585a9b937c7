// Flash attention backward as register-tiled kernels (FlashAttention-2's backward without float atomics),
// the path for long sequences on GPUs. Notation as in attention.wgsl: S = scale Q K^T, P = exp(S - LSE),
// dP = dO V^T, dS = P (dP - Delta); dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO.
//   attn_bwd_dkv_tiled: a workgroup owns BQ key rows of one (batch, head), K (scaled) and V resident in
//                       workgroup memory, and walks the query rows in tiles of BS: dK and dV in registers.
//   attn_bwd_dq_tiled:  a workgroup owns BQ query rows, Q (scaled) and dO resident, and walks the keys in
//                       tiles of BS: dQ in registers.
// Two kernels, each parallel over its own rows, so neither needs scratch nor a reduce pass (WebGPU has no
// float atomics for FlashAttention-2's dQ); S and dP are computed in both (14 n m D FLOPs against the fused
// kernel's 10), which is what buys the parallelism and drops the n x (m / 64) x D dQ scratch.
// Both have the same structure ("resident" rows R, "streamed" rows C): NT = TR x TC invocations, invocation
// (tr, tc) = (lid / TC, lid % TC) owns resident rows tr + TR r (r < RM) and
//   in the S and dP tiles (BQ x BS): streamed rows tc + TC jj (jj < SK), two RM x SK register matmuls whose
//     operands are vec4 chunks read from workgroup memory (each read feeds RM or SK dot products);
//   in the accumulators (BQ x D): vec4 chunks tc + TC i (i < CPT) of its rows, RM x CPT register matmuls
//     with P or dS passed through workgroup memory.
// The streamed tile's LSE and Delta (dK/dV: per query column) are staged beside it; the dQ kernel keeps its
// rows' LSE and Delta in registers. Keys past m, queries past n and (CAUSAL) keys after the query get P = 0.
// Specialised by T, D, D4 = ceil(D/4), BQ, BS, TR, TC, CAUSAL. Uniforms and bindings as attention.wgsl's.

//#entry attn_bwd_dkv_tiled attn_bwd_dq_tiled
const NT = TR * TC;
const RM = BQ / TR;
const SK = BS / TC;
const CPT = (D4 + TC - 1u) / TC;
const DKV = BQ_IS_KEYS;
const D_EXACT = (D % 4u) == 0u;
// Row strides padded by one chunk and one float so the rows a step reads at once fall in different banks.
const RS = D4 + 1u;
const PS = BS + 1u;

var<workgroup> ra: array<vec4<f32>, BQ * RS>;   // resident A: K scaled (dK/dV) or Q scaled (dQ)
var<workgroup> rb: array<vec4<f32>, BQ * RS>;   // resident B: V (dK/dV) or dO (dQ)
var<workgroup> sa: array<vec4<f32>, BS * RS>;   // streamed A: Q (dK/dV) or K (dQ)
var<workgroup> sb: array<vec4<f32>, BS * RS>;   // streamed B: dO (dK/dV) or V (dQ)
var<workgroup> sst: array<vec2<f32>, BS>;       // dK/dV: (LSE, Delta) of the streamed query rows
var<workgroup> tp: array<f32, BQ * PS>;         // P (dK/dV), [resident row][streamed row]
var<workgroup> tds: array<f32, BQ * PS>;        // dS

fn q_base(b: u32, h: u32, row: u32) -> u32 { return b * p.q_sb + h * p.q_sh + row * p.q_sn; }
fn k_base(b: u32, h: u32, row: u32) -> u32 { return b * p.k_sb + h * p.k_sh + row * p.k_sn; }

// Chunk c (elements 4c..4c+3, zero past D) of row `row` of the A (q or k) and B (dy or v) inputs: A and B of
// the query side when `queries`, of the key side otherwise.
fn chunk_a(queries: bool, b: u32, h: u32, row: u32, c: u32) -> vec4<f32> {
  var r = vec4<f32>(0.0);
  if (queries) {
    let base = q_base(b, h, row) + 4u * c;
    for (var e = 0u; e < 4u; e++) { if (D_EXACT || 4u * c + e < D) { r[e] = f32(q[base + e]); } }
  } else {
    let base = k_base(b, h, row) + 4u * c;
    for (var e = 0u; e < 4u; e++) { if (D_EXACT || 4u * c + e < D) { r[e] = f32(k[base + e]); } }
  }
  return r;
}
fn chunk_b(queries: bool, b: u32, h: u32, row: u32, c: u32) -> vec4<f32> {
  var r = vec4<f32>(0.0);
  if (queries) {
    let base = q_base(b, h, row) + 4u * c;
    for (var e = 0u; e < 4u; e++) { if (D_EXACT || 4u * c + e < D) { r[e] = f32(dy[base + e]); } }
  } else {
    let base = k_base(b, h, row) + 4u * c;
    for (var e = 0u; e < 4u; e++) { if (D_EXACT || 4u * c + e < D) { r[e] = f32(v[base + e]); } }
  }
  return r;
}

// acc[r * CPT + i] + the sum over the tile's streamed rows j of w[row r][j] x src[j][chunk tc + TC i], where w
// is dS (else P) and src the streamed A rows (else B). A value in and out: WGSL passes no pointers to
// workgroup memory without an extension.
fn accumulate(acc_in: array<vec4<f32>, RM * CPT>, w_ds: bool, src_a: bool, tr: u32, tc: u32) -> array<vec4<f32>, RM * CPT> {
  var acc = acc_in;
  for (var j = 0u; j < BS; j++) {
    var wr: array<f32, RM>;
    for (var r = 0u; r < RM; r++) {
      let at = (tr + TR * r) * PS + j;
      if (w_ds) { wr[r] = tds[at]; } else { wr[r] = tp[at]; }
    }
    for (var i = 0u; i < CPT; i++) {
      let c = tc + TC * i;
      if (c < D4) {
        var x: vec4<f32>;
        if (src_a) { x = sa[j * RS + c]; } else { x = sb[j * RS + c]; }
        for (var r = 0u; r < RM; r++) { acc[r * CPT + i] = fma(vec4<f32>(wr[r]), x, acc[r * CPT + i]); }
      }
    }
  }
  return acc;
}

struct Sums { a: array<vec4<f32>, RM * CPT>, b: array<vec4<f32>, RM * CPT> }

// dQ rows (sums.a) of query block wid.x, or dK (sums.a) and dV (sums.b) rows of key block wid.x, before the
// final scale of dQ and dK.
fn bwd_tiled(b: u32, h: u32, row0: u32, lid: u32) -> Sums {
  let tr = lid / TC;
  let tc = lid % TC;
  let n_res = select(p.n, p.m, DKV);
  let n_str = select(p.m, p.n, DKV);
  for (var e = lid; e < BQ * D4; e += NT) {
    let r = e / D4;
    let c = e % D4;
    var xa = vec4<f32>(0.0);
    var xb = vec4<f32>(0.0);
    if (row0 + r < n_res) {
      xa = chunk_a(!DKV, b, h, row0 + r, c) * p.scale;
      xb = chunk_b(!DKV, b, h, row0 + r, c);
    }
    ra[r * RS + c] = xa;
    rb[r * RS + c] = xb;
  }
  // dQ: the resident query rows' (LSE, Delta).
  var rst: array<vec2<f32>, RM>;
  if (!DKV) {
    for (var r = 0u; r < RM; r++) {
      let row = row0 + tr + TR * r;
      if (row < p.n) { rst[r] = vec2<f32>(lse[(b * p.heads + h) * p.n + row], delta[(b * p.heads + h) * p.n + row]); }
    }
  }
  var acc: Sums;
  // CAUSAL (query i sees keys j <= i): a key block meets no query before it, a query block no key after it.
  var s0 = 0u;
  var s_end = n_str;
  if (CAUSAL && DKV) { s0 = (row0 / BS) * BS; }
  if (CAUSAL && !DKV) { s_end = min(n_str, row0 + BQ); }
  for (var st = s0; st < s_end; st += BS) {
    for (var e = lid; e < BS * D4; e += NT) {
      let r = e / D4;
      let c = e % D4;
      var xa = vec4<f32>(0.0);
      var xb = vec4<f32>(0.0);
      if (st + r < n_str) {
        xa = chunk_a(DKV, b, h, st + r, c);
        xb = chunk_b(DKV, b, h, st + r, c);
      }
      sa[r * RS + c] = xa;
      sb[r * RS + c] = xb;
    }
    if (DKV) {
      for (var r = lid; r < BS; r += NT) {
        var x = vec2<f32>(0.0);
        if (st + r < p.n) { x = vec2<f32>(lse[(b * p.heads + h) * p.n + st + r], delta[(b * p.heads + h) * p.n + st + r]); }
        sst[r] = x;
      }
    }
    workgroupBarrier();
    // s[r * SK + jj] = resident A row . streamed A row (the scale is in the resident rows), dp likewise for B.
    var s = array<f32, RM * SK>();
    var dp = array<f32, RM * SK>();
    for (var c = 0u; c < D4; c++) {
      var xa: array<vec4<f32>, RM>;
      var xb: array<vec4<f32>, RM>;
      for (var r = 0u; r < RM; r++) {
        xa[r] = ra[(tr + TR * r) * RS + c];
        xb[r] = rb[(tr + TR * r) * RS + c];
      }
      for (var jj = 0u; jj < SK; jj++) {
        let ya = sa[(tc + TC * jj) * RS + c];
        let yb = sb[(tc + TC * jj) * RS + c];
        for (var r = 0u; r < RM; r++) {
          s[r * SK + jj] += dot(xa[r], ya);
          dp[r * SK + jj] += dot(xb[r], yb);
        }
      }
    }
    for (var r = 0u; r < RM; r++) {
      let rrow = row0 + tr + TR * r;
      for (var jj = 0u; jj < SK; jj++) {
        let srow = st + tc + TC * jj;
        let query = select(rrow, srow, DKV);
        let key = select(srow, rrow, DKV);
        let seen = rrow < n_res && srow < n_str && (!CAUSAL || key <= query);
        var stat = rst[r];
        if (DKV) { stat = sst[tc + TC * jj]; }
        let pij = select(0.0, exp(s[r * SK + jj] - stat.x), seen);
        if (DKV) { tp[(tr + TR * r) * PS + tc + TC * jj] = pij; }
        tds[(tr + TR * r) * PS + tc + TC * jj] = pij * (dp[r * SK + jj] - stat.y);
      }
    }
    workgroupBarrier();
    if (DKV) {
      acc.a = accumulate(acc.a, true, true, tr, tc); // dK += dS^T Q
      acc.b = accumulate(acc.b, false, false, tr, tc); // dV += P^T dO
    } else {
      acc.a = accumulate(acc.a, true, true, tr, tc); // dQ += dS K
    }
    workgroupBarrier();
  }
  return acc;
}

//#entry attn_bwd_dkv_tiled
const BQ_IS_KEYS = true;
@compute @workgroup_size(NT)
fn attn_bwd_dkv_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let b = wid.y / p.heads;
  let h = wid.y % p.heads;
  let row0 = wid.x * BQ;
  let acc = bwd_tiled(b, h, row0, lid);
  let tr = lid / TC;
  let tc = lid % TC;
  for (var r = 0u; r < RM; r++) {
    let row = row0 + tr + TR * r;
    if (row >= p.m) { continue; }
    let kb = k_base(b, h, row);
    for (var i = 0u; i < CPT; i++) {
      let c = tc + TC * i;
      for (var x = 0u; x < 4u; x++) {
        if (c < D4 && 4u * c + x < D) {
          dk[kb + 4u * c + x] = T(acc.a[r * CPT + i][x] * p.scale);
          dv[kb + 4u * c + x] = T(acc.b[r * CPT + i][x]);
        }
      }
    }
  }
}

//#entry attn_bwd_dq_tiled
const BQ_IS_KEYS = false;
@compute @workgroup_size(NT)
fn attn_bwd_dq_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let b = wid.y / p.heads;
  let h = wid.y % p.heads;
  let row0 = wid.x * BQ;
  let acc = bwd_tiled(b, h, row0, lid);
  let tr = lid / TC;
  let tc = lid % TC;
  for (var r = 0u; r < RM; r++) {
    let row = row0 + tr + TR * r;
    if (row >= p.n) { continue; }
    let qb = q_base(b, h, row);
    for (var i = 0u; i < CPT; i++) {
      let c = tc + TC * i;
      for (var x = 0u; x < 4u; x++) {
        if (c < D4 && 4u * c + x < D) { dq[qb + 4u * c + x] = T(acc.a[r * CPT + i][x] * p.scale); }
      }
    }
  }
}
