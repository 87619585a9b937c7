// Every tile config matmul and conv2d can pick (src/ops/matmul.ts: the CPU adapters' 8x8-block tiles and the
// GPUs' 4x4-block ones), with the label each family's tile case carries: both families run one case per tile on
// every adapter, whichever set pickTile would choose there.
import {
  DIRECT_TILES,
  GPU_TILE_32,
  GPU_TILE_64,
  GPU_TILE_COLS_16,
  GPU_TILE_ROWS_16,
  TILE_128,
  TILE_32,
  TILE_64,
  TILE_COLS_16,
  TILE_COLS_4,
  TILE_ROWS_16,
  TILE_ROWS_4,
  type Tile,
} from '../../ops/tiles.ts';
import { TC_TILES, type TcTile } from '../../ops/gemm.ts';

export const NAMED_TILES: readonly (readonly [Tile, string])[] = [
  [TILE_64, '64x64'],
  [TILE_128, '128x128'],
  [TILE_32, '32x32'],
  [TILE_ROWS_4, '4-row'],
  [TILE_ROWS_16, '16-row'],
  [TILE_COLS_4, '4-column'],
  [TILE_COLS_16, '16-column'],
  [GPU_TILE_64, 'GPU 64x64 (4x4 blocks)'],
  [GPU_TILE_32, 'GPU 32x32 (4x4 blocks)'],
  [GPU_TILE_ROWS_16, 'GPU 16-row'],
  [GPU_TILE_COLS_16, 'GPU 16-column'],
];

/**
 * The direct core's tiles (no shared tiles; CPU adapters' matmuls): the square one first, then the skinny ones.
 * Matmul runs them all; the convolutions, which never pick them, the square one (their loaders serve both cores).
 */
export const DIRECT_NAMED_TILES: readonly (readonly [Tile, string])[] = [
  [DIRECT_TILES.square[0], 'direct 32x64 (4x8 blocks)'],
  [DIRECT_TILES.rows4, 'direct 4-row'],
  [DIRECT_TILES.rows16, 'direct 16-row'],
  [DIRECT_TILES.cols4, 'direct 4-column'],
  [DIRECT_TILES.cols16, 'direct 16-column'],
];

/** Every tensor-core tile (src/ops/gemm.ts), with its case label. */
export const NAMED_TC_TILES: readonly (readonly [TcTile, string])[] = TC_TILES.map((t) => [t, `${t.BM}x${t.BN} (${t.SGM}x${t.SGN} subgroups)`]);

/** A tile at the 32-deep step with the next step's loads prefetched into registers (GemmConfig bk 32, prefetch). */
export function deepPrefetch(t: Tile): Tile {
  return { ...t, BK: 32, PREFETCH: true };
}

/**
 * The prefetching core (a GPU's default config) on tiles whose invocations stage 2 vec4 groups per operand and step
 * (GPU 64x64), 2 of A and 8 of B (GPU 16-row, the most prefetchFits allows) and the reverse (GPU 16-column: a GPU's
 * tile for a side of at most 16, also at most 4).
 */
export const PREFETCH_TILES: readonly (readonly [Tile, string])[] = [
  [deepPrefetch(GPU_TILE_64), 'GPU 64x64, 32-deep, prefetch'],
  [deepPrefetch(GPU_TILE_ROWS_16), 'GPU 16-row, 32-deep, prefetch'],
  [deepPrefetch(GPU_TILE_COLS_16), 'GPU 16-column, 32-deep, prefetch'],
];
