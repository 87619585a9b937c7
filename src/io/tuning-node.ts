// Node host: the per-adapter GEMM tuning cache (src/ops/tune.ts) as one JSON file, key -> entry, in the user's
// cache folder: $DBS_CACHE_DIR, else $XDG_CACHE_HOME/dreambooth-studio, else ~/.cache/dreambooth-studio.
import { existsSync, mkdirSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { dirname, join } from 'node:path';
import type { TuningCache } from '../ops/tune.ts';

export function defaultCacheDir(env: NodeJS.ProcessEnv = process.env): string {
  return env.DBS_CACHE_DIR || join(env.XDG_CACHE_HOME || join(homedir(), '.cache'), 'dreambooth-studio');
}

/**
 * Entries in `file` (default <cache dir>/gpu-tuning.json). A file that is not a JSON object is reported by load
 * (the tuner then times again) and replaced by the next save; saves write a temporary file and rename it over the
 * old, so an interrupted save leaves the old file whole.
 */
export function nodeTuningCache(file = join(defaultCacheDir(), 'gpu-tuning.json')): TuningCache {
  const readAll = (): Record<string, string> => {
    if (!existsSync(file)) return {};
    let v: unknown;
    try {
      v = JSON.parse(readFileSync(file, 'utf8'));
    } catch (e) {
      throw new Error(`${file}: not JSON (${(e as Error).message}); delete it to start a new tuning cache`, { cause: e });
    }
    if (typeof v !== 'object' || v === null || Array.isArray(v)) throw new Error(`${file}: not a JSON object; delete it to start a new tuning cache`);
    return v as Record<string, string>;
  };
  return {
    async load(key) {
      const v = readAll()[key];
      return typeof v === 'string' ? v : v === undefined ? null : JSON.stringify(v);
    },
    async save(key, value) {
      let all: Record<string, string>;
      try {
        all = readAll();
      } catch {
        all = {}; // an unreadable file is replaced
      }
      all[key] = value;
      mkdirSync(dirname(file), { recursive: true });
      const tmp = `${file}.${process.pid}.tmp`;
      writeFileSync(tmp, JSON.stringify(all, null, 2) + '\n');
      renameSync(tmp, file);
    },
  };
}
