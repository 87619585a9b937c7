// Flash attention (forward and backward) and the delta term of its backward.
//
// Per (batch b, head h): S = scale * Q K^T [N, M], P = softmax_rows(S), O = P V.
// Forward: one invocation per query row; key/value tiles of BC rows are staged in workgroup memory
// and the softmax is computed online: per tile, s_j = scale q.k_j, m' = max(m, max_j s_j),
// l = l e^(m-m') + sum_j e^(s_j-m'), o = o e^(m-m') + sum_j e^(s_j-m') v_j. At the end O = o / l and
// LSE = m + log l is saved, so the backward can rebuild P = exp(S - LSE) tile by tile. The N x M
// matrices S and P never exist in memory.
// Backward (with dO): Delta_i = sum_d dO_id O_id; dS_ij = P_ij (dO_i . v_j - Delta_i);
//   dQ_i = scale sum_j dS_ij k_j      (attn_bwd_dq: one invocation per query row, loops over key tiles)
//   dK_j = scale sum_i dS_ij q_i,  dV_j = sum_i P_ij dO_i
//                                     (attn_bwd_dkv: one invocation per key row, loops over query tiles)
// so no atomics are needed. Specialised by T (storage), D (head dim), BR (rows per workgroup =
// invocations), BC (tile rows staged in workgroup memory, as f32) and CAUSAL (query i attends to keys
// j <= i only; self-attention).
//
// Layouts are given by strides: element (b, h, row, d) of a tensor lives at
// b*s_b + h*s_h + row*s_row + d, which covers [B,H,N,D] and [B,N,H,D] alike.

struct Params {
  heads: u32,
  n: u32,            // query rows
  m: u32,            // key rows
  scale: f32,
  q_sb: u32, q_sh: u32, q_sn: u32,     // strides of q, out, dout, dq
  k_sb: u32, k_sh: u32, k_sn: u32,     // strides of k, v, dk, dv
  q_split: u32,      // attn_bwd_dkv_split: query rows per split (a multiple of BC)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<T>;
@group(0) @binding(2) var<storage, read> k: array<T>;
@group(0) @binding(3) var<storage, read> v: array<T>;
@group(0) @binding(4) var<storage, read_write> out: array<T>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;
@group(0) @binding(6) var<storage, read> o_in: array<T>;
@group(0) @binding(7) var<storage, read> dout: array<T>;
@group(0) @binding(8) var<storage, read> lse_in: array<f32>;
@group(0) @binding(9) var<storage, read_write> delta: array<f32>;
@group(0) @binding(10) var<storage, read> delta_in: array<f32>;
@group(0) @binding(11) var<storage, read_write> dq: array<T>;
@group(0) @binding(12) var<storage, read_write> dk: array<T>;
@group(0) @binding(13) var<storage, read_write> dv: array<T>;
// Few keys (e.g. 77 for cross-attention): each split of the query rows writes f32 partial
// dK/dV, dense [split][b][h][key][d], and attn_bwd_dkv_reduce sums the splits.
@group(0) @binding(14) var<storage, read_write> dk_part: array<f32>;
@group(0) @binding(15) var<storage, read_write> dv_part: array<f32>;
@group(0) @binding(16) var<storage, read> dk_part_in: array<f32>;
@group(0) @binding(17) var<storage, read> dv_part_in: array<f32>;

var<workgroup> tile_a: array<f32, BC * D>;   // K (forward, dQ) or Q (dK/dV)
var<workgroup> tile_b: array<f32, BC * D>;   // V (forward, dQ) or dO (dK/dV)
var<workgroup> tile_r: array<f32, BC * 2u>;  // dK/dV: LSE and Delta of the staged query rows

fn q_base(b: u32, h: u32, row: u32) -> u32 { return b * p.q_sb + h * p.q_sh + row * p.q_sn; }
fn k_base(b: u32, h: u32, row: u32) -> u32 { return b * p.k_sb + h * p.k_sh + row * p.k_sn; }

// Workgroup id -> (b, h, first row): x walks row tiles, y walks b*heads.
struct Task { b: u32, h: u32, row0: u32 }
fn task(wid: vec3<u32>) -> Task {
  return Task(wid.y / p.heads, wid.y % p.heads, wid.x * BR);
}

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
  for (var e = lid; e < BC * D; e += BR) {
    let r = e / D;
    let d = e % D;
    var kv = 0.0;
    var vv = 0.0;
    if (r0 + r < p.m) {
      let i = k_base(b, h, r0 + r) + d;
      kv = f32(k[i]);
      vv = f32(v[i]);
    }
    tile_a[e] = kv;
    tile_b[e] = vv;
  }
}

