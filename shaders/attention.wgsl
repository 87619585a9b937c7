// Flash attention (forward and backward) and the delta term of its backward.
//
// Per (batch b, head h): S = scale * Q K^T [N, M], P = softmax_rows(S), O = P V.
// Forward: key/value tiles are staged in workgroup memory and the softmax is computed online: per
// tile, s_j = scale q.k_j, m' = max(m, max_j s_j), l = l e^(m-m') + sum_j e^(s_j-m'),
// o = o e^(m-m') + sum_j e^(s_j-m') v_j. At the end O = o / l and LSE = m + log l is saved, so the
// backward can rebuild P = exp(S - LSE) tile by tile. The N x M matrices S and P never exist.
//   attn_fwd_tiled(_sg): FlashAttention-2, a block of BQ query rows per workgroup, S and O tiles as
//                        register matmuls (see its section);
//   attn_fwd:            one invocation per query row (devices whose workgroup memory fits no tile).
// Backward (with dO): Delta_i = sum_d dO_id O_id; dS_ij = P_ij (dO_i . v_j - Delta_i);
//   dQ_i = scale sum_j dS_ij k_j,  dK_j = scale sum_i dS_ij q_i,  dV_j = sum_i P_ij dO_i.
//   attn_bwd_fused(_split): one invocation per key row, loops over query tiles: dK, dV, and each key
//                        block's share of dQ to f32 scratch, added in block order by attn_bwd_dq_reduce;
//   attn_bwd_dq + attn_bwd_dkv(_split): the same sums in two kernels that each recompute S and dP
//                        (where the fused kernel's scratch does not fit).
// No atomics are needed. Specialised by T (storage), D (head dim), D4 = ceil(D/4) (vec4 chunks per
// row), BR (rows per workgroup = invocations of the row kernels), BC (tile rows staged in workgroup
// memory, as f32, a multiple of 4), CAUSAL (query i attends to keys j <= i only), and for the tiled
// forward BQ, BK, TR, TC, D4S, KC, PREFETCH, for the fused backward KQ.
//
// Layouts are given by strides: element (b, h, row, d) of a tensor lives at
// b*s_b + h*s_h + row*s_row + d, which covers [B,H,N,D] and [B,N,H,D] alike.

// Uniforms and bindings are declared per entry point in src/ops/attention.ts (src/gpu/kernel.ts
// generates them). Every entry takes
//   heads, n (query rows), m (key rows), scale,
//   q_sb, q_sh, q_sn   strides of q, out, dy, dq
//   k_sb, k_sh, k_sn   strides of k, v, dk, dv
// the split dK/dV kernels also q_split (query rows per split, a multiple of BC), and the fused backward's
// kernels bh0 (the first b*head of the dispatch's slice). Bindings: q, k, v, out, dy (T); lse, delta
// (f32 [B,H,N]); dq, dk, dv (T); dk_part, dv_part (f32 partials of the split dK/dV path, dense
// [split][local b*h][key][d], summed by attn_bwd_dkv_reduce); dq_part (f32 [key block][local b*h][query][d]).

//#entry attn_fwd attn_bwd_dq attn_bwd_dkv attn_bwd_dkv_split attn_bwd_fused attn_bwd_fused_split
// Tiles hold rows of D4 = ceil(D/4) vec4 chunks (zero past D), so every dot product and
// accumulation runs 4 lanes wide and each workgroup-memory read feeds 4 FMAs.
var<workgroup> tile_a: array<vec4<f32>, BC * D4>;   // K (forward, dQ) or Q (dK/dV)
var<workgroup> tile_b: array<vec4<f32>, BC * D4>;   // V (forward, dQ) or dO (dK/dV)
var<workgroup> tile_r: array<vec2<f32>, BC>;        // dK/dV: (LSE, Delta) of the staged query rows

//#entry attn_fwd attn_fwd_tiled attn_fwd_tiled_sg attn_bwd_delta attn_bwd_dq attn_bwd_dkv attn_bwd_dkv_split attn_bwd_fused attn_bwd_fused_split attn_bwd_dkv_reduce attn_bwd_dq_reduce
const NEG_BIG = -3.0e38;        // "minus infinity" for masked scores: exp(NEG_BIG - m) = 0
const D_EXACT = (D % 4u) == 0u;  // no zero padding in the last chunk

