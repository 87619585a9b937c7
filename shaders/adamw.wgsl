// AdamW (torch.optim.AdamW semantics) on fp32 master weights and fp32 moments, one element per
// invocation. Specialised by G (storage of the loss-scaled gradient, f16 | f32), W (storage of the
// compute copy of the weight), W_F16 (that copy is f16), WG and CLIP. Per element, with t the step number:
//   g = grad * inv_scale * clip,    clip = min(1, max_norm / (norm + 1e-6))   (CLIP; else 1)
//   p = p * (1 - lr * wd)                                   decoupled weight decay
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps),     step_size = lr / (1 - b1^t),
//                                                            bc2_sqrt = sqrt(1 - b2^t)
// in PyTorch's order of operations; the host computes the scalar factors in float64 and passes
// them as f32, as PyTorch does. If the non-finite flag is set (an inf/NaN in this step's gradients)
// every invocation returns at once: master, m, v and the weight copy stay bit-identical, decided on
// the GPU with no read-back. Windows of tensors larger than one binding start at aligned offsets:
// *_skip is the index of the dispatch's first element inside each.
//
// adamw_check computes the same update (the same function, so the same values) and writes nothing but
// the update flag: it raises it when the new m, v or master would be inf/NaN, or, with an f16 weight
// copy (W_F16), when |master| would pass f16's largest finite 65504 (the copy would be inf). The
// optimizer runs it over every chunk before any update, so a learning rate that blows the weights up
// skips the whole step instead of writing inf. adamw_stats measures a chunk's state (max |master|,
// max |m|, max v, max |m| / (sqrt(v) + eps)) for the host's bound that spares streamed chunks the
// check (ops/adamw.ts adamwStepSafe). Both test bit patterns, as reduce.wgsl's nonfinite does:
// isinf/isnan may be folded to false by fast-math compilers.

// Uniforms and bindings are declared per entry point in src/ops/adamw.ts (src/gpu/kernel.ts generates them):
// the update kernels read grad, master, m, v, the non-finite flag (f32 0.0 / 1.0, read as bits) and, with
// CLIP, norm (f32 [1]: the unscaled global gradient norm); adamw_step_copy also writes weight,
// adamw_check raises update_flag (f32 1.0 bits) and adamw_stats raises stats (4 non-negative f32 maxima,
// as bits).

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return gid.x + gid.y * nwg.x * WG;
}

//#entry adamw_step adamw_step_copy adamw_check
fn skip_step() -> bool {
  return flag[0] != 0u;
}

struct Next {
  m: f32,
  v: f32,
  w: f32,
}

// The updated m[i], v[i] and master[i] (nothing written).
fn next_state(i: u32) -> Next {
  var clip = 1.0;
  if (CLIP) { clip = min(1.0, p.max_norm / (norm[0] + 1e-6)); }
  let g = f32(grad[i + p.g_skip]) * p.inv_scale * clip;
  let m1 = p.beta1 * m[i + p.m_skip] + p.one_minus_beta1 * g;
  let v1 = p.beta2 * v[i + p.v_skip] + p.one_minus_beta2 * g * g;
  let denom = sqrt(v1) / p.bc2_sqrt + p.eps;
  let w = master[i + p.p_skip] * p.decay - p.step_size * (m1 / denom);
  return Next(m1, v1, w);
}

//#entry adamw_step adamw_step_copy
// Updates master[i], m[i], v[i]; returns the new master value.
fn update(i: u32) -> f32 {
  let s = next_state(i);
  m[i + p.m_skip] = s.m;
  v[i + p.v_skip] = s.v;
  master[i + p.p_skip] = s.w;
  return s.w;
}

//#entry adamw_step
// Master and moments only (the model computes with the master itself, or the copy is made elsewhere).
@compute @workgroup_size(WG)
fn adamw_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n || skip_step()) { return; }
  update(i);
}

//#entry adamw_step_copy
// ... and the compute-dtype copy of the weight: W(master), rounded to nearest even for f16.
@compute @workgroup_size(WG)
fn adamw_step_copy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n || skip_step()) { return; }
  weight[i + p.w_skip] = W(update(i));
}

//#entry adamw_check
fn nonfinite(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}

