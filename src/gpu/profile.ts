// Adapter profiles: every fact about an adapter that the engine's kernel choices branch on (features, limits,
// subgroup sizes, subgroup-matrix configs, and the vendor strings that tell a CPU adapter or SwiftShader), as one
// plain object. A real adapter's profile is read from a live Gpu (`profileOf`); a named one describes an adapter
// this machine does not have (NVIDIA_H200, from the facts a lease recorded), so the census (bench/census.ts) can
// ask what kernels that adapter would get through src/gpu/recording.ts without owning it.
import type { AdapterSummary, Gpu } from './device.ts';

export interface AdapterProfile {
  /** A short name (`--profile nvidia-h200`). */
  name: string;
  /** GPUAdapterInfo as Dawn reports it (vendor strings decide a software adapter / SwiftShader: adapter.ts). */
  info: {
    vendor: string;
    architecture: string;
    device: string;
    description: string;
    subgroupMinSize: number;
    subgroupMaxSize: number;
    subgroupMatrixConfigs?: { componentType: string; resultComponentType: string; M: number; N: number; K: number }[];
  };
  features: string[];
  /** Device limits (those device.ts raises to the adapter's maximum and the alignments). */
  limits: Record<string, number>;
  /** Where each fact came from, for reports: which were recorded on the hardware and which are assumed. */
  source: string;
}

/** f16 x f16 -> f16/f32 subgroup-matrix shapes of NVIDIA's Vulkan driver (devprobe on the H200). */
const NVIDIA_MATRIX_CONFIGS = ['f16', 'f32'].flatMap((result) =>
  [
    [16, 16, 16],
    [16, 8, 16],
    [16, 8, 8],
  ].map(([M, N, K]) => ({ componentType: 'f16', resultComponentType: result, M, N, K })),
);

/**
 * The NVIDIA H200 lent to issue 13 (Dawn through the `webgpu` package 0.6.2, Vulkan, driver 580.159.04, with the
 * toggles vulkan_enable_f16_on_nvidia and allow_unsafe_apis): features, subgroup sizes, matrix configs and the four
 * large limits as bench/results/logs/devprobe-nvidia-h200.log and kernels-node-nvidia-h200.json recorded them. The
 * other limits were not recorded; they are Dawn's usual values on a Vulkan GPU (NVIDIA's storage offset alignment 16).
 */
export const NVIDIA_H200: AdapterProfile = {
  name: 'nvidia-h200',
  info: {
    vendor: 'nvidia',
    architecture: '',
    device: '',
    description: 'NVIDIA: 580.159.04 580.159.4.0',
    subgroupMinSize: 32,
    subgroupMaxSize: 32,
    subgroupMatrixConfigs: NVIDIA_MATRIX_CONFIGS,
  },
  features: ['chromium-experimental-subgroup-matrix', 'core-features-and-limits', 'shader-f16', 'subgroups', 'timestamp-query'],
  limits: {
    maxBufferSize: 1099511627776,
    maxStorageBufferBindingSize: 2147483644,
    maxComputeWorkgroupStorageSize: 49152,
    maxComputeInvocationsPerWorkgroup: 1024,
    maxComputeWorkgroupSizeX: 1024,
    maxComputeWorkgroupSizeY: 1024,
    maxComputeWorkgroupSizeZ: 64,
    maxComputeWorkgroupsPerDimension: 65535,
    maxStorageBuffersPerShaderStage: 16,
    maxUniformBufferBindingSize: 65536,
    maxBindingsPerBindGroup: 1000,
    minStorageBufferOffsetAlignment: 16,
    minUniformBufferOffsetAlignment: 64,
  },
  source:
    'recorded on the H200 lease (devprobe-nvidia-h200.log, kernels-node-nvidia-h200.json): info, features, subgroup sizes and matrix configs, maxBufferSize, maxStorageBufferBindingSize, maxComputeWorkgroupStorageSize, maxComputeInvocationsPerWorkgroup; assumed (Dawn/Vulkan usual values): the other limits',
};

export const PROFILES: Readonly<Record<string, AdapterProfile>> = { 'nvidia-h200': NVIDIA_H200 };

/**
 * What a named profile's adapter would report (AdapterSummary): the input adapter.ts's `adapterFacts` builds the
 * adapter profile the kernels read from, the same as for a live adapter.
 */
export function summaryOf(p: AdapterProfile): AdapterSummary {
  const { vendor, architecture, device, description, subgroupMinSize } = p.info;
  return { vendor, architecture, device, description, features: [...p.features].sort(), limits: { ...p.limits }, subgroupMinSize };
}

/** The profile of the adapter a live Gpu runs on (this machine's: `--profile local`). */
export function profileOf(gpu: Gpu, name = 'local'): AdapterProfile {
  const a = gpu.adapter;
  return {
    name,
    info: {
      vendor: a.vendor,
      architecture: a.architecture,
      device: a.device,
      description: a.description,
      subgroupMinSize: a.subgroupMinSize,
      subgroupMaxSize: a.subgroupMinSize,
    },
    features: [...a.features],
    limits: { ...a.limits },
    source: `read from the live adapter (${a.description || a.vendor})`,
  };
}