fn q_base(b: u32, h: u32, row: u32) -> u32 { return b * p.q_sb + h * p.q_sh + row * p.q_sn; }
fn k_base(b: u32, h: u32, row: u32) -> u32 { return b * p.k_sb + h * p.k_sh + row * p.k_sn; }

//#entry attn_fwd attn_fwd_tiled attn_fwd_tiled_sg attn_bwd_dq attn_bwd_dkv attn_bwd_dkv_split attn_bwd_fused attn_bwd_fused_split
// Chunk c (elements 4c..4c+3, zero past D) of the row starting at `base` of each input.
fn q_chunk(base: u32, c: u32) -> vec4<f32> {
  var r = vec4<f32>(0.0);
  for (var e = 0u; e < 4u; e++) { if (D_EXACT || 4u * c + e < D) { r[e] = f32(q[base + 4u * c + e]); } }
  return r;
}
fn k_chunk(base: u32, c: u32) -> vec4<f32> {
  var r = vec4<f32>(0.0);
  for (var e = 0u; e < 4u; e++) { if (D_EXACT || 4u * c + e < D) { r[e] = f32(k[base + 4u * c + e]); } }
  return r;
}
fn v_chunk(base: u32, c: u32) -> vec4<f32> {
  var r = vec4<f32>(0.0);
  for (var e = 0u; e < 4u; e++) { if (D_EXACT || 4u * c + e < D) { r[e] = f32(v[base + 4u * c + e]); } }
  return r;
}
//#entry attn_bwd_dq attn_bwd_dkv attn_bwd_dkv_split attn_bwd_fused attn_bwd_fused_split
fn do_chunk(base: u32, c: u32) -> vec4<f32> {
  var r = vec4<f32>(0.0);
  for (var e = 0u; e < 4u; e++) { if (D_EXACT || 4u * c + e < D) { r[e] = f32(dy[base + 4u * c + e]); } }
  return r;
}

//#entry attn_fwd attn_bwd_dq attn_bwd_dkv attn_bwd_dkv_split attn_bwd_fused attn_bwd_fused_split
fn hsum(x: vec4<f32>) -> f32 { return (x.x + x.y) + (x.z + x.w); }

//#entry attn_fwd attn_bwd_delta attn_bwd_dq attn_bwd_dkv attn_bwd_dkv_split attn_bwd_fused attn_bwd_fused_split
// Workgroup id -> (b, h, first row): x walks row tiles, y walks b*heads. `part` is the fused backward's
// dQ-partial slot (key block, local b*head); 0 elsewhere.
struct Task { b: u32, h: u32, row0: u32, part: u32 }
fn task(wid: vec3<u32>) -> Task {
  return Task(wid.y / p.heads, wid.y % p.heads, wid.x * BR, 0u);
}

//#entry attn_fwd attn_bwd_dq
// Keys of the tile starting at kt that query `row` attends to: all of them, or with CAUSAL (a
// decoder-style mask, CLIP's text encoder) only keys kt + j <= row.
fn visible_keys(row: u32, kt: u32) -> u32 {
  let cols = min(BC, p.m - kt);
  if (!CAUSAL) { return cols; }
  if (row < kt) { return 0u; }
  return min(cols, row + 1u - kt);
}

// Stages key rows [r0, r0+BC) of k into tile_a and of v into tile_b (zeros past m).
fn stage_kv(b: u32, h: u32, r0: u32, lid: u32) {
  for (var e = lid; e < BC * D4; e += BR) {
    let r = e / D4;
    let c = e % D4;
    var kv = vec4<f32>(0.0);
    var vv = vec4<f32>(0.0);
    if (r0 + r < p.m) {
      let base = k_base(b, h, r0 + r);
      kv = k_chunk(base, c);
      vv = v_chunk(base, c);
    }
    tile_a[e] = kv;
    tile_b[e] = vv;
  }
}

