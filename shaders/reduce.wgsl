// Reductions: sums (all / rows / columns), MSE loss and its gradient, the sum of squares behind the
// global gradient norm, and the non-finite check. Specialised by:
//   T  storage type of the inputs x, y (f16 | f32)
//   O  storage type of the output (f32 for partial sums; f16 | f32 for final row/column sums, dpred)
//   WG workgroup size
//   SQRT   row kernels: the pass finishes a norm (square root of the sum)
//   IS_F16 whether the non-finite check reads f16 or f32 bit patterns
// Every sum accumulates in f32. A tensor is reduced in passes: each pass turns segments of at most
// `seg` elements into one f32 partial each, until one value per output remains; the last pass applies
// `scale` (and a square root for norms) and stores O. The host binds windows of tensors larger than
// one storage binding: `elem0` is the first element a dispatch covers and `*_skip` its index inside
// each bound window (windows start at aligned byte offsets, so the first element may sit further in).

// Uniforms and bindings are declared per entry point in src/ops/reduce.ts (src/gpu/kernel.ts generates them).
// Row kernels (sum_rows, sumsq_rows, sqdiff_rows) reduce units = segments of rows:
//   cols   elements per row          segs   segments per row         seg   elements per segment
//   unit0  first unit of this dispatch (row * segs + segment)        units units in this dispatch
//   elem0  global index of the first element this dispatch covers
//   scale  applied to the finished sum: 1 for sums, 1/n for means, 1/loss_scale for norms
// and store O(scale * sum), or O(scale * sqrt(sum)) when the def SQRT is true (a norm's last pass).

//#entry sum_rows sumsq_rows sqdiff_rows
var<workgroup> scratch: array<f32, WG>;

fn finish(s: f32) -> f32 {
  if (SQRT) { return p.scale * sqrt(s); }
  return p.scale * s;
}

// Unit handled by this workgroup (workgroups laid out on a 2D grid past 65535).
fn unit_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return wid.x + wid.y * nwg.x;
}

// Global element range [begin, end) of unit u: segment u % segs of row u / segs.
fn unit_begin(u: u32) -> u32 {
  return (u / p.segs) * p.cols + (u % p.segs) * p.seg;
}
fn unit_end(u: u32) -> u32 {
  let s = u % p.segs;
  return (u / p.segs) * p.cols + min(s * p.seg + p.seg, p.cols);
}

// Tree reduction of each thread's partial over the workgroup; thread 0 stores the unit's result.
fn store_unit(lid: u32, u: u32, acc: f32) {
  scratch[lid] = acc;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
    if (lid < stride) { scratch[lid] = scratch[lid] + scratch[lid + stride]; }
    workgroupBarrier();
  }
  if (lid == 0u) { out[u - p.unit0 + p.out_skip] = O(finish(scratch[0])); }
}

//#entry sum_rows
// out[u] = sum of x over unit u.
@compute @workgroup_size(WG)
fn sum_rows(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let w = unit_index(wid, nwg);
  if (w >= p.units) { return; }   // whole workgroups leave together: barriers stay uniform
  let u = p.unit0 + w;
  let base = p.x_skip - p.elem0;   // u32 wrap-around: i + base is i's index in the window
  var acc = 0.0;
  for (var i = unit_begin(u) + lid; i < unit_end(u); i += WG) { acc += f32(x[i + base]); }
  store_unit(lid, u, acc);
}

//#entry sumsq_rows
// out[u] = sum of x^2 over unit u (the global gradient norm's first pass).
@compute @workgroup_size(WG)
fn sumsq_rows(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let w = unit_index(wid, nwg);
  if (w >= p.units) { return; }   // whole workgroups leave together: barriers stay uniform
  let u = p.unit0 + w;
  let base = p.x_skip - p.elem0;   // u32 wrap-around: i + base is i's index in the window
  var acc = 0.0;
  for (var i = unit_begin(u) + lid; i < unit_end(u); i += WG) {
    let v = f32(x[i + base]);
    acc += v * v;
  }
  store_unit(lid, u, acc);
}

//#entry sqdiff_rows
// out[u] = sum of (x - y)^2 over unit u (the MSE loss's first pass).
@compute @workgroup_size(WG)
fn sqdiff_rows(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let w = unit_index(wid, nwg);
  if (w >= p.units) { return; }   // whole workgroups leave together: barriers stay uniform
  let u = p.unit0 + w;
  let xb = p.x_skip - p.elem0;
  let yb = p.y_skip - p.elem0;
  var acc = 0.0;
  for (var i = unit_begin(u) + lid; i < unit_end(u); i += WG) {
    let d = f32(x[i + xb]) - f32(y[i + yb]);
    acc += d * d;
  }
  store_unit(lid, u, acc);
}

//#entry sum_cols
// Column sums of x viewed as [rows, cols]: out[s, c] = sum of x[r, c] over the rows r of row segment s
// (`row_seg` rows each, `rows` in all). One thread per column, so neighbouring threads read neighbouring
// elements. Workgroups: (ceil(cols / WG), segments in this dispatch); seg0 is the dispatch's first
// segment and row0 its first row.
@compute @workgroup_size(WG)
fn sum_cols(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
  let c = gid.x;
  if (c >= p.cols) { return; }
  let s = p.seg0 + wid.y;
  let r_begin = s * p.row_seg;
  let r_end = min(r_begin + p.row_seg, p.rows);
  var acc = 0.0;
  for (var r = r_begin; r < r_end; r++) { acc += f32(x[(r - p.row0) * p.cols + c + p.x_skip]); }
  out[wid.y * p.cols + c + p.out_skip] = O(acc);
}

// ---- element-wise: MSE gradient and the non-finite check --------------------------------------------

//#entry mse_backward nonfinite
fn flat(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return gid.x + gid.y * nwg.x * WG;
}

//#entry mse_backward
// d loss / d pred for loss = mean((pred - target)^2) with x = pred, y = target, times the loss scale:
// coef = 2 * scale / n.
@compute @workgroup_size(WG)
fn mse_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  out[i + p.out_skip] = O(p.coef * (f32(x[i + p.x_skip]) - f32(y[i + p.y_skip])));
}

//#entry nonfinite
// Tests the exponent bits instead of isinf/isnan, which fast-math compilers may fold to false.
// x is read as raw 32-bit words `bits` (two f16 per word when IS_F16), from element `skip` on. The flag is
// an f32 [1] tensor; any thread that sees inf or NaN stores 1.0 (bits 0x3f800000) into it. Nothing ever
// clears it here.
@compute @workgroup_size(WG)
fn nonfinite(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = flat(gid, nwg);
  if (i >= p.n) { return; }
  let e = i + p.skip;
  var bad: bool;
  if (IS_F16) {
    let h = (bits[e >> 1u] >> ((e & 1u) * 16u)) & 0xffffu;
    bad = (h & 0x7c00u) == 0x7c00u;
  } else {
    bad = (bits[e] & 0x7f800000u) == 0x7f800000u;
  }
  if (bad) { atomicStore(&flag[0], 0x3f800000u); }
}
