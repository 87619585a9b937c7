// The tensor-core GEMM core shared by matmul and conv2d: C = A · B on subgroup matrices (f16 in, f32 accumulate;
// src/gpu/tensorcore.ts says what they are and when the engine may use them).
//
// A workgroup owns a BM x BN block of C and walks the reduction BK = 32 at a time:
//   1. stage: every invocation loads groups of 4 elements of op(A) [BM x BK] and op(B) [BK x BN] through the op's
//      loaders (zero outside the matrix, so ragged M, N and K need no special case) into f16 workgroup tiles,
//      row-major with rows padded by 8 halves (16 bytes) so consecutive rows start in different banks;
//   2. multiply: the SGM x SGN subgroups each own an FM x FN grid of m x n result fragments; per k-step of the
//      fragment depth, a subgroup loads FM left and FN right fragments from the tiles and does FM·FN
//      multiply-accumulates;
//   3. epilogue: each result fragment goes through a per-subgroup f32 scratch in workgroup memory, from which the
//      subgroup's 32 lanes hand element (m, n) to the op's `tc_out` (bias, accumulation, conversion, edge mask),
//      consecutive lanes on consecutive columns.
//
// The op's WGSL section provides, for batch z:
//   fn tc_dims() -> vec3<u32>                            (M, N, K) of this dispatch
//   fn tc_a4(z: u32, m: u32, k: u32) -> vec4<f32>        op(A)[m .. m+3, k], 0 outside
//   fn tc_b4(z: u32, k: u32, n: u32) -> vec4<f32>        op(B)[k, n .. n+3], 0 outside
//   fn tc_out(z: u32, m: u32, n: u32, v: f32)            stores C[m, n] = v (+ bias, + C), m < M and n < N
//   const TC_A_K_FAST: bool  / TC_B_N_FAST: bool         which index runs fastest across invocations while
//                                                        staging (the operand's contiguous one, for coalescing)
// The generated code is unrolled: fragment grids and k-steps are constants of the tile.
import type { Gpu } from '../gpu/device.ts';
import type { Defs } from '../gpu/shaders.ts';
import { MATRIX_DIRECTIVES, SUBGROUP_LANES, type MatrixShape } from '../gpu/tensorcore.ts';

/** A tensor-core workgroup tile: BM x BN of C, SGM x SGN subgroups of 32 lanes. */
export interface TcTile {
  BM: number;
  BN: number;
  SGM: number;
  SGN: number;
}

/** Reduction depth staged per step (two 16-deep fragment steps). */
export const TC_BK = 32;
/** Row padding of the staged f16 tiles, in halves. */
const TC_PAD = 8;

export const TC_TILE_128: TcTile = { BM: 128, BN: 128, SGM: 2, SGN: 2 };
export const TC_TILE_128x64: TcTile = { BM: 128, BN: 64, SGM: 2, SGN: 2 };
export const TC_TILE_64x128: TcTile = { BM: 64, BN: 128, SGM: 2, SGN: 2 };
export const TC_TILE_64: TcTile = { BM: 64, BN: 64, SGM: 2, SGN: 2 };
export const TC_TILE_32x64: TcTile = { BM: 32, BN: 64, SGM: 1, SGN: 2 };
export const TC_TILE_32: TcTile = { BM: 32, BN: 32, SGM: 1, SGN: 1 };
/** Largest first: pickTcTile takes the first that fills the GPU. */
export const TC_TILES: readonly TcTile[] = [TC_TILE_128, TC_TILE_128x64, TC_TILE_64x128, TC_TILE_64, TC_TILE_32x64, TC_TILE_32];

/** Workgroup memory a tile needs: the two f16 tiles and one f32 fragment scratch per subgroup. */
export function tcSharedBytes(t: TcTile, s: MatrixShape): number {
  return 2 * (t.BM * (TC_BK + TC_PAD) + TC_BK * (t.BN + TC_PAD)) + 4 * t.SGM * t.SGN * s.M * s.N;
}

