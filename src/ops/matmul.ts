// Matmul family: batched tiled matmul with transposes, bias epilogue and accumulation; its backward
// through the transpose variants of the same kernel; nn.Linear on top. Each op has a plain-TS
// reference (`*Ref`, float64 accumulation) beside it.
//
//   Y = op(A) · op(B) + bias        op(A): [M, K], op(B): [K, N], Y: [M, N] per batch
//   dop(A) = dY · op(B)ᵀ            dop(B) = op(A)ᵀ · dY  (summed over the batch when B is broadcast)
//   dbias = column sums of dY over every row of every batch
import type { BufferWindow, Gpu } from '../gpu/device.ts';
import { kernel } from '../gpu/kernel.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import type { Defs } from '../gpu/shaders.ts';
import { BYTES, expectSameDType, expectShape, numel, Tensor, type DType } from '../gpu/tensor.ts';

export interface MatmulOptions {
  /** a is stored [..., K, M]. */
  transA?: boolean;
  /** b is stored [..., N, K]. */
  transB?: boolean;
  /** [N], added in the epilogue. */
  bias?: Tensor;
  /** Write into this tensor instead of a new one (input dtype, or f32 for f32 gradient buffers). */
  out?: Tensor;
  /** out += a·b (+ bias) instead of out = ... (needs `out`). */
  accumulate?: boolean;
  /** Force a workgroup tile (tests, benchmarks, the tuner); by default picked from the problem size. */
  tile?: Tile;
  /** Force the number of split-K ranges (1: none); by default picked with the tile. */
  splitK?: number;
}

/** Workgroup tile: BM x BN outputs, BK-deep steps, TM x TN outputs per invocation (multiples of 4). */
export interface Tile {
  BM: number;
  BN: number;
  BK: number;
  TM: number;
  TN: number;
}

/** 256 invocations with 4x4 blocks; 8 KiB of shared tiles. For small or skinny problems. */
export const TILE_64: Tile = { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4 };
/** 256 invocations with 8x8 blocks; 16 KiB of shared tiles (Chrome's default limit). */
export const TILE_128: Tile = { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 };

/** Shared-memory bytes a tile config needs (f32 tiles of A and B). */
export function tileSharedBytes(t: Tile): number {
  return 4 * (t.BM + t.BN) * t.BK;
}

function checkTile(gpu: Gpu, t: Tile, transA: boolean, transB: boolean): void {
  const ok =
    t.TM % 4 === 0 &&
    t.TN % 4 === 0 &&
    t.BK % 4 === 0 &&
    t.BM % t.TM === 0 &&
    t.BN % t.TN === 0 &&
    (t.BM / t.TM) * (t.BN / t.TN) <= gpu.device.limits.maxComputeInvocationsPerWorkgroup &&
    gemmSharedBytes(t, transA, transB) <= gpu.device.limits.maxComputeWorkgroupStorageSize;
  if (!ok) throw new ShapeError('matmul', `invalid tile ${JSON.stringify(t)}`);
}

/**
 * Skinny tiles for problems with very few rows (M: a linear layer over a handful of tokens, e.g. the time
 * embedding or SD's deepest blocks at low resolution) or very few columns (N: a convolution's output pixels
 * per sample at 1x1 or 2x2). A 64x64 tile over M = 2 computes 32x the useful work; these keep the waste
 * under 4x (2x at M = 2, 4 % at M = 8 with the 16-row tile), with 32-64 invocations per workgroup.
 */
export const TILE_ROWS_4: Tile = { BM: 4, BN: 128, BK: 16, TM: 4, TN: 4 };
export const TILE_ROWS_16: Tile = { BM: 16, BN: 64, BK: 16, TM: 4, TN: 4 };
export const TILE_COLS_4: Tile = { BM: 128, BN: 4, BK: 16, TM: 4, TN: 4 };
export const TILE_COLS_16: Tile = { BM: 64, BN: 16, BK: 16, TM: 4, TN: 4 };

/**
 * Skinny tiles where one side is at most 16; big tiles once they still give the device enough workgroups to fill
 * it (`fillWorkgroups`: Gpu.fillWorkgroups, 64 on a GPU, 8 on a CPU adapter).
 */
export function pickTile(M: number, N: number, batch: number, fillWorkgroups = 64): Tile {
  if (M <= 4 && N > M) return TILE_ROWS_4;
  if (N <= 4) return TILE_COLS_4;
  if (M <= 16 && N > M) return TILE_ROWS_16;
  if (N <= 16) return TILE_COLS_16;
  const bigTiles = Math.ceil(M / TILE_128.BM) * Math.ceil(N / TILE_128.BN) * batch;
  return bigTiles >= fillWorkgroups ? TILE_128 : TILE_64;
}

// ---- windows: element ranges of a tensor bound at an aligned offset ---------------------------

export interface ElemWindow {
  window: BufferWindow;
  /** Element index, inside the window, of the range's first element. */
  offset: number;
}

/**
 * Binds elements [first, first + count) of `t`: the window starts at the aligned offset at or
 * below the range, and `offset` says where the range begins inside it.
 */
export function elemWindow(gpu: Gpu, t: Tensor, first: number, count: number): ElemWindow {
  const bytes = BYTES[t.dtype];
  const align = gpu.device.limits.minStorageBufferOffsetAlignment;
  const start = t.byteOffset + first * bytes;
  const base = Math.floor(start / align) * align;
  const end = Math.min(Math.ceil((start + Math.max(count, 1) * bytes) / 4) * 4, t.buffer.size);
  return { window: { buffer: t.buffer, offset: base, size: end - base }, offset: (start - base) / bytes };
}

/** Bytes of the largest window a range of `count` elements can need (alignment slack included). */
export function windowBytesBound(gpu: Gpu, count: number, bytes: number): number {
  return count * bytes + gpu.device.limits.minStorageBufferOffsetAlignment + 4;
}

// ---- the GEMM driver ------------------------------------------------------------------------

/** One batched GEMM over row-major operands with leading dimensions and batch strides. */
interface Gemm {
  op: string;
  M: number;
  N: number;
  K: number;
  batch: number;
  a: Tensor;
  b: Tensor;
  c: Tensor;
  bias: Tensor | null;
  transA: boolean;
  transB: boolean;
  lda: number;
  ldb: number;
  ldc: number;
  strideA: number;
  strideB: number;
  strideC: number;
  accumulate: boolean;
  tile?: Tile;
  splitK?: number;
}

/** Element span [first, last] of rows [r0, r0+rc) x cols [c0, c0+cc) over batches [b0, b0+nb). */
function span(ld: number, stride: number, b0: number, nb: number, r0: number, rc: number, c0: number, cc: number): [number, number] {
  return [b0 * stride + r0 * ld + c0, (b0 + nb - 1) * stride + (r0 + rc - 1) * ld + c0 + cc - 1];
}

/** A sub-problem: batches [b0, b0+nb), output rows [m0, m0+mc), columns [n0, n0+nc), reduction [k0, k0+kc). */
interface Block {
  b0: number;
  nb: number;
  m0: number;
  mc: number;
  n0: number;
  nc: number;
  k0: number;
  kc: number;
}

type Dim = 'm' | 'n' | 'k';

