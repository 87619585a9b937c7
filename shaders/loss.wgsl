// The denoising loss's element-wise parts (ops/loss.ts), with coefficients per sample (each sample of a batch
// has its own timestep). Specialised by T (storage) and WG.
//   mix:      out = c[b].x * x + c[b].y * y    (x_t = sqrt(ā) x0 + sqrt(1-ā) eps;  v = sqrt(ā) eps - sqrt(1-ā) x0)
//   wmse_grad: d/dpred of sum_b w[b] mean_b((pred - target)^2) / B, times the loss scale:
//             2 w[b] (pred - target) / (per_sample * B) * scale  (the host folds 2 * scale / (per_sample * B) into alpha)
//   masked_sq_err:    m[b, s] (pred - target)^2 in f32, the masked loss's terms (summed per sample on the host side)
//   masked_wmse_grad: d/dpred of sum_b w[b] mean_b(m[b, s] (pred - target)^2) / B, times the loss scale:
//             2 w[b] m[b, s] (pred - target) / (per_sample * B) * scale
//   with m [B, plane] the per-sample loss mask at latent resolution, shared by the channels (sd-scripts'
//   apply_masked_loss: loss * mask, then the plain mean; the mask is not renormalised), s = the element's
//   position in its channel plane.

// Uniforms (n elements, per_sample elements per sample, wmse_grad's alpha) and bindings are declared per
// entry point in src/train/objective.ts (src/gpu/kernel.ts generates them). x = pred and y = target in
// wmse_grad; coef [B] (vec2 f32) and weight [B] (f32) hold the per-sample factors; mask [B, plane] (f32).

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return gid.x + gid.y * nwg.x * WG;
}

//#entry mix
@compute @workgroup_size(WG)
fn mix(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n) { return; }
  let c = coef[i / p.per_sample];
  out[i] = T(c.x * f32(x[i]) + c.y * f32(y[i]));
}

//#entry wmse_grad
@compute @workgroup_size(WG)
fn wmse_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(p.alpha * weight[i / p.per_sample] * (f32(x[i]) - f32(y[i])));
}

//#entry masked_sq_err masked_wmse_grad
// Element i of a [B, C, plane] tensor: its mask weight m[b, s], b = i / per_sample, s = i % plane.
fn mask_at(i: u32) -> f32 {
  return mask[(i / p.per_sample) * p.plane + i % p.plane];
}

//#entry masked_sq_err
@compute @workgroup_size(WG)
fn masked_sq_err(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n) { return; }
  let d = f32(x[i]) - f32(y[i]);
  out[i] = mask_at(i) * d * d;
}

//#entry masked_wmse_grad
@compute @workgroup_size(WG)
fn masked_wmse_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = index(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(p.alpha * weight[i / p.per_sample] * mask_at(i) * (f32(x[i]) - f32(y[i])));
}
