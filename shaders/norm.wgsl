// GroupNorm and LayerNorm, forward and backward, as one "segment norm".
//
// Both normalise contiguous segments of L = CPG * INNER elements: GroupNorm on NCHW has segment
// (n, g) = channels g*CPG .. g*CPG+CPG-1 of sample n, each INNER = H*W long; LayerNorm over the last
// dim D is GROUPS = 1, CPG = D, INNER = 1. Element j of segment s belongs to affine channel
//   c = (s % GROUPS) * CPG + j / INNER.
// Forward: mean = sum(x)/L, var = sum((x-mean)^2)/L (two passes, f32), rstd = 1/sqrt(var+eps),
//   y = (x-mean)*rstd*gamma[c] + beta[c]; mean and rstd are saved (f32) for the backward.
// Backward with xhat = (x-mean)*rstd and g = dy*gamma[c]:
//   dx = rstd * (g - mean_seg(g) - xhat * mean_seg(g*xhat));
//   dgamma[c] = sum over all (n, spatial) of dy*xhat;  dbeta[c] = sum of dy.
// Specialised by T (storage of x, y, dy, dx, gamma, beta) and WG. Parameter gradients are f32.
// SILU (GroupNorm + SiLU, one dispatch each way): the forward stores silu(n) for n = the norm's output as a T
// store keeps it; the backward takes dy of silu's output and first forms what the SiLU backward would have
// stored, dn = T(dy * silu'(n)), n recomputed from x, mean, rstd, gamma and beta by the forward's expression. The
// values are those of the two unfused kernels (same expressions, same roundings), so the results are their bits.
// ACCUMULATE (input gradient): dx += the result, rounded to T first as its store would be, so it is the bits of
// the kernel and then an add (src/nn/ops.ts Tape.accGemm), one dispatch fewer.

// Lanes per segment. A workgroup of WG invocations works on WG / LANES segments (or, in the param-grad
// kernel, channels) at once, LANES invocations each; LANES = p.lanes is a power of two from 1 to WG, picked
// per call from the segment length by src/ops/norm.ts (normLanes). Software adapters (lavapipe, SwiftShader)
// pay dearly for every workgroup barrier and idle lane, so short segments get few lanes: with LANES = 1 an
// invocation owns a whole segment and no barrier runs at all. LANES = WG is the classic one workgroup per
// segment; the sums then add up in the same order as before lanes existed (bit-identical results).
// Invocation lid of workgroup w works on slot w * (WG / LANES) + lid / LANES as lane lid % LANES.

// Uniforms and bindings are declared per entry point in src/ops/norm.ts (src/gpu/kernel.ts generates them):
//   seg_len     L
//   cpg         channels per group
//   inner       elements per channel inside a segment (H*W, or 1)
//   groups      segments per sample
//   seg_offset  index of this dispatch's first segment (tensors bigger than one binding)
//   n_segs      segments in this dispatch (param-grad kernel: segments to walk)
//   lanes       LANES above
//   eps         forward only
//   accumulate  param-grad kernel: add into dgamma/dbeta instead of overwriting
// mean and rstd are written (f32) by the forward and read by both backward kernels.

var<workgroup> red_a: array<f32, WG>;
var<workgroup> red_b: array<f32, WG>;

// Tree sums of a and b over the LANES lanes of each slot; every lane of the slot gets its slot's totals.
// p.lanes is uniform, so the barriers stay in uniform control flow; with one lane there is nothing to add.
fn reduce2(lid: u32, a: f32, b: f32) -> vec2<f32> {
  if (p.lanes == 1u) { return vec2<f32>(a, b); }
  let lane = lid % p.lanes;
  red_a[lid] = a;
  red_b[lid] = b;
  workgroupBarrier();
  for (var stride = p.lanes / 2u; stride > 0u; stride = stride / 2u) {
    if (lane < stride) {
      red_a[lid] += red_a[lid + stride];
      red_b[lid] += red_b[lid + stride];
    }
    workgroupBarrier();
  }
  let r = vec2<f32>(red_a[lid - lane], red_b[lid - lane]);
  workgroupBarrier();
  return r;
}

// The slot (segment of the dispatch, or channel) this invocation works on.
fn slot_of(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
  return (wid.x + wid.y * nwg.x) * (WG / p.lanes) + lid / p.lanes;
}

// Splits elements i = lane, lane + lanes, lane + 2 lanes, ... of a walk into q = i / inner (plus `first`) and
// k = i % inner without dividing per element (integer division has no SIMD instruction on CPUs; the divisor is
// a uniform): in a segment q is the affine channel (first = its group's first channel), in the param-grad walk
// the count of the channel's segments passed.
struct ChannelWalk {
  q: u32,
  k: u32,
  dq: u32,
  dk: u32,
}

fn walk_start(first: u32, lane: u32) -> ChannelWalk {
  return ChannelWalk(first + lane / p.inner, lane % p.inner, p.lanes / p.inner, p.lanes % p.inner);
}

fn walk_next(w: ptr<function, ChannelWalk>) {
  (*w).q += (*w).dq;
  (*w).k += (*w).dk;
  if ((*w).k >= p.inner) {
    (*w).k -= p.inner;
    (*w).q += 1u;
  }
}

// v as a T store keeps it, as an f32 (round_f16: f32(T(v)) may be folded into v by a compiler).
fn stored(v: f32) -> f32 {
  if (T_IS_F16) { return round_f16(v); }
  return v;
}

// SiLU and its derivative, as shaders/elementwise.wgsl computes them (act, act_grad with ACT = 0).
fn silu(v: f32) -> f32 {
  return v * (1.0 / (1.0 + exp(-v)));
}