// Raises update_flag when this element's update would leave a non-finite m, v or master, or (W_F16) a
// master beyond 65504 (0x477fe000; NaN and inf bits compare above it too). Writes nothing else.
@compute @workgroup_size(WG)
fn adamw_check(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n || skip_step()) { return; }
  let s = next_state(i);
  var bad = nonfinite(s.m) || nonfinite(s.v) || nonfinite(s.w);
  if (W_F16) { bad = bad || (bitcast<u32>(s.w) & 0x7fffffffu) > 0x477fe000u; }
  if (bad) { atomicStore(&update_flag[0], 0x3f800000u); }
}

//#entry adamw_stats
// Chunk statistics: atomic maxima (as u32 bits: non-negative f32 order like their bits) of |master|,
// |m|, v and |m| / (sqrt(v) + stats_eps) (the host's stats epsilon), reduced in the workgroup first so
// only one invocation per workgroup touches the four words. Each invocation first takes the maxima of every
// element i = its index + k * (all invocations) (the host caps the grid, so a chunk of millions is a few
// hundred workgroups and as many barrier trees, not one per 256 elements); max is order-free, so the result
// does not depend on the grid.
var<workgroup> wg_max: array<u32, 4 * WG>; // [quantity * WG + invocation]

@compute @workgroup_size(WG)
fn adamw_stats(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let total = nwg.x * nwg.y * WG;
  // Maxima taken on the bits (u32 order = f32 order for non-negative values, NaN above inf), so a NaN anywhere
  // reaches the statistics, where the host's bound refuses it (an f32 max() may drop a NaN).
  var s = array<u32, 4>(0u, 0u, 0u, 0u);
  for (var i = index(gid, nwg); i < p.n; i += total) {
    let mi = m[i + p.m_skip];
    let vi = v[i + p.v_skip];
    s[0] = max(s[0], bitcast<u32>(abs(master[i + p.p_skip])));
    s[1] = max(s[1], bitcast<u32>(abs(mi)));
    s[2] = max(s[2], bitcast<u32>(abs(vi)));
    s[3] = max(s[3], bitcast<u32>(abs(mi) / (sqrt(abs(vi)) + p.stats_eps)));
  }
  for (var k = 0u; k < 4u; k++) { wg_max[k * WG + lid] = s[k]; }
  workgroupBarrier();
  for (var width = WG / 2u; width > 0u; width = width / 2u) {
    if (lid < width) {
      for (var k = 0u; k < 4u; k++) { wg_max[k * WG + lid] = max(wg_max[k * WG + lid], wg_max[k * WG + lid + width]); }
    }
    workgroupBarrier();
  }
  if (lid == 0u) {
    for (var k = 0u; k < 4u; k++) { atomicMax(&stats[k], wg_max[k * WG]); }
  }
}

//#entry adamw_packed
// AdamW on a packed optimizer state (ops/adamw-packed.ts): the master either an f32 array (HAS_MASTER: an fp32
// master, or the f32 compute weight itself) or the f16 compute weight plus a 16-bit extension word (EXT); the
// moments either f32 arrays (M32) or 8-bit codes with a per-block f32 absolute maximum (Q8, bitsandbytes'
// blockwise 8-bit Adam). One workgroup = one quantisation block of QB = 256 elements, 64 invocations of 4
// consecutive elements each (so a u32 word of 8-bit codes or of two extension halves has one writer).
//
// Q8: m = code_s[q] * absmax_m (signed dynamic map), v = code_u[q] * absmax_v (unsigned dynamic map); the update
// runs in f32 on the dequantised values; the block's new absmax is the max of |new m| (of new v) over the block;
// each new value is requantised to the nearest code of the table scaled by it (binary search; ties to the lower
// code). The parameter update uses the unquantised new m, v (as bitsandbytes does).
// EXT: master = w + ext * ulp16(w) / 65536 (ext an i16, ulp16(w) the f16 spacing at w: 2^(e-10), 2^-24 below
// f16's normals), so |master - stored| <= ulp16(w) * 2^-17 ~ 2^-27 |master| (27 significant bits). The update is
// compensated: d = -lr wd (w + r) - step * m / denom (small, f32), s = r + d, y = w + s, the new w = y rounded to
// the f16 grid (exactly: scaled by a power of two, round(), scaled back), and the new residual (w - w_new) + s
// (w - w_new is exact) becomes the new ext. So the master keeps its 27 bits instead of f32's 24.
// CHECK computes the update and writes nothing but update_flag (the rules of adamw_check); otherwise (STATS) the
// kernel also raises stats with the new state's maxima (|master|, |m|, v, |m| / (sqrt(v) + stats_eps), m and v
// as the next step will read them), so a streamed chunk needs no separate statistics pass.
// QB is a def (src/ops/adamw-packed.ts QBLOCK, which also sizes the grid and the packed layout); LANES invocations of
// 4 elements cover one block.
const LANES: u32 = QB / 4u;
var<workgroup> code_tab: array<f32, 512>; // [signed map | unsigned map]
var<workgroup> red: array<vec4<u32>, LANES>;

