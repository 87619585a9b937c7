// Inspection of a model on disk or from the browser: architecture, prediction type, tensor counts and
// parameters per component, read from safetensors headers only (a single file's SD2 prediction test
// reads one 320-value tensor).
import { SafetensorsFile } from '../io/safetensors.ts';
import type { ByteSource } from '../io/source.ts';
import { detectDiffusers, detectSingleFile, type Detected } from './detect.ts';
import { COMPONENTS, countTensors, readDiffusersFolder, singleFilePrediction, type FolderReader, type Json } from './source.ts';

export type { FolderReader } from './source.ts';

export interface Inspection extends Detected {
  tensorCount: number;
  files: string[];
}

export async function inspectSingleFile(source: ByteSource, config?: { prediction_type?: string }): Promise<Inspection> {
  const f = await SafetensorsFile.open(source);
  const shapes = new Map(f.names.map((n) => [n, f.entry(n).shape] as const));
  const det = detectSingleFile(shapes, source.name, config);
  // The prediction type as the loader decides it (for SD2: config, else the weights test, else the default).
  const p = await singleFilePrediction(f, det.family, config as Json | undefined);
  return { ...det, prediction: p.prediction, predictionSource: p.source, tensorCount: shapes.size, files: [source.name] };
}

export async function inspectDiffusers(dir: FolderReader, config?: { prediction_type?: string }): Promise<Inspection> {
  const f = await readDiffusersFolder(dir, { overrides: { scheduler: config as Json | undefined } });
  try {
    const det = detectDiffusers({ modelIndex: f.modelIndex, unet: f.configs.unet, scheduler: f.scheduler, textEncoder: f.configs.text_encoder }, countTensors(f.files), dir.name);
    const tensorCount = COMPONENTS.reduce((s, c) => s + f.files[c].names.length, 0);
    return { ...det, tensorCount, files: COMPONENTS.map((c) => f.paths[c]) };
  } finally {
    for (const c of COMPONENTS) await f.files[c].source.close?.();
  }
}