/** Each operand's stored (row, column) dims and its element span for a block. */
function operands(g: Gemm, k: Block): { name: string; rows: Dim; cols: Dim; span: [number, number] }[] {
  const len = (d: Dim) => (d === 'm' ? [k.m0, k.mc] : d === 'n' ? [k.n0, k.nc] : [k.k0, k.kc]);
  const op = (name: string, ld: number, stride: number, rows: Dim, cols: Dim) => {
    const [r0, rc] = len(rows);
    const [c0, cc] = len(cols);
    return { name, rows, cols, span: span(ld, stride, k.b0, k.nb, r0, Math.max(rc, 1), c0, Math.max(cc, 1)) };
  };
  return [
    g.transA ? op('a', g.lda, g.strideA, 'k', 'm') : op('a', g.lda, g.strideA, 'm', 'k'),
    g.transB ? op('b', g.ldb, g.strideB, 'n', 'k') : op('b', g.ldb, g.strideB, 'k', 'n'),
    op('c', g.ldc, g.strideC, 'm', 'n'),
  ];
}

function spanFits(gpu: Gpu, s: [number, number], bytes: number): boolean {
  return windowBytesBound(gpu, s[1] - s[0] + 1, bytes) <= gpu.maxBinding;
}

/** ceil(total / parts), rounded up to whole tiles while it is at least one tile. */
function chunkLen(total: number, parts: number, tileLen: number): number {
  const raw = Math.max(1, Math.ceil(total / parts));
  return raw >= tileLen ? Math.min(total, Math.ceil(raw / tileLen) * tileLen) : raw;
}

/**
 * Splits the GEMM into dispatches whose operand windows each fit one storage binding: whole batch
 * groups when they fit, else one batch at a time in chunks of M, N and K. An operand that does not
 * fit has its stored row dimension split (rows of a row-major matrix are contiguous), then its
 * column dimension. K chunks after the first accumulate onto it.
 */
function planGemm(gpu: Gpu, g: Gemm, tile: Tile): Block[] {
  const bytes = BYTES[g.a.dtype];
  const whole = (b0: number, nb: number): Block => ({ b0, nb, m0: 0, mc: g.M, n0: 0, nc: g.N, k0: 0, kc: g.K });
  const allFit = (k: Block) => operands(g, k).every((o) => spanFits(gpu, o.span, bytes));
  const maxZ = gpu.device.limits.maxComputeWorkgroupsPerDimension;
  let group = Math.min(g.batch, maxZ);
  while (group > 1 && !allFit(whole(0, group))) group = Math.ceil(group / 2);
  if (allFit(whole(0, group))) {
    const blocks: Block[] = [];
    for (let b0 = 0; b0 < g.batch; b0 += group) blocks.push(whole(b0, Math.min(group, g.batch - b0)));
    return blocks;
  }
  // One batch at a time; grow the number of chunks per dimension until every window fits.
  const parts: Record<Dim, number> = { m: 1, n: 1, k: 1 };
  const total: Record<Dim, number> = { m: g.M, n: g.N, k: g.K };
  const tileLen: Record<Dim, number> = { m: tile.BM, n: tile.BN, k: tile.BK };
  for (;;) {
    const c: Record<Dim, number> = { m: chunkLen(g.M, parts.m, tile.BM), n: chunkLen(g.N, parts.n, tile.BN), k: chunkLen(g.K, parts.k, tile.BK) };
    const bad = operands(g, { b0: 0, nb: 1, m0: 0, mc: c.m, n0: 0, nc: c.n, k0: 0, kc: c.k }).filter((o) => !spanFits(gpu, o.span, bytes));
    if (!bad.length) {
      const blocks: Block[] = [];
      for (let b0 = 0; b0 < g.batch; b0++)
        for (let m0 = 0; m0 < g.M; m0 += c.m)
          for (let n0 = 0; n0 < g.N; n0 += c.n)
            for (let k0 = 0; k0 < Math.max(g.K, 1); k0 += Math.max(c.k, 1))
              blocks.push({ b0, nb: 1, m0, mc: Math.min(c.m, g.M - m0), n0, nc: Math.min(c.n, g.N - n0), k0, kc: Math.min(c.k, g.K - k0) });
      return blocks;
    }
    for (const o of bad) {
      const d = c[o.rows] > 1 ? o.rows : c[o.cols] > 1 ? o.cols : null;
      if (!d)
        throw new ShapeError(
          g.op,
          `operands [${g.M}x${g.K}]${g.transA ? 'ᵀ' : ''} · [${g.K}x${g.N}]${g.transB ? 'ᵀ' : ''}: ${o.name} cannot be split into storage bindings of ${gpu.maxBinding} bytes`,
        );
      if (chunkLen(total[d], parts[d], tileLen[d]) === c[d]) parts[d] *= 2;
    }
  }
}

// ---- the generated tile loop -----------------------------------------------------------------

/** The shared-memory layout of one operand's tile (f32 vec4s along the operand's contiguous dim). */
interface TileLayout {
  /** Stored rows of the tile (K when the vec4s run along M or N, else BM / BN). */
  rows: number;
  /** vec4 groups per stored row. */
  groups: number;
  /** vec4s between rows: `groups`, plus one of padding when the vec4s run along K. */
  pitch: number;
}

/** A's tile: [BK][BM/4] when A is stored [K, M] (vec4s along M), else [BM][BK/4 + 1] (along K, padded). */
function layoutA(t: Tile, transA: boolean): TileLayout {
  return transA ? { rows: t.BK, groups: t.BM / 4, pitch: t.BM / 4 } : { rows: t.BM, groups: t.BK / 4, pitch: t.BK / 4 + 1 };
}

/** B's tile: [BK][BN/4] when B is stored [K, N], else [BN][BK/4 + 1]. */
function layoutB(t: Tile, transB: boolean): TileLayout {
  return transB ? { rows: t.BN, groups: t.BK / 4, pitch: t.BK / 4 + 1 } : { rows: t.BK, groups: t.BN / 4, pitch: t.BN / 4 };
}

/** Workgroup-memory bytes of the generated kernel's two tiles. */
export function gemmSharedBytes(t: Tile, transA: boolean, transB: boolean): number {
  const a = layoutA(t, transA);
  const b = layoutB(t, transB);
  return 16 * (a.rows * a.pitch + b.rows * b.pitch);
}

/**
 * WGSL of `gemm_tile` for one tile shape: staging loads (global -> registers), staging stores (registers
 * -> shared), the register micro-kernel and the epilogue, unrolled so that every register is a named
 * variable. See shaders/matmul.wgsl for the layout.
 */
