// The two GEMM cores matmul and conv2d share, generated per tile so every register is a named variable indexed
// by constants (a register array indexed by a loop counter is kept in memory and gathered/scattered by software
// adapters such as SwiftShader):
//   simtGemmEntry    f32 or f16 storage, f32 math: each invocation owns a TM x TN register block; operands staged
//                    through shared tiles, or with def DIRECT read by each invocation itself (directGemmCode)
//   tensorCoreEntry  f16 on subgroup matrices (tensor cores; src/gpu/tensorcore.ts says when the engine uses them)
//
// Both read the op through one interface its WGSL section provides, for batch z:
//   fn gemm_dims() -> vec3<u32>                        (M, N, K) of this dispatch
//   fn gemm_a4(z: u32, m: u32, k: u32) -> vec4<f32>    op(A)[m .. m+3, k], 0 outside the matrix
//   fn gemm_b4(z: u32, k: u32, n: u32) -> vec4<f32>    op(B)[k, n .. n+3], 0 outside the matrix
//   fn gemm_out(z: u32, m: u32, n: u32, v: f32)        stores C[m, n] = v (+ bias, + C), for m < M and n < N
//   fn gemm_ak4(z: u32, m: u32, k: u32) -> vec4<f32>   op(A)[m, k .. k+3] (SIMT core with def A_QUADS only)
//   fn gemm_bk4(z: u32, k: u32, n: u32) -> vec4<f32>   op(B)[k .. k+3, n] (SIMT core with def B_QUADS only)
//   const A_K_FAST: bool, B_N_FAST: bool               which index runs fastest across invocations while staging
//                                                      (the operand's contiguous one, so reads coalesce)
// Zero-filled loads outside the matrix make ragged M, N and K need no special case. When the tile divides the
// problem (def FITS: M % BM, N % BN and K % BK all 0, the shapes of SD's layers) the loaders and the epilogue are
// compiled without their bounds checks.
//
// Split-K (def SPLIT_K, uniforms k_splits and k_chunk, binding part): when a GEMM has too few output tiles to fill
// the device but a long reduction (a weight gradient sums over every pixel or token of the batch: LoRA's
// [rank x features] over 8192 tokens is 3 tiles), workgroup z = batch * k_splits + s sums only k in
// [s * k_chunk, (s + 1) * k_chunk) and stores that f32 partial product in part[z][m][n] instead of calling
// gemm_out. k_chunk is a whole number of BK steps, so no staged tile straddles two chunks. A second entry point
// (splitReduceEntry) then sums the k_splits partials of each element in order and hands the sum to gemm_out, so
// bias and accumulation are applied once, as without the split.
//
// The SIMT core (tile BM x BN x BK, register block TM x TN; src/ops/matmul.ts's Tile): A and B are staged as f32
// vec4 groups in k-major shared tiles, tile_a[k][m/4] and tile_b[k][n/4] (an operand contiguous in k with aligned
// strides is read as 4x4 quads of vec4s along k and transposed in registers on the way: operandStaging); per k, each invocation reads TM/4 vec4s
// of A and TN/4 of B and does TM·TN/4 vec4 FMAs into acc_r_j (row r of its block, column group j). Its rows are
// interleaved so neighbouring invocations read neighbouring vec4s of the shared tiles and write neighbouring vec4s
// of C: row group i of invocation (tx, ty) is rows (i * WG_Y + ty) * 4 + 0..3, column group j is columns
// (j * WG_X + tx) * 4 + 0..3.
//
// With def PREFETCH (a GPU's default, GemmConfig.prefetch) the staging is software-pipelined through registers:
// each invocation's units (groups or quads) of the first step are loaded before the k loop into registers
// pa_i_r / pb_i_r; each step stores
// them into the shared tiles, waits at the barrier, then issues the next step's global loads into the same
// registers before its FMAs, so the loads are in flight while the FMAs run (a GPU hides their latency behind
// them). The group -> (k, row) maps are computed once per invocation. Only tiles whose invocations stage a whole
// number of groups per operand, at most PREFETCH_MAX_GROUPS, prefetch (`prefetchFits`): the skinny GPU tiles
// (4 rows or 4 columns: 32 groups per invocation at 32 deep) would hold 32 more vec4 registers, and SwiftShader
// lost its device compiling one.
//
// The tensor-core core walks the reduction TC_BK = 32 at a time:
//   1. stage: groups of 4 elements of op(A) [BM x BK] and op(B) [BK x BN] into f16 workgroup tiles, row-major with
//      rows padded by 8 halves (16 bytes) so consecutive rows start in different banks;
//   2. multiply: the SGM x SGN subgroups each own an FM x FN grid of m x n result fragments; per k-step of the
//      fragment depth, a subgroup loads FM left and FN right fragments and does FM·FN multiply-accumulates;
//   3. epilogue: each result fragment goes through a per-subgroup f32 scratch in workgroup memory, from which the
//      subgroup's 32 lanes hand element (m, n) to gemm_out, consecutive lanes on consecutive columns.
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
  return (
    t.BM % (t.SGM * s.M) === 0 &&
    t.BN % (t.SGN * s.N) === 0 &&
    TC_BK % s.K === 0 &&
    t.BM % 4 === 0 &&
    t.BN % 4 === 0 &&
    SUBGROUP_LANES * t.SGM * t.SGN <= gpu.facts.maxInvocationsPerWorkgroup &&
    tcSharedBytes(t, s) <= gpu.facts.maxWorkgroupStorage
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
    const [BM, BN, SGM, SGN, m, nn, kd] = ['TC_BM', 'TC_BN', 'TC_SGM', 'TC_SGN', 'MMA_M', 'MMA_N', 'MMA_K'].map((k) => numDef(entry, defs, k));
    const FM = BM / (SGM * m);
    const FN = BN / (SGN * nn);
    const BK = TC_BK;
    const SA = BK + TC_PAD;
    const SB = BN + TC_PAD;
    const threads = SUBGROUP_LANES * SGM * SGN;
    const frag = m * nn;
    const split = boolDef(entry, defs, 'SPLIT_K');
    const fits = boolDef(entry, defs, 'FITS');
    const L: string[] = [...MATRIX_DIRECTIVES];
    L.push(
      `// Tensor-core GEMM core, generated by src/ops/gemm.ts: tile ${BM}x${BN}x${BK}, ${SGM}x${SGN} subgroups of ${FM}x${FN} ${m}x${nn} fragments.`,
      ...EPILOGUE_WGSL,
    );
    L.push(`var<workgroup> tc_a: array<f16, ${BM * SA}>;`);
    L.push(`var<workgroup> tc_b: array<f16, ${BK * SB}>;`);
    L.push(`var<workgroup> tc_c: array<f32, ${SGM * SGN * frag}>;`);
    L.push(`@compute @workgroup_size(${threads})`);
    L.push(`fn ${entry}(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {`);
    L.push('  let dims = gemm_dims();', ...reductionRange(split), `  let row0 = wg.y * ${BM}u;`, `  let col0 = wg.x * ${BN}u;`);
    L.push(`  let sg = tid / ${SUBGROUP_LANES}u;`, `  let lane = tid % ${SUBGROUP_LANES}u;`);
    L.push(`  let sg_row = (sg / ${SGN}u) * ${FM * m}u;`, `  let sg_col = (sg % ${SGN}u) * ${FN * nn}u;`);
    for (let i = 0; i < FM; i++) for (let j = 0; j < FN; j++) L.push(`  var acc_${i}_${j} = subgroup_matrix_result<f32, ${nn}, ${m}>();`);
    L.push(`  for (var k0 = k_lo; k0 < k_hi; k0 += ${BK}u) {`);
    // stage op(A): BM/4 x BK groups of 4 rows at one k
    L.push(`    for (var g = tid; g < ${(BM / 4) * BK}u; g += ${threads}u) {`);
    L.push('      var k: u32;', '      var m4: u32;');
    L.push(`      if (A_K_FAST) { k = g % ${BK}u; m4 = g / ${BK}u; } else { m4 = g % ${BM / 4}u; k = g / ${BM / 4}u; }`);
    L.push('      let v = gemm_a4(z, row0 + m4 * 4u, k0 + k);');
    L.push(`      let at = m4 * ${4 * SA}u + k;`);
    L.push(`      tc_a[at] = f16(v.x); tc_a[at + ${SA}u] = f16(v.y); tc_a[at + ${2 * SA}u] = f16(v.z); tc_a[at + ${3 * SA}u] = f16(v.w);`);
    L.push('    }');
    // stage op(B): BK x BN/4 groups of 4 columns at one k
    L.push(`    for (var g = tid; g < ${BK * (BN / 4)}u; g += ${threads}u) {`);
    L.push('      var k: u32;', '      var n4: u32;');
    L.push(`      if (B_N_FAST) { n4 = g % ${BN / 4}u; k = g / ${BN / 4}u; } else { k = g % ${BK}u; n4 = g / ${BK}u; }`);
    L.push('      let v = gemm_b4(z, k0 + k, col0 + n4 * 4u);');
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
        const store = storeResult(split, 'm', 'n', `tc_c[sg * ${frag}u + e]`);
        L.push(fits ? `    ${store}` : `    if (m < dims.x && n < dims.y) { ${store} }`);
        L.push('  }');
        L.push('  workgroupBarrier();');
      }
    L.push('}');
    return L.join('\n');
  };
}

