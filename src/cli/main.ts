// Command line on the same engine (Node + Dawn): `npm run cli -- <command> ...`; `--help` (or -h), alone or
// after a command, prints usage and exits 0 (help.ts).
//   inspect <model.safetensors | diffusers folder> [--config scheduler_config.json]
//   run <unet|text-encoder|vae-encode|vae-decode> --model <path> --in <in.safetensors> --out <out.safetensors>
//       [--config <config.json>] [--dtype f32|f16]
//   grad unet --model <path> --in <in.safetensors> --out <grads.safetensors> [--config <json>] [--dtype f32|f16]
//   train --model <path> --images <dir> --prompt "..." --mode lora|full --steps N --out <dir> (see train.ts) | train --resume <dir>
//   train <the same, no --out> --bundle <dir> [--hub-id <repo> [--revision <rev>]]  (a job for diffusers / Ray Train, bundle.ts)
//   sample --model <path> --prompt "..." --out image.png [--steps --seed --guidance --negative --sampler ...] [--lora <file> [--lora-scale x]]
//   grid --model <folder> --prompts "a|b|..." --out grid.png [--seeds 1,2,3 --scale 4 ...]   (one row per prompt, grid.ts)
//   export --model <path> [--lora <file>] --format <format> --out <file>   (results trained elsewhere, export.ts)
// Pretraining the demo model is the lab's, not the product's: `npm run lab:pretrain -- ...` (lab/demo-model/README.md).
import { existsSync, statSync } from 'node:fs';
import { NodeFileSource } from '../io/source-node.ts';
import { nodeFolder } from '../models/folder-node.ts';
import { inspectDiffusers, inspectionReport, inspectSingleFile } from '../models/inspect.ts';
import { inspectSdxlPath, isSdxlPath } from './run-sdxl.ts';
import type { SourceOptions } from '../models/source.ts';
import { parseFlags, readJsonFile, stringFlag, UsageError, type Flags } from './args.ts';
import { userMessage } from './errors.ts';
import { helpText, wantsHelp } from './help.ts';
import { withGpu } from './with-gpu.ts';

const INSPECT_USAGE = 'usage: inspect <model.safetensors | diffusers folder> [--config config.json]';
const INSPECT_FLAGS: Flags = {
  config: { type: 'string', arg: '<json>', help: "the scheduler's config, or config overrides of the model's components by name", default: 'none' },
};
const INSPECT = { usage: INSPECT_USAGE, flags: INSPECT_FLAGS };

async function inspect(args: string[]): Promise<void> {
  const { values, positionals } = parseFlags(args, INSPECT_FLAGS, INSPECT_USAGE, { positionals: 1 });
  const path = positionals[0];
  if (!path) throw new UsageError(INSPECT_USAGE);
  if (!existsSync(path)) throw new Error(`${path}: no such file or folder`);
  const cfgPath = stringFlag(values, 'config');
  const json = cfgPath ? readJsonFile(cfgPath, '--config') : undefined;
  // Per-component overrides ({unet: {...}, ...}) as the loader takes them; a plain object is the scheduler config.
  const perComponent = json && ['unet', 'vae', 'text_encoder', 'text_encoder_2', 'scheduler'].some((k) => k in json);
  const overrides = perComponent ? (json as SourceOptions['overrides']) : undefined;
  const config = perComponent ? undefined : json;
  if (await isSdxlPath(path)) {
    const report = await inspectSdxlPath(path, { ...overrides, ...(config ? { scheduler: config } : {}) });
    console.log(JSON.stringify(report, null, 2));
    refuseProblems(path, report);
    return;
  }
  let r;
  if (statSync(path).isDirectory()) r = await inspectDiffusers(nodeFolder(path), config, overrides);
  else {
    const src = await NodeFileSource.open(path);
    try {
      r = await inspectSingleFile(src, config, overrides);
    } finally {
      await src.close();
    }
  }
  // The loader's own checks: a model it would refuse shows its problems here (missing or misshaped tensors, configs).
  const report = inspectionReport(r);
  console.log(JSON.stringify(report, null, 2));
  refuseProblems(path, report);
}

/** The report is printed either way; a model the loader would refuse also exits 1 (scripts test `inspect m && train ...`). */
function refuseProblems(path: string, report: object): void {
  const problems = (report as { problems?: unknown }).problems;
  if (!Array.isArray(problems) || problems.length === 0) return;
  console.error(
    `error: ${path}: the loader would refuse this model: ${problems.length === 1 ? 'one problem' : `${problems.length} problems`}, listed under "problems" in the report (first: ${String(problems[0])})`,
  );
  process.exitCode = 1;
}

const run = (args: string[]) => withGpu(async () => (await import('./run.ts')).runCommand, args);
const sample = (args: string[]) => withGpu(async () => (await import('./sample.ts')).sampleCommand, args);
const grid = (args: string[]) => withGpu(async () => (await import('./grid.ts')).gridCommand, args);
const grad = (args: string[]) => withGpu(async () => (await import('./run.ts')).gradCommand, args);
const train = (args: string[]) =>
  // --bundle writes the run as a job for diffusers' scripts / Ray Train instead of training: no GPU (bundle.ts).
  args.some((a) => a === '--bundle' || a.startsWith('--bundle='))
    ? import('./bundle.ts').then((m) => m.bundleCommand(args))
    : import('./train.ts').then(async (m) => {
        // A new run's flags, settings and caption files are checked before Dawn opens: a refusal costs no device (trainCommand checks them again).
        const { values } = parseFlags(args, m.FLAGS, m.TRAIN_USAGE);
        if (values.resume === undefined && ['model', 'images', 'prompt', 'out'].every((k) => values[k] !== undefined)) {
          m.settingsFromFlags(values);
          await m.checkNewRunCaptions(values);
        }
        return withGpu(async () => m.trainCommand, args);
      });
const exportModel = async (args: string[]) => (await import('./export.ts')).exportCommand(args);

const [command, ...rest] = process.argv.slice(2);
const commands: Record<string, (a: string[]) => Promise<void>> = { inspect, run, grad, sample, grid, train, export: exportModel };
try {
  if (command === 'pretrain')
    throw new Error("pretrain is the demo-model lab's command, not the product's: npm run lab:pretrain -- --help (lab/demo-model/README.md)");
  else if ((command === undefined || !commands[command]) && wantsHelp(process.argv.slice(2))) console.log(await helpText(undefined, INSPECT));
  else if (!command || !commands[command]) throw new Error(`usage: npm run cli -- <${Object.keys(commands).join('|')}> ...   (--help: every command's usage)`);
  else if (wantsHelp(rest)) console.log(await helpText(command, INSPECT));
  else await commands[command](rest);
} catch (e) {
  console.error(`error: ${userMessage(e)}`);
  process.exitCode = 1;
}
// Dawn keeps the event loop alive: leave once the command is done.
process.exit(process.exitCode ?? 0);
