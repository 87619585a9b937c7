// Token + position embedding lookup: out[b, t, :] = table[ids[b, t], :] + pos[t, :].
// Specialised by T (storage of table, pos, out) and WG. One invocation per output element.
// (Its backward, a scatter-add into the table, is only needed for textual inversion: not here.)

// Uniforms and bindings are declared in src/ops/embedding.ts (src/gpu/kernel.ts generates them):
//   n      B * L * D output elements
//   dim    D
//   len    L (positions)
//   vocab  rows of the table; ids past it read row 0 and are refused on the host
// ids [B * L] are u32; table [V, D], pos [P >= L, D] and out [B, L, D] are T.

@compute @workgroup_size(WG)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = gid.x + gid.y * nwg.x * WG;
  if (i >= p.n) { return; }
  let d = i % p.dim;
  let bt = i / p.dim;
  let t = bt % p.len;
  let id = min(ids[bt], p.vocab - 1u);
  out[i] = T(f32(table[id * p.dim + d]) + f32(pos[t * p.dim + d]));
}
