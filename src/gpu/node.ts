// Node host: WebGPU through Dawn (the `webgpu` npm package).
import { Gpu, type GpuOptions } from './device.ts';
import { filterNativeStderr } from './native-stderr.ts';
import { nodeShaderSource } from './shaders-node.ts';

let dawn: GPU | null = null;

/**
 * Dawn's notice when it clamps an adapter limit it cannot honour (dawn::WarningLog in Limits.cpp), e.g.
 * "Warning: maxDynamicUniformBuffersPerPipelineLayout artificially reduced from 1000000 to 16 to fit dynamic
 * offset allocation limit." on lavapipe and RADV: harmless (we use no dynamic offsets) and not for users.
 */
export const DAWN_LIMIT_NOTICE = /^Warning: \w+ artificially reduced from \d+ to \d+\b/;

/**
 * Dawn discovers the adapters, and prints its limit notices from native code straight to stderr, inside
 * the first requestAdapter call, synchronously. That one call runs with stderr filtered (native-stderr.ts):
 * the notices are dropped, anything else it prints (a Vulkan driver failing to load) still shows.
 */
function quietDiscovery(gpu: GPU): GPU {
  const requestAdapter = gpu.requestAdapter.bind(gpu);
  let discovered = false;
  gpu.requestAdapter = (options) => {
    if (discovered) return requestAdapter(options);
    discovered = true;
    return filterNativeStderr(() => requestAdapter(options), DAWN_LIMIT_NOTICE);
  };
  return gpu;
}

export async function nodeGpu(opts: Partial<GpuOptions> = {}): Promise<Gpu> {
  if (!dawn) {
    const webgpu = (await import('webgpu')) as unknown as { create: (flags: string[]) => GPU; globals: object };
    Object.assign(globalThis, webgpu.globals);
    // Timestamps at full resolution (Dawn rounds them to ~65 us by default, which hides short kernels in
    // profiles); DBS_DAWN_FLAGS adds flags, separated by ';' (e.g. 'enable-dawn-features=allow_unsafe_apis').
    const flags = ['disable-dawn-features=timestamp_quantization', ...(process.env.DBS_DAWN_FLAGS ?? '').split(';').filter(Boolean)];
    dawn = quietDiscovery(webgpu.create(flags));
  }
  // DBS_GPU_POISON=1 (set by the test runner): new tensors are NaN-filled, so reading unwritten memory fails tests.
  return Gpu.create(dawn, { shaders: nodeShaderSource(), poison: process.env.DBS_GPU_POISON === '1', ...opts });
}
