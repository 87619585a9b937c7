// Node host: WebGPU through Dawn (the `webgpu` npm package).
import { Gpu, type GpuOptions } from './device.ts';
import { nodeShaderSource } from './shaders-node.ts';

let dawn: GPU | null = null;

export async function nodeGpu(opts: Partial<GpuOptions> = {}): Promise<Gpu> {
  if (!dawn) {
    const webgpu = (await import('webgpu')) as unknown as { create: (flags: string[]) => GPU; globals: object };
    Object.assign(globalThis, webgpu.globals);
    dawn = webgpu.create([]);
  }
  return Gpu.create(dawn, { shaders: nodeShaderSource(), ...opts });
}
