// The GEMM kernel choices (register block, fill, split-K, step depth, prefetch, the direct core) a Gpu carries:
// the defaults for the adapter's kind, the values each may take, and the check a recorded config passes before
// a resumed run applies it (Gpu.setGemmConfig).

/**
 * The GEMM kernel choices a per-adapter timing (src/ops/tune.ts) may change; until it runs (or where a host skips
 * it), the defaults for the adapter's kind (`defaultGemmConfig`). The register block, step depth, prefetch and the
 * direct core change speed only: every output still sums its products in k order. Split-K changes the order of the sums, so results differ in the last
 * bits: a training run records the config it started with and a resume applies it again.
 */
export interface GemmConfig {
  /** Outputs per invocation in the square tiles, as a side: 8 (8x8 blocks) or 4 (4x4 blocks). */
  registerBlock: 4 | 8;
  /** Workgroups a dispatch needs before a bigger tile pays (pickTile) or split-K stops (pickSplitK). */
  fillWorkgroups: number;
  /** Whether GEMMs with few output tiles and a long reduction split it on their own (split-K). */
  splitK: boolean;
  /** Reduction depth staged per step in the SIMT tiles: 16 or 32 (where the tile's shared memory fits the device). */
  bk: 16 | 32;
  /** Whether each step's global loads of the next staged tile are issued into registers before its FMAs (prefetch). */
  prefetch: boolean;
  /**
   * Whether matmuls (not the convolutions' implicit GEMMs) run on the direct SIMT core: no shared tiles and no
   * barriers, each invocation reading its own operands (src/ops/gemm.ts; matmul.ts DIRECT_TILES). A config recorded
   * before this field existed has none: the device keeps its own value (gemmConfigProblem, Gpu.setGemmConfig).
   */
  direct: boolean;
}

/** The values each GemmConfig field may take. */
export const GEMM_CONFIG_VALUES = {
  registerBlock: [8, 4],
  fillWorkgroups: [8, 64, 256],
  splitK: [false, true],
  bk: [16, 32],
  prefetch: [false, true],
  direct: [false, true],
} as const;

/** GemmConfig fields a recorded config may lack (it predates them); Gpu.setGemmConfig keeps the device's value. */
const GEMM_CONFIG_OPTIONAL: readonly string[] = ['direct'];

/**
 * Before any timing: CPU adapters (one workgroup per thread, a few cores) get 8x8 blocks and a fill of 8, which
 * measured twice the GEMM rate of 4x4 blocks on lavapipe, no automatic split-K (0.87-1.02x there), 16-deep steps
 * and no prefetch (a CPU lane has no load latency to hide behind other work); GPUs get the usual shape of a fast
 * SIMT GEMM, to be confirmed by timing on each (src/ops/tune.ts): 4x4 blocks in 32-256-invocation workgroups, a fill
 * of 256 (an H200 has 132 multiprocessors holding several workgroups each), split-K, 32-deep steps (half the
 * barriers per k) and the next step's loads in flight during the FMAs.
 */
export function defaultGemmConfig(software: boolean, splitK?: boolean): GemmConfig {
  return software
    ? { registerBlock: 8, fillWorkgroups: 8, splitK: splitK ?? false, bk: 16, prefetch: false, direct: true }
    : { registerBlock: 4, fillWorkgroups: 256, splitK: splitK ?? true, bk: 32, prefetch: true, direct: false };
}

/** The reason `c` is not a GemmConfig (a field missing or out of GEMM_CONFIG_VALUES), or null when it is one. */
export function gemmConfigProblem(c: unknown): string | null {
  if (typeof c !== 'object' || c === null) return 'not an object';
  const o = c as Record<string, unknown>;
  for (const [field, allowed] of Object.entries(GEMM_CONFIG_VALUES))
    if (!(o[field] === undefined && GEMM_CONFIG_OPTIONAL.includes(field)) && !(allowed as readonly unknown[]).includes(o[field]))
      return `${field} is ${JSON.stringify(o[field])}, expected one of ${allowed.join(', ')}`;
  return null;
}