/** Whether the tile divides into whole fragments for this matrix shape and fits the device. */
export function tcTileFits(gpu: Gpu, t: TcTile, s: MatrixShape): boolean {
  const lim = gpu.device.limits;
  return (
    t.BM % (t.SGM * s.M) === 0 &&
    t.BN % (t.SGN * s.N) === 0 &&
    TC_BK % s.K === 0 &&
    t.BM % 4 === 0 &&
    t.BN % 4 === 0 &&
    SUBGROUP_LANES * t.SGM * t.SGN <= lim.maxComputeInvocationsPerWorkgroup &&
    tcSharedBytes(t, s) <= lim.maxComputeWorkgroupStorageSize
  );
}

/**
 * The tensor-core tile for an M x N GEMM over `batch` batches, or null where the device has no tensor cores: the
 * largest tile that still gives `gpu.fillWorkgroups` workgroups, else the smallest.
 */
export function pickTcTile(gpu: Gpu, M: number, N: number, batch: number): TcTile | null {
  const s = gpu.tensorCores;
  if (!s) return null;
  const fits = TC_TILES.filter((t) => tcTileFits(gpu, t, s));
  if (!fits.length) return null;
  const count = (t: TcTile) => Math.ceil(M / t.BM) * Math.ceil(N / t.BN) * batch;
  return fits.find((t) => count(t) >= gpu.fillWorkgroups) ?? fits[fits.length - 1];
}

/** Defs that specialise a tensor-core entry point (the generated code reads them back). */
export function tcDefs(t: TcTile, s: MatrixShape): Defs {
  return { TC_BM: t.BM, TC_BN: t.BN, TC_SGM: t.SGM, TC_SGN: t.SGN, MMA_M: s.M, MMA_N: s.N, MMA_K: s.K };
}