// ---- split-K ------------------------------------------------------------------------------------------

/** How a GEMM's reduction is cut: `splits` chunks of `chunk` (a multiple of BK); splits = 1 runs it whole. */
export interface SplitK {
  splits: number;
  chunk: number;
}

/** Shortest reduction chunk worth a split of its own (64 BK steps): shorter ones cost more in partials than they gain. */
export const SPLIT_K_MIN_CHUNK = 1024;
/** Most chunks of one reduction. */
export const SPLIT_K_MAX = 32;

/**
 * Split-K for a GEMM of `workgroups` output tiles over a K-long reduction with BK-deep steps: none while the tiles
 * fill the device (`fill`: Gpu.fillWorkgroups), else enough chunks to fill it, each at least SPLIT_K_MIN_CHUNK
 * long, and no more than `maxSplits` (the partials' room in one storage binding). `forced` (tests, benchmarks)
 * asks for that many chunks regardless of size.
 */
export function pickSplitK(workgroups: number, K: number, BK: number, fill: number, maxSplits: number, forced?: number): SplitK {
  // fill 0: automatic split-K is off (Gpu.autoSplitK false), only a forced one runs
  let want: number;
  if (forced !== undefined) {
    if (!Number.isInteger(forced) || forced < 1) throw new Error(`splitK must be a whole number >= 1, got ${forced}`);
    want = forced;
  } else want = fill === 0 || workgroups >= fill ? 1 : Math.min(Math.ceil(fill / workgroups), Math.floor(K / SPLIT_K_MIN_CHUNK), SPLIT_K_MAX);
  want = Math.min(want, maxSplits, Math.ceil(K / BK));
  if (want < 2) return { splits: 1, chunk: K };
  const chunk = Math.ceil(K / want / BK) * BK;
  const splits = Math.ceil(K / chunk);
  return splits < 2 ? { splits: 1, chunk: K } : { splits, chunk };
}