//#entry attn_fwd
// Each staged tile's keys are taken four at a time: their scores form a vec4 (registers, no per-invocation array
// of scores, which a CPU adapter keeps in memory and indexes lane by lane), the running max moves once per four
// keys, and keys past the visible count score NEG_BIG (p = 0; BC is a multiple of 4, so their rows are staged). On
// lavapipe at 256 query and key rows, head dim 8, this forward took 30 ms where two sweeps over an array of BC
// scores took 42.
@compute @workgroup_size(BR)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;
  let live = row < p.n;
  let qb = q_base(t.b, t.h, min(row, p.n - 1u));
  var qr: array<vec4<f32>, D4>;
  var o: array<vec4<f32>, D4>;
  for (var c = 0u; c < D4; c++) { qr[c] = q_chunk(qb, c) * p.scale; o[c] = vec4<f32>(0.0); }
  var m_run = NEG_BIG;
  var l_run = 0.0;
  for (var kt = 0u; kt < p.m; kt += BC) {
    stage_kv(t.b, t.h, kt, lid);
    workgroupBarrier();
    let cols = visible_keys(row, kt);
    if (live) {
      for (var j = 0u; j < cols; j += 4u) {
        var s4 = vec4<f32>(NEG_BIG);
        for (var u = 0u; u < 4u; u++) {
          if (j + u < cols) {
            var acc = vec4<f32>(0.0);
            for (var c = 0u; c < D4; c++) { acc = fma(qr[c], tile_a[(j + u) * D4 + c], acc); }
            s4[u] = hsum(acc);
          }
        }
        // Rescale what was accumulated under the old running max.
        let m_new = max(m_run, max(max(s4.x, s4.y), max(s4.z, s4.w)));
        let corr = exp(m_run - m_new);
        let p4 = exp(s4 - vec4<f32>(m_new));
        l_run = l_run * corr + ((p4.x + p4.y) + (p4.z + p4.w));
        for (var c = 0u; c < D4; c++) {
          var oc = o[c] * corr;
          oc = fma(vec4<f32>(p4.x), tile_b[j * D4 + c], oc);
          oc = fma(vec4<f32>(p4.y), tile_b[(j + 1u) * D4 + c], oc);
          oc = fma(vec4<f32>(p4.z), tile_b[(j + 2u) * D4 + c], oc);
          oc = fma(vec4<f32>(p4.w), tile_b[(j + 3u) * D4 + c], oc);
          o[c] = oc;
        }
        m_run = m_new;
      }
    }
    workgroupBarrier();
  }
  if (live) {
    let inv = 1.0 / l_run;
    for (var d = 0u; d < D; d++) { out[qb + d] = T(o[d / 4u][d % 4u] * inv); }
    lse[(t.b * p.heads + t.h) * p.n + row] = m_run + log(l_run);
  }
}

//#entry attn_fwd_tiled attn_fwd_tiled_sg
// FlashAttention-2 forward. A workgroup owns BQ query rows of one (batch, head) and walks the keys in tiles
// of BK. Its NT = TR x TC invocations form a grid: invocation (tr, tc) = (lid / TC, lid % TC) owns the RM
// query rows tr + TR r, and
//   in the score tile S = Q K^T (BQ x BK): keys tc + TC jj (jj < SK), an RM x SK register matmul whose
//     operands come from workgroup memory (Q in chunks of KC vec4 of head dim, K whole);
//   in the output O (BQ x D): vec4 chunks tc + TC i (i < CPT) of its rows, an RM x CPT register matmul
//     O += P V with P passed through workgroup memory.
// The TC invocations of a row group share the row's running max: the tile's row max is taken across them
// (rows_max: subgroup shuffles where the lanes of a row group are one subgroup's, else workgroup memory),
// and each keeps a partial row sum l, added up once at the end (the rescale factor is the same for all).
// Loops have constant bounds; keys past m (and, with CAUSAL, past the query) are masked to p = 0. With
// PREFETCH the next K/V tile's global loads are issued into registers before this tile's math and stored
// after its last barrier. Q is staged once when it fits (Q_RESIDENT: KC == D4S), else chunk by chunk per tile.
const NT = TR * TC;
const RM = BQ / TR;
const SK = BK / TC;
const CPT = D4S / TC;
const Q_RESIDENT = KC == D4S;
const KV_REGS = (BK * D4S + NT - 1u) / NT;
const S_CHUNKS = select(KC, D4, Q_RESIDENT);   // chunks per S step: a resident Q's padding is skipped
// Row strides padded by one so the rows an S step reads at once (8 keys, 4 queries per 32 lanes) fall in
// different banks: an unpadded 16- or 32-word stride would put them all in one.
const QS = KC + 1u;
const KS = D4S + 1u;
const PS = BK + 1u;

var<workgroup> fq: array<vec4<f32>, BQ * QS>;   // Q rows (scaled), KC chunks each
var<workgroup> fk: array<vec4<f32>, BK * KS>;   // K tile, zero past m and D4
var<workgroup> fv: array<vec4<f32>, BK * KS>;   // V tile
var<workgroup> fp: array<f32, BQ * PS>;         // P tile, [query][key]

