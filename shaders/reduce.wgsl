// Reductions: sums to partials and scalars, sums of squares (gradient norms, MSE), row sums,
// the MSE gradient, and a non-finite check. Everything accumulates in f32.
// Specialised by T (storage of the input), WG, ITEMS (elements per invocation per pass) and
// MODE for the partial-sum entry: 0 sum x, 1 sum x^2, 2 sum (x - y)^2.

struct Params {
  n: u32,             // elements in this range
  out_offset: u32,    // partial sums: index of this range's first partial
  alpha: f32,         // finalize / mse gradient: scale
  flags: u32,         // finalize: 1 = take the square root
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> y: array<T>;
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<T>;
@group(0) @binding(5) var<storage, read_write> flag: array<atomic<u32>>;

var<workgroup> red: array<f32, WG>;

fn term(i: u32) -> f32 {
  let v = f32(x[i]);
  if (MODE == 0u) { return v; }
  if (MODE == 1u) { return v * v; }
  let d = v - f32(y[i]);
  return d * d;
}

// Each workgroup sums WG*ITEMS consecutive terms into partial[out_offset + workgroup].
@compute @workgroup_size(WG)
fn partial_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let g = wid.x + wid.y * nwg.x;
  let base = g * WG * ITEMS;
  var s = 0.0;
  for (var k = 0u; k < ITEMS; k++) {
    let i = base + k * WG + lid;
    if (i < p.n) { s += term(i); }
  }
  red[lid] = s;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
    if (lid < stride) { red[lid] += red[lid + stride]; }
    workgroupBarrier();
  }
  if (lid == 0u && base < p.n) { partial[p.out_offset + g] = red[0]; }
}

// out[0] = alpha * (sqrt if flags&1)(x[0]) — turns a reduced sum into a mean, a norm, ...
@compute @workgroup_size(1)
fn finalize() {
  var v = f32(x[0]);
  if ((p.flags & 1u) != 0u) { v = sqrt(v); }
  out[0] = T(p.alpha * v);
}

// Row sums of x [rows, n] into f32: partial[row] = sum_j x[row, j]. One workgroup per row; the row
// count travels in out_offset.
@compute @workgroup_size(WG)
fn row_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let row = wid.x + wid.y * nwg.x;
  if (row >= p.out_offset) { return; }   // out_offset carries the row count here
  var s = 0.0;
  for (var j = lid; j < p.n; j += WG) { s += f32(x[row * p.n + j]); }
  red[lid] = s;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
    if (lid < stride) { red[lid] += red[lid + stride]; }
    workgroupBarrier();
  }
  if (lid == 0u) { partial[row] = red[0]; }
}

// d mean((pred - target)^2) / d pred = 2 (pred - target) / N, times the loss scale: alpha = 2*scale/N.
@compute @workgroup_size(WG)
fn mse_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x + gid.y * nwg.x * WG;
  if (i >= p.n) { return; }
  out[i] = T(p.alpha * (f32(x[i]) - f32(y[i])));
}

// Sets flag[0] = 1 if any element is inf or NaN. Tested on the f32 bit pattern (exponent all ones),
// which f16 -> f32 conversion preserves, so fast-math cannot optimise the test away.
@compute @workgroup_size(WG)
fn nonfinite(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x + gid.y * nwg.x * WG;
  if (i >= p.n) { return; }
  let bits = bitcast<u32>(f32(x[i]));
  if ((bits & 0x7f800000u) == 0x7f800000u) { atomicStore(&flag[0], 1u); }
}
