// Named kernel interfaces. Each compute entry point declares its uniforms and storage bindings once, in
// TypeScript, as {name, type} lists; the WGSL declarations are generated from that list and the host binds
// by name. A WGSL file therefore declares no `var<uniform>` or `var<storage>` of its own.
//
//   const NORM_FWD = kernel({
//     shader: 'norm', entry: 'norm_fwd',
//     uniforms: [{ name: 'seg_len', type: 'u32' }, { name: 'eps', type: 'f32' }],
//     bindings: [{ name: 'x', type: 'T', access: 'read' }, { name: 'y', type: 'T', access: 'read_write' }],
//   });
//   gpu.run(NORM_FWD, { defs: { T: 'f16' }, uniforms: { seg_len: 640, eps: 1e-5 }, bindings: { x, y }, workgroups: [n] });
//
// generates, ahead of the shader text,
//
//   struct Params { seg_len: u32, eps: f32, }
//   @group(0) @binding(0) var<uniform> p: Params;
//   @group(0) @binding(1) var<storage, read> x: array<T>;
//   @group(0) @binding(2) var<storage, read_write> y: array<T>;
//
// Sections. A WGSL file holding several entry points is split by marker lines `//#entry name1 name2 ...`: the
// text before the first marker is common to every entry point; each marker starts a section that belongs to the
// entry points it names. The module compiled for an entry point is the generated declarations, the common text
// and its sections, so each entry point sees exactly the uniforms and bindings it declared.
//
// Generated code. `code(defs)` may emit WGSL (an unrolled micro-kernel, say) between the declarations and the
// file's text.
//
// Optional bindings. A binding with `when: 'HAS_BIAS'` is a storage binding only when the boolean def HAS_BIAS
// is true; otherwise it becomes `var<private> bias: array<T, 1>`, so code under `if (HAS_BIAS)` still compiles,
// no buffer is bound and none may be passed. `when: '!SPLIT_K'` binds it only when the def is false.

import { specialise, type Defs } from './shaders.ts';

export type ScalarType = 'u32' | 'i32' | 'f32';

export interface UniformDecl {
  readonly name: string;
  readonly type: ScalarType;
}

export interface BindingDecl {
  readonly name: string;
  /** WGSL element type of the bound array: 'T', 'f32', 'u32', 'vec4<f32>', 'atomic<u32>', ... */
  readonly type: string;
  readonly access: 'read' | 'read_write';
  /** Bound only when this boolean def is true, or with a leading '!' false (see the file comment). */
  readonly when?: string;
}

export interface KernelDecl {
  /** shaders/<shader>.wgsl */
  readonly shader: string;
  readonly entry: string;
  readonly uniforms: readonly UniformDecl[];
  readonly bindings: readonly BindingDecl[];
  /**
   * WGSL generated from the defs, placed after the declarations and before the file's text: for code that
   * WGSL cannot express with constant loop bounds alone, e.g. a register micro-kernel unrolled into
   * constant indices for one tile shape. Part of the pipeline's identity only through the defs.
   */
  readonly code?: (defs: Defs) => string;
}

/** Shorthands for declarations: a u32 / f32 uniform, and a storage array read or written (elements T by default). */
export const u32 = <N extends string>(name: N) => ({ name, type: 'u32' as const });
export const f32 = <N extends string>(name: N) => ({ name, type: 'f32' as const });
export const read = <N extends string>(name: N, type = 'T') => ({ name, type, access: 'read' as const });
export const write = <N extends string>(name: N, type = 'T') => ({ name, type, access: 'read_write' as const });

/** Declares a kernel; `const` keeps the literal names so calls are checked against them. */
export function kernel<const D extends KernelDecl>(decl: D): D {
  const names = new Set<string>();
  for (const { name } of [...decl.uniforms, ...decl.bindings]) {
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(name)) throw new Error(`${decl.shader}.${decl.entry}: '${name}' is not a WGSL identifier`);
    if (names.has(name)) throw new Error(`${decl.shader}.${decl.entry}: '${name}' is declared twice`);
    names.add(name);
  }
  return decl;
}