struct KvRegs { k: array<vec4<f32>, KV_REGS>, v: array<vec4<f32>, KV_REGS> }

// Global loads of key rows [kt, kt + BK): invocation lid holds tile elements lid + NT i (row e / D4S, chunk e % D4S).
fn load_kv(b: u32, h: u32, kt: u32, lid: u32) -> KvRegs {
  var r: KvRegs;
  for (var i = 0u; i < KV_REGS; i++) {
    let e = lid + NT * i;
    let row = e / D4S;
    let c = e % D4S;
    r.k[i] = vec4<f32>(0.0);
    r.v[i] = vec4<f32>(0.0);
    if (e < BK * D4S && c < D4 && kt + row < p.m) {
      let base = k_base(b, h, kt + row);
      r.k[i] = k_chunk(base, c);
      r.v[i] = v_chunk(base, c);
    }
  }
  return r;
}

fn store_kv(r: KvRegs, lid: u32) {
  for (var i = 0u; i < KV_REGS; i++) {
    let e = lid + NT * i;
    if (e < BK * D4S) {
      let at = (e / D4S) * KS + e % D4S;
      fk[at] = r.k[i];
      fv[at] = r.v[i];
    }
  }
}

// Chunks [c0, c0 + KC) of query rows [row0, row0 + BQ), times the softmax scale; zero past n and D4.
fn stage_q_rows(b: u32, h: u32, row0: u32, c0: u32, lid: u32) {
  for (var e = lid; e < BQ * KC; e += NT) {
    let r = e / KC;
    let c = c0 + e % KC;
    var x = vec4<f32>(0.0);
    if (row0 + r < p.n && c < D4) { x = q_chunk(q_base(b, h, row0 + r), c) * p.scale; }
    fq[r * QS + e % KC] = x;
  }
}

fn fwd_tiled(wid: vec3<u32>, lid: u32) {
  let b = wid.y / p.heads;
  let h = wid.y % p.heads;
  let row0 = wid.x * BQ;
  let tr = lid / TC;
  let tc = lid % TC;
  var o: array<vec4<f32>, RM * CPT>;   // o[r * CPT + i]: row tr + TR r, chunk tc + TC i
  var m_run: array<f32, RM>;
  var l_part: array<f32, RM>;
  for (var r = 0u; r < RM; r++) { m_run[r] = NEG_BIG; }
  // With CAUSAL no query of this block sees a key past its last row.
  var kend = p.m;
  if (CAUSAL) { kend = min(p.m, row0 + BQ); }
  if (Q_RESIDENT) { stage_q_rows(b, h, row0, 0u, lid); }
  var kv: KvRegs;
  if (PREFETCH) { kv = load_kv(b, h, 0u, lid); }
  for (var kt = 0u; kt < kend; kt += BK) {
    if (!PREFETCH) { kv = load_kv(b, h, kt, lid); }
    store_kv(kv, lid);
    workgroupBarrier();
    if (PREFETCH && kt + BK < kend) { kv = load_kv(b, h, kt + BK, lid); }
    // S tile: s[r * SK + jj] = scale q_(tr + TR r) . k_(kt + tc + TC jj)
    var s = array<f32, RM * SK>();   // explicitly zeroed: lavapipe kept the last tile's values in a bare `var s;`
    for (var c0 = 0u; c0 < D4; c0 += KC) {
      if (!Q_RESIDENT) { stage_q_rows(b, h, row0, c0, lid); workgroupBarrier(); }
      for (var c = 0u; c < S_CHUNKS; c++) {
        var qv: array<vec4<f32>, RM>;
        for (var r = 0u; r < RM; r++) { qv[r] = fq[(tr + TR * r) * QS + c]; }
        for (var jj = 0u; jj < SK; jj++) {
          let kc = fk[(tc + TC * jj) * KS + c0 + c];
          for (var r = 0u; r < RM; r++) { s[r * SK + jj] += dot(qv[r], kc); }
        }
      }
      if (!Q_RESIDENT) { workgroupBarrier(); }
    }
    // Mask, then each row's max over the tile: this invocation's keys, then across the row group.
    var mx: array<f32, RM>;
    for (var r = 0u; r < RM; r++) {
      let row = row0 + tr + TR * r;
      var m = NEG_BIG;
      for (var jj = 0u; jj < SK; jj++) {
        let key = kt + tc + TC * jj;
        let seen = key < p.m && (!CAUSAL || key <= row);
        s[r * SK + jj] = select(NEG_BIG, s[r * SK + jj], seen);
        m = max(m, s[r * SK + jj]);
      }
      mx[r] = m;
    }
    mx = rows_max(mx, tr, tc);
    // Online softmax: rescale what was summed under the old max, p = exp(s - m_new) (0 where masked).
    for (var r = 0u; r < RM; r++) {
      let m_new = max(m_run[r], mx[r]);
      let corr = exp(m_run[r] - m_new);
      var sum = 0.0;
      for (var jj = 0u; jj < SK; jj++) {
        let e = s[r * SK + jj];
        let pj = select(0.0, exp(e - m_new), e != NEG_BIG);
        sum += pj;
        fp[(tr + TR * r) * PS + tc + TC * jj] = pj;
      }
      l_part[r] = l_part[r] * corr + sum;
      m_run[r] = m_new;
      for (var i = 0u; i < CPT; i++) { o[r * CPT + i] *= corr; }
    }
    workgroupBarrier();
    // O += P V
    for (var j = 0u; j < BK; j++) {
      var pr: array<f32, RM>;
      for (var r = 0u; r < RM; r++) { pr[r] = fp[(tr + TR * r) * PS + j]; }
      for (var i = 0u; i < CPT; i++) {
        let vc = fv[j * KS + tc + TC * i];
        for (var r = 0u; r < RM; r++) { o[r * CPT + i] = fma(vec4<f32>(pr[r]), vc, o[r * CPT + i]); }
      }
    }
    workgroupBarrier();
  }
  let l = rows_sum(l_part, tr, tc);
  for (var r = 0u; r < RM; r++) {
    let row = row0 + tr + TR * r;
    if (row < p.n) {
      let inv = 1.0 / l[r];
      let ob = q_base(b, h, row);
      for (var i = 0u; i < CPT; i++) {
        let c = tc + TC * i;
        for (var x = 0u; x < 4u; x++) {
          if (4u * c + x < D) { out[ob + 4u * c + x] = T(o[r * CPT + i][x] * inv); }
        }
      }
      if (tc == 0u) { lse[(b * p.heads + h) * p.n + row] = m_run[r] + log(l[r]); }
    }
  }
}