export function gemmCode(defs: Defs): string {
  const num = (k: string) => defs[k] as number;
  const flag = (k: string) => defs[k] === true;
  const t: Tile = { BM: num('BM'), BN: num('BN'), BK: num('BK'), TM: num('TM'), TN: num('TN') };
  const [transA, transB] = [flag('TRANS_A'), flag('TRANS_B')];
  const wgX = t.BN / t.TN;
  const wgY = t.BM / t.TM;
  const wg = wgX * wgY;
  const la = layoutA(t, transA);
  const lb = layoutB(t, transB);
  const out: string[] = [];
  out.push(`alias AE = ${flag('VEC_A') ? 'vec4<T>' : 'T'};`, `alias BE = ${flag('VEC_B') ? 'vec4<T>' : 'T'};`);
  out.push(`var<workgroup> tile_a: array<vec4<f32>, ${la.rows * la.pitch}>;`, `var<workgroup> tile_b: array<vec4<f32>, ${lb.rows * lb.pitch}>;`);

  // Loads of one group of 4 contiguous elements at stored (row, col), 0 outside the matrix. Branch-free:
  // indices are clamped into the bound array and `select` zeroes what lies outside (branches per element,
  // inlined at every staging load, cost lavapipe's compiler a minute on skinny tiles).
  const loader = (name: string, buf: string, ld: string, vec: boolean, rowLimit: string, colLimit: string, checkRow: boolean, checkCol: boolean) => {
    const body: string[] = [`  let i = base + row * p.${ld} + col;`, `  let last = arrayLength(&${buf}) - 1u;`];
    const at = (idx: string) => (checkRow || checkCol ? `${buf}[min(${idx}, last)]` : `${buf}[${idx}]`);
    if (vec) body.push(`  let v = vec4<f32>(${at('i / 4u')});`);
    else body.push(`  let v = vec4<f32>(f32(${at('i')}), f32(${at('i + 1u')}), f32(${at('i + 2u')}), f32(${at('i + 3u')}));`);
    const inside: string[] = [];
    if (checkRow) inside.push(`vec4<bool>(row < ${rowLimit})`);
    // vec4 groups are wholly inside or outside (the contiguous dim is a multiple of 4).
    if (checkCol) inside.push(vec ? `vec4<bool>(col < ${colLimit})` : `vec4<u32>(col) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(${colLimit})`);
    if (inside.length === 0) body.push(`  return v;`);
    else body.push(`  return select(vec4<f32>(0.0), v, ${inside.map((c) => `(${c})`).join(' & ')});`);
    return `fn ${name}(base: u32, row: u32, col: u32, k_end: u32) -> vec4<f32> {\n${body.join('\n')}\n}`;
  };
  const [cm, cn, ck] = [flag('CHECK_M'), flag('CHECK_N'), flag('CHECK_K')];
  out.push(
    transA ? loader('load_a', 'a', 'lda', flag('VEC_A'), 'k_end', 'p.M', ck, cm) : loader('load_a', 'a', 'lda', flag('VEC_A'), 'p.M', 'k_end', cm, ck),
    transB ? loader('load_b', 'b', 'ldb', flag('VEC_B'), 'p.N', 'k_end', cn, ck) : loader('load_b', 'b', 'ldb', flag('VEC_B'), 'k_end', 'p.N', ck, cn),
  );

  // Staging: invocation tid moves groups tid, tid + WG, ... of each tile. Up to 4 groups per invocation go
  // through named registers (the next tile is loaded while this one is multiplied); skinny tiles, whose few
  // invocations move many groups each, copy straight from global to shared memory in a loop instead (an
  // unrolled copy of 16+ groups costs lavapipe's compiler most of a minute).
  const staging = (op: 'a' | 'b', l: TileLayout, stored: (r: string, c: string) => [string, string]) => {
    const total = l.rows * l.groups;
    const n = Math.ceil(total / wg);
    const at = (g: string, k0: string) => stored(`(${g} / ${l.groups}u)`, `(${g} % ${l.groups}u * 4u)`).map((x) => x.replaceAll('K0', k0));
    const slot = (g: string) => `tile_${op}[${g} / ${l.groups}u * ${l.pitch}u + ${g} % ${l.groups}u]`;
    if (n > 4) {
      const copy = (k0: string) => {
        const [row, col] = at('g', k0);
        return [`    for (var g = tid; g < ${total}u; g += ${wg}u) { ${slot('g')} = load_${op}(base_${op}, ${row}, ${col}, k_end); }`];
      };
      return { decl: [] as string[], load: (_k0: string) => [] as string[], store: copy };
    }
    const regs = Array.from({ length: n }, (_, i) => `p${op}${i}`);
    const guard = (i: number) => (total % wg !== 0 && (i + 1) * wg > total ? `if (tid + ${i * wg}u < ${total}u) ` : '');
    return {
      decl: regs.map((r) => `  var ${r} = vec4<f32>(0.0);`),
      load: (k0: string) =>
        regs.map((r, i) => {
          const [row, col] = at(`(tid + ${i * wg}u)`, k0);
          return `    ${guard(i)}{ ${r} = load_${op}(base_${op}, ${row}, ${col}, k_end); }`;
        }),
      store: (_k0: string) => regs.map((r, i) => `    ${guard(i)}{ ${slot(`(tid + ${i * wg}u)`)} = ${r}; }`),
    };
  };
  // Stored (row, col) of a group at tile (row r, vec4 column c); K0 is replaced by the tile's first k.
  const sa = staging('a', la, (r, c) => (transA ? [`K0 + ${r}`, `row0 + ${c}`] : [`row0 + ${r}`, `K0 + ${c}`]));
  const sb = staging('b', lb, (r, c) => (transB ? [`col0 + ${r}`, `K0 + ${c}`] : [`K0 + ${r}`, `col0 + ${c}`]));

  // The micro-kernel for 4 k values (kk * 4 + q): fragments, then TM x TN/4 vec4 FMAs per q.
  const VM = t.TM / 4;
  const VN = t.TN / 4;
  const micro: string[] = [];
  const aOf: string[][] = []; // aOf[r][q]: WGSL expression of op(A)[row r of the block, k q]
  const comp = ['x', 'y', 'z', 'w'];
  for (let r = 0; r < t.TM; r++) aOf.push([]);
  if (transA) {
    for (let q = 0; q < 4; q++)
      for (let i = 0; i < VM; i++) {
        micro.push(`      let a${q}_${i} = tile_a[(kk * 4u + ${q}u) * ${la.pitch}u + ${i * wgY}u + ty];`);
        for (let e = 0; e < 4; e++) aOf[i * 4 + e][q] = `a${q}_${i}.${comp[e]}`;
      }
  } else {
    for (let i = 0; i < VM; i++)
      for (let e = 0; e < 4; e++) {
        micro.push(`      let a${i}_${e} = tile_a[((${i * wgY}u + ty) * 4u + ${e}u) * ${la.pitch}u + kk];`);
        for (let q = 0; q < 4; q++) aOf[i * 4 + e][q] = `a${i}_${e}.${comp[q]}`;
      }
  }
  const bOf: string[][] = []; // bOf[q][j]: vec4 of op(B)[k q, columns of block j]
  for (let q = 0; q < 4; q++) bOf.push([]);
  if (!transB) {
    for (let q = 0; q < 4; q++)
      for (let j = 0; j < VN; j++) {
        micro.push(`      let b${q}_${j} = tile_b[(kk * 4u + ${q}u) * ${lb.pitch}u + ${j * wgX}u + tx];`);
        bOf[q][j] = `b${q}_${j}`;
      }
  } else {
    for (let j = 0; j < VN; j++)
      for (let e = 0; e < 4; e++) micro.push(`      let bn${j}_${e} = tile_b[((${j * wgX}u + tx) * 4u + ${e}u) * ${lb.pitch}u + kk];`);
    for (let q = 0; q < 4; q++)
      for (let j = 0; j < VN; j++) {
        micro.push(`      let b${q}_${j} = vec4<f32>(${[0, 1, 2, 3].map((e) => `bn${j}_${e}.${comp[q]}`).join(', ')});`);
        bOf[q][j] = `b${q}_${j}`;
      }
  }
  for (let q = 0; q < 4; q++)
    for (let r = 0; r < t.TM; r++) for (let j = 0; j < VN; j++) micro.push(`      acc${r}_${j} = fma(vec4<f32>(${aOf[r][q]}), ${bOf[q][j]}, acc${r}_${j});`);

  const accs: string[] = [];
  const epilogue: string[] = [];
  for (let i = 0; i < VM; i++)
    for (let e = 0; e < 4; e++)
      for (let j = 0; j < VN; j++) {
        const r = i * 4 + e;
        accs.push(`  var acc${r}_${j} = vec4<f32>(0.0);`);
        epilogue.push(`  store_out(base_c, row0 + (${i * wgY}u + ty) * 4u + ${e}u, col0 + (${j * wgX}u + tx) * 4u, acc${r}_${j});`);
      }

  const next = [...sa.load(`(k0 + ${t.BK}u)`), ...sb.load(`(k0 + ${t.BK}u)`)];
  const prefetch = next.length
    ? [`    // The next tile into registers while this one is multiplied.`, `    if (k0 + ${t.BK}u < k_end) {`, ...next.map((s) => `  ${s}`), `    }`]
    : [];
  return [
    ...out,
    `// One ${t.BM}x${t.BN} tile of C over k in [k_begin, k_end): ${t.TM}x${t.TN} outputs per invocation.`,
    `fn gemm_tile(row0: u32, col0: u32, base_a: u32, base_b: u32, base_c: u32, k_begin: u32, k_end: u32, tx: u32, ty: u32, tid: u32) {`,
    ...accs,
    ...sa.decl,
    ...sb.decl,
    `  if (k_begin < k_end) {`,
    ...sa.load('k_begin'),
    ...sb.load('k_begin'),
    `  }`,
    `  for (var k0 = k_begin; k0 < k_end; k0 += ${t.BK}u) {`,
    ...sa.store('k0'),
    ...sb.store('k0'),
    `    workgroupBarrier();`,
    ...prefetch,
    `    for (var kk = 0u; kk < ${t.BK / 4}u; kk++) {`,
    ...micro,
    `    }`,
    `    workgroupBarrier();`,
    `  }`,
    ...epilogue,
    `}`,
  ].join('\n');
}

