// The generated GEMM cores' shape (src/ops/gemm.ts) and the tensor-core path's host-side logic, which run on every
// machine: which adapters get tensor cores, which tile a GEMM picks, and the generated entry points. Its numerics are the self-test's tensor-core tile cases and every
// f16 matmul/conv case, which run only where the adapter offers subgroup matrices (reported as not run elsewhere).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import { Tensor } from '../../src/gpu/tensor.ts';
import { kernel, kernelModule } from '../../src/gpu/kernel.ts';
import { chooseMatrixShape } from '../../src/gpu/tensorcore.ts';
import {
  pickSplitK,
  pickTcTile,
  prefetchFits,
  simtGemmEntry,
  SPLIT_K_MAX,
  SPLIT_K_MIN_CHUNK,
  tcDefs,
  tcSharedBytes,
  tcTileFits,
  TC_TILE_128,
  TC_TILE_32,
  TC_TILE_64,
  TC_TILES,
  tensorCoreEntry,
} from '../../src/ops/gemm.ts';
import { matmul, matmulRef } from '../../src/ops/matmul.ts';
import { DIRECT_TILES, GPU_TILE_32, GPU_TILE_64, GPU_TILE_COLS_16, GPU_TILE_ROWS_16, TILE_128, TILE_64, TILE_ROWS_4, type Tile } from '../../src/ops/tiles.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { matmulTol } from '../../src/selftest/cases/matmul.ts';
import { assertChecks, recordDispatches, testGpu } from '../helpers.ts';

const H200_CONFIGS = [
  { componentType: 'f16', resultComponentType: 'f16', M: 16, N: 16, K: 16 },
  { componentType: 'f16', resultComponentType: 'f32', M: 16, N: 8, K: 16 },
  { componentType: 'f16', resultComponentType: 'f32', M: 16, N: 16, K: 16 },
  { componentType: 'u8', resultComponentType: 'u32', M: 16, N: 16, K: 32 },
];
const ALL = new Set(['shader-f16', 'subgroups', 'chromium-experimental-subgroup-matrix']);
const info = (min: number, max: number, configs: unknown[] = H200_CONFIGS) => ({ subgroupMinSize: min, subgroupMaxSize: max, subgroupMatrixConfigs: configs });

describe('chooseMatrixShape', () => {
  it('takes the f16 x f16 -> f32 16x16x16 config an H200 lists (not the f16-result or integer ones)', () => {
    assert.deepEqual(chooseMatrixShape(ALL, info(32, 32)).shape, { M: 16, N: 16, K: 16 });
  });
  it('falls back to another f16 -> f32 config when 16x16x16 is absent', () => {
    assert.deepEqual(
      chooseMatrixShape(
        ALL,
        info(
          32,
          32,
          H200_CONFIGS.filter((c) => c.N !== 16 || c.componentType !== 'f16'),
        ),
      ).shape,
      { M: 16, N: 8, K: 16 },
    );
  });
  it('refuses adapters without the feature, f16, subgroups, 32-lane subgroups or an f16 -> f32 config, saying which', () => {
    const cases: [Set<string>, Record<string, unknown>, RegExp][] = [
      [new Set(['shader-f16', 'subgroups']), info(32, 32), /offers no subgroup matrices/],
      [new Set(['subgroups', 'chromium-experimental-subgroup-matrix']), info(32, 32), /shader-f16/],
      [new Set(['shader-f16', 'chromium-experimental-subgroup-matrix']), info(32, 32), /subgroups feature/],
      [ALL, info(8, 32), /32-lane subgroups; the adapter has 8-32/],
      [ALL, info(32, 32, [{ componentType: 'f16', resultComponentType: 'f16', M: 16, N: 16, K: 16 }]), /no f16 x f16 -> f32/],
    ];
    for (const [features, inf, why] of cases) {
      const r = chooseMatrixShape(features, inf);
      assert.equal(r.shape, null);
      assert.match(r.note, why);
    }
  });
});

/** A stand-in with an H200's limits and tensor cores, for the host-side tile choice (no GPU work is done). */
function h200Like(): Gpu {
  return {
    tensorCores: { M: 16, N: 16, K: 16 },
    fillWorkgroups: 256,
    facts: { maxInvocationsPerWorkgroup: 1024, maxWorkgroupStorage: 49152 },
  } as unknown as Gpu;
}

