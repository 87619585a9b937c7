// Node host: reads shaders/*.wgsl from the repository.
import { readdirSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { MapShaderSource } from './shaders.ts';

/** shaders/ beside the sources, or DBS_SHADERS_DIR (for bundled builds that run elsewhere). */
export function nodeShaderSource(dir = process.env.DBS_SHADERS_DIR ?? join(dirname(fileURLToPath(import.meta.url)), '../../shaders')): MapShaderSource {
  const files = new Map<string, string>();
  for (const f of readdirSync(dir)) if (f.endsWith('.wgsl')) files.set(f.slice(0, -5), readFileSync(join(dir, f), 'utf8'));
  return new MapShaderSource(files);
}
