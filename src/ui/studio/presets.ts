// What the page shows of the run settings: the presets, the page's defaults and the export formats. The
// settings themselves (types, ranges, defaults, labels) are the schema's (pipeline/settings.ts).
import type { ExportFormat } from '../../pipeline/run.ts';
import { defaultSettings, SETTINGS, type RunSettings, type SettingKey, type TrainMode } from '../../pipeline/settings.ts';

export type PresetName = 'lora' | 'full';

/**
 * What a preset sets: the schema's defaults of its mode (pipeline/settings.ts) for every per-mode setting and
 * every setting of one mode only, then the preset's own differences from those defaults.
 */
function preset(mode: TrainMode, differences: Partial<RunSettings>): Partial<RunSettings> {
  const d = defaultSettings(mode);
  const own = SETTINGS.filter((s) => s.onlyMode !== undefined || (typeof s.default === 'object' && s.default !== null)).map((s) => [s.key, d[s.key]]);
  return { ...(Object.fromEntries(own) as Partial<RunSettings>), mode, ...differences };
}

/** "LoRA (fast)" and "Full DreamBooth": diffusers' and kohya's usual starting points. */
export const PRESETS: Record<PresetName, { label: string; settings: Partial<RunSettings> }> = {
  lora: { label: 'LoRA (fast)', settings: preset('lora', {}) },
  // Full DreamBooth keeps the subject's class with prior preservation (diffusers' recipe for full fine-tuning).
  full: { label: 'Full DreamBooth', settings: preset('full', { priorPreservation: true }) },
};

/** The page starts from the schema's LoRA defaults with samples every 50 steps and example prompts. */
export const PAGE_DEFAULTS: RunSettings = {
  ...defaultSettings('lora'),
  aspect: 'bucket',
  sampleEvery: 50,
  classPrompt: 'a photo of a dog',
  samplePrompt: 'a photo of sks dog',
};

/** Each setting's label on the page (the schema's; messages name settings by these). */
export const SETTING_LABELS = Object.fromEntries(SETTINGS.map((s) => [s.key, s.label])) as Record<SettingKey, string>;

export const EXPORT_LABELS: Record<ExportFormat, string> = {
  'lora-kohya': 'LoRA, kohya / A1111 / ComfyUI (.safetensors)',
  'lora-diffusers': 'LoRA, diffusers / PEFT (.safetensors)',
  'full-single-file': 'Full checkpoint, single file (.safetensors, fp16)',
  'diffusers-zip': 'Full model, diffusers folder (.zip)',
};