const GEMM_DIMS = [
  { name: 'M', type: 'u32' },
  { name: 'N', type: 'u32' },
  { name: 'K', type: 'u32' },
  { name: 'lda', type: 'u32' },
  { name: 'ldb', type: 'u32' },
] as const;

const MATMUL = kernel({
  shader: 'matmul',
  entry: 'matmul',
  uniforms: [
    ...GEMM_DIMS,
    { name: 'ldc', type: 'u32' },
    { name: 'off_a', type: 'u32' },
    { name: 'off_b', type: 'u32' },
    { name: 'off_c', type: 'u32' },
    { name: 'off_bias', type: 'u32' },
    { name: 'stride_a', type: 'u32' },
    { name: 'stride_b', type: 'u32' },
    { name: 'stride_c', type: 'u32' },
  ],
  bindings: [
    { name: 'a', type: 'AE', access: 'read' },
    { name: 'b', type: 'BE', access: 'read' },
    { name: 'c', type: 'TC', access: 'read_write' },
    { name: 'bias', type: 'T', access: 'read', when: 'HAS_BIAS' },
  ],
  code: gemmCode,
});

const MATMUL_PARTIAL = kernel({
  shader: 'matmul',
  entry: 'matmul_partial',
  uniforms: [...GEMM_DIMS, { name: 'off_a', type: 'u32' }, { name: 'off_b', type: 'u32' }, { name: 'k_split', type: 'u32' }],
  bindings: [
    { name: 'a', type: 'AE', access: 'read' },
    { name: 'b', type: 'BE', access: 'read' },
    { name: 'partial', type: 'f32', access: 'read_write' },
  ],
  code: gemmCode,
});

const MATMUL_REDUCE = kernel({
  shader: 'matmul',
  entry: 'matmul_reduce',
  uniforms: [
    { name: 'M', type: 'u32' },
    { name: 'N', type: 'u32' },
    { name: 'ldc', type: 'u32' },
    { name: 'off_c', type: 'u32' },
    { name: 'off_bias', type: 'u32' },
    { name: 'splits', type: 'u32' },
  ],
  bindings: [
    { name: 'partial', type: 'f32', access: 'read' },
    { name: 'c', type: 'TC', access: 'read_write' },
    { name: 'bias', type: 'T', access: 'read', when: 'HAS_BIAS' },
  ],
});

// ---- choosing a configuration ----------------------------------------------------------------

/** How one GEMM runs: the workgroup tile and the number of K ranges (1: no split-K). */
export interface GemmConfig {
  tile: Tile;
  splitK: number;
}

/** Candidate tiles for the cost model and the tuner, biggest register blocks first. */
export const GEMM_TILES: readonly Tile[] = [
  { BM: 128, BN: 128, BK: 32, TM: 8, TN: 8 },
  { BM: 128, BN: 64, BK: 32, TM: 8, TN: 8 },
  { BM: 64, BN: 128, BK: 32, TM: 8, TN: 8 },
  { BM: 64, BN: 64, BK: 32, TM: 8, TN: 8 },
  { BM: 64, BN: 64, BK: 32, TM: 4, TN: 4 },
  { BM: 32, BN: 64, BK: 32, TM: 4, TN: 4 },
  { BM: 64, BN: 32, BK: 32, TM: 4, TN: 4 },
  { BM: 32, BN: 32, BK: 32, TM: 4, TN: 4 },
];

/** Skinny tiles for M or N at most 4 or 16 (see TILE_ROWS_4 ...), 32 deep. */
const SKINNY = {
  rows4: { BM: 4, BN: 128, BK: 32, TM: 4, TN: 4 },
  rows16: { BM: 16, BN: 64, BK: 32, TM: 4, TN: 4 },
  cols4: { BM: 128, BN: 4, BK: 32, TM: 4, TN: 4 },
  cols16: { BM: 64, BN: 16, BK: 32, TM: 4, TN: 4 },
} as const;

/** The tile with BK halved (down to 8) until its shared tiles fit the device; null if they never do. */
export function fitTile(gpu: Gpu, t: Tile, transA: boolean, transB: boolean): Tile | null {
  const lim = gpu.device.limits;
  if ((t.BM / t.TM) * (t.BN / t.TN) > lim.maxComputeInvocationsPerWorkgroup) return null;
  if (t.BN / t.TN > lim.maxComputeWorkgroupSizeX || t.BM / t.TM > lim.maxComputeWorkgroupSizeY) return null;
  let f = t;
  while (gemmSharedBytes(f, transA, transB) > lim.maxComputeWorkgroupStorageSize) {
    if (f.BK <= 8) return null;
    f = { ...f, BK: f.BK / 2 };
  }
  return f;
}

/** The problem a configuration is chosen for. */
export interface GemmProblem {
  M: number;
  N: number;
  K: number;
  batch: number;
  dtype: DType;
  transA: boolean;
  transB: boolean;
}

const pow2 = (x: number) => 2 ** Math.ceil(Math.log2(Math.max(1, x)));

/** The tuning class of a problem: M, N, K and batch rounded up to powers of two, dtype and transposes. */
export function gemmClass(p: GemmProblem): string {
  return `${p.dtype}:${p.transA ? 't' : 'n'}${p.transB ? 't' : 'n'}:m${pow2(p.M)}:n${pow2(p.N)}:k${pow2(p.K)}:b${pow2(p.batch)}`;
}

/** Configurations tuned for a Gpu (src/ops/tune.ts), by gemmClass; consulted before the heuristic. */
const tuned = new WeakMap<Gpu, Map<string, GemmConfig>>();

export function tunedGemms(gpu: Gpu): Map<string, GemmConfig> {
  let m = tuned.get(gpu);
  if (!m) tuned.set(gpu, (m = new Map()));
  return m;
}

