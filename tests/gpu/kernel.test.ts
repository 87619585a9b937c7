// Named kernel interfaces (src/gpu/kernel.ts): declarations generated from {name, type} lists, sections of a
// multi-entry WGSL file, uniforms packed and bindings ordered by name, and a real dispatch through them.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { MapShaderSource } from '../../src/gpu/shaders.ts';
import { Gpu } from '../../src/gpu/device.ts';
import { declarations, kernel, kernelModule, orderBindings, packUniforms, read, sectionsFor } from '../../src/gpu/kernel.ts';
import { nodeGpu } from '../../src/gpu/node.ts';

const AXPY = kernel({
  shader: 'axpy',
  entry: 'axpy',
  uniforms: [
    { name: 'n', type: 'u32' },
    { name: 'alpha', type: 'f32' },
    { name: 'shift', type: 'i32' },
  ],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'bias', type: 'T', access: 'read', when: 'HAS_BIAS' },
    { name: 'y', type: 'T', access: 'read_write' },
  ],
});

const SOURCE = `
fn twice(v: f32) -> f32 { return 2.0 * v; }
//#entry axpy
@compute @workgroup_size(64)
fn axpy(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.n) { return; }
  var v = p.alpha * f32(x[i]) + f32(y[i]) + f32(p.shift);
  if (HAS_BIAS) { v += f32(bias[i]); }
  y[i] = T(v);
}
//#entry other
@compute @workgroup_size(1)
fn other() { undeclared_thing[0] = 1.0; }
`;