//#entry attn_fwd_tiled
@compute @workgroup_size(NT)
fn attn_fwd_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) { fwd_tiled(wid, lid); }

// Row reductions across the TC invocations of a row group through workgroup memory.
var<workgroup> fred: array<f32, BQ * TC>;
fn rows_max(x: array<f32, RM>, tr: u32, tc: u32) -> array<f32, RM> {
  for (var r = 0u; r < RM; r++) { fred[(tr + TR * r) * TC + tc] = x[r]; }
  workgroupBarrier();
  var y: array<f32, RM>;
  for (var r = 0u; r < RM; r++) {
    var m = NEG_BIG;
    for (var t = 0u; t < TC; t++) { m = max(m, fred[(tr + TR * r) * TC + t]); }
    y[r] = m;
  }
  workgroupBarrier();
  return y;
}
fn rows_sum(x: array<f32, RM>, tr: u32, tc: u32) -> array<f32, RM> {
  for (var r = 0u; r < RM; r++) { fred[(tr + TR * r) * TC + tc] = x[r]; }
  workgroupBarrier();
  var y: array<f32, RM>;
  for (var r = 0u; r < RM; r++) {
    var sum = 0.0;
    for (var t = 0u; t < TC; t++) { sum += fred[(tr + TR * r) * TC + t]; }
    y[r] = sum;
  }
  workgroupBarrier();
  return y;
}

//#entry attn_fwd_tiled_sg
enable subgroups;
// Row reductions across the TC invocations of a row group by subgroup shuffles: the group is TC
// consecutive invocations (TC a power of two, at most the adapter's smallest subgroup), so lanes
// lid ^ off for off < TC are in it. Every lane ends with the whole group's result.
@compute @workgroup_size(NT)
fn attn_fwd_tiled_sg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) { fwd_tiled(wid, lid); }

fn rows_max(x: array<f32, RM>, tr: u32, tc: u32) -> array<f32, RM> {
  var y = x;
  for (var r = 0u; r < RM; r++) {
    for (var off = 1u; off < TC; off <<= 1u) { y[r] = max(y[r], subgroupShuffleXor(y[r], off)); }
  }
  return y;
}
fn rows_sum(x: array<f32, RM>, tr: u32, tc: u32) -> array<f32, RM> {
  var y = x;
  for (var r = 0u; r < RM; r++) {
    for (var off = 1u; off < TC; off <<= 1u) { y[r] += subgroupShuffleXor(y[r], off); }
  }
  return y;
}