/** Output tiles of a problem under a tile. */
function tileCount(p: GemmProblem, t: Tile): number {
  return Math.ceil(p.M / t.BM) * Math.ceil(p.N / t.BN) * p.batch;
}

/**
 * Split-K for problems with few output tiles and a long K (weight gradients: M = N = 320, K = 8192): K
 * ranges of whole BK steps, enough of them to give the device `fillWorkgroups` workgroups, each at least
 * 256 deep. Single-batch problems only.
 */
export function pickSplitK(p: GemmProblem, t: Tile, fill: number): number {
  if (p.batch !== 1) return 1;
  const tiles = tileCount(p, t);
  if (tiles >= fill || p.K < 1024) return 1;
  return Math.max(1, Math.min(Math.ceil(fill / tiles), Math.floor(p.K / 256), 32));
}

/**
 * The heuristic: skinny tiles where one side is at most 16; otherwise the candidate with the lowest cost
 * = padded work / (register-block intensity x occupancy), where intensity TM·TN / (TM + TN) counts the
 * FMAs per shared load and occupancy min(1, tiles / fillWorkgroups) the device's use. Rectangular tiles
 * win where they pad less (N = 320: 64-wide columns, not 384).
 */
export function heuristicGemm(gpu: Gpu, p: GemmProblem): GemmConfig {
  const fit = (t: Tile) => fitTile(gpu, t, p.transA, p.transB);
  const skinny = p.M <= 4 && p.N > p.M ? SKINNY.rows4 : p.N <= 4 ? SKINNY.cols4 : p.M <= 16 && p.N > p.M ? SKINNY.rows16 : p.N <= 16 ? SKINNY.cols16 : null;
  if (skinny) {
    const t = fit(skinny) ?? TILE_64;
    return { tile: t, splitK: pickSplitK(p, t, gpu.fillWorkgroups) };
  }
  let best: { tile: Tile; cost: number } | null = null;
  for (const cand of GEMM_TILES) {
    const t = fit(cand);
    if (!t) continue;
    const padded = Math.ceil(p.M / t.BM) * t.BM * Math.ceil(p.N / t.BN) * t.BN * p.batch;
    const occupancy = Math.min(1, tileCount(p, t) / gpu.fillWorkgroups);
    const cost = padded / (((t.TM * t.TN) / (t.TM + t.TN)) * occupancy);
    if (!best || cost < best.cost) best = { tile: t, cost };
  }
  const tile = best?.tile ?? TILE_64;
  return { tile, splitK: pickSplitK(p, tile, gpu.fillWorkgroups) };
}

/** A tuned configuration for the problem's class when there is one, else the heuristic's. */
export function chooseGemm(gpu: Gpu, p: GemmProblem): GemmConfig {
  return tuned.get(gpu)?.get(gemmClass(p)) ?? heuristicGemm(gpu, p);
}

// ---- running one GEMM ------------------------------------------------------------------------

/** The specialisation of one block: vec4 loads where the operand allows, bounds checks where needed. */
export interface GemmVariant {
  vecA: boolean;
  vecB: boolean;
  checkM: boolean;
  checkN: boolean;
  checkK: boolean;
}

/**
 * vec4 loads of an operand need its contiguous dimension, leading dimension, batch stride and window
 * offset to be multiples of 4 (every group of 4 is then aligned and either wholly inside or outside).
 */
function vecOk(contiguous: number, ld: number, stride: number, offset: number): boolean {
  return contiguous % 4 === 0 && ld % 4 === 0 && stride % 4 === 0 && offset % 4 === 0;
}

function variantOf(g: Gemm, k: Block, t: Tile, kc: number, offA: number, offB: number): GemmVariant {
  return {
    vecA: vecOk(g.transA ? k.mc : k.kc, g.lda, g.strideA, offA),
    vecB: vecOk(g.transB ? k.kc : k.nc, g.ldb, g.strideB, offB),
    checkM: k.mc % t.BM !== 0,
    checkN: k.nc % t.BN !== 0,
    checkK: kc % t.BK !== 0,
  };
}

function variantDefs(g: Gemm, t: Tile, v: GemmVariant): Defs {
  return {
    T: g.a.dtype,
    ...t,
    TRANS_A: g.transA,
    TRANS_B: g.transB,
    VEC_A: v.vecA,
    VEC_B: v.vecB,
    CHECK_M: v.checkM,
    CHECK_N: v.checkN,
    CHECK_K: v.checkK,
  };
}

/** What the last GEMM dispatched ran as (tests assert that a fast path is really taken). */
export interface GemmTrace {
  config: GemmConfig;
  variants: GemmVariant[];
}

let trace: GemmTrace[] | null = null;

/** Records the configuration and variants of every GEMM `fn` runs. */
export function traceGemms<R>(fn: () => R): { result: R; gemms: GemmTrace[] } {
  const prev = trace;
  trace = [];
  try {
    const result = fn();
    return { result, gemms: trace };
  } finally {
    trace = prev;
  }
}

function runGemm(gpu: Gpu, g: Gemm): void {
  if (g.M === 0 || g.N === 0 || g.batch === 0) return;
  const problem: GemmProblem = { M: g.M, N: g.N, K: g.K, batch: g.batch, dtype: g.a.dtype, transA: g.transA, transB: g.transB };
  const chosen: GemmConfig = g.tile ? { tile: g.tile, splitK: g.splitK ?? 1 } : { ...chooseGemm(gpu, problem), ...(g.splitK ? { splitK: g.splitK } : {}) };
  // A forced tile too deep for this device's workgroup memory runs with a shallower BK.
  const tile = fitTile(gpu, chosen.tile, g.transA, g.transB) ?? chosen.tile;
  checkTile(gpu, tile, g.transA, g.transB);
  const blocks = planGemm(gpu, g, tile);
  const record: GemmTrace = { config: chosen, variants: [] };
  trace?.push(record);
  // Split-K needs the whole problem in one block and its partial sums in one binding.
  const splits = blocks.length === 1 && blocks[0].nb === 1 && g.K > 0 ? Math.min(chosen.splitK, Math.ceil(g.K / tile.BK)) : 1;
  if (splits > 1 && 4 * splits * g.M * g.N <= gpu.maxBinding) {
    record.config = { tile, splitK: splits };
    runSplitK(gpu, g, blocks[0], tile, splits, record);
    return;
  }
  record.config = { tile, splitK: 1 };
  for (const k of blocks) {
    const [sa, sb, sc] = operands(g, k).map((o) => o.span);
    const firstK = k.k0 === 0;
    // K = 0 gives C = bias (or leaves C as is when accumulating): the kernel's K loop is empty.
    const wa = elemWindow(gpu, g.a, sa[0], sa[1] - sa[0] + 1);
    const wb = elemWindow(gpu, g.b, sb[0], sb[1] - sb[0] + 1);
    const wc = elemWindow(gpu, g.c, sc[0], sc[1] - sc[0] + 1);
    const wbias = firstK && g.bias !== null ? elemWindow(gpu, g.bias, k.n0, k.nc) : null;
    const v = variantOf(g, k, tile, k.kc, wa.offset, wb.offset);
    record.variants.push(v);
    gpu.run(MATMUL, {
      defs: { ...variantDefs(g, tile, v), TC: g.c.dtype, HAS_BIAS: wbias !== null, ACCUMULATE: g.accumulate || !firstK },
      uniforms: {
        M: k.mc,
        N: k.nc,
        K: k.kc,
        lda: g.lda,
        ldb: g.ldb,
        ldc: g.ldc,
        off_a: wa.offset,
        off_b: wb.offset,
        off_c: wc.offset,
        off_bias: wbias?.offset ?? 0,
        stride_a: g.strideA,
        stride_b: g.strideB,
        stride_c: g.strideC,
      },
      bindings: { a: wa.window, b: wb.window, c: wc.window, ...(wbias ? { bias: wbias.window } : {}) },
      workgroups: [Math.ceil(k.nc / tile.BN), Math.ceil(k.mc / tile.BM), k.nb],
    });
  }
}

