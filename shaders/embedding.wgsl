// Token + position embedding lookup: out[b, t, :] = table[ids[b, t], :] + pos[t, :].
// Specialised by T (storage of table, pos, out) and WG. One invocation per output element.
// (Its backward, a scatter-add into the table, is only needed for textual inversion: not here.)

struct Params {
  n: u32,        // B * L * D
  dim: u32,      // D
  len: u32,      // L (positions)
  vocab: u32,    // rows of the table; ids past it read row 0 and are refused on the host
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<T>;
@group(0) @binding(3) var<storage, read> pos: array<T>;
@group(0) @binding(4) var<storage, read_write> out: array<T>;

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
