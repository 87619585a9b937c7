// Element-wise ops. Specialised by: T (storage type), U (storage type of convert's output), WG (workgroup
// size), ACT (activation: 0 SiLU, 1 GELU (erf), 2 quick-GELU). Flat entries walk `n` elements; the host
// splits tensors larger than one storage binding into ranges.
//
// Uniforms and bindings are declared per entry point in src/ops/elementwise.ts (src/gpu/kernel.ts generates
// them); every entry takes `n`, the elements (or planes) it walks.

// Each invocation walks PER elements, WG apart, of its workgroup's block of WG * PER: on CPU adapters
// (lavapipe, SwiftShader) a workgroup's fixed cost is many times one element's, so fewer, longer
// workgroups are ~2x faster; the lanes of a workgroup still touch consecutive elements at each step.
// first(): this invocation's first element, over a 2D grid of workgroups (x up to 65535, then y).
fn first(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
  return (wid.x + wid.y * nwg.x) * WG * PER + lid;
}

// ---- arithmetic ------------------------------------------------------------------------------

//#entry add
// out = x + alpha * y
@compute @workgroup_size(WG)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    out[i] = T(f32(x[i]) + p.alpha * f32(y[i]));
  }
}

//#entry mul
// out = alpha * x * y   (mul's backward is mul again: with upstream gradient g, dx = g * y, dy = g * x)
@compute @workgroup_size(WG)
fn mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    out[i] = T(p.alpha * f32(x[i]) * f32(y[i]));
  }
}

//#entry scale
// out = alpha * x
@compute @workgroup_size(WG)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    out[i] = T(p.alpha * f32(x[i]));
  }
}

//#entry add4
// add over vec4s (n counts vec4s: the host uses it when a range's elements are a multiple of 4). The same f32
// math per component, so results equal add's bit for bit; CPU adapters move a vec4 for little more than
// one scalar, so this is ~1.5x faster there.
@compute @workgroup_size(WG)
fn add4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    out[i] = vec4<T>(vec4<f32>(x[i]) + p.alpha * vec4<f32>(y[i]));
  }
}

//#entry scale4
// scale over vec4s (see add4).
@compute @workgroup_size(WG)
fn scale4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    out[i] = vec4<T>(p.alpha * vec4<f32>(x[i]));
  }
}

//#entry convert
// out = U(x): f16 <-> f32 conversion (f32 -> f16 rounds to nearest even, overflow gives inf).
@compute @workgroup_size(WG)
fn convert(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    out[i] = U(x[i]);
  }
}

//#entry add_channel
// x [N, C, H, W] + per-channel t: out[i] = x[i] + t[n * t_stride + t_off + c] for the plane n * C + c =
// (elem0 + i) / inner, inner = H*W, elem0 = the flat index of this range's first element. t is [N, C] (t_stride
// = C, t_off = 0) or columns [t_off, t_off + C) of a wider [N, t_stride] row-major tensor (several layers'
// projections computed by one GEMM).
@compute @workgroup_size(WG)
fn add_channel(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let plane = (p.elem0 + i) / p.inner;
    let n = plane / p.chans;
    out[i] = T(f32(x[i]) + f32(t[n * p.t_stride + p.t_off + (plane - n * p.chans)]));
  }
}

//#entry repeat
// out[i] = x[i % inner]: x repeated (a bias broadcast to one row per sample).
@compute @workgroup_size(WG)
fn repeat(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    out[i] = x[i % p.inner];
  }
}

//#entry sum_planes
var<workgroup> red: array<f32, WG>;

// Backward of add_channel for the channel operand: out[plane] = sum over the plane of dy (`inner` elements
// each). n = planes. Each plane gets `lanes` = 2^shift lanes (the host picks ~16 elements per lane, at most
// 64 lanes), so a workgroup sums WG / lanes planes: lane l of a plane adds elements l, l + lanes, ...; after
// one barrier the plane's first lane adds its `lanes` partial sums in order. (One barrier instead of a
// log2(WG)-level tree: on CPU adapters each barrier switches through every lane group of the workgroup.)
@compute @workgroup_size(WG)
fn sum_planes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let plane = (wid.x + wid.y * nwg.x) * (WG >> p.shift) + (lid >> p.shift);
  let lane = lid & (p.lanes - 1u);
  var s = 0.0;
  if (plane < p.n) {
    for (var j = lane; j < p.inner; j += p.lanes) { s += f32(dy[plane * p.inner + j]); }
  }
  red[lid] = s;
  workgroupBarrier();
  if (lane == 0u && plane < p.n) {
    var total = 0.0;
    for (var q = 0u; q < p.lanes; q++) { total += red[lid + q]; }
    out[plane] = T(total);
  }
}