fn is_nonfinite(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}

// 2^k for k in f32's normal range, exactly (exp2 need not be exact).
fn pow2(k: i32) -> f32 {
  return bitcast<f32>(u32(k + 127) << 23u);
}

// The exponent k of f16's spacing at |x|: ulp16(x) = 2^k (x's binade - 10; -24 below 2^-14).
fn ulp16_exp(x: f32) -> i32 {
  let e = i32((bitcast<u32>(x) >> 23u) & 0xffu) - 127;
  return max(e, -14) - 10;
}

// Maxima over the workgroup of four non-negative quantities (as bits: the order of non-negative f32, NaN on top).
fn wg_max(lid: u32, x: vec4<u32>) -> vec4<u32> {
  red[lid] = x;
  workgroupBarrier();
  for (var width = LANES / 2u; width > 0u; width = width / 2u) {
    if (lid < width) { red[lid] = max(red[lid], red[lid + width]); }
    workgroupBarrier();
  }
  let res = red[0];
  workgroupBarrier();
  return res;
}

// The nearest code of table `base` (sorted ascending) to x when each code is scaled by a (> 0): the largest k
// with code[k] * a <= x (0 if none), then k + 1 if strictly nearer. a == 0 (an all-zero block): `zero`.
fn quantise(x: f32, a: f32, base: u32, zero: u32) -> u32 {
  if (a == 0.0) { return zero; }
  var lo = 0u;
  for (var stride = 128u; stride > 0u; stride = stride / 2u) {
    let k = lo + stride;
    if (k <= 255u) {
      if (code_tab[base + k] * a <= x) { lo = k; }
    }
  }
  if (lo < 255u) {
    let below = x - code_tab[base + lo] * a;
    let above = code_tab[base + lo + 1u] * a - x;
    if (above < below) { return lo + 1u; }
  }
  return lo;
}