/** Split-K: `splits` K ranges of whole BK steps into f32 partials, then their parallel reduction into C. */
function runSplitK(gpu: Gpu, g: Gemm, k: Block, tile: Tile, splits: number, record: GemmTrace): void {
  const [sa, sb, sc] = operands(g, k).map((o) => o.span);
  const kSplit = Math.ceil(Math.ceil(g.K / splits) / tile.BK) * tile.BK;
  const used = Math.ceil(g.K / kSplit);
  const partial = gpu.tensor([used, g.M, g.N], 'f32', 'scratch', 'matmul-splitk');
  const wa = elemWindow(gpu, g.a, sa[0], sa[1] - sa[0] + 1);
  const wb = elemWindow(gpu, g.b, sb[0], sb[1] - sb[0] + 1);
  const wc = elemWindow(gpu, g.c, sc[0], sc[1] - sc[0] + 1);
  const wp = elemWindow(gpu, partial, 0, partial.numel);
  const v = variantOf(g, k, tile, g.K, wa.offset, wb.offset);
  record.config = { tile, splitK: used };
  record.variants.push(v);
  gpu.run(MATMUL_PARTIAL, {
    defs: variantDefs(g, tile, v),
    uniforms: { M: g.M, N: g.N, K: g.K, lda: g.lda, ldb: g.ldb, off_a: wa.offset, off_b: wb.offset, k_split: kSplit },
    bindings: { a: wa.window, b: wb.window, partial: wp.window },
    workgroups: [Math.ceil(g.N / tile.BN), Math.ceil(g.M / tile.BM), used],
  });
  const wbias = g.bias ? elemWindow(gpu, g.bias, 0, g.N) : null;
  gpu.run(MATMUL_REDUCE, {
    defs: { T: g.a.dtype, TC: g.c.dtype, HAS_BIAS: wbias !== null, ACCUMULATE: g.accumulate },
    uniforms: { M: g.M, N: g.N, ldc: g.ldc, off_c: wc.offset, off_bias: wbias?.offset ?? 0, splits: used },
    bindings: { partial: wp.window, c: wc.window, ...(wbias ? { bias: wbias.window } : {}) },
    workgroups: [Math.ceil(g.N / 64), Math.ceil(g.M / 4)],
  });
  // Freeing before the submit is safe: the buffer's next user runs after these commands.
  gpu.free(partial);
}

/** An output is stored in the input dtype, or in f32 (f32 gradient buffers of f16 operands). */
function expectOutDType(op: string, input: Tensor, out: Tensor): void {
  if (out.dtype !== input.dtype && out.dtype !== 'f32')
    throw new ShapeError(op, `out must be ${input.dtype} or f32, got ${out.dtype}${fmtShape(out.shape)} for ${input.dtype}${fmtShape(input.shape)} inputs`);
}

// ---- matmul ----------------------------------------------------------------------------------

interface MatmulShape {
  M: number;
  N: number;
  K: number;
  batchShape: number[];
  batch: number;
  aBatched: boolean;
  bBatched: boolean;
}

function matmulShape(op: string, a: Tensor, b: Tensor, transA: boolean, transB: boolean): MatmulShape {
  const desc = () => `a ${fmtShape(a.shape)}${transA ? 'ᵀ' : ''} · b ${fmtShape(b.shape)}${transB ? 'ᵀ' : ''}`;
  if (a.shape.length < 2 || b.shape.length < 2) throw new ShapeError(op, `operands must have at least 2 dims: ${desc()}`);
  expectSameDType(op, a, b);
  const [ar, ac] = a.shape.slice(-2);
  const [br, bc] = b.shape.slice(-2);
  const M = transA ? ac : ar;
  const K = transA ? ar : ac;
  const Kb = transB ? bc : br;
  const N = transB ? br : bc;
  if (K !== Kb) throw new ShapeError(op, `inner dimensions differ (${K} vs ${Kb}): ${desc()}`);
  const aBatch = a.shape.slice(0, -2);
  const bBatch = b.shape.slice(0, -2);
  if (aBatch.length && bBatch.length && (aBatch.length !== bBatch.length || aBatch.some((d, i) => d !== bBatch[i])))
    throw new ShapeError(op, `batch dimensions differ: ${desc()}`);
  const batchShape = aBatch.length ? aBatch : bBatch;
  return { M, N, K, batchShape, batch: numel(batchShape), aBatched: aBatch.length > 0, bBatched: bBatch.length > 0 };
}

/**
 * Y = op(a) · op(b) (+ bias), batched over leading dims (either operand may be unbatched, i.e.
 * broadcast). Output dtype = input dtype, f32 accumulation.
 */
export function matmul(gpu: Gpu, a: Tensor, b: Tensor, opts: MatmulOptions = {}): Tensor {
  const op = 'matmul';
  const transA = opts.transA ?? false;
  const transB = opts.transB ?? false;
  const s = matmulShape(op, a, b, transA, transB);
  const outShape = [...s.batchShape, s.M, s.N];
  if (opts.bias) {
    expectShape(op, 'bias', opts.bias, [s.N]);
    expectSameDType(op, a, opts.bias);
  }
  if (opts.accumulate && !opts.out) throw new ShapeError(op, 'accumulate needs an out tensor');
  if (opts.out) {
    expectShape(op, 'out', opts.out, outShape);
    expectOutDType(op, a, opts.out);
  }
  const c = opts.out ?? gpu.tensor(outShape, a.dtype, 'activations', 'matmul');
  const g: Gemm = {
    op,
    M: s.M,
    N: s.N,
    K: s.K,
    batch: s.batch,
    a,
    b,
    c,
    bias: opts.bias ?? null,
    transA,
    transB,
    lda: a.shape[a.shape.length - 1],
    ldb: b.shape[b.shape.length - 1],
    ldc: s.N,
    strideA: s.aBatched ? s.M * s.K : 0,
    strideB: s.bBatched ? s.K * s.N : 0,
    strideC: s.M * s.N,
    accumulate: opts.accumulate ?? false,
    tile: opts.tile,
    splitK: opts.splitK,
  };
  // A broadcast B over rows of A [M, K] is one big GEMM over batch * M rows.
  if (!s.bBatched && s.aBatched && !transA) {
    g.M *= g.batch;
    g.batch = 1;
  }
  runGemm(gpu, g);
  return c;
}

/**
 * Σ_batch op(x_b) · op(y_b) into one [M, N] result (gradients of an operand that was broadcast over
 * the batch). When the reduction runs along the stored rows of both (x transposed, y not) the
 * batches are just more rows: one GEMM over batch * rows. Otherwise one accumulating GEMM per batch.
 */
