// 2-D convolution, NCHW (PyTorch semantics), as implicit GEMM: the im2col matrix is never stored;
// the tile loaders gather it from x (or dy) on the fly. One tiled GEMM core serves the forward and
// both gradients; MODE picks what A, B and C are (r = kh * KW + kw runs over the KH x KW taps):
//
//   MODE 0 forward      y[n]  [Co, Ho*Wo]   = w [Co, Ci*KHW]          · im2col(x[n]) [Ci*KHW, Ho*Wo]  (+ bias[co])
//   MODE 1 grad input   dx[n] [Ci, H*W]     = wᵀ [Ci, Co*KHW]         · col2im-gather(dy[n]) [Co*KHW, H*W]
//   MODE 2 grad weight  dw    [Co, Ci*KHW]  = dy [Co, (n, Ho*Wo)]     · im2col(x)ᵀ [(n, Ho*Wo), Ci*KHW]
//
// Grad input: dx[ci, ih, iw] = Σ_{co,kh,kw} w[co, ci, kh, kw] · dy[co, oh, ow] where ih = oh*S - P + kh,
// i.e. oh = (ih + P - kh) / S when that divides exactly and lands inside dy (the stride-2 zeros of
// the transposed convolution are skipped by that test, not stored).
//
// Specialised by: T (storage of x, w, dy, bias), TC (storage of the output: T or f32), MODE,
// KH, KW, STRIDE, tiles BM, BN, BK, TM, TN (as in matmul.wgsl), HAS_BIAS, ACCUMULATE.
// `bias_grad` (db[co] = Σ_{n, pixels} dy[n, co, ·]) uses T, TC and ACCUMULATE.
//
// Bindings: src_a = w (modes 0, 1) or dy (mode 2); src_b = x (modes 0, 2) or dy (mode 1); out = y,
// dx or dw. The host binds windows of whole samples and passes element offsets (off_*), so tensors
// larger than one storage binding run in sample chunks.

