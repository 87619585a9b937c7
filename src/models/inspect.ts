// Inspection of a model on disk or from the browser: architecture, prediction type, tensor counts and
// parameters per component, read from safetensors headers only (a single file's SD2 prediction test
// reads one 320-value tensor), and the problems the loader would refuse it for, found by the loader's
// own checks (check.ts), so inspect never calls a model fine that the loader refuses.
import { SafetensorsFile } from '../io/safetensors.ts';
import type { ByteSource } from '../io/source.ts';
import { modelProblems } from './check.ts';
import { detectDiffusers, detectSingleFile, ModelError, type Detected } from './detect.ts';
import {
  closeFolder,
  COMPONENTS,
  countTensors,
  folderSource,
  openSingleFile,
  readDiffusersFolder,
  singleFilePrediction,
  type FolderReader,
  type Json,
  type ModelSource,
  type SourceOptions,
} from './source.ts';

export type { FolderReader } from './source.ts';

export interface Inspection extends Detected {
  tensorCount: number;
  files: string[];
  /**
   * Why the loader would refuse the model, one line each; empty when it would load. Config problems
   * first, then each missing, misshaped or unused tensor (at most LISTED_PER_KIND per kind and component).
   */
  problems: string[];
}

/** The loader's checks on a source, as lines; a ModelError met while opening it is the one problem. */
async function problemsOf(open: () => Promise<ModelSource> | ModelSource): Promise<string[]> {
  try {
    return modelProblems(await open());
  } catch (e) {
    if (e instanceof ModelError) return [e.message];
    throw e;
  }
}

/**
 * `config` is a scheduler config (prediction_type); `overrides` are the per-component config values the
 * loader would be given (--config), which decide what a single file at non-SD widths can be checked against.
 */
export async function inspectSingleFile(
  source: ByteSource,
  config?: { prediction_type?: string },
  overrides?: SourceOptions['overrides'],
): Promise<Inspection> {
  const f = await SafetensorsFile.open(source);
  const shapes = new Map(f.names.map((n) => [n, f.entry(n).shape] as const));
  const det = detectSingleFile(shapes, source.name, config);
  // The prediction type as the loader decides it (for SD2: config, else the weights test, else the default).
  const p = await singleFilePrediction(f, det.family, config as Json | undefined);
  const problems = await problemsOf(() =>
    openSingleFile(f, { family: det.family, overrides: { ...overrides, scheduler: { ...overrides?.scheduler, ...config } } }),
  );
  return { ...det, prediction: p.prediction, predictionSource: p.source, tensorCount: shapes.size, files: [source.name], problems };
}

export async function inspectDiffusers(dir: FolderReader, config?: { prediction_type?: string }, overrides?: SourceOptions['overrides']): Promise<Inspection> {
  const o: SourceOptions = { overrides: { ...overrides, scheduler: { ...overrides?.scheduler, ...(config as Json | undefined) } } };
  const f = await readDiffusersFolder(dir, o);
  try {
    const det = detectDiffusers(
      { modelIndex: f.modelIndex, unet: f.configs.unet, scheduler: f.scheduler, textEncoder: f.configs.text_encoder },
      countTensors(f.files),
      dir.name,
    );
    const tensorCount = COMPONENTS.reduce((s, c) => s + f.files[c].names.length, 0);
    const problems = await problemsOf(() => folderSource(dir, f, det, o));
    return { ...det, tensorCount, files: COMPONENTS.map((c) => f.paths[c]), problems };
  } finally {
    await closeFolder(f);
  }
}

/** What `inspect` prints (the CLI writes it as JSON): the inspection with parameters per component. */
export function inspectionReport(r: Inspection): Record<string, unknown> {
  const parameters = Object.fromEntries(Object.entries(r.components).map(([k, v]) => [k, v.parameters]));
  return {
    architecture: r.family,
    predictionType: r.prediction,
    predictionSource: r.predictionSource,
    layout: r.layout,
    contextDim: r.contextDim,
    tensorCount: r.tensorCount,
    parameters,
    ignored: r.ignored,
    files: r.files,
    problems: r.problems,
  };
}
