// Adapter profiles: every fact about an adapter that the engine's kernel choices branch on (features, limits,
// subgroup sizes, subgroup-matrix configs, and the vendor strings that tell a CPU adapter or SwiftShader), as one
// plain object. A real adapter's profile is read from a live Gpu (`profileOf`); a named one describes an adapter
// this machine does not have (NVIDIA_H200, from the facts a lease recorded), so the census (bench/census.ts) can
// ask what kernels that adapter would get through src/gpu/recording.ts without owning it.
import type { AdapterSummary, Gpu } from './device.ts';

/**
 * An adapter as it reports itself: the AdapterSummary that Gpu.create builds from a live adapter and adapterFacts
 * (adapter.ts) turns into the facts the kernels branch on, plus what only a recording adapter must present itself
 * (the largest subgroup size and the subgroup-matrix configs, which tensorcore.ts reads from GPUAdapterInfo) and the
 * profile's name and sources.
 */
export interface AdapterProfile extends AdapterSummary {
  /** A short name (`--profile nvidia-h200`). */
  name: string;
  subgroupMaxSize: number;
  subgroupMatrixConfigs?: { componentType: string; resultComponentType: string; M: number; N: number; K: number }[];
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
  vendor: 'nvidia',
  architecture: '',
  device: '',
  description: 'NVIDIA: 580.159.04 580.159.4.0',
  subgroupMinSize: 32,
  subgroupMaxSize: 32,
  subgroupMatrixConfigs: NVIDIA_MATRIX_CONFIGS,
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

/** The AdapterSummary part of a profile: what adapterFacts takes, as Gpu.create would build it from this adapter. */
export function summaryOf(p: AdapterProfile): AdapterSummary {
  const { vendor, architecture, device, description, subgroupMinSize } = p;
  return { vendor, architecture, device, description, features: [...p.features].sort(), limits: { ...p.limits }, subgroupMinSize };
}

/** The GPUAdapterInfo a recording adapter presents for a profile (recording.ts). */
export function adapterInfoOf(p: AdapterProfile): GPUAdapterInfo {
  const { vendor, architecture, device, description, subgroupMinSize, subgroupMaxSize, subgroupMatrixConfigs } = p;
  return { vendor, architecture, device, description, subgroupMinSize, subgroupMaxSize, subgroupMatrixConfigs } as unknown as GPUAdapterInfo;
}

/** The profile of the adapter a live Gpu runs on (this machine's: `--profile local`). */
export function profileOf(gpu: Gpu, name = 'local'): AdapterProfile {
  const a = gpu.adapter;
  return {
    ...a,
    features: [...a.features],
    limits: { ...a.limits },
    name,
    subgroupMaxSize: a.subgroupMinSize,
    source: `read from the live adapter (${a.description || a.vendor})`,
  };
}