function matmulSumBatch(
  gpu: Gpu,
  op: string,
  x: Tensor,
  y: Tensor,
  transX: boolean,
  transY: boolean,
  out: Tensor | undefined,
  accumulate: boolean,
  tile: Tile | undefined,
): Tensor {
  const s = matmulShape(op, x, y, transX, transY);
  const flat = (t: Tensor) => t.shape.slice(-2);
  if (transX && !transY) {
    const rows = x.numel / x.shape[x.shape.length - 1];
    return matmul(gpu, x.reshape([rows, x.shape[x.shape.length - 1]]), y.reshape([rows, y.shape[y.shape.length - 1]]), {
      transA: true,
      out,
      accumulate,
      tile,
    });
  }
  const c = out ?? gpu.tensor([s.M, s.N], x.dtype, 'gradients', `${op}-sum`);
  const xs = flat(x);
  const ys = flat(y);
  for (let i = 0; i < s.batch; i++) {
    const xv = new Tensor(x.alloc, xs, x.dtype, x.byteOffset + i * numel(xs) * BYTES[x.dtype], false);
    const yv = new Tensor(y.alloc, ys, y.dtype, y.byteOffset + i * numel(ys) * BYTES[y.dtype], false);
    matmul(gpu, xv, yv, { transA: transX, transB: transY, out: c, accumulate: accumulate || i > 0, tile });
  }
  return c;
}

export interface MatmulGrads {
  da: Tensor;
  db: Tensor;
  dbias?: Tensor;
}

export interface MatmulBackwardOptions extends MatmulOptions {
  /** Gradient tensors to write (or, with `accumulate`, add) into instead of new ones. */
  into?: { da?: Tensor; db?: Tensor; dbias?: Tensor };
}

/**
 * Gradients of Y = op(a) · op(b) + bias for upstream dY (same argument order as matmul; `bias`
 * only says whether dbias is wanted). With `accumulate`, adds into `into.*`.
 */
export function matmulBackward(gpu: Gpu, a: Tensor, b: Tensor, dy: Tensor, opts: MatmulBackwardOptions = {}): MatmulGrads {
  const op = 'matmulBackward';
  const transA = opts.transA ?? false;
  const transB = opts.transB ?? false;
  const s = matmulShape(op, a, b, transA, transB);
  expectShape(op, 'dy', dy, [...s.batchShape, s.M, s.N]);
  expectSameDType(op, a, dy);
  const acc = opts.accumulate ?? false;
  const into = opts.into ?? {};
  if (acc && (!into.da || !into.db || (opts.bias && !into.dbias))) throw new ShapeError(op, 'accumulate needs into.da, into.db (and into.dbias with a bias)');
  const sumA = !s.aBatched && s.bBatched;
  const sumB = !s.bBatched && s.aBatched;

  const tile = opts.tile;
  // dop(A) = dY · op(B)ᵀ. Stored A = op(A) (no transA) or op(A)ᵀ = op(B) · dYᵀ (transA).
  let da: Tensor;
  if (!transA)
    da = sumA
      ? matmulSumBatch(gpu, op, dy, b, false, !transB, into.da, acc, tile)
      : matmul(gpu, dy, b, { transB: !transB, out: into.da, accumulate: acc, tile });
  else
    da = sumA
      ? matmulSumBatch(gpu, op, b, dy, transB, true, into.da, acc, tile)
      : matmul(gpu, b, dy, { transA: transB, transB: true, out: into.da, accumulate: acc, tile });

  // dop(B) = op(A)ᵀ · dY. Stored B = op(B) (no transB) or op(B)ᵀ = dYᵀ · op(A) (transB).
  let db: Tensor;
  if (!transB)
    db = sumB
      ? matmulSumBatch(gpu, op, a, dy, !transA, false, into.db, acc, tile)
      : matmul(gpu, a, dy, { transA: !transA, out: into.db, accumulate: acc, tile });
  else
    db = sumB
      ? matmulSumBatch(gpu, op, dy, a, true, transA, into.db, acc, tile)
      : matmul(gpu, dy, a, { transA: true, transB: transA, out: into.db, accumulate: acc, tile });

  const grads: MatmulGrads = { da, db };
  if (opts.bias) grads.dbias = colSum(gpu, dy.reshape([dy.numel / s.N, s.N]), into.dbias, acc);
  return grads;
}

const COL_SUM_PARTIAL = kernel({
  shader: 'matmul',
  entry: 'col_sum_partial',
  uniforms: [
    { name: 'rows', type: 'u32' },
    { name: 'cols', type: 'u32' },
    { name: 'off_x', type: 'u32' },
    { name: 'part_row0', type: 'u32' },
  ],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'partial', type: 'f32', access: 'read_write' },
  ],
});

const COL_SUM_FINISH = kernel({
  shader: 'matmul',
  entry: 'col_sum_finish',
  uniforms: [
    { name: 'cols', type: 'u32' },
    { name: 'off_out', type: 'u32' },
    { name: 'parts', type: 'u32' },
  ],
  bindings: [
    { name: 'partial', type: 'f32', access: 'read' },
    { name: 'out', type: 'TO', access: 'read_write' },
  ],
});

/** out[n] = Σ_r x[r, n] in f32 (two passes: per-256-row partial sums, then their sum). */
export function colSum(gpu: Gpu, x: Tensor, out?: Tensor, accumulate = false): Tensor {
  const op = 'colSum';
  if (x.shape.length !== 2) throw new ShapeError(op, `x must be 2-D, got ${fmtShape(x.shape)}`);
  const [rows, cols] = x.shape;
  if (out) {
    expectShape(op, 'out', out, [cols]);
    expectOutDType(op, x, out);
  }
  if (accumulate && !out) throw new ShapeError(op, 'accumulate needs an out tensor');
  const o = out ?? gpu.tensor([cols], x.dtype, 'gradients', 'colsum');
  const bytes = BYTES[x.dtype];
  const rowsPerWg = 256; // ROWS_PER_WG in the shader
  // Row chunks of x that fit one binding; each chunk writes ceil(rows / 256) partial rows.
  const chunkRows = Math.floor((gpu.maxBinding - windowBytesBound(gpu, 0, bytes)) / (cols * bytes));
  if (chunkRows < 1 && rows > 0) throw new ShapeError(op, `${fmtShape(x.shape)}: one row does not fit a storage binding of ${gpu.maxBinding} bytes`);
  const chunks: { r0: number; rc: number }[] = [];
  for (let r0 = 0; r0 < rows; r0 += chunkRows) chunks.push({ r0, rc: Math.min(chunkRows, rows - r0) });
  const parts = Math.max(
    1,
    chunks.reduce((n, c) => n + Math.ceil(c.rc / rowsPerWg), 0),
  );
  const partial = gpu.tensor([parts, cols], 'f32', 'scratch', 'colsum-partial');
  const wo = elemWindow(gpu, o, 0, cols);
  const wp = elemWindow(gpu, partial, 0, parts * cols);
  let part = 0;
  for (const { r0, rc } of chunks) {
    const wx = elemWindow(gpu, x, r0 * cols, rc * cols);
    const blocks = Math.ceil(rc / rowsPerWg);
    gpu.run(COL_SUM_PARTIAL, {
      defs: { T: x.dtype },
      uniforms: { rows: rc, cols, off_x: wx.offset, part_row0: part },
      bindings: { x: wx.window, partial: wp.window },
      workgroups: [Math.ceil(cols / 64), blocks],
    });
    part += blocks;
  }
  gpu.run(COL_SUM_FINISH, {
    defs: { TO: o.dtype, ACCUMULATE: accumulate },
    uniforms: { cols, off_out: wo.offset, parts: part },
    bindings: { partial: wp.window, out: wo.window },
    workgroups: [Math.ceil(cols / 64)],
  });
  // Submit before freeing: work already submitted still sees the buffer.
  gpu.flush();
  gpu.free(partial);
  return o;
}

