// GEMM tiles and windows: the SIMT workgroup tiles matmul and conv2d choose among (per adapter kind: CPU
// adapters' 8x8 register blocks, GPUs' 4x4), how a problem picks one (pickTile), which cores an adapter refuses,
// and the aligned windows an op binds for an element range of a tensor. The GEMM driver is src/ops/matmul.ts,
// the generated cores src/ops/gemm.ts.
import type { BufferWindow, Gpu } from '../gpu/device.ts';
import { ShapeError } from '../gpu/errors.ts';
import type { Defs } from '../gpu/shaders.ts';
import { BYTES, type Tensor } from '../gpu/tensor.ts';
import { prefetchFits } from './gemm.ts';

/**
 * Workgroup tile: BM x BN outputs, BK-deep steps, TM x TN outputs per invocation (multiples of 4); with PREFETCH
 * the next step's global loads go into registers before the current step's FMAs (src/ops/gemm.ts).
 */
export interface Tile {
  BM: number;
  BN: number;
  BK: number;
  TM: number;
  TN: number;
  PREFETCH?: boolean;
  /** The direct core (CPU adapters): no shared tiles, each invocation reads its own operands (src/ops/gemm.ts). */
  DIRECT?: boolean;
}

// Register blocks are 8x8 where the tile allows: on CPU adapters (lavapipe, SwiftShader) an invocation is one
// SIMD lane, and an 8x8 block does 64 FMAs per two shared vec4 reads of A and B against 16 for a 4x4 block. Measured
// on lavapipe (2 cores): 256x256x256 took 18.9 ms with 64x64 tiles of 4x4 blocks and 11.6 ms with 8x8 blocks, as
// fast as 128x128 tiles (11.4 ms) with a quarter of their padding.

/** 64 invocations with 8x8 blocks; 8 KiB of shared tiles. */
export const TILE_64: Tile = { BM: 64, BN: 64, BK: 16, TM: 8, TN: 8 };
/** 256 invocations with 8x8 blocks; 16 KiB of shared tiles (Chrome's default limit). */
export const TILE_128: Tile = { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 };
/**
 * 16 invocations with 8x8 blocks; 4 KiB of shared tiles. For small GEMMs: a conv over 8x8 pixels with 32 output
 * channels is a 32x64 GEMM per sample, which a 128x128 tile pads 8x (the demo model's UNet step spent most of its
 * conv time there).
 */
export const TILE_32: Tile = { BM: 32, BN: 32, BK: 16, TM: 8, TN: 8 };

/** Shared-memory bytes a tile config needs (f32 tiles of A and B). */
export function tileSharedBytes(t: Tile): number {
  return 4 * (t.BM + t.BN) * t.BK;
}

/** Throws a ShapeError for a tile the kernels or the device cannot run. */
export function checkTile(gpu: Gpu, t: Tile): void {
  const ok =
    t.TM % 4 === 0 &&
    t.TN % 4 === 0 &&
    t.BM % t.TM === 0 &&
    t.BN % t.TN === 0 &&
    t.BM % 4 === 0 &&
    t.BN % 4 === 0 &&
    (t.BM / t.TM) * (t.BN / t.TN) <= gpu.facts.maxInvocationsPerWorkgroup &&
    tileSharedBytes(t) <= gpu.facts.maxWorkgroupStorage;
  if (!ok) throw new ShapeError('matmul', `invalid tile ${JSON.stringify(t)}`);
}

/**
 * Skinny tiles for problems with very few rows (M: a linear layer over a handful of tokens, e.g. the time
 * embedding or SD's deepest blocks at low resolution) or very few columns (N: a convolution's output pixels
 * per sample at 1x1 or 2x2). A 64x64 tile over M = 2 computes 32x the useful work; these keep the waste
 * under 4x (2x at M = 2, 4 % at M = 8 with the 16-row tile), with 16 invocations per workgroup.
 */
export const TILE_ROWS_4: Tile = { BM: 4, BN: 128, BK: 16, TM: 4, TN: 8 };
export const TILE_ROWS_16: Tile = { BM: 16, BN: 64, BK: 16, TM: 8, TN: 8 };
export const TILE_COLS_4: Tile = { BM: 128, BN: 4, BK: 16, TM: 8, TN: 4 };
export const TILE_COLS_16: Tile = { BM: 64, BN: 16, BK: 16, TM: 8, TN: 8 };

