// 2-D convolution, NCHW (PyTorch semantics), as implicit GEMM: the im2col matrix is never stored;
// the tile loaders gather it from x (or dy) on the fly. One register-tiled GEMM core (generated per tile
// shape by src/ops/conv2d.ts: `conv_gemm`, with constant register indices) serves the forward and both
// gradients; each entry point below says what A, B and C are (r = kh * KW + kw runs over the KH x KW taps):
//
//   conv_fwd  y[n]  [CO, HO*WO]  = w [CO, CI*KHW]       · im2col(x[n]) [CI*KHW, HO*WO]  (+ bias[co])
//   conv_dx   dx[n] [CI, H*W]    = wᵀ [CI, CO*KHW]      · col2im-gather(dy[n]) [CO*KHW, H*W]
//   conv_dw   dw    [CO, CI*KHW] = dy [CO, (n, HO*WO)]  · im2col(x)ᵀ [(n, HO*WO), CI*KHW]
//
// Grad input: dx[ci, ih, iw] = Σ_{co,kh,kw} w[co, ci, kh, kw] · dy[co, oh, ow] where ih = oh*S - P + kh,
// i.e. oh = (ih + P - kh) / S when that divides exactly and lands inside dy (the stride-2 zeros of
// the transposed convolution are skipped by that test, not stored).
//
// Every size fixed by the layer is a pipeline constant (def): CI, H, W, CO, KH, KW, STRIDE, PAD, HO, WO, so
// every division and modulo below is by a constant (a shift when it is a power of two). Per output
// column the core computes its tap origin once (`b_col`), per row its base (`a_row`); per K step only the
// reduction index k is split (by constants). Offsets of the bound sample windows (off_*) and, for the
// weight gradient, the reduction length of this sample chunk (k_len) and of one K split (k_split) are
// uniforms: they vary per call.
//
// Each GEMM entry point supplies, for the core:
//   GM, GN        GEMM rows and columns (constants)
//   a_row(m)      per-row base of A, hoisted out of the K loop;  a_load(row, k)  A[m, k]
//   b_col(n)      per-column tap origin, hoisted;                b_load(col, k, z) B[k, n] of sample/split z
//   store_c(m, n, v, z)   the epilogue for C[m, n .. n+3] (bias, accumulate, bounds on n)
// a_load / b_load are only called with k inside the reduction: the core zeroes the rest.
// Declared per entry point (src/ops/conv2d.ts): the uniforms and bindings named in each section.

//#entry conv_fwd conv_dx conv_dw
const KHW = KH * KW;
const HW = H * W;
const HWO = HO * WO;
const X_SAMPLE = CI * HW;
const Y_SAMPLE = CO * HWO;

// Whether (ih, iw) lies inside the input image (negative values wrap to large u32s).
fn inside(ih: i32, iw: i32, h: u32, w: u32) -> bool {
  return u32(ih) < h && u32(iw) < w;
}

//#entry conv_fwd
// A = w [CO, CI*KHW] (rows contiguous), B[k = (ci, r), n = (oh, ow)] = x[z, ci, oh*S - P + kh, ow*S - P + kw].
const GM = CO;
const GN = HWO;
const GK = CI * KHW;

fn a_row(m: u32) -> u32 { return p.off_w + m * GK; }
fn a_load(row: u32, k: u32) -> f32 { return f32(w[row + k]); }

// The column's top-left tap (ih, iw) at kh = kw = 0.
fn b_col(n: u32) -> vec3<i32> {
  return vec3<i32>(i32((n / WO) * STRIDE) - i32(PAD), i32((n % WO) * STRIDE) - i32(PAD), 0);
}
fn b_load(col: vec3<i32>, k: u32, z: u32) -> f32 {
  let ci = k / KHW;
  let r = k % KHW;
  let ih = col.x + i32(r / KW);
  let iw = col.y + i32(r % KW);
  if (!inside(ih, iw, H, W)) { return 0.0; }
  return f32(x[p.off_x + z * X_SAMPLE + ci * HW + u32(ih) * W + u32(iw)]);
}

fn store_c(m: u32, n: u32, v: vec4<f32>, z: u32) {
  var b = 0.0;
  if (HAS_BIAS) { b = f32(bias[p.off_bias + m]); }
  let base = p.off_y + z * Y_SAMPLE + m * GN;
  for (var q = 0u; q < 4u; q++) {
    if (!FIT_N && n + q >= GN) { break; }
    var s = v[q] + b;
    if (ACCUMULATE) { s += f32(y[base + n + q]); }
    y[base + n + q] = TC(s);
  }
}

@compute @workgroup_size(WG_X, WG_Y)
fn conv_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
            @builtin(local_invocation_index) tid: u32) {
  conv_gemm(tid, lid.x, lid.y, wg.y * BM, wg.x * BN, wg.z, 0u, GK);
}

//#entry conv_dx
// A[m = ci, k = (co, r)] = w[co, ci, r], B[k = (co, r), n = (ih, iw)] = dy[z, co, (ih + P - kh) / S, (iw + P - kw) / S].
const GM = CI;
const GN = HW;
const GK = CO * KHW;

fn a_row(m: u32) -> u32 { return p.off_w + m * KHW; }
fn a_load(row: u32, k: u32) -> f32 { return f32(w[row + (k / KHW) * (CI * KHW) + k % KHW]); }