//#entry attn_bwd_delta
// Delta_i = sum_d dO_id * O_id, one invocation per query row.
@compute @workgroup_size(BR)
fn attn_bwd_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;
  if (row >= p.n) { return; }
  let base = q_base(t.b, t.h, row);
  var acc = 0.0;
  for (var d = 0u; d < D; d++) { acc += f32(dy[base + d]) * f32(out[base + d]); }
  delta[(t.b * p.heads + t.h) * p.n + row] = acc;
}

//#entry attn_bwd_dq
@compute @workgroup_size(BR)
fn attn_bwd_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;
  let live = row < p.n;
  let qb = q_base(t.b, t.h, min(row, p.n - 1u));
  var qr: array<vec4<f32>, D4>;
  var dor: array<vec4<f32>, D4>;
  var acc: array<vec4<f32>, D4>;
  for (var c = 0u; c < D4; c++) { qr[c] = q_chunk(qb, c) * p.scale; dor[c] = do_chunk(qb, c); acc[c] = vec4<f32>(0.0); }
  let r = (t.b * p.heads + t.h) * p.n + min(row, p.n - 1u);
  let lse_i = lse[r];
  let delta_i = delta[r];
  for (var kt = 0u; kt < p.m; kt += BC) {
    stage_kv(t.b, t.h, kt, lid);
    workgroupBarrier();
    let cols = visible_keys(row, kt);
    if (live && cols > 0u) {
      // dS_ij = P_ij (dO_i . v_j - Delta_i), P_ij = exp(S_ij - LSE_i), added into dQ_i as it comes (no array
      // of scores per invocation: a CPU adapter would keep it in memory).
      for (var j = 0u; j < cols; j++) {
        var sa = vec4<f32>(0.0);
        var da = vec4<f32>(0.0);
        for (var c = 0u; c < D4; c++) {
          sa = fma(qr[c], tile_a[j * D4 + c], sa);
          da = fma(dor[c], tile_b[j * D4 + c], da);
        }
        let ds = exp(hsum(sa) - lse_i) * (hsum(da) - delta_i);
        for (var c = 0u; c < D4; c++) { acc[c] = fma(vec4<f32>(ds), tile_a[j * D4 + c], acc[c]); }
      }
    }
    workgroupBarrier();
  }
  if (live) {
    for (var d = 0u; d < D; d++) { dq[qb + d] = T(acc[d / 4u][d % 4u] * p.scale); }
  }
}

//#entry attn_bwd_dkv attn_bwd_dkv_split attn_bwd_fused attn_bwd_fused_split
// Stages query rows [r0, r0+BC) of q and dO (and their LSE, Delta) for the dK/dV kernel.
fn stage_q(b: u32, h: u32, r0: u32, lid: u32) {
  for (var e = lid; e < BC * D4; e += BR) {
    let r = e / D4;
    let c = e % D4;
    var qv = vec4<f32>(0.0);
    var dov = vec4<f32>(0.0);
    if (r0 + r < p.n) {
      let base = q_base(b, h, r0 + r);
      qv = q_chunk(base, c);
      dov = do_chunk(base, c);
    }
    tile_a[e] = qv;
    tile_b[e] = dov;
  }
  for (var r = lid; r < BC; r += BR) {
    var ld = vec2<f32>(0.0);
    if (r0 + r < p.n) {
      let idx = (b * p.heads + h) * p.n + r0 + r;
      ld = vec2<f32>(lse[idx], delta[idx]);
    }
    tile_r[r] = ld;
  }
}

// dK/dV accumulators of one key row over query rows [q_begin, q_end) (before the final scale of dK).
struct DkvSums {
  dk: array<vec4<f32>, D4>,
  dv: array<vec4<f32>, D4>,
}