/**
 * Tiles for GPUs (every adapter but the CPU ones). A GPU runs an invocation per SIMD lane of a 32- or 64-wide
 * subgroup and hides memory latency with many resident invocations, so 8x8 blocks in 16-invocation workgroups
 * (half an NVIDIA warp) leave most of it idle: measured on an H200 (bench/results/kernels-node-nvidia-h200.json,
 * 3f5718f), 4096x320x320 in f16 ran at 13 TFLOP/s and 77x768x320 took 0.22 ms. These use 4x4 blocks and 32-256
 * invocations; TILE_128 (8x8 blocks, 256 invocations) stays the largest. Shared tiles stay within 16 KiB.
 */
export const GPU_TILE_64: Tile = { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4 };
export const GPU_TILE_32: Tile = { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4 };
export const GPU_TILE_ROWS_16: Tile = { BM: 16, BN: 64, BK: 16, TM: 4, TN: 4 };
export const GPU_TILE_COLS_16: Tile = { BM: 64, BN: 16, BK: 16, TM: 4, TN: 4 };

/**
 * Tiles of the direct core (GemmConfig.direct, CPU adapters' default for matmuls; src/ops/gemm.ts): no shared tiles,
 * so BK only sets the split-K chunk and FITS granularity (its 4-k steps). 4x8 register blocks in 8x8 invocations.
 * Measured on lavapipe (2 cores, the CPU otherwise idle), f32, against the staged core's 64x64 tile: 512x320x320
 * (x·Wᵀ) 8.9 against 13.8 ms, 320x320x512 (Aᵀ·B, a weight gradient) 9.4 against 13.3; 8x8 blocks on the direct core
 * ran 12.1 and 11.7 (they spill). A pretrain step of the factor-4 demo UNet (batch 8): 2.02 against 2.07-2.18 s.
 * The convolutions keep the staged core: their implicit-GEMM gathers, shared by a workgroup when staged, would be
 * recomputed by each invocation (measured 1.0-2x slower).
 */
export const DIRECT_TILES: TileSet = {
  square: [{ BM: 32, BN: 64, BK: 4, TM: 4, TN: 8, DIRECT: true }],
  rows4: { BM: 4, BN: 128, BK: 4, TM: 4, TN: 8, DIRECT: true },
  rows16: { BM: 16, BN: 64, BK: 4, TM: 4, TN: 8, DIRECT: true },
  cols4: { BM: 64, BN: 4, BK: 4, TM: 4, TN: 4, DIRECT: true },
  cols16: { BM: 32, BN: 16, BK: 4, TM: 4, TN: 4, DIRECT: true },
};

/** The tiles pickTile chooses among: square ones largest first (the last is the fallback), and the skinny ones. */
export interface TileSet {
  square: Tile[];
  rows4: Tile;
  rows16: Tile;
  cols4: Tile;
  cols16: Tile;
}
export const CPU_TILES: TileSet = { square: [TILE_128, TILE_64, TILE_32], rows4: TILE_ROWS_4, rows16: TILE_ROWS_16, cols4: TILE_COLS_4, cols16: TILE_COLS_16 };
/**
 * On a GPU a side of at most 4 also gets the 16-wide skinny tile: such GEMMs (the time_emb_proj GEMVs, rows = batch;
 * 3x3 convs over 2x2 pixels, K up to 23040) are bound by the latency of serialised loads, not by FLOPs. A 4-wide
 * tile has 32 invocations that each stage 32 loads per 32-deep step one after another (gemm.ts prefetchFits refuses
 * it); the 16-wide one has 64 that stage at most 8 groups and prefetch them, for 4x the (cheap) padded FMAs.
 * Modelled on the H200 (bench/costmodel.ts, MODELLED): a [2,1280]x[1280,1280] GEMV 1.35 -> 0.07 ms.
 */
export const GPU_TILES: TileSet = {
  square: [TILE_128, GPU_TILE_64, GPU_TILE_32],
  rows4: GPU_TILE_ROWS_16,
  rows16: GPU_TILE_ROWS_16,
  cols4: GPU_TILE_COLS_16,
  cols16: GPU_TILE_COLS_16,
};