// The column's (ih + P, iw + P).
fn b_col(n: u32) -> vec3<i32> {
  return vec3<i32>(i32(n / W + PAD), i32(n % W + PAD), 0);
}
fn b_load(col: vec3<i32>, k: u32, z: u32) -> f32 {
  let co = k / KHW;
  let r = k % KHW;
  let th = col.x - i32(r / KW);
  let tw = col.y - i32(r % KW);
  // A negative th or tw wraps to a huge u32, which fails the range test below.
  if (STRIDE != 1u && ((th | tw) & i32(STRIDE - 1u)) != 0) { return 0.0; }
  let oh = u32(th) / STRIDE;
  let ow = u32(tw) / STRIDE;
  if (th < 0 || tw < 0 || oh >= HO || ow >= WO) { return 0.0; }
  return f32(dy[p.off_dy + z * Y_SAMPLE + co * HWO + oh * WO + ow]);
}

fn store_c(m: u32, n: u32, v: vec4<f32>, z: u32) {
  let base = p.off_dx + z * X_SAMPLE + m * GN;
  for (var q = 0u; q < 4u; q++) {
    if (!FIT_N && n + q >= GN) { break; }
    var s = v[q];
    if (ACCUMULATE) { s += f32(dx[base + n + q]); }
    dx[base + n + q] = TC(s);
  }
}

@compute @workgroup_size(WG_X, WG_Y)
fn conv_dx(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
           @builtin(local_invocation_index) tid: u32) {
  conv_gemm(tid, lid.x, lid.y, wg.y * BM, wg.x * BN, wg.z, 0u, GK);
}

//#entry conv_dw
// A[m = co, k = (s, pixel)] = dy[s, co, pixel], B[k = (s, oh, ow), n = (ci, r)] = x[s, ci, oh*S - P + kh, ow*S - P + kw].
// Workgroup z is the K split: it sums k in [z * k_split, min(k_len, (z + 1) * k_split)) and writes its own
// [GM, GN] slab of `dw` at off_dw + z * GM * GN (f32 partials, summed by dw_reduce), or dw itself when unsplit.
const GM = CO;
const GN = CI * KHW;

fn a_row(m: u32) -> u32 { return p.off_dy + m * HWO; }
fn a_load(row: u32, k: u32) -> f32 { return f32(dy[row + (k / HWO) * Y_SAMPLE + k % HWO]); }

// The column's (channel offset in x, kh - P, kw - P).
fn b_col(n: u32) -> vec3<i32> {
  let r = n % KHW;
  return vec3<i32>(i32((n / KHW) * HW), i32(r / KW) - i32(PAD), i32(r % KW) - i32(PAD));
}
fn b_load(col: vec3<i32>, k: u32, z: u32) -> f32 {
  let s = k / HWO;
  let pix = k % HWO;
  let ih = i32((pix / WO) * STRIDE) + col.y;
  let iw = i32((pix % WO) * STRIDE) + col.z;
  if (!inside(ih, iw, H, W)) { return 0.0; }
  return f32(x[p.off_x + s * X_SAMPLE + u32(col.x) + u32(ih) * W + u32(iw)]);
}

fn store_c(m: u32, n: u32, v: vec4<f32>, z: u32) {
  let base = p.off_dw + z * (GM * GN) + m * GN;
  for (var q = 0u; q < 4u; q++) {
    if (!FIT_N && n + q >= GN) { break; }
    var s = v[q];
    if (ACCUMULATE) { s += f32(dw[base + n + q]); }
    dw[base + n + q] = TC(s);
  }
}

@compute @workgroup_size(WG_X, WG_Y)
fn conv_dw(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
           @builtin(local_invocation_index) tid: u32) {
  let k_begin = wg.z * p.k_split;
  conv_gemm(tid, lid.x, lid.y, wg.y * BM, wg.x * BN, wg.z, k_begin, min(p.k_len, k_begin + p.k_split));
}

//#entry dw_reduce
// out[i] (+)= Σ_s partial[s * len + i]: the K splits of conv_dw summed in f32, one invocation per element.
const RED_WG = 256u;

@compute @workgroup_size(RED_WG)
fn dw_reduce(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) tid: u32) {
  let i = (wg.y * nwg.x + wg.x) * RED_WG + tid;
  if (i >= p.len) { return; }
  var s = 0.0;
  for (var k = 0u; k < p.splits; k++) { s += partial[k * p.len + i]; }
  if (ACCUMULATE) { s += f32(out[p.off_out + i]); }
  out[p.off_out + i] = TC(s);
}

//#entry bias_grad
// db[co] = Σ_{n, pixel} dy[n, co, pixel]: one workgroup per channel over the n_samples samples of this window.
const SUM_WG = 256u;
var<workgroup> partial_sums: array<f32, SUM_WG>;

@compute @workgroup_size(SUM_WG)
fn bias_grad(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let co = wg.x;
  var s = 0.0;
  for (var n = 0u; n < p.n_samples; n++) {
    let base = p.off_dy + (n * p.channels + co) * p.plane;
    for (var i = tid; i < p.plane; i += SUM_WG) { s += f32(dy[base + i]); }
  }
  partial_sums[tid] = s;
  workgroupBarrier();
  for (var w = SUM_WG / 2u; w > 0u; w /= 2u) {
    if (tid < w) { partial_sums[tid] += partial_sums[tid + w]; }
    workgroupBarrier();
  }
  if (tid == 0u) {
    var t = partial_sums[0];
    let idx = p.off_db + co;
    if (ACCUMULATE) { t += f32(db[idx]); }
    db[idx] = TC(t);
  }
}

//#entry bias_fill
// y[n, co, pixel] = bias[co] over the `count` elements of this window (a 1x1 convolution's GEMM then adds
// W · x onto it): CO and HWO are constants.
const FILL_WG = 256u;

@compute @workgroup_size(FILL_WG)
fn bias_fill(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) tid: u32) {
  let i = (wg.y * nwg.x + wg.x) * FILL_WG + tid;
  if (i >= p.count) { return; }
  y[p.off_y + i] = bias[p.off_bias + (i / HWO) % CO];
}
