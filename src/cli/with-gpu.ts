// A GPU command's frame, shared by the product CLI (main.ts) and the lab's entries (lab/demo-model/cli.ts): Dawn's
// device opened, its GEMM kernels tuned for the adapter (gpu-tuning.ts), the command run, the device closed.
import type { Gpu } from '../gpu/device.ts';

/** Runs a GPU command on Dawn (its GEMM kernels tuned for the adapter first: gpu-tuning.ts), closing the device afterwards. */
export async function withGpu(load: () => Promise<(gpu: Gpu, args: string[]) => Promise<void>>, args: string[]): Promise<void> {
  // `2> log` (a file opened without O_APPEND): Dawn's native notices can only be kept out by relaying (stderr-relay.ts).
  const relay = await import('./stderr-relay.ts');
  if (relay.needsStderrRelay()) {
    process.exitCode = await relay.runWithStderrRelay();
    return;
  }
  const { nodeGpu } = await import('../gpu/node.ts');
  const { tuneCliGpu } = await import('./gpu-tuning.ts');
  const command = await load();
  const gpu = await nodeGpu();
  try {
    await tuneCliGpu(gpu);
    await command(gpu, args);
  } finally {
    gpu.destroy();
  }
}
