// The options a Gpu is created with (Gpu.create, src/gpu/device.ts).
import type { ShaderSource } from './shaders.ts';

export interface GpuOptions {
  shaders: ShaderSource;
  powerPreference?: GPUPowerPreference;
  /** Force the f32 path even where shader-f16 exists. */
  disableF16?: boolean;
  /** Pretend the largest storage binding is this many bytes (tests exercise the chunked paths with it). */
  bindingLimit?: number;
  /** Ask for this storage-buffer offset alignment (bytes) where the adapter allows less: tests run browsers' 256. */
  storageAlignment?: number;
  /**
   * Memory planning: allocations are accounted but not backed, dispatches, writes and reads do nothing
   * (reads return zeros), so the real code measures its own peak bytes for any model size in moments.
   */
  dryRun?: boolean;
  /**
   * With dryRun, on a device that backs and runs nothing (src/gpu/recording.ts, the census's): buffers are made at
   * their real size and dispatches are encoded and submitted, so the device sees every dispatch the run issues;
   * writes and reads stay skipped (reads return zeros) as in any dry run.
   */
  recording?: boolean;
  /**
   * Fill every new tensor with NaN (0xFFFFFFFF words) before handing it out, so code that reads memory it never
   * wrote fails loudly (the pool hands out buffers with stale contents). The tests run with it (DBS_GPU_POISON=1).
   */
  poison?: boolean;
  /**
   * Tensor cores (f16 subgroup matrices, src/gpu/tensorcore.ts) for f16 matmul and conv: on by default where the
   * adapter offers them and the start-up check passes on this device (the check is the gate; a failing path is refused
   * and named in `tensorCoreNote`); false turns them off and every GEMM runs the SIMT kernels.
   */
  tensorCores?: boolean;
  /** How this host's user turns tensor cores off (e.g. "DBS_TENSOR_CORES=0"), named in the note when they did. */
  tensorCoreOptOut?: string;
  /**
   * Split the long reductions of GEMMs with too few output tiles to fill the device (split-K, src/ops/gemm.ts).
   * Default: on GPUs; off on CPU adapters, where it measured 0.87-1.02x on lavapipe (2 cores) at LoRA and conv
   * weight-gradient shapes. Ops can still force it (MatmulOptions.splitK).
   */
  splitK?: boolean;
}