fn silu_grad(v: f32) -> f32 {
  let s = 1.0 / (1.0 + exp(-v));
  return s + v * s * (1.0 - s);
}

// The norm output's gradient dn = T(dy * silu'(n)) for element value xv of affine channel c.
fn silu_dn(c: u32, xv: f32, mu: f32, r: f32, dyv: f32) -> f32 {
  let n = stored((xv - mu) * r * f32(gamma[c]) + f32(beta[c]));
  return stored(dyv * silu_grad(n));
}

//#entry norm_fwd
// Invocations past the last segment stay for the barriers with an empty loop (len 0) and write nothing.
@compute @workgroup_size(WG)
fn norm_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let local_seg = slot_of(wid, nwg, lid);
  let in_range = local_seg < p.n_segs;
  let len = select(0u, p.seg_len, in_range);
  let lane = lid % p.lanes;
  let seg = p.seg_offset + local_seg;
  let base = local_seg * p.seg_len;
  var s = 0.0;
  for (var j = lane; j < len; j += p.lanes) { s += f32(x[base + j]); }
  let mu = reduce2(lid, s, 0.0).x / f32(p.seg_len);
  var ss = 0.0;
  for (var j = lane; j < len; j += p.lanes) {
    let d = f32(x[base + j]) - mu;
    ss += d * d;
  }
  let r = inverseSqrt(reduce2(lid, ss, 0.0).x / f32(p.seg_len) + p.eps);
  var w = walk_start((seg % p.groups) * p.cpg, lane);
  for (var j = lane; j < len; j += p.lanes) {
    let v = (f32(x[base + j]) - mu) * r * f32(gamma[w.q]) + f32(beta[w.q]);
    if (SILU) {
      y[base + j] = T(silu(stored(v)));
    } else {
      y[base + j] = T(v);
    }
    walk_next(&w);
  }
  if (in_range && lane == 0u) {
    mean[seg] = mu;
    rstd[seg] = r;
  }
}

//#entry norm_bwd_input norm_bwd_params
// The norm output's gradient at element i of affine channel c: dy itself, or through SiLU (see silu_dn).
fn dn_at(i: u32, c: u32, mu: f32, r: f32) -> f32 {
  if (SILU) { return silu_dn(c, f32(x[i]), mu, r, f32(dy[i])); }
  return f32(dy[i]);
}

//#entry norm_bwd_input
@compute @workgroup_size(WG)
fn norm_bwd_input(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let local_seg = slot_of(wid, nwg, lid);
  let in_range = local_seg < p.n_segs;
  let len = select(0u, p.seg_len, in_range);
  let lane = lid % p.lanes;
  let seg = p.seg_offset + select(0u, local_seg, in_range); // inactive lanes read a valid mean/rstd they do not use
  let base = local_seg * p.seg_len;
  let mu = mean[seg];
  let r = rstd[seg];
  var sg = 0.0;
  var sgx = 0.0;
  var w = walk_start((seg % p.groups) * p.cpg, lane);
  for (var j = lane; j < len; j += p.lanes) {
    let g = dn_at(base + j, w.q, mu, r) * f32(gamma[w.q]);
    walk_next(&w);
    sg += g;
    sgx += g * (f32(x[base + j]) - mu) * r;
  }
  let sums = reduce2(lid, sg, sgx) / f32(p.seg_len);
  w = walk_start((seg % p.groups) * p.cpg, lane);
  for (var j = lane; j < len; j += p.lanes) {
    let g = dn_at(base + j, w.q, mu, r) * f32(gamma[w.q]);
    walk_next(&w);
    let xhat = (f32(x[base + j]) - mu) * r;
    let v = r * (g - sums.x - xhat * sums.y);
    if (ACCUMULATE) {
      dx[base + j] = T(f32(dx[base + j]) + stored(v));
    } else {
      dx[base + j] = T(v);
    }
  }
}

//#entry norm_bwd_params
// Slot = affine channel c: its lanes walk every element of channel c in the segments of this dispatch.
@compute @workgroup_size(WG)
fn norm_bwd_params(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let c = slot_of(wid, nwg, lid);
  let n_channels = p.groups * p.cpg;
  let lane = lid % p.lanes;
  let g = c / p.cpg;
  let within = (c % p.cpg) * p.inner;       // offset of channel c inside its segment
  // Segments of this dispatch that belong to group g: local segment indices ls with (seg_offset+ls) % groups == g.
  let first = (g + p.groups - (p.seg_offset % p.groups)) % p.groups;
  let n_mine = select(0u, (p.n_segs - first + p.groups - 1u) / p.groups, first < p.n_segs);
  let items = select(0u, n_mine * p.inner, c < n_channels);
  var sdg = 0.0;
  var sdb = 0.0;
  var w = walk_start(0u, lane);
  for (var i = lane; i < items; i += p.lanes) {
    let ls = first + w.q * p.groups;
    let seg = p.seg_offset + ls;
    let idx = ls * p.seg_len + within + w.k;
    walk_next(&w);
    let d = dn_at(idx, c, mean[seg], rstd[seg]);
    sdg += d * (f32(x[idx]) - mean[seg]) * rstd[seg];
    sdb += d;
  }
  let sums = reduce2(lid, sdg, sdb);
  if (c < n_channels && lane == 0u) {
    if (p.accumulate != 0u) {
      dgamma[c] += sums.x;
      dbeta[c] += sums.y;
    } else {
      dgamma[c] = sums.x;
      dbeta[c] = sums.y;
    }
  }
}
