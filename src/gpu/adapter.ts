// The adapter profile: every fact about the adapter that the kernels and their dispatch branch on, in one object
// built once per device (Gpu.create, device.ts) from what the adapter reports and the options. Kernels read
// `gpu.facts` (is it a software adapter, SwiftShader, f16, subgroups, tensor cores, binding, alignment and workgroup
// limits, the GEMM defaults before tuning) instead of testing vendor strings or device features themselves. The
// census's named profiles (profile.ts, `--profile nvidia-h200`) are AdapterSummaries too, and go through the same
// `adapterFacts`.
import { defaultGemmConfig, type GemmConfig } from './gemm-config.ts';
import type { MatrixShape } from './tensorcore.ts';

/** What the adapter reports: its info strings, the device's features and limits, the subgroup size. */
export interface AdapterSummary {
  vendor: string;
  architecture: string;
  device: string;
  description: string;
  features: string[];
  limits: Record<string, number>;
  /** Fewest lanes a subgroup may have (0 without the subgroups feature). */
  subgroupMinSize: number;
}

/** The options that change what the engine makes of an adapter (GpuOptions' fields of the same names). */
export interface AdapterOptions {
  /** Force the f32 path even where shader-f16 exists. */
  disableF16?: boolean;
  /** A smaller storage-binding limit than the device's (tests of the splitting paths). */
  bindingLimit?: number;
  /** Split-K by default (undefined: on GPUs, off on software adapters; gemm-config.ts). */
  splitK?: boolean;
}

export interface AdapterFacts {
  /**
   * A software adapter running compute shaders on the CPU (Mesa's lavapipe/llvmpipe, SwiftShader): a workgroup is
   * a thread of a few cores, so barriers and idle lanes cost more than arithmetic, and load latency is nothing to hide.
   */
  readonly software: boolean;
  /** Chrome's software adapter, whose shader compiler loses the device on the prefetching and direct GEMM cores. */
  readonly swiftShader: boolean;
  /** f16 storage and arithmetic (the shader-f16 feature, unless turned off). */
  readonly f16: boolean;
  readonly subgroups: boolean;
  /** Fewest lanes a subgroup may have (0 without subgroups). */
  readonly subgroupMinSize: number;
  readonly timestamps: boolean;
  /** The subgroup-matrix shape f16 GEMMs run on (tensor cores), or null: they run the SIMT kernels. */
  readonly tensorCores: MatrixShape | null;
  /** Why tensor cores are on or off (for reports). */
  readonly tensorCoreNote: string;
  /** Bytes one storage binding may span (the device's limit, or a smaller forced one). */
  readonly maxBinding: number;
  readonly maxBufferSize: number;
  /** Bytes of workgroup memory one workgroup may use (tile sizes must fit). */
  readonly maxWorkgroupStorage: number;
  readonly maxInvocationsPerWorkgroup: number;
  readonly maxWorkgroupsPerDimension: number;
  /**
   * Bytes a storage binding's offset must be a multiple of (the device's minStorageBufferOffsetAlignment: 256 in
   * browsers, 16 on lavapipe, or what GpuOptions.storageAlignment raised it to): where a window of a tensor may start.
   */
  readonly storageAlignment: number;
  /** The GEMM kernel choices before any timing (gemm-config.ts defaultGemmConfig), direct off where it may not run. */
  readonly gemmDefaults: Readonly<GemmConfig>;
  /** Whether the direct GEMM core may run here (not on SwiftShader: ops/tiles.ts directRefusal). */
  readonly directGemm: boolean;
  /** Whether the prefetching GEMM core may run here (not on SwiftShader: ops/tiles.ts prefetchRefusal). */
  readonly prefetchGemm: boolean;
  /**
   * Bind groups the device keeps for reuse. Software adapters get fewer: lavapipe backs each bind group with its
   * own memfd mapping and a process may hold 65530 mappings (bindGroupCacheMax below).
   */
  readonly bindGroupCacheMax: number;
}

const infoText = (a: AdapterSummary) => `${a.vendor} ${a.architecture} ${a.device} ${a.description}`;

/** Software adapters that run compute shaders on the CPU (Mesa's lavapipe/llvmpipe, SwiftShader). */
export function isSoftwareAdapter(a: AdapterSummary): boolean {
  return /llvmpipe|lavapipe|swiftshader|software/i.test(infoText(a));
}

/** Chrome's software adapter, whose shader compiler loses the device on some GEMM cores (src/ops/tiles.ts). */
export function isSwiftShader(a: AdapterSummary): boolean {
  return /swiftshader/i.test(infoText(a));
}

/**
 * Bind groups kept for reuse (cheap to rebuild; the bound caps memory), the oldest dropped first. CPU adapters get
 * fewer: lavapipe backs each bind group with its own memfd mapping, Linux allows a process 65530 mappings
 * (vm.max_map_count), and past that lavapipe's mmap fails and the process dies (SIGSEGV: sampling 21 pictures
 * from the small-f4 demo model in one process did it, with 62,000 bind groups held). Dropped bind groups
 * are freed once collected, so the live ones peak near the cap plus those dropped since the last collection: with
 * 8,192, passes of 12,288 new bind groups added about 21,000 mappings in all (tests/gpu/stats.test.ts).
 */
export function bindGroupCacheMax(software: boolean): number {
  return software ? 1 << 13 : 1 << 16;
}

/** The adapter profile of an adapter as it reports itself, under the given options and tensor-core check. */
export function adapterFacts(
  a: AdapterSummary,
  opts: AdapterOptions = {},
  tensorCores: { shape: MatrixShape | null; note: string } = { shape: null, note: 'not checked' },
): AdapterFacts {
  const software = isSoftwareAdapter(a);
  const swiftShader = isSwiftShader(a);
  const features = new Set(a.features);
  const limit = (name: string) => a.limits[name] ?? 0;
  const gemmDefaults = defaultGemmConfig(software, opts.splitK);
  // SwiftShader refuses the direct core: its config says what runs, whatever it is given (Gpu.setGemmConfig).
  gemmDefaults.direct &&= !swiftShader;
  return {
    software,
    swiftShader,
    f16: features.has('shader-f16') && !opts.disableF16,
    subgroups: features.has('subgroups'),
    subgroupMinSize: a.subgroupMinSize,
    timestamps: features.has('timestamp-query'),
    tensorCores: tensorCores.shape,
    tensorCoreNote: tensorCores.note,
    maxBinding: Math.min(opts.bindingLimit ?? Infinity, limit('maxStorageBufferBindingSize')),
    maxBufferSize: limit('maxBufferSize'),
    maxWorkgroupStorage: limit('maxComputeWorkgroupStorageSize'),
    maxInvocationsPerWorkgroup: limit('maxComputeInvocationsPerWorkgroup'),
    maxWorkgroupsPerDimension: limit('maxComputeWorkgroupsPerDimension'),
    storageAlignment: limit('minStorageBufferOffsetAlignment'),
    gemmDefaults,
    directGemm: !swiftShader,
    prefetchGemm: !swiftShader,
    bindGroupCacheMax: bindGroupCacheMax(software),
  };
}
