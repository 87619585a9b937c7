// Element-wise ops. Specialised by: T (storage type of x/y/out), U (storage type of out_cast, for
// casts), WG (workgroup size), ACT (activation: 0 SiLU, 1 GELU (erf), 2 quick-GELU). Flat entries
// walk `n` elements; the host splits tensors larger than one storage binding into ranges.

struct Params {
  n: u32,
  alpha: f32,
  inner: u32,    // channel ops: elements per (n, c) plane; GEGLU: F; upsample: output width
  offset: u32,   // channel ops: flat index of this range's first element; upsample: output height
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> y: array<T>;
@group(0) @binding(3) var<storage, read_write> out: array<T>;
@group(0) @binding(4) var<storage, read_write> out_cast: array<U>;
@group(0) @binding(5) var<storage, read> t32: array<f32>;

// Flat element index over a 2D grid of workgroups (x up to 65535, then y).
fn flat(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return gid.x + gid.y * nwg.x * WG;
}

// ---- arithmetic ------------------------------------------------------------------------------

// out = x + alpha * y
@compute @workgroup_size(WG)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(f32(x[i]) + p.alpha * f32(y[i]));
}

// out = alpha * x * y   (mul's backward is mul again: with upstream gradient g, dx = g * y, dy = g * x)
@compute @workgroup_size(WG)
fn mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(p.alpha * f32(x[i]) * f32(y[i]));
}

// out = alpha * x
@compute @workgroup_size(WG)
fn scale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(p.alpha * f32(x[i]));
}

// out_cast = U(x): f16 <-> f32 conversion (f32 -> f16 rounds to nearest even, overflow gives inf).
@compute @workgroup_size(WG)
fn convert(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out_cast[i] = U(x[i]);
}

// x [N, C, H, W] + per-channel y [N, C]: out[i] = x[i] + y[(offset + i) / inner], inner = H*W.
@compute @workgroup_size(WG)
fn add_channel(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(f32(x[i]) + f32(y[(p.offset + i) / p.inner]));
}

// out[i] = x[i % inner]: x repeated (a bias broadcast to one row per sample).
@compute @workgroup_size(WG)
fn repeat(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = x[i % p.inner];
}

var<workgroup> red: array<f32, WG>;

// Backward of add_channel for the channel operand: out[nc] = sum over the plane nc of x (= the upstream gradient dy).
// One workgroup per plane.
@compute @workgroup_size(WG)
fn sum_planes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let plane = wid.x + wid.y * nwg.x;
  if (plane >= p.n) { return; }
  var s = 0.0;
  for (var j = lid; j < p.inner; j += WG) { s += f32(x[plane * p.inner + j]); }
  red[lid] = s;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
    if (lid < stride) { red[lid] += red[lid + stride]; }
    workgroupBarrier();
  }
  if (lid == 0u) { out[plane] = T(red[0]); }
}

// ---- activations ------------------------------------------------------------------------------

// erfc(a) for a >= 0 by the Chebyshev fit of Numerical Recipes (erfcc): relative error < 1.2e-7 for
// every a, so erf = 1 - erfc is within ~1.2e-7 absolute and the far tail keeps its relative precision.
fn erfc_pos(a: f32) -> f32 {
  let t = 1.0 / (1.0 + 0.5 * a);
  let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (0.27886807
    + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
  return t * exp(poly - a * a);
}

// Standard normal CDF Phi(v) = (1 + erf(v/sqrt2))/2, taken as erfc(|v|/sqrt2)/2 on the negative side so
// GELU's negative tail (Phi tiny) has no cancellation against 1.
fn normal_cdf(v: f32) -> f32 {
  let tail = 0.5 * erfc_pos(abs(v) * 0.70710678118654752);
  return select(1.0 - tail, tail, v < 0.0);
}

fn sigmoid(v: f32) -> f32 {
  return 1.0 / (1.0 + exp(-v));
}

// f(v): SiLU v*sigmoid(v); GELU v*Phi(v) with Phi(v) = (1 + erf(v/sqrt2))/2; quick-GELU v*sigmoid(1.702 v).
fn act(v: f32) -> f32 {
  if (ACT == 0u) { return v * sigmoid(v); }
  if (ACT == 1u) { return v * normal_cdf(v); }
  return v * sigmoid(1.702 * v);
}

// f'(v): SiLU s + v s (1-s); GELU Phi(v) + v phi(v); quick-GELU s + 1.702 v s (1-s) with s = sigmoid(1.702 v).
fn act_grad(v: f32) -> f32 {
  if (ACT == 0u) {
    let s = sigmoid(v);
    return s + v * s * (1.0 - s);
  }
  if (ACT == 1u) {
    let cdf = normal_cdf(v);
    let pdf = 0.39894228040143268 * exp(-0.5 * v * v);
    return cdf + v * pdf;
  }
  let s = sigmoid(1.702 * v);
  return s + 1.702 * v * s * (1.0 - s);
}

// out = f(x)
@compute @workgroup_size(WG)
fn act_fwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(act(f32(x[i])));
}