@compute @workgroup_size(BR)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;
  let live = row < p.n;
  var qr: array<f32, D>;
  var o: array<f32, D>;
  if (live) {
    let qb = q_base(t.b, t.h, row);
    for (var d = 0u; d < D; d++) { qr[d] = f32(q[qb + d]) * p.scale; o[d] = 0.0; }
  }
  var m_run = -3.0e38;
  var l_run = 0.0;
  var s: array<f32, BC>;
  for (var kt = 0u; kt < p.m; kt += BC) {
    stage_kv(t.b, t.h, kt, lid);
    workgroupBarrier();
    if (live) {
      let cols = visible_keys(row, kt);
      var m_tile = m_run;
      for (var j = 0u; j < cols; j++) {
        var acc = 0.0;
        for (var d = 0u; d < D; d++) { acc += qr[d] * tile_a[j * D + d]; }
        s[j] = acc;
        m_tile = max(m_tile, acc);
      }
      let corr = exp(m_run - m_tile);
      l_run *= corr;
      for (var d = 0u; d < D; d++) { o[d] *= corr; }
      for (var j = 0u; j < cols; j++) {
        let pj = exp(s[j] - m_tile);
        l_run += pj;
        for (var d = 0u; d < D; d++) { o[d] += pj * tile_b[j * D + d]; }
      }
      m_run = m_tile;
    }
    workgroupBarrier();
  }
  if (live) {
    let ob = q_base(t.b, t.h, row);
    let inv = 1.0 / l_run;
    for (var d = 0u; d < D; d++) { out[ob + d] = T(o[d] * inv); }
    lse[(t.b * p.heads + t.h) * p.n + row] = m_run + log(l_run);
  }
}

// Delta_i = sum_d dO_id * O_id, one invocation per query row.
@compute @workgroup_size(BR)
fn attn_bwd_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;
  if (row >= p.n) { return; }
  let base = q_base(t.b, t.h, row);
  var acc = 0.0;
  for (var d = 0u; d < D; d++) { acc += f32(dout[base + d]) * f32(o_in[base + d]); }
  delta[(t.b * p.heads + t.h) * p.n + row] = acc;
}

@compute @workgroup_size(BR)
fn attn_bwd_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;
  let live = row < p.n;
  var qr: array<f32, D>;
  var dor: array<f32, D>;
  var acc: array<f32, D>;
  var lse_i = 0.0;
  var delta_i = 0.0;
  if (live) {
    let qb = q_base(t.b, t.h, row);
    for (var d = 0u; d < D; d++) { qr[d] = f32(q[qb + d]) * p.scale; dor[d] = f32(dout[qb + d]); acc[d] = 0.0; }
    let r = (t.b * p.heads + t.h) * p.n + row;
    lse_i = lse_in[r];
    delta_i = delta_in[r];
  }
  for (var kt = 0u; kt < p.m; kt += BC) {
    stage_kv(t.b, t.h, kt, lid);
    workgroupBarrier();
    if (live) {
      let cols = visible_keys(row, kt);
      for (var j = 0u; j < cols; j++) {
        var sj = 0.0;
        var dpj = 0.0;
        for (var d = 0u; d < D; d++) {
          sj += qr[d] * tile_a[j * D + d];
          dpj += dor[d] * tile_b[j * D + d];
        }
        let ds = exp(sj - lse_i) * (dpj - delta_i);
        for (var d = 0u; d < D; d++) { acc[d] += ds * tile_a[j * D + d]; }
      }
    }
    workgroupBarrier();
  }
  if (live) {
    let qb = q_base(t.b, t.h, row);
    for (var d = 0u; d < D; d++) { dq[qb + d] = T(acc[d] * p.scale); }
  }
}

