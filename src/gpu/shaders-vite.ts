// Browser host: Vite bundles shaders/*.wgsl as strings at build time.
import { MapShaderSource } from './shaders.ts';

const modules = import.meta.glob('/shaders/*.wgsl', { query: '?raw', import: 'default', eager: true }) as Record<string, string>;

export function viteShaderSource(): MapShaderSource {
  const files = new Map<string, string>();
  for (const [path, text] of Object.entries(modules)) files.set(path.replace(/^.*\//, '').replace(/\.wgsl$/, ''), text);
  return new MapShaderSource(files);
}