// dx = dy * f'(x); x = the forward input, y = dy.
@compute @workgroup_size(WG)
fn act_bwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(f32(y[i]) * act_grad(f32(x[i])));
}

// GEGLU: x [R, 2F] = [hidden | gate] along the last dim; out [R, F] = hidden * gelu(gate).
// n = R*F output elements, inner = F.
@compute @workgroup_size(WG)
fn geglu_fwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  let r = i / p.inner;
  let j = i % p.inner;
  let hidden = f32(x[r * 2u * p.inner + j]);
  let gate = f32(x[r * 2u * p.inner + p.inner + j]);
  out[i] = T(hidden * act(gate));
}

// dx [R, 2F]: d hidden = dy * gelu(gate); d gate = dy * hidden * gelu'(gate). n = R*2F, y = dy [R, F].
@compute @workgroup_size(WG)
fn geglu_bwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  let f = p.inner;
  let r = i / (2u * f);
  let j = i % (2u * f);
  let k = j % f;
  let hidden = f32(x[r * 2u * f + k]);
  let gate = f32(x[r * 2u * f + f + k]);
  let d = f32(y[r * f + k]);
  if (j < f) {
    out[i] = T(d * act(gate));
  } else {
    out[i] = T(d * hidden * act_grad(gate));
  }
}

// ---- resampling and embeddings ------------------------------------------------------------------

// Nearest 2x upsample of NCHW planes: out [P, 2H, 2W] from x [P, H, W]. n = output elements,
// inner = 2W (output width), offset = 2H (output height).
@compute @workgroup_size(WG)
fn upsample2x_fwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  let ow = p.inner;
  let oh = p.offset;
  let plane = i / (ow * oh);
  let oy = (i / ow) % oh;
  let ox = i % ow;
  out[i] = x[(plane * (oh / 2u) + oy / 2u) * (ow / 2u) + ox / 2u];
}

// Backward: each input pixel sums its 2x2 block of dy (x = dy here). n = input elements,
// inner = W (input width), offset = H (input height).
@compute @workgroup_size(WG)
fn upsample2x_bwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  let w = p.inner;
  let h = p.offset;
  let plane = i / (w * h);
  let iy = (i / w) % h;
  let ix = i % w;
  let base = (plane * 2u * h + 2u * iy) * 2u * w + 2u * ix;
  let s = f32(x[base]) + f32(x[base + 1u]) + f32(x[base + 2u * w]) + f32(x[base + 2u * w + 1u]);
  out[i] = T(s);
}