/**
 * The tile set for a device's GEMM config (Gpu.gemmConfig; src/ops/tune.ts may time and change it): 8x8 register
 * blocks (CPU adapters' default, they run fastest with them) or 4x4 (GPUs'), each tile at the config's step depth
 * where its shared tiles fit the device (else 16 deep), prefetching where the config says so and the tile allows
 * (gemm.ts prefetchFits: not the skinny 4-row and 4-column GPU tiles).
 */
export function tilesFor(gpu: Gpu): TileSet {
  const c = gpu.gemmConfig;
  const base = c.registerBlock === 8 ? CPU_TILES : GPU_TILES;
  const limit = gpu.facts.maxWorkgroupStorage;
  const tune = (t: Tile): Tile => {
    const deep = { ...t, BK: c.bk };
    const sized = tileSharedBytes(deep) <= limit ? deep : t;
    return { ...sized, PREFETCH: c.prefetch && prefetchFits(sized) && !prefetchRefusal(gpu) };
  };
  return { square: base.square.map(tune), rows4: tune(base.rows4), rows16: tune(base.rows16), cols4: tune(base.cols4), cols16: tune(base.cols16) };
}

/**
 * Why this device never runs the prefetching GEMM core, or null. SwiftShader (Chrome's software adapter) lost its
 * device compiling it for the GPU 16-row tile (165 s) and took 19 s for the 64x64 one; lavapipe compiles both in
 * about 2 s. Its defaults never prefetch; this keeps a forced config from reaching it too.
 */
export function prefetchRefusal(gpu: Gpu): string | null {
  return !gpu.facts.prefetchGemm ? "SwiftShader's shader compiler loses the device on the prefetching GEMM core (a CPU adapter never prefetches)" : null;
}

/**
 * Why this device never runs the direct GEMM core, or null. SwiftShader lost its device on the page self-test's
 * first matmul on it (the golden [37,19]·[19,41] + bias, after 128 s), where the staged core passes. Its Gpu keeps
 * GemmConfig.direct off whatever config it is given (Gpu.setGemmConfig); this keeps forced direct tiles (the
 * self-test's cases) from reaching it.
 */
export function directRefusal(gpu: Gpu): string | null {
  return !gpu.facts.directGemm ? "SwiftShader's shader compiler loses the device on the direct GEMM core (its matmuls stay on the staged core)" : null;
}

/** The defs a SIMT tile specialises its core with (PREFETCH spelled out, so the pipeline key always has it). */
export function simtTileDefs(t: Tile): Defs {
  return { BM: t.BM, BN: t.BN, BK: t.BK, TM: t.TM, TN: t.TN, PREFETCH: t.PREFETCH ?? false, DIRECT: t.DIRECT ?? false };
}

/**
 * Skinny tiles where one side is at most 16. Otherwise the largest square tile whose padded output is at most
 * 25 % more than the smallest square tile's (the least padding) and that still gives the device enough workgroups
 * to fill it (`fillWorkgroups`: Gpu.fillWorkgroups, 256 on a GPU, 8 on a CPU adapter); the smallest when none does.
 */
export function pickTile(M: number, N: number, batch: number, fillWorkgroups = 256, tiles: TileSet = CPU_TILES): Tile {
  if (M <= 4 && N > M) return tiles.rows4;
  if (N <= 4) return tiles.cols4;
  if (M <= 16 && N > M) return tiles.rows16;
  if (N <= 16) return tiles.cols16;
  const tilesM = (t: Tile) => Math.ceil(M / t.BM);
  const tilesN = (t: Tile) => Math.ceil(N / t.BN);
  const padded = (t: Tile) => tilesM(t) * t.BM * tilesN(t) * t.BN;
  const smallest = tiles.square[tiles.square.length - 1];
  const least = padded(smallest);
  for (const t of tiles.square) if (padded(t) <= 1.25 * least && tilesM(t) * tilesN(t) * batch >= fillWorkgroups) return t;
  return smallest;
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
  const align = gpu.facts.storageAlignment;
  const start = t.byteOffset + first * bytes;
  const base = Math.floor(start / align) * align;
  const end = Math.min(Math.ceil((start + Math.max(count, 1) * bytes) / 4) * 4, t.buffer.size);
  return { window: { buffer: t.buffer, offset: base, size: end - base }, offset: (start - base) / bytes };
}

/** Bytes of the largest window a range of `count` elements can need (alignment slack included). */
export function windowBytesBound(gpu: Gpu, count: number, bytes: number): number {
  return count * bytes + gpu.facts.storageAlignment + 4;
}
