// The generated GEMM cores' shape (src/ops/gemm.ts) and the tensor-core path's host-side logic, which run on every
// machine: which adapters get tensor cores, which tile a GEMM picks, and the generated entry points. Its numerics are the self-test's tensor-core tile cases and every
// f16 matmul/conv case, which run only where the adapter offers subgroup matrices (reported as not run elsewhere).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import { kernel, kernelModule } from '../../src/gpu/kernel.ts';
import { chooseMatrixShape } from '../../src/gpu/tensorcore.ts';
import {
  pickTcTile,
  simtGemmEntry,
  tcDefs,
  tcSharedBytes,
  tcTileFits,
  TC_TILE_128,
  TC_TILE_32,
  TC_TILE_64,
  TC_TILES,
  tensorCoreEntry,
} from '../../src/ops/gemm.ts';
import { TILE_128, TILE_ROWS_4 } from '../../src/ops/matmul.ts';
import { testGpu } from '../helpers.ts';

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
    device: { limits: { maxComputeInvocationsPerWorkgroup: 1024, maxComputeWorkgroupStorageSize: 49152 } },
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