/**
 * Split-K of one GEMM dispatch of `batches` x M x N outputs in `workgroups` tiles over a K-long reduction on this
 * device: pickSplitK with the device's fill (0 where automatic split-K is off, Gpu.autoSplitK), the partials'
 * room in one storage binding and in the z dimension, and none where the reduce pass's row-per-workgroup grid would
 * exceed the y dimension. `forced` as pickSplitK.
 */
export function chooseSplitK(gpu: Gpu, workgroups: number, batches: number, M: number, N: number, K: number, BK: number, forced?: number): SplitK {
  const maxGroups = gpu.facts.maxWorkgroupsPerDimension;
  if (M > maxGroups) return { splits: 1, chunk: K };
  const room = Math.min(Math.floor((gpu.maxBinding - 256) / (4 * batches * M * N)), Math.floor(maxGroups / batches));
  return pickSplitK(workgroups, K, BK, gpu.autoSplitK ? gpu.fillWorkgroups : 0, room, forced);
}

/** The batch z and reduction range [k_lo, k_hi) of this workgroup (generated code; see the split-K note above). */
function reductionRange(split: boolean): string[] {
  if (!split) return ['  let z = wg.z;', '  let k_lo = 0u;', '  let k_hi = dims.z;'];
  return ['  let z = wg.z / p.k_splits;', '  let k_lo = (wg.z % p.k_splits) * p.k_chunk;', '  let k_hi = min(dims.z, k_lo + p.k_chunk);'];
}

/**
 * The epilogue's flags, bits of the `epilogue` uniform of every GEMM entry point, read by gemm_out (matmul.wgsl,
 * conv2d.wgsl) through the generated epi_<name>() accessors: add the bias, index it by row m instead of column n (a
 * 1x1 convolution's per-channel bias), add the result into C. They act once per output element after the reduction,
 * so they are uniforms, not defs: one pipeline serves a GEMM with and without a bias, written or accumulated.
 */
