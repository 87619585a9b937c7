// Fills a range of 32-bit words with one bit pattern: zeros for Gpu.zeros on a reused (pooled) buffer, and
// NaN (0xFFFFFFFF: a NaN in f32 and two NaNs in f16) when the Gpu poisons new tensors to catch code that
// reads memory it never wrote. Specialised by WG (workgroup size). The host splits ranges larger than one
// storage binding.

// Interface (FILL in src/gpu/device.ts): uniforms words (32-bit words to fill) and value (the bit pattern);
// binding out: array<u32>.

@compute @workgroup_size(WG)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x + gid.y * nwg.x * WG;
  if (i >= p.words) { return; }
  out[i] = p.value;
}
