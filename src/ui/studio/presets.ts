// What the page shows of the run settings: the presets, the labels of the settings and the export formats.
// The settings themselves (types, ranges, defaults) are the schema's (pipeline/settings.ts).
import type { ExportFormat } from '../../pipeline/run.ts';
import { defaultSettings, type RunSettings, type SettingKey } from '../../pipeline/settings.ts';

export type PresetName = 'lora' | 'full';

/** "LoRA (fast)" and "Full DreamBooth": diffusers' and kohya's usual starting points. */
export const PRESETS: Record<PresetName, { label: string; settings: Partial<RunSettings> }> = {
  lora: {
    label: 'LoRA (fast)',
    settings: { mode: 'lora', steps: 400, lr: 1e-4, rank: 8, alpha: 0, checkpointEvery: 50, trainTextEncoder: false, optimizer: 'adamw', master: 'fp32' },
  },
  full: {
    label: 'Full DreamBooth',
    settings: {
      mode: 'full',
      steps: 800,
      lr: 5e-6,
      rank: 0,
      alpha: 0,
      checkpointEvery: 100,
      priorPreservation: true,
      trainTextEncoder: false,
      // 8-bit moments + compact master: 4 bytes of optimizer state per weight instead of 12.
      optimizer: 'adamw8bit',
      master: 'compact',
    },
  },
};

/** The page starts from the schema's LoRA defaults with samples every 50 steps and example prompts. */
export const PAGE_DEFAULTS: RunSettings = {
  ...defaultSettings('lora'),
  aspect: 'bucket',
  sampleEvery: 50,
  classPrompt: 'a photo of a dog',
  samplePrompt: 'a photo of sks dog',
};

/** Each setting's label on the page (messages name settings by these). */
export const SETTING_LABELS: Record<SettingKey, string> = {
  mode: 'Preset',
  steps: 'Steps',
  lr: 'Learning rate',
  rank: 'LoRA rank',
  alpha: 'LoRA alpha (0: the rank)',
  resolution: 'Resolution (px)',
  budgetBytes: 'GPU memory budget',
  seed: 'Seed',
  priorPreservation: 'Prior preservation (class images)',
  classPrompt: 'Class prompt',
  classCount: 'Class images to generate (when none are added)',
  classSteps: 'Denoising steps per class image',
  priorWeight: 'Prior loss weight',
  offsetNoise: 'Offset noise (0: off)',
  minSnrGamma: 'Min-SNR gamma (0: off)',
  flip: 'Also train on mirrored photos',
  trainTextEncoder: 'Also train the text encoder (LoRA)',
  textEncoderLr: 'Text encoder learning rate (0: the learning rate)',
  optimizer: 'Optimizer moments (adamw8bit: 8-bit, a third of the state)',
  master: 'Master weights (compact: f16 + 16-bit extension)',
  fusedUpdates: 'Update inside the backward pass (less GPU memory, one more pass per step)',
  checkpointEvery: 'Checkpoint every N steps',
  validateEvery: 'Validation loss every N steps (0: never)',
  aspect: 'Non-square photos train at',
  sampleEvery: 'Sample every N steps (0: never)',
  samplePrompt: 'Sample prompt',
  sampleSteps: 'Sampling steps',
};

export const EXPORT_LABELS: Record<ExportFormat, string> = {
  'lora-kohya': 'LoRA, kohya / A1111 / ComfyUI (.safetensors)',
  'lora-diffusers': 'LoRA, diffusers / PEFT (.safetensors)',
  'full-single-file': 'Full checkpoint, single file (.safetensors, fp16)',
  'diffusers-zip': 'Full model, diffusers folder (.zip)',
};
