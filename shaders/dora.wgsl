// DoRA's per-column magnitude scale (src/ops/dora.ts): c = m / (sqrt(ss) + eps) for a vector of squared
// column norms ss and magnitudes m, and its backward. Specialised by T (storage type) and WG (workgroup size);
// the vectors are one element per column of a weight (at most a few thousand), so one element per invocation.
// Everything computes in f32.

fn at(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return gid.x + gid.y * nwg.x * WG;
}

//#entry dora_scale_fwd
@compute @workgroup_size(WG)
fn dora_scale_fwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = at(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(f32(m[i]) / (sqrt(f32(ss[i])) + p.eps));
}

//#entry dora_scale_bwd
// With n = sqrt(ss) + eps: dm = dc / n and dss = -dc m / n^2 * 1 / (2 sqrt(ss)) (0 where ss = 0, where the
// norm's derivative does not exist; torch's norm backward gives 0 there too).
@compute @workgroup_size(WG)
fn dora_scale_bwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = at(gid, nwg);
  if (i >= p.n) { return; }
  let r = sqrt(f32(ss[i]));
  let n = r + p.eps;
  let g = f32(dc[i]);
  dm[i] = T(g / n);
  var d = 0.0;
  if (r > 0.0) { d = -g * f32(m[i]) / (n * n) * 0.5 / r; }
  dss[i] = T(d);
}