// ---- linear (PyTorch nn.Linear: weight [out, in]) ---------------------------------------------

/** y = x · Wᵀ + b, x [..., in], weight [out, in], bias [out]. */
export function linear(gpu: Gpu, x: Tensor, weight: Tensor, bias?: Tensor | null): Tensor {
  if (x.shape.length < 1 || weight.shape.length !== 2)
    throw new ShapeError('linear', `x ${fmtShape(x.shape)}, weight ${fmtShape(weight.shape)} (must be [out, in])`);
  if (x.shape[x.shape.length - 1] !== weight.shape[1])
    throw new ShapeError(
      'linear',
      `x ${fmtShape(x.shape)} has ${x.shape[x.shape.length - 1]} features, weight ${fmtShape(weight.shape)} takes ${weight.shape[1]}`,
    );
  const x2 = x.shape.length === 1 ? x.reshape([1, x.shape[0]]) : x;
  const y = matmul(gpu, x2, weight, { transB: true, bias: bias ?? undefined });
  // An owning tensor of the output's shape (a view would never free the buffer).
  return x.shape.length === 1 ? new Tensor(y.alloc, [weight.shape[0]], y.dtype, y.byteOffset, y.owner) : y;
}

// Bias gradients are `dbias` here as in matmulBackward: `db` is only ever the gradient of matmul's operand b
// (for linear, that is dw).
export interface LinearGrads {
  dx: Tensor;
  dw: Tensor;
  dbias?: Tensor;
}

/** Gradients of linear: dx = dy · W, dW = Σ dyᵀ · x, dbias = Σ dy (when a bias was used). */
export function linearBackward(
  gpu: Gpu,
  x: Tensor,
  weight: Tensor,
  dy: Tensor,
  bias?: Tensor | null,
  into?: { dx?: Tensor; dw?: Tensor; dbias?: Tensor; accumulate?: boolean },
): LinearGrads {
  if (x.shape.length < 1 || weight.shape.length !== 2 || x.shape[x.shape.length - 1] !== weight.shape[1])
    throw new ShapeError('linearBackward', `x ${fmtShape(x.shape)}, weight ${fmtShape(weight.shape)} (must be [out, in])`);
  const rows = x.numel / weight.shape[1];
  const x2 = x.reshape([rows, weight.shape[1]]);
  expectShape('linearBackward', 'dy', dy, [...x.shape.slice(0, -1), weight.shape[0]]);
  const dy2 = dy.reshape([rows, weight.shape[0]]);
  const g = matmulBackward(gpu, x2, weight, dy2, {
    transB: true,
    bias: bias ?? undefined,
    accumulate: into?.accumulate,
    into: { da: into?.dx?.reshape([rows, weight.shape[1]]), db: into?.dw, dbias: into?.dbias },
  });
  // dx owns its buffer in x's shape (a reshape view would leave the buffer unfreeable).
  const out: LinearGrads = { dx: into?.dx ?? new Tensor(g.da.alloc, x.shape, g.da.dtype, g.da.byteOffset, g.da.owner), dw: g.db };
  if (g.dbias) out.dbias = g.dbias;
  return out;
}

// ---- plain-TS references (float64 accumulation) ---------------------------------------------

export interface MatmulRefOptions {
  transA?: boolean;
  transB?: boolean;
  bias?: ArrayLike<number>;
}

function refShape(aShape: readonly number[], bShape: readonly number[], transA: boolean, transB: boolean) {
  const [ar, ac] = aShape.slice(-2);
  const [br, bc] = bShape.slice(-2);
  const M = transA ? ac : ar;
  const K = transA ? ar : ac;
  const N = transB ? br : bc;
  const aB = numel(aShape.slice(0, -2));
  const bB = numel(bShape.slice(0, -2));
  const batch = Math.max(aShape.length > 2 ? aB : 1, bShape.length > 2 ? bB : 1);
  return { M, N, K, batch, aStride: aShape.length > 2 ? M * K : 0, bStride: bShape.length > 2 ? K * N : 0 };
}

/** op(a) · op(b) (+ bias) over the batch; returns [batch * M * N]. */
export function matmulRef(
  a: ArrayLike<number>,
  aShape: readonly number[],
  b: ArrayLike<number>,
  bShape: readonly number[],
  opts: MatmulRefOptions = {},
): Float32Array {
  const tA = opts.transA ?? false;
  const tB = opts.transB ?? false;
  const { M, N, K, batch, aStride, bStride } = refShape(aShape, bShape, tA, tB);
  const out = new Float32Array(batch * M * N);
  for (let z = 0; z < batch; z++)
    for (let m = 0; m < M; m++)
      for (let n = 0; n < N; n++) {
        let s = opts.bias ? opts.bias[n] : 0;
        for (let k = 0; k < K; k++) {
          const av = a[z * aStride + (tA ? k * M + m : m * K + k)];
          const bv = b[z * bStride + (tB ? n * K + k : k * N + n)];
          s += av * bv;
        }
        out[(z * M + m) * N + n] = s;
      }
  return out;
}

/** Reference gradients of matmul (da/db in the stored layouts and batch shapes of a and b). */
export function matmulBackwardRef(
  a: ArrayLike<number>,
  aShape: readonly number[],
  b: ArrayLike<number>,
  bShape: readonly number[],
  dy: ArrayLike<number>,
  opts: { transA?: boolean; transB?: boolean } = {},
): { da: Float32Array; db: Float32Array; dbias: Float32Array } {
  const tA = opts.transA ?? false;
  const tB = opts.transB ?? false;
  const { M, N, K, batch, aStride, bStride } = refShape(aShape, bShape, tA, tB);
  const da = new Float64Array(numel(aShape));
  const db = new Float64Array(numel(bShape));
  const dbias = new Float64Array(N);
  for (let z = 0; z < batch; z++)
    for (let m = 0; m < M; m++)
      for (let n = 0; n < N; n++) {
        const g = dy[(z * M + m) * N + n];
        dbias[n] += g;
        for (let k = 0; k < K; k++) {
          const ai = z * aStride + (tA ? k * M + m : m * K + k);
          const bi = z * bStride + (tB ? n * K + k : k * N + n);
          da[ai] += g * b[bi];
          db[bi] += g * a[ai];
        }
      }
  return { da: Float32Array.from(da), db: Float32Array.from(db), dbias: Float32Array.from(dbias) };
}

/** x [rows, in] · W [out, in]ᵀ + b. */
export function linearRef(
  x: ArrayLike<number>,
  xShape: readonly number[],
  w: ArrayLike<number>,
  wShape: readonly number[],
  bias?: ArrayLike<number>,
): Float32Array {
  const rows = numel(xShape) / wShape[1];
  return matmulRef(x, [rows, wShape[1]], w, wShape, { transB: true, bias });
}

export function linearBackwardRef(
  x: ArrayLike<number>,
  xShape: readonly number[],
  w: ArrayLike<number>,
  wShape: readonly number[],
  dy: ArrayLike<number>,
): { dx: Float32Array; dw: Float32Array; dbias: Float32Array } {
  const rows = numel(xShape) / wShape[1];
  const g = matmulBackwardRef(x, [rows, wShape[1]], w, wShape, dy, { transB: true });
  return { dx: g.da, dw: g.db, dbias: g.dbias };
}
