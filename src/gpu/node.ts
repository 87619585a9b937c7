// Node host: WebGPU through Dawn (the `webgpu` npm package).
import { Gpu, type GpuOptions } from './device.ts';
import { NoWebGpuError } from './errors.ts';
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
 * The native source location Dawn prints under a warning ("    at operator() (.../BackendVk.cpp:368)") and the
 * blank line after it: a trace into Dawn's C++ sources, not for users (the warning line itself is kept).
 */
export const DAWN_SOURCE_LINE = /^\s+at .*\.(cpp|cc|mm|h):\d+\)?$|^\s*$/;
const DISCOVERY_NOISE = new RegExp(`${DAWN_LIMIT_NOTICE.source}|${DAWN_SOURCE_LINE.source}`);

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
    return filterNativeStderr(() => requestAdapter(options), DISCOVERY_NOISE);
  };
  return gpu;
}

/**
 * Dawn toggles every Node adapter and device gets (the `webgpu` package takes them as `enable-dawn-features=a,b`
 * and `disable-dawn-features=c`, one flag of each kind, comma-separated):
 * - `timestamp_quantization` off: timestamps at full resolution (Dawn rounds them to 65.536 us by default,
 *   which hides short kernels in profiles and benchmarks);
 * - `vulkan_enable_f16_on_nvidia`: Dawn hides shader-f16 on NVIDIA's Vulkan driver unless this adapter toggle
 *   is on (an old conformance guard); every other adapter ignores it;
 * - `allow_unsafe_apis`: lets the adapter offer experimental features such as
 *   `chromium-experimental-subgroup-matrix` (cooperative matrices: tensor cores), which device.ts then requests.
 * Chrome takes the same toggles as command-line switches (README, "GPU").
 */
export const DAWN_ENABLE = ['vulkan_enable_f16_on_nvidia', 'allow_unsafe_apis'];
export const DAWN_DISABLE = ['timestamp_quantization'];

/**
 * The flags for webgpu.create(): ours merged with `extra` (DBS_DAWN_FLAGS, separated by ';'). Toggle lists of
 * the same kind are joined into one flag, since the package keeps only one value per flag name.
 */
export function dawnFlags(extra: string[] = []): string[] {
  const toggles: Record<string, string[]> = { 'enable-dawn-features': [...DAWN_ENABLE], 'disable-dawn-features': [...DAWN_DISABLE] };
  const other: string[] = [];
  for (const flag of extra) {
    const eq = flag.indexOf('=');
    const name = flag.slice(0, eq);
    if (eq > 0 && name in toggles)
      toggles[name].push(
        ...flag
          .slice(eq + 1)
          .split(',')
          .filter(Boolean),
      );
    else other.push(flag);
  }
  const joined = Object.entries(toggles).map(([name, list]) => `${name}=${[...new Set(list)].join(',')}`);
  return [...joined, ...other];
}

/**
 * DBS_TENSOR_CORES: unset or 1 uses tensor cores where the start-up check passes (the default), 0 turns them off;
 * anything else is refused before the device opens.
 */
export function tensorCoresFromEnv(value: string | undefined): boolean {
  if (value === undefined || value === '' || value === '1') return true;
  if (value === '0') return false;
  throw new Error(`DBS_TENSOR_CORES=${value}: use 0 to turn tensor cores off or 1 (the default) to use them where the start-up check passes`);
}

export async function nodeGpu(opts: Partial<GpuOptions> = {}): Promise<Gpu> {
  // Tensor cores: on where the adapter offers them and the start-up check passes; DBS_TENSOR_CORES=0 turns them off.
  const tensorCores = tensorCoresFromEnv(process.env.DBS_TENSOR_CORES);
  if (!dawn) {
    const webgpu = (await import('webgpu')) as unknown as { create: (flags: string[]) => GPU; globals: object };
    Object.assign(globalThis, webgpu.globals);
    // DBS_DAWN_FLAGS adds flags, separated by ';' (e.g. 'enable-dawn-features=dump_shaders;backend=vulkan').
    dawn = quietDiscovery(webgpu.create(dawnFlags((process.env.DBS_DAWN_FLAGS ?? '').split(';').filter(Boolean))));
  }
  // DBS_GPU_POISON=1 (set by the test runner): new tensors are NaN-filled, so reading unwritten memory fails tests.
  try {
    return await Gpu.create(dawn, {
      shaders: nodeShaderSource(),
      poison: process.env.DBS_GPU_POISON === '1',
      tensorCores,
      tensorCoreOptOut: 'DBS_TENSOR_CORES=0',
      ...opts,
    });
  } catch (e) {
    // No adapter on the Node host is a missing or broken Vulkan driver, not a browser setting.
    if (e instanceof NoWebGpuError)
      throw new NoWebGpuError(
        process.env.DBS_SYSTEM_VULKAN === '1'
          ? "no GPU adapter: DBS_SYSTEM_VULKAN=1 uses this system's Vulkan driver, and Dawn found none that works (see the warning above). " +
              "Install one (the NVIDIA driver, or mesa-vulkan-drivers), or leave DBS_SYSTEM_VULKAN unset to run on the project's lavapipe (scripts/gpu-env.sh)"
          : "no GPU adapter: Dawn found no working Vulkan driver (see the warning above). Run through scripts/gpu-env.sh (npm run cli does), which points Dawn at the project's lavapipe",
        { cause: e },
      );
    throw e;
  }
}
