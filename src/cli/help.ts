// `--help` and `-h`: every command's usage on stdout with exit 0, before any work (no GPU, no file read).
// train's flags are described from the settings schema (pipeline/settings.ts settingsHelp: each flag, what
// it does, its default per mode and its range); its input flags below.
import { settingsHelp } from '../pipeline/settings.ts';

/** train's flags that are not settings: the run's inputs and its folder. */
const TRAIN_INPUTS: [string, string][] = [
  ['--model <path>', 'the base model: a diffusers folder, or a single .safetensors file (with --tokenizer)'],
  ['--images <dir>', 'the folder of photos of the subject (a same-name .txt beside a photo is its caption)'],
  ['--prompt <text>', 'the instance prompt: a rare token plus the class, e.g. "a photo of sks dog"'],
  ['--out <dir>', 'the run folder (created if missing): run.json, store/, samples/, the exports'],
  ['--resume <dir>', 'continue the run in <dir> from its last checkpoint (with it only --model, --steps, --export)'],
  ['--overwrite', 'replace the run in --out'],
  ['--tokenizer <dir>', 'a folder with vocab.json and merges.txt (or tokenizer.json), for a single-file --model'],
  ['--config <json>', "config overrides of the model's components"],
  ['--class-images <dir | count>', 'with --class-prompt: a folder of class images, or how many to generate'],
  ['--masks <dir>', 'loss masks: an image per photo with the same name, white where the subject is'],
  ['--export <formats>', 'comma-separated: lora-kohya, lora-diffusers, full-single-file, diffusers-zip'],
  ['--bundle <dir>', 'write the run as a job for diffusers / Ray Train instead of training (no --out)'],
  ['--hub-id <repo>', "with --bundle: the Hub repo of --model, so the job's scripts can load it"],
  ['--revision <rev>', 'with --bundle and --hub-id: its commit or branch'],
];

/** train --help: the usage, then every flag with its description (the settings' with default and range). */
export function trainHelp(usage: string): string {
  return [
    usage,
    '',
    'inputs:',
    ...TRAIN_INPUTS.flatMap(([flag, what]) => [`  ${flag}`, `      ${what}`]),
    '',
    'settings (the same schema as the studio):',
    ...settingsHelp(),
  ].join('\n');
}

export const COMMANDS = ['inspect', 'run', 'grad', 'sample', 'grid', 'train', 'export', 'pretrain'] as const;

/** A command's usage text (loaded from its module: nothing runs). */
async function usageOf(command: string, inspectUsage: string): Promise<string> {
  switch (command) {
    case 'inspect':
      return inspectUsage;
    case 'run':
      return (await import('./run.ts')).RUN_USAGE;
    case 'grad':
      return (await import('./run.ts')).GRAD_USAGE;
    case 'sample':
      return (await import('./sample.ts')).SAMPLE_USAGE;
    case 'grid':
      return (await import('./grid.ts')).GRID_USAGE;
    case 'export':
      return (await import('./export.ts')).EXPORT_USAGE;
    case 'pretrain':
      return (await import('./pretrain.ts')).USAGE;
    case 'train':
      return trainHelp((await import('./bundle.ts')).BUNDLE_USAGE);
    default:
      throw new Error(`no such command: ${command}`);
  }
}

/** `cli --help`: every command's usage; `cli <command> --help`: that command's. */
export async function helpText(command: string | undefined, inspectUsage: string): Promise<string> {
  if (command !== undefined) return usageOf(command, inspectUsage);
  const lines = ['usage: npm run cli -- <command> [flags]   (each command: <command> --help)', ''];
  for (const c of COMMANDS) lines.push(c === 'train' ? (await import('./train.ts')).TRAIN_USAGE : await usageOf(c, inspectUsage));
  return lines.join('\n');
}

/** Whether the arguments ask for help: --help or -h anywhere. */
export const wantsHelp = (args: string[]) => args.includes('--help') || args.includes('-h');