@compute @workgroup_size(LANES)
fn adamw_packed(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let blk = wid.x + wid.y * nwg.x;
  let e0 = blk * QB + lid * 4u;
  let run = inputs[0] == 0u;
  if (Q8) {
    for (var k = lid; k < 512u; k = k + LANES) { code_tab[k] = codes[k]; }
  }
  workgroupBarrier();
  var clip = 1.0;
  if (CLIP) { clip = min(1.0, p.max_norm / (bitcast<f32>(inputs[p.norm_at]) + 1e-6)); }
  let live = blk * QB < p.n;
  var am_old = 0.0;
  var av_old = 0.0;
  var wm8 = 0u;
  var wv8 = 0u;
  if (Q8 && live) {
    am_old = absm[blk + p.am_skip];
    av_old = absv[blk + p.av_skip];
    wm8 = m8[blk * LANES + lid + p.m8_skip];
    wv8 = v8[blk * LANES + lid + p.v8_skip];
  }
  var m1 = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
  var v1 = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
  var wn = array<f32, 4>(0.0, 0.0, 0.0, 0.0); // the new master (EXT: its f32 rounding, for checks and stats)
  var hi = array<f32, 4>(0.0, 0.0, 0.0, 0.0); // EXT: the new f16 weight
  var lo = array<i32, 4>(0, 0, 0, 0); // EXT: the new extension word
  var bad = false;
  for (var j = 0u; j < 4u; j++) {
    let e = e0 + j;
    if (e >= p.n) { continue; }
    let g = f32(grad[e + p.g_skip]) * p.inv_scale * clip;
    var m0 = 0.0;
    var v0 = 0.0;
    if (Q8) {
      m0 = code_tab[(wm8 >> (8u * j)) & 0xffu] * am_old;
      v0 = code_tab[256u + ((wv8 >> (8u * j)) & 0xffu)] * av_old;
    } else {
      m0 = m[e + p.m_skip];
      v0 = v[e + p.v_skip];
    }
    let mm = p.beta1 * m0 + p.one_minus_beta1 * g;
    let vv = p.beta2 * v0 + p.one_minus_beta2 * g * g;
    let ratio = mm / (sqrt(vv) / p.bc2_sqrt + p.eps);
    if (EXT) {
      let x = f32(weight[e + p.w_skip]);
      let pair = ext[(e >> 1u) + p.e_skip];
      let q = bitcast<i32>(pair << (16u * (1u - (e & 1u)))) >> 16u; // the element's signed half
      let r = f32(q) * pow2(ulp16_exp(x) - 16);
      let d = p.neg_lr_wd * (x + r) - p.step_size * ratio;
      let s = r + d;
      let y = x + s;
      let k = ulp16_exp(y);
      let w16 = round(y * pow2(-k)) * pow2(k);
      let r2 = (x - w16) + s;
      lo[j] = i32(clamp(round(r2 * pow2(16 - ulp16_exp(w16))), -32768.0, 32767.0));
      hi[j] = w16;
      wn[j] = y;
    } else {
      wn[j] = master[e + p.p_skip] * p.decay - p.step_size * ratio;
    }
    m1[j] = mm;
    v1[j] = vv;
    bad = bad || is_nonfinite(mm) || is_nonfinite(vv) || is_nonfinite(wn[j]);
    if (W_F16) { bad = bad || (bitcast<u32>(wn[j]) & 0x7fffffffu) > 0x477fe000u; }
  }
  // The block's new absolute maxima (Q8), then the values as they will be read back.
  var am_new = 0.0;
  var av_new = 0.0;
  var qm = 0u;
  var qv = 0u;
  var md = m1;
  var vd = v1;
  if (Q8) {
    var lm = 0u;
    var lv = 0u;
    for (var j = 0u; j < 4u; j++) {
      lm = max(lm, bitcast<u32>(abs(m1[j])));
      lv = max(lv, bitcast<u32>(abs(v1[j])));
    }
    let mx = wg_max(lid, vec4<u32>(lm, lv, 0u, 0u));
    am_new = bitcast<f32>(mx.x);
    av_new = bitcast<f32>(mx.y);
    for (var j = 0u; j < 4u; j++) {
      let cm = quantise(m1[j], am_new, 0u, p.zero_m);
      let cv = quantise(v1[j], av_new, 256u, p.zero_v);
      qm = qm | (cm << (8u * j));
      qv = qv | (cv << (8u * j));
      md[j] = code_tab[cm] * am_new;
      vd[j] = code_tab[256u + cv] * av_new;
    }
  }
  if (CHECK) {
    if (bad && run) { atomicStore(&signals[0], 0x3f800000u); }
  }
  if (STATS) {
    var st = vec4<u32>(0u, 0u, 0u, 0u);
    for (var j = 0u; j < 4u; j++) {
      let ratio = abs(md[j]) / (sqrt(abs(vd[j])) + p.stats_eps);
      st = max(st, bitcast<vec4<u32>>(vec4<f32>(abs(wn[j]), abs(md[j]), abs(vd[j]), ratio)));
    }
    let tot = wg_max(lid, st);
    if (lid == 0u && run && live) {
      for (var k = 0u; k < 4u; k++) { atomicMax(&signals[p.stats_at + k], tot[k]); }
    }
  }
  if (CHECK || !run || !live) { return; }
  if (Q8) {
    m8[blk * LANES + lid + p.m8_skip] = qm;
    v8[blk * LANES + lid + p.v8_skip] = qv;
    if (lid == 0u) {
      absm[blk + p.am_skip] = am_new;
      absv[blk + p.av_skip] = av_new;
    }
  }
  for (var j = 0u; j < 4u; j++) {
    let e = e0 + j;
    if (e >= p.n) { continue; }
    if (M32) {
      m[e + p.m_skip] = m1[j];
      v[e + p.v_skip] = v1[j];
    }
    if (EXT) {
      weight[e + p.w_skip] = W(hi[j]);
    } else {
      master[e + p.p_skip] = wn[j];
      if (COPY) { weight[e + p.w_skip] = W(wn[j]); }
    }
  }
  if (EXT) {
    for (var h = 0u; h < 2u; h++) {
      if (e0 + 2u * h < p.n) {
        ext[(e0 >> 1u) + h + p.e_skip] = (u32(lo[2u * h]) & 0xffffu) | (u32(lo[2u * h + 1u]) << 16u);
      }
    }
  }
}
