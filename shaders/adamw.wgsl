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
// only one invocation per workgroup touches the four words.
var<workgroup> wg_max: array<u32, 4 * WG>; // [quantity * WG + invocation]

@compute @workgroup_size(WG)
fn adamw_stats(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i = index(gid, nwg);
  var s = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
  if (i < p.n) {
    let mi = m[i + p.m_skip];
    let vi = v[i + p.v_skip];
    s = array<f32, 4>(abs(master[i + p.p_skip]), abs(mi), abs(vi), abs(mi) / (sqrt(abs(vi)) + p.stats_eps));
  }
  for (var k = 0u; k < 4u; k++) { wg_max[k * WG + lid] = bitcast<u32>(s[k]); }
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
