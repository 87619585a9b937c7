// Node host: WebGPU through Dawn (the `webgpu` npm package).
import { Gpu, type GpuOptions } from './device.ts';
import { nodeShaderSource } from './shaders-node.ts';

let dawn: GPU | null = null;

export async function nodeGpu(opts: Partial<GpuOptions> = {}): Promise<Gpu> {
  if (!dawn) {
    const webgpu = (await import('webgpu')) as unknown as { create: (flags: string[]) => GPU; globals: object };
    Object.assign(globalThis, webgpu.globals);
    // DBS_DAWN_FLAGS: extra Dawn flags, comma-separated via ';' (e.g. 'disable-dawn-features=...').
    dawn = webgpu.create((process.env.DBS_DAWN_FLAGS ?? '').split(';').filter(Boolean));
  }
  return Gpu.create(dawn, { shaders: nodeShaderSource(), ...opts });
}
