// The studio's names for the shared run pipeline (src/pipeline/run.ts), which `cli train` runs too. The
// worker drives a TrainingRun; the page sends RunSettings checked by the one schema (pipeline/settings.ts).
import { defaultSettings, type RunSettings } from '../pipeline/settings.ts';

export {
  TrainingRun as StudioSession,
  RunError as StudioError,
  RunStorageFullError,
  EXPORT_FORMATS,
  exportFileName,
  storageNeed,
  type ExportFormat,
  type ImageInput,
  type OpenedModel,
  type PlanSummary,
  type RunEvent as StudioEvent,
  type RunHost as SessionHost,
  type RunInput,
  type Phase,
} from '../pipeline/run.ts';

export type StudioSettings = RunSettings;

/** The schema's LoRA defaults with samples on (every 50 steps), as the page starts. */
export const DEFAULT_SETTINGS: StudioSettings = {
  ...defaultSettings('lora'),
  sampleEvery: 50,
  classPrompt: 'a photo of a dog',
  samplePrompt: 'a photo of sks dog',
};