describe('pickTcTile', () => {
  it('is null where the device has no tensor cores (lavapipe here)', async () => {
    const gpu = await testGpu();
    assert.equal(gpu.tensorCores, null);
    assert.equal(pickTcTile(gpu, 4096, 320, 1), null);
  });
  it('takes the largest tile that still fills the GPU, else the smallest', () => {
    const gpu = h200Like();
    assert.equal(pickTcTile(gpu, 4096, 2560, 1), TC_TILE_128); // GEGLU projection: 640 workgroups of 128x128
    assert.equal(pickTcTile(gpu, 4096, 320, 1), TC_TILE_64); // attention projections: 320 of 64x64 (128x128 gives 96)
    assert.equal(pickTcTile(gpu, 77, 320, 1), TC_TILE_32); // cross-attention k/v: too few rows for anything bigger
  });
  it('every tile divides into 16x16 fragments and needs at most 24 KiB of workgroup memory', () => {
    const gpu = h200Like();
    for (const t of TC_TILES) {
      assert.ok(tcTileFits(gpu, t, { M: 16, N: 16, K: 16 }), JSON.stringify(t));
      assert.ok(tcSharedBytes(t, { M: 16, N: 16, K: 16 }) <= 24 * 1024, JSON.stringify(t));
    }
    assert.equal(tcTileFits(gpu, { BM: 48, BN: 64, SGM: 2, SGN: 2 }, { M: 16, N: 16, K: 16 }), false); // 48 rows / 2 subgroups: not whole fragments
  });
});