type NameIfRequired<B> = B extends { readonly when: string } ? never : B extends { readonly name: infer N } ? N : never;
type RequiredBinding<D extends KernelDecl> = NameIfRequired<D['bindings'][number]> & string;
type OptionalBinding<D extends KernelDecl> = Exclude<D['bindings'][number]['name'], RequiredBinding<D>>;

/** `uniforms` of a call: every declared uniform by name. */
export type UniformArgs<D extends KernelDecl> = { readonly [K in D['uniforms'][number]['name']]: number };
/** `bindings` of a call: every binding by name; `when` bindings only when their def is on. */
export type BindingArgs<D extends KernelDecl, B> = { readonly [K in RequiredBinding<D>]: B } & {
  readonly [K in OptionalBinding<D>]?: B;
};

/** Whether the binding is a storage binding under these defs. */
function isBound(b: BindingDecl, defs: Defs): boolean {
  if (b.when === undefined) return true;
  const negated = b.when.startsWith('!');
  const def = negated ? b.when.slice(1) : b.when;
  const v = defs[def];
  if (typeof v !== 'boolean') throw new Error(`binding '${b.name}' depends on def ${def}, which must be a boolean (got ${String(v)})`);
  return v !== negated;
}

/** The WGSL declarations of a kernel's interface under these defs (binding i + 1 is the i-th binding). */
export function declarations(decl: KernelDecl, defs: Defs): string {
  const lines: string[] = [];
  if (decl.uniforms.length > 0) {
    lines.push(`struct Params {`, ...decl.uniforms.map((u) => `  ${u.name}: ${u.type},`), `}`);
    lines.push(`@group(0) @binding(0) var<uniform> p: Params;`);
  }
  decl.bindings.forEach((b, i) => {
    if (isBound(b, defs)) lines.push(`@group(0) @binding(${i + 1}) var<storage, ${b.access}> ${b.name}: array<${b.type}>;`);
    else lines.push(`var<private> ${b.name}: array<${b.type}, 1>;`);
  });
  return lines.join('\n');
}

const MARKER = /^\/\/#entry\b(.*)$/;
const DIRECTIVE = /^[ \t]*(enable|requires|diagnostic)\b[^;\n]*;[ \t]*$/gm;

/** The common text of a WGSL file plus the sections that belong to `entry`. */
export function sectionsFor(source: string, entry: string): string {
  const lines = source.split('\n');
  const kept: string[] = [];
  let keep = true; // the common part
  let found = false;
  let sawMarker = false;
  for (const line of lines) {
    const m = MARKER.exec(line);
    if (m) {
      sawMarker = true;
      keep = m[1].trim().split(/\s+/).includes(entry);
      found ||= keep;
      kept.push(''); // keeps line numbers of compiler messages close to the file's
      continue;
    }
    kept.push(keep ? line : '');
  }
  if (sawMarker && !found) throw new Error(`no '//#entry' section names entry point '${entry}'`);
  return kept.join('\n');
}

/** The full module for one entry point: prelude of defs, generated interface, then its text. */
export function kernelModule(source: string, decl: KernelDecl, defs: Defs): string {
  const generated = decl.code ? `${decl.code(defs)}\n` : '';
  const body = specialise(`${declarations(decl, defs)}\n${generated}${sectionsFor(source, decl.entry)}`, defs);
  // WGSL wants directives (`enable subgroups;`) before every declaration: lift those of the generated code and
  // the sections above the prelude (blank lines keep the line count).
  const directives = new Set<string>();
  const rest = body.replace(DIRECTIVE, (line) => {
    directives.add(line.trim());
    return '';
  });
  return directives.size ? `${[...directives].join('\n')}\n${rest}` : rest;
}