/** `code` for a kernel declaration: the tensor-core entry point `entry`, unrolled for the tile in `defs`. */
export function tensorCoreEntry(entry: string): (defs: Defs) => string {
  return (defs) => {
    const n = (k: string) => {
      const v = defs[k];
      if (typeof v !== 'number') throw new Error(`${entry}: def ${k} must be a number`);
      return v;
    };
    const [BM, BN, SGM, SGN, m, nn, kd] = ['TC_BM', 'TC_BN', 'TC_SGM', 'TC_SGN', 'MMA_M', 'MMA_N', 'MMA_K'].map(n);
    const FM = BM / (SGM * m);
    const FN = BN / (SGN * nn);
    const BK = TC_BK;
    const SA = BK + TC_PAD;
    const SB = BN + TC_PAD;
    const threads = SUBGROUP_LANES * SGM * SGN;
    const frag = m * nn;
    const L: string[] = [...MATRIX_DIRECTIVES];
    L.push(
      `// Tensor-core GEMM core, generated by src/ops/tensorcore.ts: tile ${BM}x${BN}x${BK}, ${SGM}x${SGN} subgroups of ${FM}x${FN} ${m}x${nn} fragments.`,
    );
    L.push(`var<workgroup> tc_a: array<f16, ${BM * SA}>;`);
    L.push(`var<workgroup> tc_b: array<f16, ${BK * SB}>;`);
    L.push(`var<workgroup> tc_c: array<f32, ${SGM * SGN * frag}>;`);
    L.push(`@compute @workgroup_size(${threads})`);
    L.push(`fn ${entry}(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {`);
    L.push('  let dims = tc_dims();', '  let z = wg.z;', `  let row0 = wg.y * ${BM}u;`, `  let col0 = wg.x * ${BN}u;`);
    L.push(`  let sg = tid / ${SUBGROUP_LANES}u;`, `  let lane = tid % ${SUBGROUP_LANES}u;`);
    L.push(`  let sg_row = (sg / ${SGN}u) * ${FM * m}u;`, `  let sg_col = (sg % ${SGN}u) * ${FN * nn}u;`);
    for (let i = 0; i < FM; i++) for (let j = 0; j < FN; j++) L.push(`  var acc_${i}_${j} = subgroup_matrix_result<f32, ${nn}, ${m}>();`);
    L.push(`  for (var k0 = 0u; k0 < dims.z; k0 += ${BK}u) {`);
    // stage op(A): BM/4 x BK groups of 4 rows at one k
    L.push(`    for (var g = tid; g < ${(BM / 4) * BK}u; g += ${threads}u) {`);
    L.push('      var k: u32;', '      var m4: u32;');
    L.push(`      if (TC_A_K_FAST) { k = g % ${BK}u; m4 = g / ${BK}u; } else { m4 = g % ${BM / 4}u; k = g / ${BM / 4}u; }`);
    L.push('      let v = tc_a4(z, row0 + m4 * 4u, k0 + k);');
    L.push(`      let at = m4 * ${4 * SA}u + k;`);
    L.push(`      tc_a[at] = f16(v.x); tc_a[at + ${SA}u] = f16(v.y); tc_a[at + ${2 * SA}u] = f16(v.z); tc_a[at + ${3 * SA}u] = f16(v.w);`);
    L.push('    }');
    // stage op(B): BK x BN/4 groups of 4 columns at one k
    L.push(`    for (var g = tid; g < ${BK * (BN / 4)}u; g += ${threads}u) {`);
    L.push('      var k: u32;', '      var n4: u32;');
    L.push(`      if (TC_B_N_FAST) { n4 = g % ${BN / 4}u; k = g / ${BN / 4}u; } else { k = g % ${BK}u; n4 = g / ${BK}u; }`);
    L.push('      let v = tc_b4(z, k0 + k, col0 + n4 * 4u);');
    L.push(`      let bt = k * ${SB}u + n4 * 4u;`);
    L.push('      tc_b[bt] = f16(v.x); tc_b[bt + 1u] = f16(v.y); tc_b[bt + 2u] = f16(v.z); tc_b[bt + 3u] = f16(v.w);');
    L.push('    }');
    L.push('    workgroupBarrier();');
    for (let kk = 0; kk < BK; kk += kd) {
      for (let i = 0; i < FM; i++)
        L.push(
          `    let l${kk}_${i} = subgroupMatrixLoad<subgroup_matrix_left<f16, ${kd}, ${m}>>(&tc_a, (sg_row + ${i * m}u) * ${SA}u + ${kk}u, false, ${SA}u);`,
        );
      for (let j = 0; j < FN; j++)
        L.push(`    let r${kk}_${j} = subgroupMatrixLoad<subgroup_matrix_right<f16, ${nn}, ${kd}>>(&tc_b, ${kk * SB}u + sg_col + ${j * nn}u, false, ${SB}u);`);
      for (let i = 0; i < FM; i++)
        for (let j = 0; j < FN; j++) L.push(`    acc_${i}_${j} = subgroupMatrixMultiplyAccumulate(l${kk}_${i}, r${kk}_${j}, acc_${i}_${j});`);
    }
    L.push('    workgroupBarrier();', '  }');
    // epilogue: fragment by fragment through the subgroup's scratch
    for (let i = 0; i < FM; i++)
      for (let j = 0; j < FN; j++) {
        L.push(`  subgroupMatrixStore(&tc_c, sg * ${frag}u, acc_${i}_${j}, false, ${nn}u);`);
        L.push('  workgroupBarrier();');
        L.push(`  for (var e = lane; e < ${frag}u; e += ${SUBGROUP_LANES}u) {`);
        L.push(`    let m = row0 + sg_row + ${i * m}u + e / ${nn}u;`);
        L.push(`    let n = col0 + sg_col + ${j * nn}u + e % ${nn}u;`);
        L.push(`    if (m < dims.x && n < dims.y) { tc_out(z, m, n, tc_c[sg * ${frag}u + e]); }`);
        L.push('  }');
        L.push('  workgroupBarrier();');
      }
    L.push('}');
    return L.join('\n');
  };
}