struct Params {
  GM: u32,        // GEMM rows (Co, Ci, Co)
  GN: u32,        // GEMM columns (Ho*Wo, H*W, Ci*KHW)
  GK: u32,        // reduction (Ci*KHW, Co*KHW, samples*Ho*Wo)
  Ci: u32,
  H: u32,
  W: u32,
  Co: u32,
  Ho: u32,
  Wo: u32,
  pad: u32,
  off_a: u32,
  off_b: u32,
  off_c: u32,
  off_bias: u32,
  stride_b: u32,  // elements between samples of src_b (modes 0, 1: z = sample)
  stride_c: u32,  // elements between samples of out
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src_a: array<T>;
@group(0) @binding(2) var<storage, read> src_b: array<T>;
@group(0) @binding(3) var<storage, read_write> out: array<TC>;
// Always bound (layout 'auto'); without HAS_BIAS the host binds any read-only window here.
@group(0) @binding(4) var<storage, read> bias: array<T>;

const KHW = KH * KW;
const VM = TM / 4u;
const VN = TN / 4u;
const WG_X = BN / TN;
const WG_Y = BM / TM;
const WG_SIZE = WG_X * WG_Y;
const A_GROUPS = BM * BK / 4u;
const B_GROUPS = BK * BN / 4u;
// Which GEMM index runs fastest across invocations while staging B, for coalesced reads: the pixel
// (GEMM column) in modes 0 and 1, the reduction index (pixels of a sample) in mode 2. A is always
// staged reduction-fastest (w rows are contiguous in k; dy rows in pixels).
const B_COL_FAST = MODE != 2u;

var<workgroup> tile_a: array<vec4<f32>, BK * BM / 4u>;
var<workgroup> tile_b: array<vec4<f32>, BK * BN / 4u>;

// x[sample base, ci, oh*S - P + kh, ow*S - P + kw], 0 in the padding.
fn x_tap(base: u32, ci: u32, oh: u32, ow: u32, r: u32) -> f32 {
  let ih = i32(oh * STRIDE + r / KW) - i32(p.pad);
  let iw = i32(ow * STRIDE + r % KW) - i32(p.pad);
  if (ih < 0 || iw < 0 || ih >= i32(p.H) || iw >= i32(p.W)) { return 0.0; }
  return f32(src_b[base + (ci * p.H + u32(ih)) * p.W + u32(iw)]);
}

// A[m, k] of the GEMM, 0 outside it.
fn load_a(m: u32, k: u32) -> f32 {
  if (m >= p.GM || k >= p.GK) { return 0.0; }
  if (MODE == 0u) { return f32(src_a[p.off_a + m * p.GK + k]); }                 // w[co, (ci, r)]
  if (MODE == 1u) { return f32(src_a[p.off_a + ((k / KHW) * p.Ci + m) * KHW + k % KHW]); } // w[co, ci, r]
  let hw = p.Ho * p.Wo;                                                           // dy[n, co, pixel]
  return f32(src_a[p.off_a + ((k / hw) * p.Co + m) * hw + k % hw]);
}

// B[k, n] of the GEMM for sample z (modes 0, 1), 0 outside it.
fn load_b(z: u32, k: u32, n: u32) -> f32 {
  if (k >= p.GK || n >= p.GN) { return 0.0; }
  let base = p.off_b + z * p.stride_b;
  if (MODE == 0u) { return x_tap(base, k / KHW, n / p.Wo, n % p.Wo, k % KHW); }
  if (MODE == 1u) {
    // dy[co, (ih + P - kh) / S, (iw + P - kw) / S] where exact and inside dy.
    let co = k / KHW;
    let r = k % KHW;
    let th = i32(n / p.W + p.pad) - i32(r / KW);
    let tw = i32(n % p.W + p.pad) - i32(r % KW);
    if (th < 0 || tw < 0) { return 0.0; }
    let oh = u32(th) / STRIDE;
    let ow = u32(tw) / STRIDE;
    if (oh * STRIDE != u32(th) || ow * STRIDE != u32(tw) || oh >= p.Ho || ow >= p.Wo) { return 0.0; }
    return f32(src_b[base + (co * p.Ho + oh) * p.Wo + ow]);
  }
  // MODE 2: k = (sample, pixel), n = (ci, r).
  let hw = p.Ho * p.Wo;
  let s = k / hw;
  let pix = k % hw;
  return x_tap(base + s * p.Ci * p.H * p.W, n / KHW, pix / p.Wo, pix % p.Wo, n % KHW);
}

@compute @workgroup_size(WG_X, WG_Y)
fn conv_gemm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
             @builtin(local_invocation_index) tid: u32) {
  let row0 = wg.y * BM;
  let col0 = wg.x * BN;
  let z = wg.z;
  var acc: array<vec4<f32>, TM * VN>;

  for (var k0 = 0u; k0 < p.GK; k0 += BK) {
    for (var g = tid; g < A_GROUPS; g += WG_SIZE) {
      let k = g % BK;
      let m4 = g / BK;
      let m = row0 + m4 * 4u;
      tile_a[k * (BM / 4u) + m4] = vec4<f32>(load_a(m, k0 + k), load_a(m + 1u, k0 + k),
                                             load_a(m + 2u, k0 + k), load_a(m + 3u, k0 + k));
    }
    for (var g = tid; g < B_GROUPS; g += WG_SIZE) {
      var k: u32;
      var n4: u32;
      if (B_COL_FAST) { n4 = g % (BN / 4u); k = g / (BN / 4u); } else { k = g % BK; n4 = g / BK; }
      let n = col0 + n4 * 4u;
      tile_b[k * (BN / 4u) + n4] = vec4<f32>(load_b(z, k0 + k, n), load_b(z, k0 + k, n + 1u),
                                             load_b(z, k0 + k, n + 2u), load_b(z, k0 + k, n + 3u));
    }
    workgroupBarrier();

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

  // C is row-major [GM, GN] per sample in all three modes: y[n, co, pixel], dx[n, ci, pixel], dw[co, (ci, r)].
  let base_c = p.off_c + z * p.stride_c;
  for (var i = 0u; i < VM; i++) {
    for (var r = 0u; r < 4u; r++) {
      let m = row0 + (i * WG_Y + lid.y) * 4u + r;
      if (m >= p.GM) { continue; }
      var bias_m = 0.0;
      if (HAS_BIAS) { bias_m = f32(bias[p.off_bias + m]); }
      for (var j = 0u; j < VN; j++) {
        let n0 = col0 + (j * WG_X + lid.x) * 4u;
        let v = acc[(i * 4u + r) * VN + j];
        for (var q = 0u; q < 4u; q++) {
          let n = n0 + q;
          if (n >= p.GN) { break; }
          var s = v[q] + bias_m;
          let idx = base_c + m * p.GN + n;
          if (ACCUMULATE) { s += f32(out[idx]); }
          out[idx] = TC(s);
        }
      }
    }
  }
}

// ---- bias gradient: db[co] = Σ_{n, pixel} dy[n, co, pixel] -----------------------------------------
// One workgroup per channel; p.GK = samples in this window, p.GN = pixels per sample, p.Co channels;
// dy is bound as src_a at p.off_a.

const SUM_WG = 256u;
var<workgroup> partial_sums: array<f32, SUM_WG>;

@compute @workgroup_size(SUM_WG)
fn bias_grad(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let co = wg.x;
  var s = 0.0;
  for (var n = 0u; n < p.GK; n++) {
    let base = p.off_a + (n * p.Co + co) * p.GN;
    for (var i = tid; i < p.GN; i += SUM_WG) { s += f32(src_a[base + i]); }
  }
  partial_sums[tid] = s;
  workgroupBarrier();
  for (var w = SUM_WG / 2u; w > 0u; w /= 2u) {
    if (tid < w) { partial_sums[tid] += partial_sums[tid + w]; }
    workgroupBarrier();
  }
  if (tid == 0u) {
    var t = partial_sums[0];
    let idx = p.off_c + co;
    if (ACCUMULATE) { t += f32(out[idx]); }
    out[idx] = TC(t);
  }
}