// ---- activations ------------------------------------------------------------------------------

//#entry act_fwd act_bwd act_fwd4 act_bwd4 geglu_fwd geglu_bwd
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

//#entry act_fwd
// out = f(x)
@compute @workgroup_size(WG)
fn act_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    out[i] = T(act(f32(x[i])));
  }
}

//#entry act_bwd
// dx = dy * f'(x); x = the forward input.
@compute @workgroup_size(WG)
fn act_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    dx[i] = T(f32(dy[i]) * act_grad(f32(x[i])));
  }
}

//#entry act_fwd4
// act_fwd over vec4s (see add4).
@compute @workgroup_size(WG)
fn act_fwd4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let v = vec4<f32>(x[i]);
    out[i] = vec4<T>(vec4<f32>(act(v.x), act(v.y), act(v.z), act(v.w)));
  }
}

//#entry act_bwd4
// act_bwd over vec4s (see add4).
@compute @workgroup_size(WG)
fn act_bwd4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let v = vec4<f32>(x[i]);
    dx[i] = vec4<T>(vec4<f32>(dy[i]) * vec4<f32>(act_grad(v.x), act_grad(v.y), act_grad(v.z), act_grad(v.w)));
  }
}

//#entry geglu_fwd
// GEGLU: x [R, 2F] = [hidden | gate] along the last dim; out [R, F] = hidden * gelu(gate).
// n = R*F output elements.
@compute @workgroup_size(WG)
fn geglu_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let r = i / p.f;
    let j = i % p.f;
    let hidden = f32(x[r * 2u * p.f + j]);
    let gate = f32(x[r * 2u * p.f + p.f + j]);
    out[i] = T(hidden * act(gate));
  }
}

//#entry geglu_bwd
// dx [R, 2F]: d hidden = dy * gelu(gate); d gate = dy * hidden * gelu'(gate). n = R*2F, dy [R, F].
@compute @workgroup_size(WG)
fn geglu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let f = p.f;
    let r = i / (2u * f);
    let j = i % (2u * f);
    let k = j % f;
    let hidden = f32(x[r * 2u * f + k]);
    let gate = f32(x[r * 2u * f + f + k]);
    let d = f32(dy[r * f + k]);
    if (j < f) {
      dx[i] = T(d * act(gate));
    } else {
      dx[i] = T(d * hidden * act_grad(gate));
    }
  }
}

// ---- resampling and embeddings ------------------------------------------------------------------

//#entry upsample2x_fwd
// Nearest 2x upsample of NCHW planes: out [P, OH, OW] = [P, 2H, 2W] from x [P, H, W]. n = output elements.
@compute @workgroup_size(WG)
fn upsample2x_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let ow = p.ow;
    let oh = p.oh;
    // Two integer divisions per element, not four (CPU adapters divide lane by lane): row = plane * oh + oy.
    let row = i / ow;
    let ox = i - row * ow;
    let plane = row / oh;
    let oy = row - plane * oh;
    out[i] = x[(plane * (oh / 2u) + oy / 2u) * (ow / 2u) + ox / 2u];
  }
}

//#entry upsample2x_bwd
// Backward: each input pixel of dx [P, H, W] sums its 2x2 block of dy [P, 2H, 2W]. n = input elements.
@compute @workgroup_size(WG)
fn upsample2x_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let w = p.w;
    let h = p.h;
    let row = i / w; // plane * h + iy (two divisions, as in upsample2x_fwd)
    let ix = i - row * w;
    let plane = row / h;
    let iy = row - plane * h;
    let base = (plane * 2u * h + 2u * iy) * 2u * w + 2u * ix;
    let s = f32(dy[base]) + f32(dy[base + 1u]) + f32(dy[base + 2u * w]) + f32(dy[base + 2u * w + 1u]);
    dx[i] = T(s);
  }
}