fn dkv_sums(t: Task, row: u32, live: bool, lid: u32, q_begin: u32, q_end: u32) -> DkvSums {
  var kr: array<vec4<f32>, D4>;
  var vr: array<vec4<f32>, D4>;
  var acc: DkvSums;
  let kb = k_base(t.b, t.h, min(row, p.m - 1u));
  for (var c = 0u; c < D4; c++) {
    kr[c] = k_chunk(kb, c) * p.scale;
    vr[c] = v_chunk(kb, c);
    acc.dk[c] = vec4<f32>(0.0);
    acc.dv[c] = vec4<f32>(0.0);
  }
  // One sweep per staged query row: its dS feeds dK at once (and, fused, dQ through keep_ds), so no score
  // is kept in a per-invocation array (one a CPU adapter would hold in memory, indexed lane by lane).
  for (var qt = q_begin; qt < q_end; qt += BC) {
    stage_q(t.b, t.h, qt, lid);
    workgroupBarrier();
    let rows = min(BC, q_end - qt);
    // Causal: query qt + i sees key `row` only when qt + i >= row.
    var first = 0u;
    if (CAUSAL && row > qt) { first = row - qt; }
    for (var i = 0u; i < rows; i++) {
      var ds = 0.0;
      if (live && i >= first) {
        var sa = vec4<f32>(0.0);
        var da = vec4<f32>(0.0);
        for (var c = 0u; c < D4; c++) {
          sa = fma(kr[c], tile_a[i * D4 + c], sa);
          da = fma(vr[c], tile_b[i * D4 + c], da);
        }
        let pw = exp(hsum(sa) - tile_r[i].x);
        ds = pw * (hsum(da) - tile_r[i].y);
        for (var c = 0u; c < D4; c++) {
          acc.dv[c] = fma(vec4<f32>(pw), tile_b[i * D4 + c], acc.dv[c]);
          acc.dk[c] = fma(vec4<f32>(ds), tile_a[i * D4 + c], acc.dk[c]);
        }
      }
      keep_ds(i, lid, ds);
    }
    emit_dq(t, live, lid, qt, q_end, kr);
    workgroupBarrier();
  }
  return acc;
}

//#entry attn_bwd_dkv attn_bwd_dkv_split
// The unfused backward computes dQ in attn_bwd_dq.
fn keep_ds(i: u32, lid: u32, ds: f32) {}
fn emit_dq(t: Task, live: bool, lid: u32, qt: u32, q_end: u32, kr: array<vec4<f32>, D4>) {}

//#entry attn_bwd_fused attn_bwd_fused_split
// Fused backward: the dK/dV kernel also yields dQ, so S and dP are computed once per (query, key). Its
// workgroup owns the BR keys of key block wid.x; for each staged tile of BC query rows it has dS (one key
// row per invocation) and writes this key block's share of dQ,
//   dQ_part[block][i] = sum over the block's keys j of dS_ij (scale k_j),
// to f32 scratch; attn_bwd_dq_reduce adds the blocks' parts in block order (WebGPU has no float atomics,
// and a fixed order keeps results bit-exact run to run). dS goes through workgroup memory, the scaled key
// rows (kept in registers) KQ vec4 chunks at a time.
// dS is written by key lane and read by query row: a row stride of BR + 1 keeps both conflict-free.
const DSS = BR + 1u;
var<workgroup> tile_ds: array<f32, BC * DSS>;         // [query row][key lane]
var<workgroup> tile_kc: array<vec4<f32>, BR * KQ>;    // [key lane][chunk]

// b*head = bh0 + wid.y (the dispatch covers a slice of b*heads so the scratch stays bounded).
fn task_fused(wid: vec3<u32>, nwg: vec3<u32>) -> Task {
  let bh = p.bh0 + wid.y;
  return Task(bh / p.heads, bh % p.heads, wid.x * BR, wid.x * nwg.y + wid.y);
}

// dS of staged query row i and this invocation's key (0 where the key is past m or masked). Rows past the
// staged ones keep an earlier tile's values: their dQ sums are computed and never written.
fn keep_ds(i: u32, lid: u32, ds: f32) { tile_ds[i * DSS + lid] = ds; }

fn emit_dq(t: Task, live: bool, lid: u32, qt: u32, q_end: u32, kr: array<vec4<f32>, D4>) {
  for (var c0 = 0u; c0 < D4; c0 += KQ) {
    for (var c = 0u; c < KQ; c++) { tile_kc[lid * KQ + c] = select(vec4<f32>(0.0), kr[min(c0 + c, D4 - 1u)], live && c0 + c < D4); }
    workgroupBarrier();
    // Consecutive invocations take consecutive query rows of one chunk.
    for (var e = lid; e < BC * KQ; e += BR) {
      let i = e % BC;
      let c = c0 + e / BC;
      var acc = vec4<f32>(0.0);
      for (var j = 0u; j < BR; j++) { acc = fma(vec4<f32>(tile_ds[i * DSS + j]), tile_kc[j * KQ + e / BC], acc); }
      if (qt + i < q_end && c < D4) {
        let base = (t.part * p.n + qt + i) * D + 4u * c;
        for (var x = 0u; x < 4u; x++) { if (D_EXACT || 4u * c + x < D) { dq_part[base + x] = acc[x]; } }
      }
    }
    workgroupBarrier();
  }
}