export const EPILOGUE = { bias: 1, bias_rows: 2, accumulate: 4 } as const;

/** The `epilogue` uniform for these flags. */
export function epilogueFlags(f: { [K in keyof typeof EPILOGUE]?: boolean }): number {
  return (Object.keys(EPILOGUE) as (keyof typeof EPILOGUE)[]).reduce((bits, k) => bits | (f[k] ? EPILOGUE[k] : 0), 0);
}

/** epi_<name>() -> bool for each epilogue flag, emitted with every generated GEMM entry point. */
const EPILOGUE_WGSL = Object.entries(EPILOGUE).map(([k, bit]) => `fn epi_${k}() -> bool { return (p.epilogue & ${bit}u) != 0u; }`);

/** The statement storing result element (m, n) = v: to C through gemm_out, or with split-K to this split's partials. */
function storeResult(split: boolean, m: string, n: string, v: string): string {
  return split ? `part[(wg.z * dims.x + ${m}) * dims.y + ${n}] = ${v};` : `gemm_out(z, ${m}, ${n}, ${v});`;
}

/**
 * `code` for the kernel that finishes a split-K GEMM: C[z][m][n] = gemm_out of the sum of the k_splits partials,
 * one invocation per element (64 columns x 1 row per workgroup, z the batch).
 */
/** Columns (invocations) per workgroup of the split-K reduce pass; its callers size the grid by it. */
export const SPLIT_REDUCE_WG = 64;

export function splitReduceEntry(entry: string): (defs: Defs) => string {
  return () =>
    [
      '// split-K reduction, generated by src/ops/gemm.ts',
      ...EPILOGUE_WGSL,
      `@compute @workgroup_size(${SPLIT_REDUCE_WG})`,
      `fn ${entry}(@builtin(workgroup_id) wg: vec3<u32>, @builtin(global_invocation_id) gid: vec3<u32>) {`,
      '  let dims = gemm_dims();',
      '  let n = gid.x;',
      '  let m = wg.y;',
      '  if (n >= dims.y) { return; }',
      '  var v = 0.0;',
      '  for (var s = 0u; s < p.k_splits; s++) { v += part[((wg.z * p.k_splits + s) * dims.x + m) * dims.y + n]; }',
      '  gemm_out(wg.z, m, n, v);',
      '}',
    ].join('\n');
}

/** A def that is a boolean (absent: false). */
function boolDef(entry: string, defs: Defs, name: string): boolean {
  const v = defs[name] ?? false;
  if (typeof v !== 'boolean') throw new Error(`${entry}: def ${name} must be a boolean`);
  return v;
}

/** A def that must be a number (the tile's sizes). */
function numDef(entry: string, defs: Defs, name: string): number {
  const v = defs[name];
  if (typeof v !== 'number') throw new Error(`${entry}: def ${name} must be a number`);
  return v;
}

/** Most vec4 groups of one operand an invocation may hold in prefetch registers. */
export const PREFETCH_MAX_GROUPS = 8;

/**
 * Whether a SIMT tile may prefetch: each invocation stages a whole number of vec4 groups of A ((BM/4) x BK per
 * step) and of B (BK x (BN/4)), at most PREFETCH_MAX_GROUPS of each.
 */
export function prefetchFits(t: { BM: number; BN: number; BK: number; TM: number; TN: number }): boolean {
  const threads = (t.BM / t.TM) * (t.BN / t.TN);
  return [(t.BM / 4) * t.BK, t.BK * (t.BN / 4)].every((groups) => groups % threads === 0 && groups / threads <= PREFETCH_MAX_GROUPS);
}

/**
 * How the SIMT core stages one operand's BK-deep step into its k-major shared tile (tile_a[k][m/4], tile_b[k][n/4]):
 *   groups  unit = one vec4 group, 4 rows (columns) at one k, through gemm_a4 / gemm_b4 and stored as it is. The
 *           def A_K_FAST / B_N_FAST orders the units across invocations so the operand's contiguous index runs
 *           fastest (reads coalesce).
 *   quads   unit = a 4x4 block, 4 rows (columns) x 4 k, read as 4 vec4s along k through gemm_ak4 / gemm_bk4 (an
 *           operand contiguous in k: A [M, K], Bᵀ stored [N, K], so x·Wᵀ reads whole vec4s), transposed in
 *           registers and stored as 4 vec4s, one per k. Units run row group fastest, so neighbouring invocations
 *           store neighbouring vec4s of a tile row (no bank conflicts).
 * A unit is staged by `loads` (its registers' global loads, 1 or 4) and `stores` (registers -> shared tile); `maps`
 * gives its first k and its row (column) group from the unit index.
 */
