// Element-wise ops. Specialised by: T (storage type of x/y), U (storage type of the output where it
// differs, for casts), WG (workgroup size). Every entry walks a flat range of `n` elements; the
// host splits tensors larger than one storage binding into ranges.

struct Params {
  n: u32,
  alpha: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> y: array<T>;
@group(0) @binding(3) var<storage, read_write> out: array<T>;
@group(0) @binding(4) var<storage, read_write> out_cast: array<U>;

// Flat element index over a 2D grid of workgroups (x up to 65535, then y).
fn flat(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return gid.x + gid.y * nwg.x * WG;
}

// out = x + alpha * y
@compute @workgroup_size(WG)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i] = T(f32(x[i]) + p.alpha * f32(y[i]));
}

// out_cast = U(x): f16 <-> f32 conversion (f32 -> f16 rounds to nearest even, overflow gives inf).
@compute @workgroup_size(WG)
fn convert(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out_cast[i] = U(x[i]);
}