//#entry attn_bwd_dkv attn_bwd_fused
// One invocation per key row over all query rows; writes dK, dV in T (the fused kernel also its key block's dQ parts).
fn dkv_whole(t: Task, lid: u32) {
  let row = t.row0 + lid;
  let live = row < p.m;
  let acc = dkv_sums(t, row, live, lid, 0u, p.n);
  if (!live) { return; }
  let kb = k_base(t.b, t.h, row);
  for (var d = 0u; d < D; d++) {
    dk[kb + d] = T(acc.dk[d / 4u][d % 4u] * p.scale);
    dv[kb + d] = T(acc.dv[d / 4u][d % 4u]);
  }
}

//#entry attn_bwd_dkv_split attn_bwd_fused_split
// Few keys: split z of the query rows writes f32 partials, summed by attn_bwd_dkv_reduce (the fused kernel
// also the dQ parts of its own query rows).
fn dkv_split(t: Task, wid: vec3<u32>, nwg: vec3<u32>, lid: u32) {
  let row = t.row0 + lid;
  let live = row < p.m;
  let q_begin = wid.z * p.q_split;
  let acc = dkv_sums(t, row, live, lid, q_begin, min(p.n, q_begin + p.q_split));
  if (!live) { return; }
  let base = ((wid.z * nwg.y + wid.y) * p.m + row) * D;
  for (var d = 0u; d < D; d++) {
    dk_part[base + d] = acc.dk[d / 4u][d % 4u] * p.scale;
    dv_part[base + d] = acc.dv[d / 4u][d % 4u];
  }
}

//#entry attn_bwd_dkv
@compute @workgroup_size(BR)
fn attn_bwd_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) { dkv_whole(task(wid), lid); }

//#entry attn_bwd_dkv_split
@compute @workgroup_size(BR)
fn attn_bwd_dkv_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  dkv_split(task(wid), wid, nwg, lid);
}

//#entry attn_bwd_fused
@compute @workgroup_size(BR)
fn attn_bwd_fused(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  dkv_whole(task_fused(wid, nwg), lid);
}

//#entry attn_bwd_fused_split
@compute @workgroup_size(BR)
fn attn_bwd_fused_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  dkv_split(task_fused(wid, nwg), wid, nwg, lid);
}

//#entry attn_bwd_dq_reduce
// dQ = sum over key blocks of the fused kernel's parts, in block order: one invocation per (query, d) of
// b*head bh0 + gid.y.
@compute @workgroup_size(BR)
fn attn_bwd_dq_reduce(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x;
  if (i >= p.n * D) { return; }
  let bh = p.bh0 + gid.y;
  let blocks = (p.m + BR - 1u) / BR;
  var acc = 0.0;
  for (var kb = 0u; kb < blocks; kb++) { acc += dq_part[(kb * nwg.y + gid.y) * p.n * D + i]; }
  dq[q_base(bh / p.heads, bh % p.heads, i / D) + i % D] = T(acc);
}

//#entry attn_bwd_dkv_reduce
// Sums the split partials: one invocation per (b, h, key, d) of b*head bh0 + gid.y; splits = num query splits.
@compute @workgroup_size(BR)
fn attn_bwd_dkv_reduce(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let per_split = nwg.y * p.m * D;   // nwg.y = B * heads
  let i = gid.x;
  if (i >= p.m * D) { return; }
  let bh = p.bh0 + gid.y;
  let row = i / D;
  let d = i % D;
  var sk = 0.0;
  var sv = 0.0;
  let splits = (p.n + p.q_split - 1u) / p.q_split;
  for (var sp = 0u; sp < splits; sp++) {
    let idx = sp * per_split + gid.y * p.m * D + i;
    sk += dk_part[idx];
    sv += dv_part[idx];
  }
  let kb = k_base(bh / p.heads, bh % p.heads, row) + d;
  dk[kb] = T(sk);
  dv[kb] = T(sv);
}