// Sinusoidal timestep embedding (diffusers get_timestep_embedding, flip_sin_to_cos=True,
// downscale_freq_shift=0, max_period 10000): for half = dim/2, freq_k = exp(-ln(10000) * k / half),
// out[b] = [cos(t_b freq_0..), sin(t_b freq_0..)] (+ a zero column when dim is odd).
// t32 = timesteps [B] (f32), n = B*dim, inner = dim.
@compute @workgroup_size(WG)
fn timestep_embedding(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  let dim = p.inner;
  let half = dim / 2u;
  let b = i / dim;
  let j = i % dim;
  if (j >= 2u * half) {
    out[i] = T(0.0);
    return;
  }
  let k = j % half;
  let raw = t32[b] * exp(-9.210340371976184 * f32(k) / f32(half));
  // Reduce to [-pi, pi] first: WGSL only bounds sin/cos error there (2^-11 absolute).
  let arg = raw - 6.283185307179586 * round(raw / 6.283185307179586);
  out[i] = T(select(sin(arg), cos(arg), j < half));
}

// Zero padding of NCHW planes: out [P, OH, OW] from x [P, H, W] with the interior at (top, left).
// The pad entries take their own uniform struct at binding 0 (WGSL allows this: no entry point uses both).
struct PadParams {
  n: u32,      // elements walked: output (pad2d) or input (pad2d_crop)
  h: u32,
  w: u32,
  oh: u32,
  ow: u32,
  top: u32,
  left: u32,
}

@group(0) @binding(0) var<uniform> pp: PadParams;

@compute @workgroup_size(WG)
fn pad2d(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= pp.n) { return; }
  let plane = i / (pp.ow * pp.oh);
  let oy = (i / pp.ow) % pp.oh;
  let ox = i % pp.ow;
  var v = 0.0;
  if (oy >= pp.top && oy < pp.top + pp.h && ox >= pp.left && ox < pp.left + pp.w) {
    v = f32(x[(plane * pp.h + oy - pp.top) * pp.w + ox - pp.left]);
  }
  out[i] = T(v);
}

// Backward of pad2d: dx [P, H, W] = the interior of dy (bound as x).
@compute @workgroup_size(WG)
fn pad2d_crop(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= pp.n) { return; }
  let plane = i / (pp.w * pp.h);
  let y = (i / pp.w) % pp.h;
  let xx = i % pp.w;
  out[i] = x[(plane * pp.oh + y + pp.top) * pp.ow + xx + pp.left];
}

// Layout moves for NCHW <-> token-major tensors and skip connections. Own uniform struct, like the pads.
struct MoveParams {
  n: u32,      // output elements
  a: u32,      // transpose: R of each [R, C] matrix; concat: channels of x; split: first channel
  b: u32,      // transpose: C; concat: channels of y; split: channels taken
  inner: u32,  // concat / split: elements per channel plane (H*W)
  total: u32,  // split: channels of the input
}

@group(0) @binding(0) var<uniform> mp: MoveParams;

// out[b, c, r] = x[b, r, c]: the last two dims swapped (e.g. [N, C, HW] -> [N, HW, C]).
// Its backward is the same transpose with the two dims exchanged.
@compute @workgroup_size(WG)
fn transpose2d(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= mp.n) { return; }
  let per = mp.a * mp.b;
  let m = i / per;
  let c = (i % per) / mp.a;
  let r = i % mp.a;
  out[i] = x[m * per + r * mp.b + c];
}

// Channel concatenation of NCHW tensors: out [N, Cx + Cy, H, W] = [x | y] (the UNet's skip connections).
@compute @workgroup_size(WG)
fn concat_channels(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= mp.n) { return; }
  let ct = mp.a + mp.b;
  let n = i / (ct * mp.inner);
  let c = (i / mp.inner) % ct;
  let k = i % mp.inner;
  if (c < mp.a) {
    out[i] = x[(n * mp.a + c) * mp.inner + k];
  } else {
    out[i] = y[(n * mp.b + c - mp.a) * mp.inner + k];
  }
}

// Backward of concat_channels, one side at a time: out [N, b, H, W] = channels [a, a + b) of
// x [N, total, H, W].
@compute @workgroup_size(WG)
fn split_channels(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= mp.n) { return; }
  let n = i / (mp.b * mp.inner);
  let c = (i / mp.inner) % mp.b;
  let k = i % mp.inner;
  out[i] = x[(n * mp.total + mp.a + c) * mp.inner + k];
}