interface OperandStaging {
  x: 'a' | 'b';
  units: number;
  regs: number;
  maps(g: string): { k: string; mn: string };
  loads(k0: string, k: string, mn: string): string[];
  stores(k: string, mn: string, reg: (r: number) => string): string[];
}

function operandStaging(x: 'a' | 'b', BM: number, BN: number, BK: number, quads: boolean): OperandStaging {
  const W = (x === 'a' ? BM : BN) / 4; // shared tile row width in vec4s
  const origin = x === 'a' ? 'row0' : 'col0';
  if (quads) {
    const load = (k0: string, k: string, rc: string) => (x === 'a' ? `gemm_ak4(z, ${rc}, ${k0} + ${k})` : `gemm_bk4(z, ${k0} + ${k}, ${rc})`);
    return {
      x,
      units: W * (BK / 4),
      regs: 4,
      maps: (g) => ({ k: `(${g} / ${W}u) * 4u`, mn: `${g} % ${W}u` }),
      loads: (k0, k, mn) => [0, 1, 2, 3].map((r) => load(k0, k, `${origin} + ${mn} * 4u + ${r}u`)),
      // element c of register r is op(X)[row (column) 4 mn + r, k + c]: tile row k + c is (reg0[c], .., reg3[c])
      stores: (k, mn, reg) =>
        [0, 1, 2, 3].map((c) => `tile_${x}[(${k} + ${c}u) * ${W}u + ${mn}] = vec4<f32>(${[0, 1, 2, 3].map((r) => `${reg(r)}.${'xyzw'[c]}`).join(', ')});`),
    };
  }
  const fast = x === 'a' ? 'A_K_FAST' : 'B_N_FAST';
  return {
    x,
    units: W * BK,
    regs: 1,
    maps: (g) =>
      x === 'a'
        ? { k: `select(${g} / ${W}u, ${g} % ${BK}u, ${fast})`, mn: `select(${g} % ${W}u, ${g} / ${BK}u, ${fast})` }
        : { k: `select(${g} % ${BK}u, ${g} / ${W}u, ${fast})`, mn: `select(${g} / ${BK}u, ${g} % ${W}u, ${fast})` },
    loads: (k0, k, mn) => [x === 'a' ? `gemm_a4(z, row0 + ${mn} * 4u, ${k0} + ${k})` : `gemm_b4(z, ${k0} + ${k}, col0 + ${mn} * 4u)`],
    stores: (k, mn, reg) => [`tile_${x}[${k} * ${W}u + ${mn}] = ${reg(0)};`],
  };
}

/** The plain SIMT core's staging of one step: each invocation walks units tid, tid + threads, ... */
function stageStep(op: OperandStaging, threads: number): string[] {
  const { k, mn } = op.maps('g');
  const L = [`    for (var g = tid; g < ${op.units}u; g += ${threads}u) {`, `      let k = ${k};`, `      let mn = ${mn};`];
  op.loads('k0', 'k', 'mn').forEach((load, r) => L.push(`      let v${r} = ${load};`));
  L.push(...op.stores('k', 'mn', (r) => `v${r}`).map((l) => `      ${l}`), '    }');
  return L;
}

/**
 * The prefetch units of one operand invocation `tid` holds: unit i is tid + i * threads, guarded (`if`) where the
 * units do not divide evenly and that unit is missing for the last invocations (quads: a quarter of the groups, so
 * where prefetchFits allows at most 8 groups per invocation, at most 2 quads, 8 registers, are held).
 */
function heldUnits(op: OperandStaging, threads: number): { i: number; guard: string | null }[] {
  return Array.from({ length: Math.ceil(op.units / threads) }, (_, i) => ({ i, guard: (i + 1) * threads > op.units ? `g${op.x}_${i} < ${op.units}u` : null }));
}

