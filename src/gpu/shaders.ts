// WGSL sources live in shaders/*.wgsl, one file per op family. Each host supplies the raw text
// (Node reads the folder, Vite bundles it); this module specialises a source by parameters.
//
// Specialisation prepends a prelude generated from `defs`:
//   string 'f16' | 'f32'  -> `alias NAME = f16;`   (storage types; f16 adds `enable f16;`)
//   number               -> `const NAME: u32 = 64u;`
//   boolean              -> `const NAME: bool = true;`
// so a shader is written once against T, TILE_M, HAS_BIAS, ... and never copied per variant.

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
    if (value === 'f16' || value === 'f32') lines.push(`alias ${name} = ${value};`);
    else if (typeof value === 'boolean') lines.push(`const ${name}: bool = ${value};`);
    else {
      if (!Number.isInteger(value) || value < 0) throw new Error(`shader def ${name}=${value}: numbers must be non-negative integers`);
      lines.push(`const ${name}: u32 = ${value}u;`);
    }
  }
  return `${lines.join('\n')}\n${source}`;
}

export function defsKey(defs: Defs): string {
  return Object.keys(defs)
    .sort()
    .map((k) => `${k}=${defs[k]}`)
    .join(',');
}
