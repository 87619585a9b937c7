// The command line's GEMM tuning (src/ops/tune.ts) right after the device opens, cached in the user's cache folder
// (src/io/tuning-node.ts). DBS_GPU_TUNE picks what happens:
//   auto (default)  time a hardware GPU once and reuse its cached config; CPU adapters keep their defaults
//   on              the same, CPU adapters included
//   force           time again (CPU adapters included) and replace the cached entry
//   off             keep the defaults, read and write nothing
import { join } from 'node:path';
import type { Gpu } from '../gpu/device.ts';
import { GpuDeviceLostError } from '../gpu/errors.ts';
import { defaultCacheDir, nodeTuningCache } from '../io/tuning-node.ts';
import { describeGemmConfig, tuneGemm, type TuneOptions, type TuneReport } from '../ops/tune.ts';

const MODES = ['auto', 'on', 'force', 'off'] as const;

/**
 * Tunes `gpu` as DBS_GPU_TUNE says; a failed timing (other than a lost device) is reported and the defaults kept.
 * `timing` narrows the measurement (shapes, samples: tests and benchmarks); the mode decides the rest.
 */
export async function tuneCliGpu(
  gpu: Gpu,
  env: NodeJS.ProcessEnv = process.env,
  log: (line: string) => void = (l) => console.error(l),
  timing: Pick<TuneOptions, 'shapes' | 'samples' | 'sampleMs'> = {},
): Promise<TuneReport | null> {
  const mode = (env.DBS_GPU_TUNE || 'auto') as (typeof MODES)[number];
  if (!MODES.includes(mode))
    throw new Error(`DBS_GPU_TUNE=${env.DBS_GPU_TUNE}: expected one of ${MODES.join(', ')} (auto: time a hardware GPU's GEMM kernels once, cached)`);
  if (mode === 'off' || gpu.dryRun) return null;
  const file = join(defaultCacheDir(env), 'gpu-tuning.json');
  try {
    const r = await tuneGemm(gpu, { ...timing, cache: nodeTuningCache(file), log, cpuAdapters: mode !== 'auto', force: mode === 'force' });
    if (r.source === 'timed')
      log(
        `GEMM kernels timed on ${gpu.adapter.description || gpu.adapter.vendor} in ${r.seconds.toFixed(1)} s: ${describeGemmConfig(r.config)} (cached in ${file})`,
      );
    return r;
  } catch (e) {
    if (e instanceof GpuDeviceLostError) throw e;
    log(`GEMM tuning failed (${(e as Error).message}); using the defaults: ${describeGemmConfig(gpu.gemmConfig)}`);
    return null;
  }
}
