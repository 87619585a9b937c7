// AdamW (torch.optim.AdamW semantics) on fp32 master weights and fp32 moments, one element per
// invocation. Specialised by G (storage of the loss-scaled gradient, f16 | f32), W (storage of the
// compute copy of the weight), WG and CLIP. Per element, with t the step number:
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

struct Params {
  n: u32,
  g_skip: u32,
  p_skip: u32,
  m_skip: u32,
  v_skip: u32,
  w_skip: u32,
  decay: f32,
  beta1: f32,
  one_minus_beta1: f32,
  beta2: f32,
  one_minus_beta2: f32,
  step_size: f32,
  bc2_sqrt: f32,
  eps: f32,
  inv_scale: f32,
  max_norm: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> grad: array<G>;
@group(0) @binding(2) var<storage, read_write> master: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;
@group(0) @binding(5) var<storage, read> flag: array<u32>;   // f32 0.0 / 1.0, read as bits
@group(0) @binding(6) var<storage, read> norm: array<f32>;   // f32 [1]: unscaled global gradient norm
@group(0) @binding(7) var<storage, read_write> weight: array<W>;

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return gid.x + gid.y * nwg.x * WG;
}

fn skip_step() -> bool {
  return flag[0] != 0u;
}

// Updates master[i], m[i], v[i]; returns the new master value.
fn update(i: u32) -> f32 {
  var clip = 1.0;
  if (CLIP) { clip = min(1.0, p.max_norm / (norm[0] + 1e-6)); }
  let g = f32(grad[i + p.g_skip]) * p.inv_scale * clip;
  let m1 = p.beta1 * m[i + p.m_skip] + p.one_minus_beta1 * g;
  let v1 = p.beta2 * v[i + p.v_skip] + p.one_minus_beta2 * g * g;
  let denom = sqrt(v1) / p.bc2_sqrt + p.eps;
  let w = master[i + p.p_skip] * p.decay - p.step_size * (m1 / denom);
  m[i + p.m_skip] = m1;
  v[i + p.v_skip] = v1;
  master[i + p.p_skip] = w;
  return w;
}

// Master and moments only (the model computes with the master itself, or the copy is made elsewhere).
@compute @workgroup_size(WG)
fn adamw_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n || skip_step()) { return; }
  update(i);
}

// ... and the compute-dtype copy of the weight: W(master), rounded to nearest even for f16.
@compute @workgroup_size(WG)
fn adamw_step_copy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n || skip_step()) { return; }
  weight[i + p.w_skip] = W(update(i));
}
