// AdamW (torch.optim.AdamW semantics) on fp32 master weights and fp32 moments, one element per
// invocation. The gradient arrives in G (f16 or f32) multiplied by the loss scale; the compute copy
// of the weight is written in W (f16 or f32).
//   g = grad * inv_scale * clip,   clip = min(1, max_norm / (norm + 1e-6))  (when CLIP)
//   p = p - lr * wd * p
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),   bc_i = 1 - b_i^t
// If the non-finite flag is set (overflow in this step's gradients) nothing is written: the step is
// skipped on the GPU, with no read-back.

struct Params {
  n: u32,
  lr: f32,
  beta1: f32,
  beta2: f32,
  eps: f32,
  weight_decay: f32,
  bc1: f32,
  bc2: f32,
  inv_scale: f32,
  max_norm: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> grad: array<G>;
@group(0) @binding(2) var<storage, read_write> master: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;
@group(0) @binding(5) var<storage, read_write> weight: array<W>;
@group(0) @binding(6) var<storage, read> flag: array<u32>;
@group(0) @binding(7) var<storage, read> norm: array<f32>;

@compute @workgroup_size(WG)
fn adamw_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x + gid.y * nwg.x * WG;
  if (i >= p.n || flag[0] != 0u) { return; }
  var g = f32(grad[i]) * p.inv_scale;
  if (CLIP) { g *= min(1.0, p.max_norm / (norm[0] + 1e-6)); }
  var w = master[i];
  w -= p.lr * p.weight_decay * w;
  let m1 = p.beta1 * m[i] + (1.0 - p.beta1) * g;
  let v1 = p.beta2 * v[i] + (1.0 - p.beta2) * g * g;
  w -= (p.lr / p.bc1) * m1 / (sqrt(v1) / sqrt(p.bc2) + p.eps);
  m[i] = m1;
  v[i] = v1;
  master[i] = w;
  weight[i] = W(w);
}
