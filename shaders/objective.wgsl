// The DreamBooth objective's element-wise parts, with coefficients per sample (each sample of a batch
// has its own timestep). Specialised by T (storage) and WG.
//   mix:      out = c[b].x * x + c[b].y * y    (x_t = sqrt(ā) x0 + sqrt(1-ā) eps;  v = sqrt(ā) eps - sqrt(1-ā) x0)
//   wmse_grad: d/dpred of sum_b w[b] mean_b((pred - target)^2) / B, times the loss scale:
//             2 w[b] (pred - target) / (per_sample * B) * scale  (the host folds 2 * scale / (per_sample * B) into alpha)

struct Params {
  n: u32,
  per_sample: u32,
  alpha: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> y: array<T>;
@group(0) @binding(3) var<storage, read> coef: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read_write> out: array<T>;
@group(0) @binding(5) var<storage, read> weight: array<f32>;

@compute @workgroup_size(WG)
fn mix(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x + gid.y * nwg.x * WG;
  if (i >= p.n) { return; }
  let c = coef[i / p.per_sample];
  out[i] = T(c.x * f32(x[i]) + c.y * f32(y[i]));
}

@compute @workgroup_size(WG)
fn wmse_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x + gid.y * nwg.x * WG;
  if (i >= p.n) { return; }
  out[i] = T(p.alpha * weight[i / p.per_sample] * (f32(x[i]) - f32(y[i])));
}