/** `lines` under the unit's guard, if it has one. */
function guarded(guard: string | null, indent: string, lines: string[]): string[] {
  return guard ? [`${indent}if (${guard}) {`, ...lines.map((l) => `  ${indent}${l}`), `${indent}}`] : lines.map((l) => indent + l);
}

/**
 * The prefetching SIMT core's staging, before its k loop: which units of each staged tile invocation `tid` loads
 * (its first k k{x}_i and row or column group n{x}_i computed once), the units' registers p{x}_i_r, and the first
 * step's loads.
 */
function prefetchSetup(ops: OperandStaging[], threads: number): string[] {
  const L: string[] = [];
  for (const op of ops)
    for (const { i } of heldUnits(op, threads)) {
      const { k, mn } = op.maps(`g${op.x}_${i}`);
      L.push(`  let g${op.x}_${i} = tid + ${i * threads}u;`, `  let k${op.x}_${i} = ${k};`, `  let n${op.x}_${i} = ${mn};`);
      for (let r = 0; r < op.regs; r++) L.push(`  var p${op.x}_${i}_${r} = vec4<f32>(0.0);`);
    }
  L.push('  if (k_lo < k_hi) {', ...prefetchLoads(ops, threads, 'k_lo').map((l) => `  ${l}`), '  }');
  return L;
}

/** One k step of the prefetching core: registers to shared tiles, barrier, the next step's loads (if any). */
function prefetchStep(ops: OperandStaging[], BK: number, threads: number): string[] {
  const stores = perHeldUnit(ops, threads, '    ', (op, i) => op.stores(`k${op.x}_${i}`, `n${op.x}_${i}`, (r) => `p${op.x}_${i}_${r}`));
  return [...stores, '    workgroupBarrier();', `    if (k0 + ${BK}u < k_hi) {`, ...prefetchLoads(ops, threads, `k0 + ${BK}u`), '    }'];
}

/** The global loads of the step starting at k `k0` into the prefetch registers. */
function prefetchLoads(ops: OperandStaging[], threads: number, k0: string): string[] {
  return perHeldUnit(ops, threads, '      ', (op, i) => op.loads(k0, `k${op.x}_${i}`, `n${op.x}_${i}`).map((load, r) => `p${op.x}_${i}_${r} = ${load};`));
}

/** `lines(op, i)` for each unit i of each operand an invocation holds, under the unit's guard, indented. */
function perHeldUnit(ops: OperandStaging[], threads: number, indent: string, lines: (op: OperandStaging, i: number) => string[]): string[] {
  return ops.flatMap((op) => heldUnits(op, threads).flatMap(({ i, guard }) => guarded(guard, indent, lines(op, i))));
}