// Stages query rows [r0, r0+BC) of q and dO (and their LSE, Delta) for the dK/dV kernel.
fn stage_q(b: u32, h: u32, r0: u32, lid: u32) {
  for (var e = lid; e < BC * D; e += BR) {
    let r = e / D;
    let d = e % D;
    var qv = 0.0;
    var dov = 0.0;
    if (r0 + r < p.n) {
      let i = q_base(b, h, r0 + r) + d;
      qv = f32(q[i]);
      dov = f32(dout[i]);
    }
    tile_a[e] = qv;
    tile_b[e] = dov;
  }
  for (var r = lid; r < BC; r += BR) {
    var l = 0.0;
    var dl = 0.0;
    if (r0 + r < p.n) {
      let idx = (b * p.heads + h) * p.n + r0 + r;
      l = lse_in[idx];
      dl = delta_in[idx];
    }
    tile_r[2u * r] = l;
    tile_r[2u * r + 1u] = dl;
  }
}

// dK/dV accumulators of one key row over query rows [q_begin, q_end) (before the final scale of dK).
struct DkvSums {
  dk: array<f32, D>,
  dv: array<f32, D>,
}

fn dkv_sums(t: Task, row: u32, live: bool, lid: u32, q_begin: u32, q_end: u32) -> DkvSums {
  var kr: array<f32, D>;
  var vr: array<f32, D>;
  var acc: DkvSums;
  if (live) {
    let kb = k_base(t.b, t.h, row);
    for (var d = 0u; d < D; d++) {
      kr[d] = f32(k[kb + d]) * p.scale;
      vr[d] = f32(v[kb + d]);
      acc.dk[d] = 0.0;
      acc.dv[d] = 0.0;
    }
  }
  for (var qt = q_begin; qt < q_end; qt += BC) {
    stage_q(t.b, t.h, qt, lid);
    workgroupBarrier();
    if (live) {
      let rows = min(BC, q_end - qt);
      // Causal: query i sees key `row` only when qt + i >= row.
      var first = 0u;
      if (CAUSAL && row > qt) { first = row - qt; }
      for (var i = first; i < rows; i++) {
        var si = 0.0;
        var dpi = 0.0;
        for (var d = 0u; d < D; d++) {
          si += kr[d] * tile_a[i * D + d];
          dpi += vr[d] * tile_b[i * D + d];
        }
        let pij = exp(si - tile_r[2u * i]);
        let ds = pij * (dpi - tile_r[2u * i + 1u]);
        for (var d = 0u; d < D; d++) {
          acc.dv[d] += pij * tile_b[i * D + d];
          acc.dk[d] += ds * tile_a[i * D + d];
        }
      }
    }
    workgroupBarrier();
  }
  return acc;
}

// One invocation per key row over all query rows; writes dK, dV in T.
@compute @workgroup_size(BR)
fn attn_bwd_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;
  let live = row < p.m;
  let acc = dkv_sums(t, row, live, lid, 0u, p.n);
  if (!live) { return; }
  let kb = k_base(t.b, t.h, row);
  for (var d = 0u; d < D; d++) {
    dk[kb + d] = T(acc.dk[d] * p.scale);
    dv[kb + d] = T(acc.dv[d]);
  }
}

// Few keys: split z of the query rows writes f32 partials, summed by attn_bwd_dkv_reduce.
@compute @workgroup_size(BR)
fn attn_bwd_dkv_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;
  let live = row < p.m;
  let q_begin = wid.z * p.q_split;
  let acc = dkv_sums(t, row, live, lid, q_begin, min(p.n, q_begin + p.q_split));
  if (!live) { return; }
  let base = ((wid.z * nwg.y + wid.y) * p.m + row) * D;
  for (var d = 0u; d < D; d++) {
    dk_part[base + d] = acc.dk[d] * p.scale;
    dv_part[base + d] = acc.dv[d];
  }
}

// Sums the split partials: one invocation per (b, h, key, d); splits = num query splits.
@compute @workgroup_size(BR)
fn attn_bwd_dkv_reduce(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let per_split = nwg.y * p.m * D;   // nwg.y = B * heads
  let i = gid.x;
  if (i >= p.m * D) { return; }
  let bh = gid.y;
  let row = i / D;
  let d = i % D;
  var sk = 0.0;
  var sv = 0.0;
  let splits = (p.n + p.q_split - 1u) / p.q_split;
  for (var sp = 0u; sp < splits; sp++) {
    let idx = sp * per_split + bh * p.m * D + i;
    sk += dk_part_in[idx];
    sv += dv_part_in[idx];
  }
  let kb = k_base(bh / p.heads, bh % p.heads, row) + d;
  dk[kb] = T(sk);
  dv[kb] = T(sv);
}
