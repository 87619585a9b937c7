// Softmax over the last dim, one workgroup per row. Specialised by T (storage) and WG.
// Forward: y = exp(x - max) / sum(exp(x - max)) (max subtracted for range, f32 sums).
// Backward from y and dy: dx = y * (dy - sum(dy * y)).

// Uniforms (rows, cols) and bindings are declared per entry point in src/ops/softmax.ts (src/gpu/kernel.ts
// generates them).

var<workgroup> red: array<f32, WG>;

fn reduce_max(lid: u32, v: f32) -> f32 {
  red[lid] = v;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s / 2u) {
    if (lid < s) { red[lid] = max(red[lid], red[lid + s]); }
    workgroupBarrier();
  }
  let r = red[0];
  workgroupBarrier();
  return r;
}

fn reduce_sum(lid: u32, v: f32) -> f32 {
  red[lid] = v;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s / 2u) {
    if (lid < s) { red[lid] += red[lid + s]; }
    workgroupBarrier();
  }
  let r = red[0];
  workgroupBarrier();
  return r;
}

//#entry softmax_fwd
@compute @workgroup_size(WG)
fn softmax_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let row = wid.x + wid.y * nwg.x;
  if (row >= p.rows) { return; }
  let base = row * p.cols;
  var m = -3.0e38;
  for (var j = lid; j < p.cols; j += WG) { m = max(m, f32(x[base + j])); }
  m = reduce_max(lid, m);
  var s = 0.0;
  for (var j = lid; j < p.cols; j += WG) { s += exp(f32(x[base + j]) - m); }
  let inv = 1.0 / reduce_sum(lid, s);
  for (var j = lid; j < p.cols; j += WG) { y[base + j] = T(exp(f32(x[base + j]) - m) * inv); }
}

//#entry softmax_bwd
// y = the forward output, dy = upstream gradient.
@compute @workgroup_size(WG)
fn softmax_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let row = wid.x + wid.y * nwg.x;
  if (row >= p.rows) { return; }
  let base = row * p.cols;
  var s = 0.0;
  for (var j = lid; j < p.cols; j += WG) { s += f32(dy[base + j]) * f32(y[base + j]); }
  let dot = reduce_sum(lid, s);
  for (var j = lid; j < p.cols; j += WG) { dx[base + j] = T(f32(y[base + j]) * (f32(dy[base + j]) - dot)); }
}