/** `code` for a kernel declaration: the SIMT entry point `entry`, unrolled for the tile (BM, BN, BK, TM, TN) in `defs`. */
export function simtGemmEntry(entry: string): (defs: Defs) => string {
  return (defs) => {
    const [BM, BN, BK, TM, TN] = ['BM', 'BN', 'BK', 'TM', 'TN'].map((k) => numDef(entry, defs, k));
    const split = boolDef(entry, defs, 'SPLIT_K');
    const fits = boolDef(entry, defs, 'FITS');
    if (boolDef(entry, defs, 'DIRECT')) return directGemmCode(entry, defs, { BM, BN, BK, TM, TN }, split, fits);
    const prefetch = boolDef(entry, defs, 'PREFETCH');
    if (prefetch && !prefetchFits({ BM, BN, BK, TM, TN }))
      throw new Error(
        `${entry}: tile ${BM}x${BN}x${BK} (${TM}x${TN} blocks) cannot prefetch: its invocations would stage uneven or more than ${PREFETCH_MAX_GROUPS} vec4 groups per operand`,
      );
    const VM = TM / 4;
    const VN = TN / 4;
    const WX = BN / TN;
    const WY = BM / TM;
    const threads = WX * WY;
    const ops = (['a', 'b'] as const).map((x) => operandStaging(x, BM, BN, BK, boolDef(entry, defs, x === 'a' ? 'A_QUADS' : 'B_QUADS')));
    const L: string[] = [`// SIMT GEMM core, generated by src/ops/gemm.ts: tile ${BM}x${BN}x${BK}, ${TM}x${TN} registers per invocation.`, ...EPILOGUE_WGSL];
    L.push(`var<workgroup> tile_a: array<vec4<f32>, ${(BK * BM) / 4}>;`, `var<workgroup> tile_b: array<vec4<f32>, ${(BK * BN) / 4}>;`);
    L.push(`@compute @workgroup_size(${WX}, ${WY})`);
    L.push(`fn ${entry}(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {`);
    L.push('  let dims = gemm_dims();', ...reductionRange(split), `  let row0 = wg.y * ${BM}u;`, `  let col0 = wg.x * ${BN}u;`);
    for (let r = 0; r < TM; r++) for (let j = 0; j < VN; j++) L.push(`  var acc_${r}_${j} = vec4<f32>(0.0);`);
    if (prefetch) L.push(...prefetchSetup(ops, threads));
    L.push(`  for (var k0 = k_lo; k0 < k_hi; k0 += ${BK}u) {`);
    if (prefetch) L.push(...prefetchStep(ops, BK, threads));
    else L.push(...ops.flatMap((op) => stageStep(op, threads)), '    workgroupBarrier();');
    // rank-1 updates of the register block, one per k of the tile
    L.push(`    for (var k = 0u; k < ${BK}u; k++) {`);
    for (let j = 0; j < VN; j++) L.push(`      let b_${j} = tile_b[k * ${BN / 4}u + ${j * WX}u + lid.x];`);
    for (let i = 0; i < VM; i++) {
      L.push(`      let a_${i} = tile_a[k * ${BM / 4}u + ${i * WY}u + lid.y];`);
      for (let q = 0; q < 4; q++)
        for (let j = 0; j < VN; j++) L.push(`      acc_${4 * i + q}_${j} = fma(vec4<f32>(a_${i}.${'xyzw'[q]}), b_${j}, acc_${4 * i + q}_${j});`);
    }
    L.push('    }', '    workgroupBarrier();', '  }');
    L.push(...blockEpilogue(TM, TN, WX, WY, split, fits), '}');
    return L.join('\n');
  };
}

/**
 * The SIMT cores' epilogue, masked at the matrix edges: register block acc_r_j (row r, column group j) of invocation
 * lid to C (or split-K's partials). Row group i is rows (i * WY + lid.y) * 4 + 0..3, column group j columns
 * (j * WX + lid.x) * 4 + 0..3. The registers are copied once into an array the loops index: an unrolled epilogue
 * (TM x TN masked stores) tripled the pipeline's compile time on lavapipe.
 */
function blockEpilogue(TM: number, TN: number, WX: number, WY: number, split: boolean, fits: boolean): string[] {
  const VM = TM / 4;
  const VN = TN / 4;
  const L: string[] = [];
  L.push(`  var block = array<vec4<f32>, ${TM * VN}>(${Array.from({ length: TM * VN }, (_, x) => `acc_${Math.floor(x / VN)}_${x % VN}`).join(', ')});`);
  L.push(`  for (var i = 0u; i < ${VM}u; i++) {`, '    for (var r = 0u; r < 4u; r++) {');
  L.push(`      let m = row0 + (i * ${WY}u + lid.y) * 4u + r;`);
  if (!fits) L.push('      if (m >= dims.x) { continue; }');
  L.push(`      for (var j = 0u; j < ${VN}u; j++) {`);
  L.push(`        let n0 = col0 + (j * ${WX}u + lid.x) * 4u;`, `        let v = block[(i * 4u + r) * ${VN}u + j];`);
  L.push('        for (var q = 0u; q < 4u; q++) {');
  if (!fits) L.push('          if (n0 + q >= dims.y) { break; }');
  L.push(`          ${storeResult(split, 'm', 'n0 + q', 'v[q]')}`, '        }');
  L.push('      }', '    }', '  }');
  return L;
}

/**
 * The direct SIMT core (def DIRECT; CPU adapters): no shared tiles and no barriers. Each invocation reads the
 * operand values its own TM x TN block needs straight from storage through the interface, 4 k at a time, and does
 * the same rank-1 updates as the staged core in the same k order (so its results are bit-identical to it):
 *   A  4 k of each of its TM rows as one vec4 along k (def A_QUADS: gemm_ak4), else 4 k of each row group as a
 *      vec4 along m (gemm_a4); the element for row r at k0 + c is splat across the column group;
 *   B  4 k of each of its TN columns as one vec4 along k (def B_QUADS: gemm_bk4, transposed in registers), else
 *      4 k of each column group as a vec4 along n (gemm_b4).
 * On a CPU adapter a workgroup is run as SIMD lanes over its invocations: neighbouring lanes (lid.x) read
 * neighbouring vec4s of B and the lanes of one row (lid.y) read the same A, and nothing waits at a barrier (which a
 * CPU adapter implements by splitting the kernel and saving every lane's live registers). A split-K chunk and the
 * reduction's start are whole BK steps, and BK is a multiple of 4, so 4-k steps never straddle a chunk; past K the
 * loaders give 0.
 */