/** Bytes of a kernel's uniform struct: 4 per uniform, padded to 16 (at least 16). */
export function uniformBytes(decl: KernelDecl): number {
  return Math.max(16, Math.ceil((decl.uniforms.length * 4) / 16) * 16);
}

/** Each declared uniform's index by name, made once per declaration (packing runs on every dispatch). */
const uniformIndex = new WeakMap<KernelDecl, Map<string, number>>();

function indexOf(decl: KernelDecl): Map<string, number> {
  let index = uniformIndex.get(decl);
  if (!index) uniformIndex.set(decl, (index = new Map(decl.uniforms.map((u, i) => [u.name, i]))));
  return index;
}

/**
 * Packs a call's uniforms in declaration order into `view` at `byteOffset` (4 bytes each, the struct's padding
 * zeroed) and returns the struct's size. Checks every value first and writes nothing when one is refused.
 */
export function packUniformsInto(decl: KernelDecl, values: Readonly<Record<string, number>>, view: DataView, byteOffset: number): number {
  const where = `${decl.shader}.${decl.entry}`;
  const index = indexOf(decl);
  for (const name in values) if (!index.has(name)) throw new Error(`${where}: no uniform named '${name}'`);
  const us = decl.uniforms;
  for (let i = 0; i < us.length; i++) {
    const { name, type } = us[i];
    const v = values[name];
    if (typeof v !== 'number' || Number.isNaN(v)) throw new Error(`${where}: uniform '${name}' is missing or not a number (${String(v)})`);
    if (type === 'u32') {
      if (!Number.isInteger(v) || v < 0 || v > 0xffffffff) throw new Error(`${where}: uniform '${name}' = ${v} is not a u32`);
    } else if (type === 'i32') {
      if (!Number.isInteger(v) || v < -0x80000000 || v > 0x7fffffff) throw new Error(`${where}: uniform '${name}' = ${v} is not an i32`);
    }
  }
  const size = uniformBytes(decl);
  for (let i = 0; i < us.length; i++) {
    const v = values[us[i].name];
    const at = byteOffset + i * 4;
    if (us[i].type === 'u32') view.setUint32(at, v, true);
    else if (us[i].type === 'i32') view.setInt32(at, v, true);
    else view.setFloat32(at, v, true);
  }
  for (let at = byteOffset + us.length * 4; at < byteOffset + size; at += 4) view.setUint32(at, 0, true);
  return size;
}

/** Packs a call's uniforms in declaration order (4 bytes each, the struct padded to 16 bytes). */
export function packUniforms(decl: KernelDecl, values: Readonly<Record<string, number>>): ArrayBuffer {
  const buf = new ArrayBuffer(uniformBytes(decl));
  packUniformsInto(decl, values, new DataView(buf), 0);
  return buf;
}

/**
 * Orders a call's named bindings by binding number: entry i is @binding(i + 1), null where the binding is a
 * private stand-in under these defs. Refuses unknown names, missing bindings and bindings given for an
 * optional binding that is off.
 */
export function orderBindings<B>(decl: KernelDecl, defs: Defs, given: Readonly<Record<string, B | undefined>>): (B | null)[] {
  const where = `${decl.shader}.${decl.entry}`;
  for (const name of Object.keys(given)) if (!decl.bindings.some((b) => b.name === name)) throw new Error(`${where}: no binding named '${name}'`);
  return decl.bindings.map((b) => {
    const v = given[b.name];
    if (isBound(b, defs)) {
      if (v === undefined || v === null) throw new Error(`${where}: binding '${b.name}' is missing`);
      return v;
    }
    if (v !== undefined && v !== null) {
      const off = b.when!.startsWith('!') ? `${b.when!.slice(1)}=true` : `${b.when}=false`;
      throw new Error(`${where}: binding '${b.name}' is unused with ${off}; pass none`);
    }
    return null;
  });
}
