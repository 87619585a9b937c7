// A single checkpoint's config, given beside it in the studio: the CLI's `--config` JSON (per-component
// diffusers config.json values, `{ "unet": {...}, "vae": {...}, "text_encoder": {...}, "text_encoder_2": {...},
// "scheduler": {...} }`, or one bare object for the UNet). A single file cannot say what its weights' shapes do not
// (attention head counts, GroupNorm groups, the prediction type): the loader infers SD's standard values, and this
// file replaces them for a model that differs.
import type { Json } from '../models/source.ts';

export const CONFIG_COMPONENTS = ['unet', 'vae', 'text_encoder', 'text_encoder_2', 'scheduler'] as const;
export type ConfigOverrides = Partial<Record<(typeof CONFIG_COMPONENTS)[number], Json>>;

const isObject = (v: unknown): v is Json => typeof v === 'object' && v !== null && !Array.isArray(v);

/** The overrides in `bytes` (the file `name`), or a message naming the file and what is wrong with it. */
export function parseModelConfig(bytes: Uint8Array, name: string): ConfigOverrides {
  let j: unknown;
  try {
    j = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes));
  } catch (e) {
    throw new Error(`${name}: not a JSON config (${(e as Error).message}); give the model's config as JSON, e.g. {"unet": {"attention_head_dim": 8}}`, {
      cause: e,
    });
  }
  if (!isObject(j))
    throw new Error(`${name}: a model config is a JSON object ({"unet": {...}, "vae": {...}, ...}), not ${Array.isArray(j) ? 'an array' : typeof j}`);
  const keys = Object.keys(j);
  const components = keys.filter((k) => (CONFIG_COMPONENTS as readonly string[]).includes(k));
  // One bare object is the UNet's config.json, as `--config` takes it.
  if (!components.length) return { unet: j };
  const other = keys.find((k) => !components.includes(k));
  if (other !== undefined)
    throw new Error(
      `${name}: '${other}' is not a model component: a config gives ${CONFIG_COMPONENTS.join(', ')} (each a config.json object), or only the UNet's`,
    );
  for (const k of components) if (!isObject(j[k])) throw new Error(`${name}: '${k}' must be an object of config.json values, not ${JSON.stringify(j[k])}`);
  return j as ConfigOverrides;
}
