// `cli train ... --bundle <dir> [--hub-id <repo> [--revision <rev>]] [--overwrite]`: instead of training, writes
// the run as a job for diffusers' DreamBooth scripts and Ray Train (pipeline/bundle.ts) into <dir>. The
// same flags, settings schema and checks as a run (the settings against the model's shape too, read from
// its headers: no GPU); --out is not needed. A model in the Hugging Face cache
// (models--<org>--<name>/snapshots/<commit>) gives its hub id and revision itself.
import { existsSync, mkdirSync, rmSync, statSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';
import { encode as encodePng } from 'fast-png';
import { loadImageDir } from '../io/image-node.ts';
import { checkOutFolder, claimEntries, recordWritten, refuseLeftAside, writeFolderOutputs, writeOutput, writtenEntries } from '../io/outpath.ts';
import { SafetensorsFile } from '../io/safetensors.ts';
import { NodeFileSource } from '../io/source-node.ts';
import { nodeFolder } from '../models/folder-node.ts';
import { openDiffusers, openSingleFile, type ModelSource } from '../models/source.ts';
import { jobBundle, type BundleModel, type BundlePhoto } from '../pipeline/bundle.ts';
import { modelShapeOf } from '../pipeline/run.ts';
import { validatePrompt, validateForModel } from '../pipeline/settings.ts';
import { parseFlags, stringFlag, UsageError, type Flags } from './args.ts';
import { checkBlackMasks, pairMasks, refuseMasksAsImages } from './masks.ts';
import { configOverrides } from './run.ts';
import { classImagesIsCount, FLAGS, settingsFromFlags, TRAIN_USAGE } from './train.ts';

export const BUNDLE_FLAGS: Flags = {
  ...FLAGS,
  bundle: { type: 'string', arg: '<dir>', help: 'write the run as a job for diffusers / Ray Train instead of training (no --out)', default: 'none' },
  'hub-id': { type: 'string', arg: '<repo>', help: "with --bundle: the Hub repo of --model, so the job's scripts can load it", default: 'none' },
  revision: { type: 'string', arg: '<rev>', help: 'with --bundle and --hub-id: its commit or branch', default: 'none' },
};
export const BUNDLE_USAGE = `${TRAIN_USAGE}\n       train <the same flags, no --out> --bundle <dir> [--hub-id <hub repo of --model> [--revision <commit or branch>]] [--overwrite]`;

/** The model reference: --hub-id, or a Hugging Face cache snapshot's own repo and commit, or the local path's kind. */
export function bundleModel(path: string, hubId: string | undefined, revision: string | undefined): BundleModel {
  const dir = statSync(path).isDirectory();
  const kind = dir ? 'diffusers' : 'single-file';
  const name = basename(path);
  if (hubId) return { kind: 'hub', name, hubId, ...(revision ? { revision } : {}) };
  const cached = /(?:^|\/)models--([^/]+)--([^/]+)\/snapshots\/([0-9a-f]{40})\/?$/.exec(resolve(path));
  if (dir && cached) return { kind: 'hub', name, hubId: `${cached[1]}/${cached[2]}`, revision: cached[3] };
  return { kind, name };
}

async function openSource(path: string, config: string | undefined): Promise<{ source: ModelSource; close: () => Promise<void> }> {
  const overrides = config ? configOverrides(config, 'unet') : undefined;
  const o = overrides ? { overrides } : {};
  if (statSync(path).isDirectory()) {
    const source = await openDiffusers(nodeFolder(path), o);
    return { source, close: () => source.close() };
  }
  const file = await SafetensorsFile.open(await NodeFileSource.open(path));
  const source = await openSingleFile(file, o);
  return { source, close: async () => (await source.close(), await file.source.close?.()) };
}

async function photos(dir: string, captions: boolean): Promise<BundlePhoto[]> {
  // a caption file that is not UTF-8 text or is empty is refused (CaptionError), as a run refuses it
  const { images, errors } = await loadImageDir(dir, { onWarning: (m) => console.error(`warning: ${m}`), refuseBadCaptions: captions });
  for (const e of errors) console.error(`warning: skipped ${e.message}`);
  return images.map((im) => ({ name: im.name, image: im.image, ...(captions && im.caption !== undefined ? { caption: im.caption } : {}) }));
}

/** Each photo's loss mask from --masks, paired as a run pairs them (masks.ts); a photo without one is refused. */
async function withMasks(list: BundlePhoto[], dir: string): Promise<BundlePhoto[]> {
  const { images: masks, errors } = await loadImageDir(dir, { onWarning: (m) => console.error(`warning: --masks ${m}`) });
  if (errors.length) throw new UsageError(`--masks ${dir}: ${errors.map((e) => e.message).join('; ')}`);
  const pairs = pairMasks(
    list.map((p) => p.name),
    masks.map((m) => m.name),
    dir,
  );
  const byName = new Map(masks.map((m) => [m.name, m]));
  const maskOf = (p: BundlePhoto) => byName.get(pairs.get(p.name)!)!;
  checkBlackMasks(
    list.map((p) => ({ photo: p.name, mask: maskOf(p).name, image: maskOf(p).image })),
    dir,
    (m) => console.error(`warning: ${m}`),
  );
  return list.map((p) => ({ ...p, mask: { name: maskOf(p).name, image: maskOf(p).image } }));
}

function needFolder(path: string, flag: string): void {
  if (!existsSync(path) || !statSync(path).isDirectory()) throw new UsageError(`--${flag} ${path} is not a folder of images`);
}

export async function bundleCommand(argv: string[]): Promise<void> {
  const { values } = parseFlags(argv, BUNDLE_FLAGS, BUNDLE_USAGE);
  const out = stringFlag(values, 'bundle');
  if (!out) throw new UsageError(`--bundle needs the folder to write the job into\n${BUNDLE_USAGE}`);
  for (const k of ['resume', 'out', 'export'])
    if (values[k] !== undefined) throw new UsageError(`--${k} does not apply to --bundle: a bundle is not trained here (leave --${k} out)`);
  if (values.revision !== undefined && values['hub-id'] === undefined) throw new UsageError('--revision needs --hub-id (the hub repo it is a revision of)');
  const missing = ['model', 'images', 'prompt'].filter((k) => values[k] === undefined);
  if (missing.length) throw new UsageError(`train --bundle needs ${missing.map((k) => `--${k}`).join(', ')}\n${BUNDLE_USAGE}`);
  const settings = settingsFromFlags(values);
  const prompt = stringFlag(values, 'prompt')!;
  validatePrompt(prompt, '--prompt');
  const model = stringFlag(values, 'model')!;
  if (!existsSync(model)) throw new UsageError(`--model ${model}: no such file or folder`);
  const images = stringFlag(values, 'images')!;
  needFolder(images, 'images');
  const classArg = stringFlag(values, 'class-images');
  if (classArg !== undefined && !classImagesIsCount(classArg)) needFolder(classArg, 'class-images');
  if (existsSync(out) && !statSync(out).isDirectory()) throw new UsageError(`--bundle ${out} is a file: give a folder (it is created if missing)`);
  checkOutFolder('--bundle', out, [
    { flag: '--model', path: model },
    { flag: '--images', path: images },
    { flag: '--masks', path: stringFlag(values, 'masks') },
    { flag: '--class-images', path: classArg },
    { flag: '--config', path: stringFlag(values, 'config') },
  ]);
  if (existsSync(out) && writtenEntries(out).length && values.overwrite !== true)
    throw new UsageError(`--bundle ${out} holds a bundle already: choose another folder, or add --overwrite to replace it`);
  if (values.overwrite === true && !(existsSync(out) && writtenEntries(out).length))
    throw new UsageError(`--overwrite: ${out} holds no bundle to replace (leave --overwrite out)`);
  if (existsSync(out)) refuseLeftAside('--bundle', out);
  // The settings against the model's shape (rank, resolution factor) from its headers, as a run checks them.
  const { source, close } = await openSource(model, stringFlag(values, 'config'));
  try {
    validateForModel(settings, modelShapeOf(source, settings.mode === 'lora' && settings.trainTextEncoder));
  } finally {
    await close();
  }
  const masks = stringFlag(values, 'masks');
  if (masks !== undefined) {
    needFolder(masks, 'masks');
    refuseMasksAsImages(masks, images);
  }
  const ref = bundleModel(model, stringFlag(values, 'hub-id'), stringFlag(values, 'revision'));
  const instance = await photos(images, true);
  const files = jobBundle(
    {
      prompt,
      images: masks !== undefined ? await withMasks(instance, masks) : instance,
      classImages: classArg !== undefined && !classImagesIsCount(classArg) ? await photos(classArg, false) : [],
      settings,
      model: ref,
    },
    (rgb, width, height) => encodePng({ width, height, data: rgb, channels: 3, depth: 8 }),
  );
  // Only what a bundle wrote here is replaced (the folder's manifest, so an old bundle's masks/ goes too);
  // any other entry of a name the bundle writes is the user's and is refused. Checked before anything is written.
  const top = [...new Set([...files.map((f) => f.path.split('/')[0]), ...(settings.priorPreservation ? ['class_images'] : [])])];
  claimEntries('--bundle', out, top);
  const created = !existsSync(out);
  mkdirSync(out, { recursive: true });
  // --overwrite sets the old bundle aside (outpath.ts): a write that fails part-way leaves the folder as it was.
  try {
    writeFolderOutputs(out, '--bundle', values.overwrite === true, () => {
      recordWritten(out, top, '--bundle');
      for (const f of files) {
        const path = join(out, f.path);
        mkdirSync(dirname(path), { recursive: true });
        writeOutput(path, f.data, { flag: '--bundle', mode: f.executable ? 0o755 : 0o644 });
      }
      if (settings.priorPreservation) mkdirSync(join(out, 'class_images'), { recursive: true });
    });
  } catch (e) {
    if (created) rmSync(out, { recursive: true, force: true });
    throw e;
  }
  if (!ref.hubId) console.error(`warning: ${JSON.parse(files.find((f) => f.path === 'job.json')!.data as string).model.note}`);
  console.log(JSON.stringify({ bundle: out, script: settings.mode === 'lora' ? 'train_dreambooth_lora.py' : 'train_dreambooth.py', files: files.length }));
}