//#entry timestep_embedding
// Sinusoidal timestep embedding (diffusers get_timestep_embedding, flip_sin_to_cos=True,
// downscale_freq_shift=0, max_period 10000): for half = dim/2, freq_k = exp(-ln(10000) * k / half),
// out[b] = [cos(t_b freq_0..), sin(t_b freq_0..)] (+ a zero column when dim is odd).
// timesteps [B] (f32), n = B*dim.
@compute @workgroup_size(WG)
fn timestep_embedding(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let dim = p.dim;
    let half = dim / 2u;
    let b = i / dim;
    let j = i % dim;
    if (j >= 2u * half) {
      out[i] = T(0.0);
      continue;
    }
    let k = j % half;
    let raw = timesteps[b] * exp(-9.210340371976184 * f32(k) / f32(half));
    // Reduce to [-pi, pi] first: WGSL only bounds sin/cos error there (2^-11 absolute).
    let arg = raw - 6.283185307179586 * round(raw / 6.283185307179586);
    out[i] = T(select(sin(arg), cos(arg), j < half));
  }
}

// ---- zero padding -------------------------------------------------------------------------------
// Of NCHW planes: out [P, OH, OW] from x [P, H, W] with the interior at (top, left). n = the elements
// walked: output (pad2d) or input (pad2d_crop).

//#entry pad2d
@compute @workgroup_size(WG)
fn pad2d(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let row = i / p.ow; // plane * oh + oy (two divisions, as in upsample2x_fwd)
    let ox = i - row * p.ow;
    let plane = row / p.oh;
    let oy = row - plane * p.oh;
    var v = 0.0;
    if (oy >= p.top && oy < p.top + p.h && ox >= p.left && ox < p.left + p.w) {
      v = f32(x[(plane * p.h + oy - p.top) * p.w + ox - p.left]);
    }
    out[i] = T(v);
  }
}

//#entry pad2d_crop
// Backward of pad2d: dx [P, H, W] = the interior of dy [P, OH, OW].
@compute @workgroup_size(WG)
fn pad2d_crop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let row = i / p.w; // plane * h + y (two divisions, as in upsample2x_fwd)
    let xx = i - row * p.w;
    let plane = row / p.h;
    let y = row - plane * p.h;
    dx[i] = dy[(plane * p.oh + y + p.top) * p.ow + xx + p.left];
  }
}

// ---- layout moves for NCHW <-> token-major tensors and skip connections ------------------------------

//#entry transpose2d
// out[m, c, r] = x[m, r, c]: the last two dims of [M, rows, cols] matrices swapped (e.g. [N, C, HW] ->
// [N, HW, C]). Its backward is the same transpose with the two dims exchanged. n = output elements.
@compute @workgroup_size(WG)
fn transpose2d(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let per = p.rows * p.cols;
    let m = i / per;
    let c = (i % per) / p.rows;
    let r = i % p.rows;
    out[i] = x[m * per + r * p.cols + c];
  }
}

//#entry concat_channels
// Channel concatenation of NCHW tensors: out [N, CX + CY, H, W] = [x | y] (the UNet's skip connections);
// inner = H*W, n = output elements.
@compute @workgroup_size(WG)
fn concat_channels(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let ct = p.cx + p.cy;
    let n = i / (ct * p.inner);
    let c = (i / p.inner) % ct;
    let k = i % p.inner;
    if (c < p.cx) {
      out[i] = x[(n * p.cx + c) * p.inner + k];
    } else {
      out[i] = y[(n * p.cy + c - p.cx) * p.inner + k];
    }
  }
}

//#entry split_channels
// Backward of concat_channels, one side at a time: out [N, count, H, W] = channels [first, first + count)
// of x [N, total, H, W]; inner = H*W, n = output elements.
@compute @workgroup_size(WG)
fn split_channels(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i0 = first(wid, nwg, lid);
  for (var k = 0u; k < PER; k++) {
    let i = i0 + k * WG;
    if (i >= p.n) { return; }
    let n = i / (p.count * p.inner);
    let c = (i / p.inner) % p.count;
    let k = i % p.inner;
    out[i] = x[(n * p.total + p.first + c) * p.inner + k];
  }
}
