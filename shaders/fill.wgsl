// Fills a range of 32-bit words with one bit pattern: zeros for Gpu.zeros on a reused (pooled) buffer, and
// NaN (0xFFFFFFFF: a NaN in f32 and two NaNs in f16) when the Gpu poisons new tensors to catch code that
// reads memory it never wrote. Specialised by WG (workgroup size). The host splits ranges larger than one
// storage binding.

struct Params {
  words: u32,   // 32-bit words to fill
  value: u32,   // the bit pattern
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(WG)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x + gid.y * nwg.x * WG;
  if (i >= p.words) { return; }
  out[i] = p.value;
}