describe('named kernel interfaces', () => {
  it('generates the uniform struct and numbered bindings from the declaration', () => {
    const d = declarations(AXPY, { T: 'f32', HAS_BIAS: true });
    assert.match(d, /struct Params \{\n {2}n: u32,\n {2}alpha: f32,\n {2}shift: i32,\n\}/);
    assert.match(d, /@binding\(0\) var<uniform> p: Params;/);
    assert.match(d, /@binding\(1\) var<storage, read> x: array<T>;/);
    assert.match(d, /@binding\(2\) var<storage, read> bias: array<T>;/);
    assert.match(d, /@binding\(3\) var<storage, read_write> y: array<T>;/);
  });

  it('an optional binding that is off becomes a private stand-in with no binding number', () => {
    const d = declarations(AXPY, { T: 'f32', HAS_BIAS: false });
    assert.match(d, /var<private> bias: array<T, 1>;/);
    assert.doesNotMatch(d, /@binding\(2\)/);
    assert.match(d, /@binding\(3\) var<storage, read_write> y/);
    assert.throws(() => declarations(AXPY, { T: 'f32' }), /depends on def HAS_BIAS, which must be a boolean/);
  });

  it('keeps the common text and only the sections naming the entry point', () => {
    const s = sectionsFor(SOURCE, 'axpy');
    assert.match(s, /fn twice/);
    assert.match(s, /fn axpy/);
    assert.doesNotMatch(s, /fn other|undeclared_thing/);
    assert.equal(s.split('\n').length, SOURCE.split('\n').length, 'line count kept for compiler messages');
    assert.throws(() => sectionsFor(SOURCE, 'missing'), /no '\/\/#entry' section names entry point 'missing'/);
    assert.match(sectionsFor('fn plain() {}', 'anything'), /fn plain/, 'a file without markers is all common');
    const m = kernelModule(SOURCE, AXPY, { T: 'f16', HAS_BIAS: false });
    assert.match(m, /^enable f16;/);
    // A directive inside a section is lifted above the generated declarations (WGSL wants directives first).
    const withEnable = kernelModule(SOURCE.replace('//#entry axpy\n', '//#entry axpy\nenable subgroups;\n'), AXPY, { T: 'f16', HAS_BIAS: false });
    const lines = withEnable.split('\n');
    assert.ok(lines.indexOf('enable subgroups;') >= 0 && lines.indexOf('enable subgroups;') < lines.findIndex((l) => l.startsWith('alias')), withEnable);
    assert.equal(lines.filter((l) => /enable subgroups/.test(l)).length, 1);
  });

  it('packs uniforms by name and type, refusing unknown, missing and out-of-range values', () => {
    const bytes = new DataView(packUniforms(AXPY, { n: 7, alpha: 0.5, shift: -3 }));
    assert.equal(bytes.byteLength, 16);
    assert.equal(bytes.getUint32(0, true), 7);
    assert.equal(bytes.getFloat32(4, true), 0.5);
    assert.equal(bytes.getInt32(8, true), -3);
    assert.throws(() => packUniforms(AXPY, { n: 7, alpha: 1, shift: 0, extra: 1 }), /axpy\.axpy: no uniform named 'extra'/);
    assert.throws(() => packUniforms(AXPY, { n: 7, alpha: 1 }), /uniform 'shift' is missing/);
    assert.throws(() => packUniforms(AXPY, { n: -1, alpha: 1, shift: 0 }), /uniform 'n' = -1 is not a u32/);
    assert.throws(() => packUniforms(AXPY, { n: 1, alpha: 1, shift: 2 ** 31 }), /is not an i32/);
  });

  it('orders bindings by number and refuses unknown, missing and unused ones', () => {
    assert.deepEqual(orderBindings(AXPY, { HAS_BIAS: true }, { y: 'Y', x: 'X', bias: 'B' }), ['X', 'B', 'Y']);
    assert.deepEqual(orderBindings(AXPY, { HAS_BIAS: false }, { y: 'Y', x: 'X' }), ['X', null, 'Y']);
    assert.throws(() => orderBindings(AXPY, { HAS_BIAS: false }, { y: 'Y', x: 'X', z: 'Z' }), /no binding named 'z'/);
    assert.throws(() => orderBindings(AXPY, { HAS_BIAS: true }, { y: 'Y', x: 'X' }), /binding 'bias' is missing/);
    assert.throws(() => orderBindings(AXPY, { HAS_BIAS: false }, { y: 'Y', x: 'X', bias: 'B' }), /'bias' is unused with HAS_BIAS=false/);
    // `when: '!SPLIT'`: bound only while the def is false (the GEMM output of a split-K partial pass)
    const NEG = kernel({ shader: 's', entry: 'e', uniforms: [], bindings: [read('x'), { name: 'c', type: 'T', access: 'read_write', when: '!SPLIT' }] });
    assert.deepEqual(orderBindings(NEG, { SPLIT: false }, { x: 'X', c: 'C' }), ['X', 'C']);
    assert.deepEqual(orderBindings(NEG, { SPLIT: true }, { x: 'X' }), ['X', null]);
    assert.throws(() => orderBindings(NEG, { SPLIT: true }, { x: 'X', c: 'C' }), /'c' is unused with SPLIT=true/);
    assert.throws(() => orderBindings(NEG, { SPLIT: false }, { x: 'X' }), /binding 'c' is missing/);
    assert.match(declarations(NEG, { SPLIT: true }), /var<private> c: array<T, 1>;/);
    assert.match(declarations(NEG, { SPLIT: false }), /@binding\(2\) var<storage, read_write> c: array<T>;/);
    assert.throws(
      () => kernel({ shader: 's', entry: 'e', uniforms: [{ name: 'a', type: 'u32' }], bindings: [{ name: 'a', type: 'T', access: 'read' }] }),
      /'a' is declared twice/,
    );
  });

  it('runs a declared kernel on the GPU with its bindings by name, with and without the optional one', async () => {
    const gpu: Gpu = await nodeGpu({ shaders: new MapShaderSource(new Map([['axpy', SOURCE]])) });
    try {
      const n = 100;
      const xs = Float32Array.from({ length: n }, (_, i) => i);
      const x = gpu.upload(xs, [n], 'f32');
      const bias = gpu.upload(
        Float32Array.from({ length: n }, () => 1000),
        [n],
        'f32',
      );
      const y = gpu.upload(new Float32Array(n).fill(1), [n], 'f32');
      gpu.run(AXPY, { defs: { T: 'f32', HAS_BIAS: false }, uniforms: { n, alpha: 2, shift: -1 }, bindings: { x, y }, workgroups: [2] });
      assert.deepEqual([...(await gpu.read(y))].slice(0, 4), [0, 2, 4, 6]); // 2x + 1 - 1
      gpu.run(AXPY, { defs: { T: 'f32', HAS_BIAS: true }, uniforms: { n, alpha: 1, shift: 0 }, bindings: { x, bias, y }, workgroups: [2] });
      const out = await gpu.read(y);
      assert.equal(out[3], 6 + 3 + 1000);
      assert.equal(out[99], 198 + 99 + 1000);
    } finally {
      gpu.destroy();
    }
  });
});
