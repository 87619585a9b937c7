// Browser host for the self-test: golden fixtures bundled by Vite, fetched on demand.
import type { GoldenSet } from './check.ts';
import { EMPTY_GOLDEN, goldenFromBytes } from './golden.ts';

const urls = import.meta.glob('/tests/fixtures/kernels/*.safetensors', { query: '?url', import: 'default', eager: true }) as Record<string, string>;

const cache = new Map<string, Promise<GoldenSet>>();

export function browserGolden(family: string): Promise<GoldenSet> {
  let g = cache.get(family);
  if (!g) {
    const url = urls[`/tests/fixtures/kernels/${family}.safetensors`];
    g = url
      ? fetch(url).then(async (r) => {
          if (!r.ok) throw new Error(`golden ${family}: HTTP ${r.status}`);
          return goldenFromBytes(family, new Uint8Array(await r.arrayBuffer()));
        })
      : Promise.resolve(EMPTY_GOLDEN);
    cache.set(family, g);
  }
  return g;
}
