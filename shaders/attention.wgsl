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
// invocations) and BC (tile rows staged in workgroup memory, as f32).
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
      let cols = min(BC, p.m - kt);
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
      let cols = min(BC, p.m - kt);
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

@compute @workgroup_size(BR)
fn attn_bwd_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let row = t.row0 + lid;  // key row
  let live = row < p.m;
  var kr: array<f32, D>;
  var vr: array<f32, D>;
  var dka: array<f32, D>;
  var dva: array<f32, D>;
  if (live) {
    let kb = k_base(t.b, t.h, row);
    for (var d = 0u; d < D; d++) {
      kr[d] = f32(k[kb + d]) * p.scale;
      vr[d] = f32(v[kb + d]);
      dka[d] = 0.0;
      dva[d] = 0.0;
    }
  }
  for (var qt = 0u; qt < p.n; qt += BC) {
    stage_q(t.b, t.h, qt, lid);
    workgroupBarrier();
    if (live) {
      let rows = min(BC, p.n - qt);
      for (var i = 0u; i < rows; i++) {
        var si = 0.0;
        var dpi = 0.0;
        for (var d = 0u; d < D; d++) {
          si += kr[d] * tile_a[i * D + d];
          dpi += vr[d] * tile_b[i * D + d];
        }
        let pij = exp(si - tile_r[2u * i]);
        let ds = pij * (dpi - tile_r[2u * i + 1u]);
        for (var d = 0u; d < D; d++) {
          dva[d] += pij * tile_b[i * D + d];
          dka[d] += ds * tile_a[i * D + d];
        }
      }
    }
    workgroupBarrier();
  }
  if (live) {
    let kb = k_base(t.b, t.h, row);
    for (var d = 0u; d < D; d++) {
      dk[kb + d] = T(dka[d] * p.scale);
      dv[kb + d] = T(dva[d]);
    }
  }
}
