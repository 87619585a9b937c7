// WGSL sources live in shaders/*.wgsl, one file per op family. Each host supplies the raw text
// (Node reads the folder, Vite bundles it); this module specialises a source by parameters.
//
// Specialisation prepends a prelude generated from `defs`:
//   string 'f16' | 'f32'  -> `alias NAME = f16;`   (storage types; f16 adds `enable f16;`)
//   number               -> `const NAME: u32 = 64u;`
//   boolean              -> `const NAME: bool = true;`
// so a shader is written once against T, TILE_M, HAS_BIAS, ... and never copied per variant. A source that names
// `<TYPE>_IS_F16` for a type def also gets `const <TYPE>_IS_F16: bool`, and one that calls `round_f16(` gets that
// helper (ROUND_F16).

export type DefValue = 'f16' | 'f32' | number | boolean;
export type Defs = Record<string, DefValue>;

export interface ShaderSource {
  /** Raw WGSL text of shaders/<name>.wgsl. */
  get(name: string): string;
}

export class MapShaderSource implements ShaderSource {
  constructor(private readonly files: Map<string, string>) {}
  get(name: string): string {
    const text = this.files.get(name);
    if (text === undefined) throw new Error(`shader '${name}.wgsl' not found (have: ${[...this.files.keys()].join(', ')})`);
    return text;
  }
}

export function specialise(source: string, defs: Defs): string {
  const lines: string[] = [];
  const usesF16 = Object.values(defs).some((v) => v === 'f16');
  if (usesF16) lines.push('enable f16;');
  for (const [name, value] of Object.entries(defs)) {
    if (value === 'f16' || value === 'f32') {
      lines.push(`alias ${name} = ${value};`);
      if (source.includes(`${name}_IS_F16`)) lines.push(`const ${name}_IS_F16: bool = ${value === 'f16'};`);
    } else if (typeof value === 'boolean') lines.push(`const ${name}: bool = ${value};`);
    else {
      if (!Number.isInteger(value) || value < 0) throw new Error(`shader def ${name}=${value}: numbers must be non-negative integers`);
      lines.push(`const ${name}: u32 = ${value}u;`);
    }
  }
  if (source.includes('round_f16(')) lines.push(ROUND_F16);
  return `${lines.join('\n')}\n${source}`;
}

/**
 * x rounded to the nearest f16 value, ties to even, as an f32: what an f16 store of x keeps (inf past 65504,
 * subnormals in steps of 2^-24). Integer operations on the bits, because f32(f16(x)) is not safe: SPIR-V float
 * operations are not exact, and a compiler may fold the pair into x (lavapipe does), so an epilogue that adds
 * into an f16 output would round once where a store and an add round twice.
 */
const ROUND_F16 = `fn round_f16(x: f32) -> f32 {
  let b = bitcast<u32>(x);
  let sign = b & 0x80000000u;
  let a = b & 0x7fffffffu;
  if (a >= 0x7f800000u) { return x; }
  if (a >= 0x477ff000u) { return bitcast<f32>(sign | 0x7f800000u); }
  if (a <= 0x33000000u) { return bitcast<f32>(sign); }
  if (a < 0x33800000u) { return bitcast<f32>(sign | 0x33800000u); }
  let e = i32(a >> 23u) - 127;
  let drop = u32(select(13, -1 - e, e < -14));
  let low = a & ((1u << drop) - 1u);
  let half = 1u << (drop - 1u);
  var r = a - low;
  if (low > half || (low == half && ((a >> drop) & 1u) == 1u)) { r += 1u << drop; }
  return bitcast<f32>(sign | r);
}`;

export function defsKey(defs: Defs): string {
  return Object.keys(defs)
    .sort()
    .map((k) => `${k}=${defs[k]}`)
    .join(',');
}
