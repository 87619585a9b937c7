// `cli export --model <diffusers folder | model.safetensors> [--lora <file.safetensors>] --format <format> --out <file>
//  [--tokenizer <dir>] [--config <json>]`: results trained elsewhere, in our formats (pipeline/imported.ts).
//   --lora + lora-kohya / lora-diffusers: the LoRA re-written (e.g. diffusers' pytorch_lora_weights.safetensors
//     as a kohya file for A1111/ComfyUI), checked against --model;
//   --lora + full-single-file / diffusers-zip: --model with the LoRA merged into its UNet;
//   no --lora + full-single-file / diffusers-zip: --model itself (train_dreambooth.py's output folder as one file).
import { existsSync, readFileSync, statSync } from 'node:fs';
import { basename, join } from 'node:path';
import { SafetensorsFile } from '../io/safetensors.ts';
import { checkOutFile } from '../io/outpath.ts';
import { nodeFileSink } from '../io/sink-node.ts';
import { NodeFileSource } from '../io/source-node.ts';
import { nodeFolder } from '../models/folder-node.ts';
import { openDiffusers, openSingleFile, tokenizerFilesFrom } from '../models/source.ts';
import { TOKENIZER_FILES } from '../export/full.ts';
import { checkImportedLora, exportImported } from '../pipeline/imported.ts';
import { EXPORT_FORMATS, type ExportFormat, type OpenedModel } from '../pipeline/run.ts';
import { parseFlags, stringFlag, UsageError, type Flags } from './args.ts';
import { configOverrides } from './run.ts';
import { readLoraFile } from './sample.ts';

export const EXPORT_USAGE =
  'usage: export --model <diffusers folder | model.safetensors> [--lora <file.safetensors>] --format lora-kohya|lora-diffusers|full-single-file|diffusers-zip --out <file> [--tokenizer <dir>] [--config <json>]';

/** export's flags: what parses them and what --help says. */
export const EXPORT_FLAGS: Flags = {
  model: { type: 'string', arg: '<path>', help: 'the base model: a diffusers folder or a single .safetensors file', default: 'required' },
  lora: {
    type: 'string',
    arg: '<file.safetensors>',
    help: 'a LoRA trained elsewhere (kohya or PEFT/diffusers keys): exported as is, or merged into a full format',
    default: 'none',
  },
  format: {
    type: 'string',
    arg: `<${Object.keys(EXPORT_FORMATS).join('|')}>`,
    help: 'the format to write (the LoRA formats need --lora)',
    default: 'required',
  },
  out: { type: 'string', arg: '<file>', help: 'the file to write', default: 'required' },
  tokenizer: { type: 'string', arg: '<dir>', help: "a folder with the tokenizer's files, for a single-file --model's diffusers zip", default: 'none' },
  config: { type: 'string', arg: '<json>', help: "config overrides of the model's components", default: 'none' },
};

/** The base as the run pipeline opens models (a diffusers folder, or a single file with tokenizer files for the zip). */
async function openBase(model: string, tokDir: string | undefined, config: string | undefined): Promise<{ opened: OpenedModel; close: () => Promise<void> }> {
  const overrides = config ? configOverrides(config, 'unet') : undefined;
  const extra = overrides ? { overrides } : {};
  if (statSync(model).isDirectory()) {
    const reader = nodeFolder(model);
    const tokenizer = (await tokenizerFilesFrom(tokDir ? nodeFolder(tokDir) : reader, tokDir ? '' : 'tokenizer/')) ?? {};
    return { opened: { kind: 'diffusers', name: basename(model), reader, tokenizer, ...extra }, close: async () => undefined };
  }
  const tokenizerFiles = new Map<string, Uint8Array>();
  if (tokDir) for (const f of TOKENIZER_FILES) if (existsSync(join(tokDir, f))) tokenizerFiles.set(f, readFileSync(join(tokDir, f)));
  const file = await SafetensorsFile.open(await NodeFileSource.open(model));
  return {
    opened: { kind: 'single-file', name: basename(model), file, tokenizer: {}, tokenizerFiles, ...extra },
    close: async () => file.source.close?.(),
  };
}

export async function exportCommand(args: string[]): Promise<void> {
  const { values } = parseFlags(args, EXPORT_FLAGS, EXPORT_USAGE);
  const arg = (k: string) => stringFlag(values, k);
  const [model, format, out, loraPath, tokDir] = [arg('model'), arg('format'), arg('out'), arg('lora'), arg('tokenizer')];
  if (!model || !format || !out) throw new UsageError(`export needs --model, --format and --out\n${EXPORT_USAGE}`);
  if (!(format in EXPORT_FORMATS)) throw new UsageError(`--format: unknown format "${format}": use one of ${Object.keys(EXPORT_FORMATS).join(', ')}`);
  if (!existsSync(model)) throw new UsageError(`--model ${model}: no such file or folder`);
  checkOutFile('--out', out, [
    { flag: '--model', path: model },
    { flag: '--lora', path: loraPath },
    { flag: '--tokenizer', path: tokDir },
    { flag: '--config', path: arg('config') },
  ]);
  if (tokDir !== undefined && !existsSync(tokDir)) throw new UsageError(`--tokenizer ${tokDir}: no such folder`);
  const fmt = format as ExportFormat;
  if (!loraPath && EXPORT_FORMATS[fmt].modes.includes('lora') && !EXPORT_FORMATS[fmt].modes.includes('full'))
    throw new UsageError(`--format ${fmt} holds LoRA adapters: give --lora <file> (a full model exports as full-single-file or diffusers-zip)`);
  if (fmt === 'diffusers-zip' && !statSync(model).isDirectory() && !tokDir)
    throw new UsageError('a single-file checkpoint carries no tokenizer: pass --tokenizer <folder with vocab.json and merges.txt> for the diffusers zip');
  const lora = loraPath ? await readLoraFile(loraPath) : null;
  const { opened, close } = await openBase(model, tokDir, arg('config'));
  try {
    const o = opened.overrides ? { overrides: opened.overrides } : {};
    const source = opened.kind === 'diffusers' ? await openDiffusers(opened.reader, o) : await openSingleFile(opened.file, o);
    try {
      if (lora) checkImportedLora(lora, { unet: source.shapes('unet'), text_encoder: source.shapes('text_encoder') }, loraPath!, model);
      if (lora?.skipped.length)
        console.error(
          `warning: ${loraPath}: ${lora.skipped.length} keys adapt layers the engine has no LoRA on (e.g. ${lora.skipped.slice(0, 3).join(', ')}); they are left out`,
        );
      await exportImported({
        opened,
        source,
        lora,
        loraName: loraPath ? basename(loraPath) : '',
        format: fmt,
        sink: await nodeFileSink(out),
        onWarning: (m) => console.error(`warning: ${m}`),
      });
    } finally {
      await source.close();
    }
  } finally {
    await close();
  }
  console.log(
    JSON.stringify({
      out,
      format: fmt,
      bytes: statSync(out).size,
      ...(lora ? { lora: loraPath, layers: lora.adapters.size, rank: lora.rank, scale: lora.scale } : {}),
    }),
  );
}