function directGemmCode(entry: string, defs: Defs, t: { BM: number; BN: number; BK: number; TM: number; TN: number }, split: boolean, fits: boolean): string {
  const { BM, BN, BK, TM, TN } = t;
  if (BK % 4 !== 0) throw new Error(`${entry}: the direct core steps 4 k at a time, so BK must be a multiple of 4 (got ${BK})`);
  const aQuads = boolDef(entry, defs, 'A_QUADS');
  const bQuads = boolDef(entry, defs, 'B_QUADS');
  const VM = TM / 4;
  const VN = TN / 4;
  const WX = BN / TN;
  const WY = BM / TM;
  const row = (r: number) => `row0 + ${Math.floor(r / 4) * WY * 4}u + lid.y * 4u + ${r % 4}u`; // row r of the block
  const col = (s: number) => `col0 + ${Math.floor(s / 4) * WX * 4}u + lid.x * 4u + ${s % 4}u`; // column s
  const L: string[] = [
    `// Direct SIMT GEMM core, generated by src/ops/gemm.ts: ${BM}x${BN} per workgroup, ${TM}x${TN} registers per invocation, no shared tiles.`,
    ...EPILOGUE_WGSL,
  ];
  L.push(`@compute @workgroup_size(${WX}, ${WY})`);
  L.push(`fn ${entry}(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {`);
  L.push('  let dims = gemm_dims();', ...reductionRange(split), `  let row0 = wg.y * ${BM}u;`, `  let col0 = wg.x * ${BN}u;`);
  for (let r = 0; r < TM; r++) for (let j = 0; j < VN; j++) L.push(`  var acc_${r}_${j} = vec4<f32>(0.0);`);
  L.push('  for (var k0 = k_lo; k0 < k_hi; k0 += 4u) {');
  // a(r, c): op(A)[row r, k0 + c] as a scalar expression; b(j, c): op(B)[k0 + c, column group j] as a vec4
  let a: (r: number, c: number) => string;
  let b: (j: number, c: number) => string;
  if (aQuads) {
    for (let r = 0; r < TM; r++) L.push(`    let qa_${r} = gemm_ak4(z, ${row(r)}, k0);`);
    a = (r, c) => `qa_${r}.${'xyzw'[c]}`;
  } else {
    for (let c = 0; c < 4; c++) for (let i = 0; i < VM; i++) L.push(`    let ga_${c}_${i} = gemm_a4(z, ${row(4 * i)}, k0 + ${c}u);`);
    a = (r, c) => `ga_${c}_${Math.floor(r / 4)}.${'xyzw'[r % 4]}`;
  }
  if (bQuads) {
    for (let s = 0; s < TN; s++) L.push(`    let qb_${s} = gemm_bk4(z, k0, ${col(s)});`);
    b = (j, c) => `vec4<f32>(${[0, 1, 2, 3].map((q) => `qb_${4 * j + q}.${'xyzw'[c]}`).join(', ')})`;
  } else {
    for (let c = 0; c < 4; c++) for (let j = 0; j < VN; j++) L.push(`    let gb_${c}_${j} = gemm_b4(z, k0 + ${c}u, ${col(4 * j)});`);
    b = (j, c) => `gb_${c}_${j}`;
  }
  // rank-1 updates in k order, as the staged core
  for (let c = 0; c < 4; c++) {
    if (bQuads) for (let j = 0; j < VN; j++) L.push(`    let b_${c}_${j} = ${b(j, c)};`);
    const bv = (j: number) => (bQuads ? `b_${c}_${j}` : b(j, c));
    for (let r = 0; r < TM; r++) for (let j = 0; j < VN; j++) L.push(`    acc_${r}_${j} = fma(vec4<f32>(${a(r, c)}), ${bv(j)}, acc_${r}_${j});`);
  }
  L.push('  }');
  L.push(...blockEpilogue(TM, TN, WX, WY, split, fits), '}');
  return L.join('\n');
}