describe('tensor-core entry point', () => {
  const decl = kernel({ shader: 't', entry: 'gemm_tc', uniforms: [], bindings: [], code: tensorCoreEntry('gemm_tc') });
  for (const [tile, frags] of [
    [TC_TILE_128, 16],
    [TC_TILE_64, 4],
    [TC_TILE_32, 4],
  ] as const)
    it(`${tile.BM}x${tile.BN}: directives first, ${frags} accumulators per subgroup, 2 k-steps of multiply-accumulates, no loop-indexed matrices`, () => {
      const wgsl = kernelModule('', decl, { T: 'f16', ...tcDefs(tile, { M: 16, N: 16, K: 16 }) });
      const lines = wgsl.split('\n').filter((l) => l.trim());
      assert.deepEqual(lines.slice(0, 4), [
        'enable f16;',
        'enable subgroups;',
        'enable chromium_experimental_subgroup_matrix;',
        'diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);',
      ]);
      assert.equal(wgsl.match(/var acc_\d+_\d+ = subgroup_matrix_result<f32, 16, 16>\(\);/g)?.length, frags);
      assert.equal(wgsl.match(/subgroupMatrixMultiplyAccumulate\(/g)?.length, 2 * frags);
      assert.equal(wgsl.match(/subgroupMatrixStore\(/g)?.length, frags);
      assert.match(wgsl, new RegExp(`@workgroup_size\\(${32 * tile.SGM * tile.SGN}\\)`));
      assert.doesNotMatch(wgsl, /acc\[/);
    });
});

describe('SIMT entry point', () => {
  const decl = kernel({ shader: 't', entry: 'gemm', uniforms: [], bindings: [], code: simtGemmEntry('gemm') });
  for (const tile of [TILE_128, TILE_ROWS_4])
    it(`${tile.BM}x${tile.BN} with ${tile.TM}x${tile.TN} blocks: one named vec4 register per row and column group, updated with constant indices`, () => {
      const wgsl = kernelModule('', decl, { T: 'f32', ...tile });
      const regs = (tile.TM * tile.TN) / 4;
      assert.equal(wgsl.match(/var acc_\d+_\d+ = vec4<f32>\(0\.0\);/g)?.length, regs);
      // every FMA of the k loop names its register: none indexes an array by a loop counter (SwiftShader kept such
      // arrays in memory: 5.7x slower at 512x320x320)
      assert.equal(wgsl.match(/acc_\d+_\d+ = fma\(/g)?.length, regs);
      assert.doesNotMatch(wgsl.slice(0, wgsl.indexOf('var block')), /\w\[[^\]]*\b[ijr]\b[^\]]*\]/);
      assert.match(wgsl, new RegExp(`@workgroup_size\\(${tile.BN / tile.TN}, ${tile.BM / tile.TM}\\)`));
    });
});

describe('direct core (DIRECT: no shared tiles)', () => {
  const decl = kernel({ shader: 't', entry: 'gemm', uniforms: [], bindings: [], code: simtGemmEntry('gemm') });
  const square = DIRECT_TILES.square[0];
  it('no workgroup memory and no barrier; 4 k per step in k order, each a rank-1 update of every named register', () => {
    const wgsl = kernelModule('', decl, { T: 'f32', ...square });
    assert.doesNotMatch(wgsl, /var<workgroup>|workgroupBarrier|tile_[ab]/);
    assert.match(wgsl, /for \(var k0 = k_lo; k0 < k_hi; k0 \+= 4u\) \{/);
    // 4x8 blocks: 8 registers, each updated once per k of the 4
    assert.equal(wgsl.match(/var acc_\d+_\d+ = vec4<f32>\(0\.0\);/g)?.length, 8);
    assert.equal(wgsl.match(/acc_\d+_\d+ = fma\(/g)?.length, 4 * 8);
    // the k order of the staged core: all of k0 + 0's updates come before any of k0 + 1's
    const firstOf = (c: number) => wgsl.indexOf(`ga_${c}_0.x`);
    assert.ok(firstOf(0) < firstOf(1) && firstOf(1) < firstOf(2) && firstOf(2) < firstOf(3));
    assert.match(wgsl, /@workgroup_size\(8, 8\)/);
  });
  it('operands contiguous in k are read as vec4s along k straight into registers (A_QUADS, B_QUADS)', () => {
    const wgsl = kernelModule('', decl, { T: 'f32', ...square, A_QUADS: true, B_QUADS: true });
    assert.equal(wgsl.match(/= gemm_ak4\(/g)?.length, 4, 'one per row of the 4x8 block');
    assert.equal(wgsl.match(/= gemm_bk4\(/g)?.length, 8, 'one per column');
    assert.doesNotMatch(wgsl, /gemm_a4\(|gemm_b4\(/);
    // B's row at k0 + 2 for column group 1 is component z of its 4 columns' quads
    assert.ok(wgsl.includes('let b_2_1 = vec4<f32>(qb_4.z, qb_5.z, qb_6.z, qb_7.z);'));
  });
  it('refuses a step depth its 4-k steps would straddle', () => {
    assert.throws(() => kernelModule('', decl, { T: 'f32', ...square, BK: 6 }), /BK must be a multiple of 4/);
  });
});

describe('prefetch (32-deep steps, next step loaded into registers)', () => {
  const decl = kernel({ shader: 't', entry: 'gemm', uniforms: [], bindings: [], code: simtGemmEntry('gemm') });
  const deep = (t: Tile): Tile => ({ ...t, BK: 32, PREFETCH: true });

  it('prefetchFits: whole groups, at most PREFETCH_MAX_GROUPS per invocation and operand; not 4-row/4-column 4x4-block tiles', () => {
    // 4x4-block tiles 4 wide (no tile set has them: a GPU's side of at most 4 gets the 16-wide tile, which prefetches)
    const GPU_TILE_ROWS_4: Tile = { BM: 4, BN: 128, BK: 16, TM: 4, TN: 4 };
    const GPU_TILE_COLS_4: Tile = { BM: 128, BN: 4, BK: 16, TM: 4, TN: 4 };
    for (const t of [TILE_128, GPU_TILE_64, GPU_TILE_32, GPU_TILE_ROWS_16, GPU_TILE_COLS_16, TILE_64]) assert.ok(prefetchFits(deep(t)), JSON.stringify(t));
    // 32 vec4 groups of B (4-row) or A (4-column) per invocation at 32 deep
    for (const t of [GPU_TILE_ROWS_4, GPU_TILE_COLS_4]) assert.equal(prefetchFits(deep(t)), false, JSON.stringify(t));
    // half a group per invocation (4-row at 16 deep: 16 groups of A, 32 invocations)
    assert.equal(prefetchFits(GPU_TILE_ROWS_4), false);
    assert.throws(() => kernelModule('', decl, { T: 'f32', ...deep(GPU_TILE_ROWS_4) }), /cannot prefetch/);
  });

  it('loads the first step before the k loop and each next step after the barrier, before the FMAs', () => {
    const wgsl = kernelModule('', decl, { T: 'f32', ...deep(GPU_TILE_64) });
    // GPU 64x64 at 32 deep: 512 groups per operand over 256 invocations
    assert.equal(wgsl.match(/var pa_\d+_0 = vec4<f32>\(0\.0\);/g)?.length, 2);
    assert.equal(wgsl.match(/var pb_\d+_0 = vec4<f32>\(0\.0\);/g)?.length, 2);
    const loop = wgsl.indexOf('for (var k0 = k_lo;');
    const next = wgsl.indexOf('if (k0 + 32u < k_hi) {');
    const barrier = wgsl.indexOf('workgroupBarrier();', loop);
    const fma = wgsl.indexOf('fma(', loop);
    assert.ok(wgsl.indexOf('pa_0_0 = gemm_a4(z, row0 + na_0 * 4u, k_lo + ka_0);') < loop, 'first step loaded before the loop');
    assert.ok(barrier < next && next < fma, 'the next step is loaded after the barrier and before the FMAs');
    assert.match(wgsl.slice(next, fma), /pb_1_0 = gemm_b4\(z, k0 \+ 32u \+ kb_1, col0 \+ nb_1 \* 4u\);/);
    assert.ok(wgsl.indexOf('tile_a[ka_0 * 16u + na_0] = pa_0_0;', loop) < barrier, 'registers stored before the barrier');
  });
});

describe('quad staging (vec4 loads along k: A [M, K], Bᵀ stored [N, K])', () => {
  const decl = kernel({ shader: 't', entry: 'gemm', uniforms: [], bindings: [], code: simtGemmEntry('gemm') });
  const deep = (t: Tile): Tile => ({ ...t, BK: 32, PREFETCH: true });

  it('each unit reads 4 vec4s along k and stores their transpose, one vec4 per k row of the tile', () => {
    const wgsl = kernelModule('', decl, { T: 'f32', ...TILE_64, A_QUADS: true, B_QUADS: true });
    // 64x64x16: 16 row groups x 4 k groups per operand, walked by 64 invocations
    assert.match(wgsl, /for \(var g = tid; g < 64u; g \+= 64u\) \{/);
    for (let r = 0; r < 4; r++) assert.ok(wgsl.includes(`let v${r} = gemm_ak4(z, row0 + mn * 4u + ${r}u, k0 + k);`), `A row ${r}`);
    for (let r = 0; r < 4; r++) assert.ok(wgsl.includes(`let v${r} = gemm_bk4(z, k0 + k, col0 + mn * 4u + ${r}u);`), `B column ${r}`);
    // tile row k + c holds component c of the 4 rows
    assert.ok(wgsl.includes('tile_a[(k + 2u) * 16u + mn] = vec4<f32>(v0.z, v1.z, v2.z, v3.z);'));
    assert.ok(wgsl.includes('tile_b[(k + 3u) * 16u + mn] = vec4<f32>(v0.w, v1.w, v2.w, v3.w);'));
    assert.doesNotMatch(wgsl, /gemm_a4\(|gemm_b4\(/);
    // without the defs the groups are staged as before
    const plain = kernelModule('', decl, { T: 'f32', ...TILE_64 });
    assert.doesNotMatch(plain, /gemm_ak4\(|gemm_bk4\(/);
  });

  it('prefetching: each invocation holds whole quads, the last one guarded where they do not divide evenly', () => {
    // 8x8 blocks, 64x64x32: 128 quads per operand over 64 invocations, 2 each (8 registers), unguarded
    const cpu = kernelModule('', decl, { T: 'f32', ...deep(TILE_64), A_QUADS: true, B_QUADS: true });
    assert.equal(cpu.match(/var pa_\d_\d = vec4<f32>\(0\.0\);/g)?.length, 8);
    assert.doesNotMatch(cpu, /if \(g[ab]_\d < /);
    assert.ok(cpu.includes('pa_1_3 = gemm_ak4(z, row0 + na_1 * 4u + 3u, k_lo + ka_1);'));
    // GPU 64x64 (4x4 blocks): 128 quads over 256 invocations, only the first 128 hold one
    const gpu = kernelModule('', decl, { T: 'f32', ...deep(GPU_TILE_64), B_QUADS: true });
    assert.equal(gpu.match(/var pb_0_\d = vec4<f32>\(0\.0\);/g)?.length, 4);
    assert.equal(gpu.match(/if \(gb_0 < 128u\) \{/g)?.length, 3, 'first loads, stores and next loads guarded');
    assert.equal(gpu.match(/gb_1/g), null);
    assert.match(gpu, /var pa_1_0/, 'A still staged in groups, 2 per invocation');
  });
});

describe('quad staging: which GEMMs matmul stages in quads', () => {
  it('x·Wᵀ with K % 4 == 0 stages both operands in quads; transposed A, K % 4 != 0 and an unaligned view do not', async () => {
    const gpu = await testGpu();
    const [M, K, N] = [9, 12, 16];
    const x = randomValues(M * K, 1);
    const w = randomValues(N * K, 2);
    const tx = gpu.upload(x, [M, K], 'f32');
    const tw = gpu.upload(w, [N, K], 'f32');
    const quads = (f: () => Tensor) => {
      let y: Tensor | null = null;
      const d = recordDispatches(gpu, () => (y = f())).filter((r) => r.entry === 'matmul');
      assert.equal(d.length, 1);
      return { y: y!, a: d[0].defs.A_QUADS, b: d[0].defs.B_QUADS };
    };
    const nt = quads(() => matmul(gpu, tx, tw, { transB: true }));
    assert.deepEqual([nt.a, nt.b], [true, true]);
    assertChecks([compare('x·Wᵀ', await gpu.read(nt.y), matmulRef(x, [M, K], w, [N, K], { transB: true }), matmulTol('f32'))]);
    // Aᵀ stored [K, M] is contiguous in m: groups along m, not quads
    const tn = quads(() => matmul(gpu, tw, tw, { transA: true }));
    assert.deepEqual([tn.a, tn.b], [false, false]);
    // K = 11: no quads
    const t11 = gpu.upload(x.subarray(0, M * 11), [M, 11], 'f32');
    const w11 = gpu.upload(w.subarray(0, N * 11), [N, 11], 'f32');
    const odd = quads(() => matmul(gpu, t11, w11, { transB: true }));
    assert.deepEqual([odd.a, odd.b], [false, false]);
    // a view 1 element into its buffer: scalar loads for that operand only
    const shifted = gpu.upload(new Float32Array([0, ...x]), [M * K + 1], 'f32');
    const view = new Tensor(shifted.alloc, [M, K], 'f32', shifted.byteOffset + 4, false);
    const off = quads(() => matmul(gpu, view, tw, { transB: true }));
    assert.deepEqual([off.a, off.b], [false, true]);
    assertChecks([compare('unaligned x·Wᵀ', await gpu.read(off.y), matmulRef(x, [M, K], w, [N, K], { transB: true }), matmulTol('f32'))]);
    gpu.free(tx, tw, t11, w11, shifted, nt.y, tn.y, odd.y, off.y);
  });
});

describe('split-K', () => {
  it('pickSplitK: none while the tiles fill the device or the reduction is short; else chunks of whole BK steps', () => {
    assert.deepEqual(pickSplitK(256, 1 << 16, 16, 256, 32), { splits: 1, chunk: 1 << 16 }); // tiles fill the GPU
    assert.deepEqual(pickSplitK(3, 2047, 16, 256, 32), { splits: 1, chunk: 2047 }); // K < 2 chunks of SPLIT_K_MIN_CHUNK
    // LoRA's weight gradient at 512 px: [4 x 320] over 2 x 4096 tokens is 3 tiles on a GPU (fill 256): 8 chunks of 1024
    assert.deepEqual(pickSplitK(3, 8192, 16, 256, 32), { splits: 8, chunk: 1024 });
    // SD 1.5's 3x3 conv grad weight at 64x64 latents, batch 2: 69 tiles of 128x128 -> 4 chunks of 2048
    assert.deepEqual(pickSplitK(69, 8192, 16, 256, 32), { splits: 4, chunk: 2048 });
    // never more than SPLIT_K_MAX, nor than the partials' room
    assert.equal(pickSplitK(1, 1 << 20, 16, 256, 1000).splits, SPLIT_K_MAX);
    assert.equal(pickSplitK(1, 1 << 20, 16, 256, 5).splits, 5);
    // forced: a ragged K = 301 in 3 chunks of 112 (7 BK steps), the last 77 long
    assert.deepEqual(pickSplitK(1000, 301, 16, 256, 32, 3), { splits: 3, chunk: 112 });
    // forced more chunks than BK steps: one step each
    assert.deepEqual(pickSplitK(1, 40, 16, 256, 32, 9), { splits: 3, chunk: 16 });
    assert.deepEqual(pickSplitK(1, 301, 16, 256, 32, 1), { splits: 1, chunk: 301 });
    assert.deepEqual(pickSplitK(1, 1 << 16, 16, 0, 32), { splits: 1, chunk: 1 << 16 }); // fill 0: automatic split off
    assert.deepEqual(pickSplitK(1, 301, 16, 0, 32, 3), { splits: 3, chunk: 112 }); // ... a forced one still runs
    assert.throws(() => pickSplitK(1, 301, 16, 256, 32, 0), /splitK must be a whole number >= 1/);
    assert.equal(SPLIT_K_MIN_CHUNK % 32, 0); // whole steps of either core's BK
  });

  it('the split core sums only its chunk and stores partials, not through gemm_out', () => {
    const decl = kernel({ shader: 't', entry: 'gemm', uniforms: [], bindings: [], code: simtGemmEntry('gemm') });
    const whole = kernelModule('', decl, { T: 'f32', ...TILE_128 });
    const split = kernelModule('', decl, { T: 'f32', ...TILE_128, SPLIT_K: true });
    assert.match(whole, /gemm_out\(z, m, n0 \+ q, v\[q\]\);/);
    assert.doesNotMatch(whole, /part\[/);
    assert.match(split, /let k_lo = \(wg\.z % p\.k_splits\) \* p\.k_chunk;/);
    assert.match(split, /for \(var k0 = k_lo; k0 < k_hi; k0 \+= 16u\)/);
    assert.match(split, /part\[\(wg\.z \* dims\.x \+ m\) \* dims\.y \+ n0 \+ q\] = v\[q\];/);
    assert.doesNotMatch(split, /gemm_out\(/);
  });

  it('runs on its own where a GEMM has few tiles and a long reduction, and gives the unsplit result', async () => {
    // splitK: on by default only on GPUs; poison off, so only kernel dispatches count (it adds a fill per new tensor)
    const gpu = await testGpu({ poison: false, splitK: true });
    // LoRA-shaped weight gradient: [4 x 64] = xᵀ [4 x 4096] · dy [4096 x 64]; one 4-row tile on a CPU adapter
    // (fillWorkgroups 8), so 4 chunks of 1024: the partial pass and the reduce pass are 2 dispatches.
    const [M, K, N] = [4, 4096, 64];
    const xv = randomValues(K * M, 71);
    const dyv = randomValues(K * N, 72);
    const x = gpu.upload(xv, [K, M], 'f32');
    const dy = gpu.upload(dyv, [K, N], 'f32');
    const run = (splitK?: number) => {
      const before = gpu.dispatchCount;
      const y = matmul(gpu, x, dy, { transA: true, splitK });
      return { y, dispatches: gpu.dispatchCount - before };
    };
    const auto = run();
    const cpuDefault = await testGpu(); // the shared test device: lavapipe, where split-K is off by default
    assert.equal(cpuDefault.autoSplitK, !cpuDefault.facts.software);
    const whole = run(1);
    assert.equal(auto.dispatches, 2, 'split-K chosen: partials + reduce');
    assert.equal(whole.dispatches, 1);
    const ref = matmulRef(xv, [K, M], dyv, [K, N], { transA: true });
    // f32 sums of 4096 terms of magnitude ~1 in another order: |error| ~ 1e-7 * sqrt(K) * |terms| << 1e-4
    assertChecks([compare('split', await gpu.read(auto.y), ref, matmulTol('f32')), compare('whole', await gpu.read(whole.y), ref, matmulTol('f32'))]);
    gpu.destroy();
  });
});
