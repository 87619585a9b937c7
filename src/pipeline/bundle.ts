// A job bundle (issue 17): the run the studio or `cli train` would do, handed to the PyTorch trainers people
// use on bigger machines instead. Built from the same inputs and settings schema as a run (settings.ts), so
// every setting is either mapped to an option of diffusers' DreamBooth example scripts or listed as having
// no counterpart, never dropped. Host-neutral: the host decodes the photos and encodes PNGs.
//
//   instance_images/   the photos exactly as the engine trains them: the crop applied, resized to the training
//                      resolution (io/image prepareImage), mirrored copies for "flip"; only images, since the
//                      scripts open every file of --instance_data_dir as one
//   class_images/      given class images (centre square at the resolution), or none: the scripts generate
//                      --num_class_images with --class_prompt
//   masks/             per instance image its loss mask (same file name; crop, resize and mirror of its photo)
//   prompts.jsonl      per instance image its prompt (a caption replaces the instance prompt) and mask, for ray_train.py
//   job.json           the settings, the base model reference, each setting's counterpart or why it has none
//   train.sh           accelerate launch train_dreambooth_lora.py (LoRA) / train_dreambooth.py (full) ...
//   ray_train.py       the same job as a Ray Train TorchTrainer over N workers, with checkpoints and restore
//   requirements.txt   the versions targeted
//   README.md          how to run it on one or several GPUs (accelerate config, DeepSpeed, Ray), and what has no
//                      counterpart
//   sd-scripts.toml, train-sd-scripts.sh, README-sd-scripts.md   the kohya sd-scripts target (bundle-sdscripts.ts)
import { prepareImage, scaleCrop, type CropBox, type ImageSize, type RgbaImage } from '../io/image.ts';
import { prepareMask } from '../io/mask.ts';
import { RAY_TRAIN_PY } from './bundle-ray.ts';
import { sdScriptsFiles } from './bundle-sdscripts.ts';
import { SCRIPT_HEAD, shellComment, shellQuote } from './quote.ts';
import {
  RunError,
  SETTING_SPECS,
  SETTINGS,
  validatePrompt,
  validateSettings,
  type BundleContext,
  type BundleRow,
  type RunSettings,
  type SettingKey,
  type SettingSpec,
} from './settings.ts';

/** The diffusers release the bundle's commands are written for (tests/fixtures/diffusers/dreambooth-options.json). */
export const DIFFUSERS_TARGET = { version: '0.40.0', tag: 'v0.40.0', commit: 'd035dcd7cc7c88e0a154609b62887d50bba9fdc2' } as const;

/** Where the base model comes from, as far as the host knows. */
export interface BundleModel {
  /** What the user picked: a hub repo, a local diffusers folder, a local single file, the studio's demo model. */
  kind: 'hub' | 'diffusers' | 'single-file' | 'demo';
  /** File or folder name (or the repo id). */
  name: string;
  /** Hugging Face Hub repo id the scripts can download (`from_pretrained`). */
  hubId?: string;
  revision?: string;
}

export interface BundlePhoto {
  name: string;
  /** Decoded upright; `original` is the file's upright size when the host decoded it smaller (crops are in it). */
  image: RgbaImage & { original?: ImageSize };
  crop?: CropBox;
  caption?: string;
  /** The photo's loss mask (io/mask.ts: white = trained), decoded upright at the photo's shape. */
  mask?: { name: string; image: RgbaImage };
}

export interface BundleInput {
  prompt: string;
  images: BundlePhoto[];
  classImages: BundlePhoto[];
  settings: RunSettings;
  model: BundleModel;
}

export interface BundleFile {
  path: string;
  data: Uint8Array | string;
  /** train.sh is executable. */
  executable?: boolean;
}

/** One setting and what it became in the scripts (or why nothing). */
export interface SettingMapping {
  setting: keyof RunSettings | 'prompt' | 'captions' | 'masks' | 'model';
  value: unknown;
  /** `--option=value` of train.sh, or null when the script has no counterpart. */
  option: string | null;
  note?: string;
}

const q = (s: string) => shellQuote(s, 'a value for train.sh');

/** A safe file name: the photo's own name without its extension, numbered so names stay unique and ordered. */
function fileName(i: number, name: string, suffix = ''): string {
  const stem =
    name
      .replace(/\.[^.]*$/, '')
      .replace(/[^A-Za-z0-9._-]+/g, '-')
      .slice(0, 60) || 'image';
  return `${String(i + 1).padStart(3, '0')}-${stem}${suffix}.png`;
}

/** [3, R, R] in [-1, 1] (prepareImage) to 8-bit RGB rows, rounded. */
function toRgb(chw: Float32Array, r: number): Uint8Array {
  const rgb = new Uint8Array(3 * r * r);
  const plane = r * r;
  for (let p = 0; p < plane; p++) for (let c = 0; c < 3; c++) rgb[3 * p + c] = Math.round((chw[c * plane + p] + 1) * 127.5);
  return rgb;
}

/** The script a run maps to, by mode. */
function scriptFor(s: RunSettings): 'train_dreambooth_lora.py' | 'train_dreambooth.py' {
  return s.mode === 'lora' ? 'train_dreambooth_lora.py' : 'train_dreambooth.py';
}

/** What the model reference becomes: the hub id, or a required MODEL with what to provide. */
function modelReference(m: BundleModel): { value: string | null; note: string } {
  if (m.hubId) return { value: m.hubId, note: `Hugging Face Hub repo ${m.hubId}${m.revision ? ` at revision ${m.revision}` : ''}` };
  switch (m.kind) {
    case 'diffusers':
      return {
        value: null,
        note: `the local diffusers folder "${m.name}": copy it to the training machine and set MODEL=<its path> (the scripts load a diffusers folder with from_pretrained), or set MODEL to its Hub repo id`,
      };
    case 'single-file':
      return {
        value: null,
        note:
          `"${m.name}" is a single checkpoint file, which diffusers' training scripts cannot load: set MODEL to the Hub repo id of the same model ` +
          `(e.g. stable-diffusion-v1-5/stable-diffusion-v1-5), or convert the file to a diffusers folder ` +
          `(diffusers' scripts/convert_original_stable_diffusion_to_diffusers.py --checkpoint_path ${m.name} --from_safetensors --dump_path model) and set MODEL=model`,
      };
    case 'demo':
      return {
        value: null,
        note: "the studio's demo model ships with the studio (public/demo-model/ in its repository, a diffusers folder): set MODEL to that folder, or to the Hub repo id of a real Stable Diffusion 1.x/2.x model",
      };
    default:
      return { value: null, note: `set MODEL to the Hub repo id or diffusers folder of "${m.name}"` };
  }
}

/**
 * train.sh's order for the settings that diffusers' DreamBooth examples have options for (the rest follow in the
 * schema's order, after the captions and masks): each setting's rows come from its schema entry (`bundle`).
 */
const SCRIPT_ORDER: readonly SettingKey[] = [
  'mode',
  'steps',
  'lr',
  'rank',
  'alpha',
  'resolution',
  'seed',
  'priorPreservation',
  'classPrompt',
  'classCount',
  'classSteps',
  'priorWeight',
  'flip',
  'trainTextEncoder',
  'textEncoderLr',
  'offsetNoise',
  'minSnrGamma',
  'checkpointEvery',
  'samplePrompt',
  'sampleEvery',
  'sampleSteps',
  'budgetBytes',
  'optimizer',
  'master',
];

/**
 * Every setting of the run and its counterpart in `script` (diffusers 0.40's argument names), in train.sh
 * order; `option: null` rows are listed in the README and job.json as having no counterpart.
 */
function mapSettings(
  input: Omit<BundleInput, 'images' | 'classImages'> & { instanceCount: number; classCount: number; captions: number; masks: number },
): SettingMapping[] {
  const s = input.settings;
  const ctx: BundleContext = { prompt: input.prompt, instanceCount: input.instanceCount, classCount: input.classCount, script: scriptFor(s) };
  const rows: SettingMapping[] = [];
  const add = (setting: SettingMapping['setting'], value: unknown, option: string | null, note?: string) =>
    rows.push({ setting, value, option, ...(note ? { note } : {}) });
  /** The setting's rows from its entry; false when it has none in this run (another mode's, or not acting). */
  const addRows = (spec: SettingSpec): boolean => {
    if (spec.onlyMode && spec.onlyMode !== s.mode) return false;
    const got = spec.bundle?.(s, ctx) ?? null;
    if (got === null) return false;
    for (const r of Array.isArray(got) ? (got as readonly BundleRow[]) : [got as BundleRow])
      add(spec.key, 'value' in r ? r.value : s[spec.key], r.option, r.note);
    return true;
  };
  const ref = modelReference(input.model);
  add('model', input.model.hubId ?? input.model.name, '--pretrained_model_name_or_path="$MODEL"', ref.note);
  if (input.model.hubId && input.model.revision) rows.push({ setting: 'model', value: input.model.revision, option: `--revision=${q(input.model.revision)}` });
  add('prompt', input.prompt, `--instance_prompt=${q(input.prompt)}`);
  rows.push({ setting: 'prompt', value: 'instance_images', option: '--instance_data_dir=instance_images' });
  for (const key of SCRIPT_ORDER) addRows(SETTING_SPECS.get(key)!);
  add(
    'captions',
    input.captions,
    null,
    input.captions
      ? `${input.captions} photos have their own caption: the scripts train every photo with --instance_prompt; the captions are in prompts.jsonl, which ray_train.py reads`
      : 'none: every photo trains with the instance prompt',
  );
  add(
    'masks',
    input.masks,
    null,
    input.masks
      ? `masked loss: the scripts have none; masks/ holds each instance image's mask under the same name (white = trained, kohya's convention), and ray_train.py applies them`
      : 'no masks: no masked loss',
  );
  // Every setting of the schema appears: mapped by its entry's `bundle` field, or listed as having no
  // counterpart, never dropped.
  const seen = new Set<string>(rows.map((r) => r.setting));
  for (const spec of SETTINGS) {
    if (seen.has(spec.key)) continue;
    if (spec.onlyMode && spec.onlyMode !== s.mode) add(spec.key, s[spec.key], null, `not used: ${spec.onlyMode === 'lora' ? 'LoRA' : 'full'} runs only`);
    else if (!addRows(spec)) add(spec.key, s[spec.key], null, `no counterpart in ${ctx.script} (${spec.help})`);
  }
  return rows;
}

/** Options the engine always trains with (its batch, optimizer and precision), pinned so a script default cannot differ. */
function fixedOptions(s: RunSettings): string[] {
  return [
    '--train_batch_size=1',
    '--center_crop',
    '--lr_scheduler=constant',
    '--lr_warmup_steps=0',
    '--adam_beta1=0.9',
    '--adam_beta2=0.999',
    '--adam_weight_decay=0.01',
    '--adam_epsilon=1e-08',
    '--max_grad_norm=1.0',
    '--mixed_precision=fp16',
    '--gradient_checkpointing',
    `--output_dir=output`,
    ...(s.priorPreservation ? ['--prior_generation_precision=fp16'] : []),
  ];
}

/** train.sh: one `accelerate launch` of the script with every mapped option, extra arguments passed on. */
function trainScript(input: BundleInput & { mapping: SettingMapping[] }): string {
  const s = input.settings;
  const ref = modelReference(input.model);
  const mapped = input.mapping.map((m) => m.option).filter((o): o is string => o !== null);
  // A pinned option that a setting maps (e.g. --lr_warmup_steps) is the setting's.
  const optionName = (o: string) => o.split('=')[0];
  const names = new Set(mapped.map(optionName));
  const options = [...mapped, ...fixedOptions(s).filter((o) => !names.has(optionName(o)))];
  const model = ref.value
    ? `if [ -z "\${MODEL:-}" ]; then MODEL=${q(ref.value)}; fi`
    : `if [ -z "\${MODEL:-}" ]; then printf '%s\\n' ${q(`set MODEL first: ${ref.note}`)} >&2; exit 2; fi`;
  return [
    ...SCRIPT_HEAD,
    `# DreamBooth Studio job: ${s.mode === 'lora' ? 'LoRA' : 'full'} DreamBooth of ${shellComment(input.prompt)}`,
    `# for diffusers ${DIFFUSERS_TARGET.version} (${DIFFUSERS_TARGET.tag}, commit ${DIFFUSERS_TARGET.commit}): examples/dreambooth/${scriptFor(s)}.`,
    '# Several GPUs: run `accelerate config` once (multi-GPU, or DeepSpeed), then this script; see README.md.',
    '# Extra arguments are passed to the script, e.g. ./train.sh --report_to=wandb',
    'set -euo pipefail',
    'cd "$(dirname "$0")"',
    model,
    'DIFFUSERS_EXAMPLES="${DIFFUSERS_EXAMPLES:-diffusers/examples/dreambooth}"',
    `accelerate launch "$DIFFUSERS_EXAMPLES/${scriptFor(s)}" \\`,
    ...options.map((o) => `  ${o} \\`),
    '  "$@"',
    '',
  ].join('\n');
}

function readme(input: BundleInput, mapping: SettingMapping[], files: { instance: number; classes: number }): string {
  const s = input.settings;
  const ref = modelReference(input.model);
  const script = scriptFor(s);
  const none = mapping.filter((m) => m.option === null);
  const mapped = mapping.filter((m) => m.option !== null);
  const cell = (v: unknown) => String(typeof v === 'string' ? v : JSON.stringify(v)).replace(/\|/g, '\\|');
  return `# DreamBooth job: ${s.mode === 'lora' ? 'LoRA' : 'full'} DreamBooth of "${input.prompt}"

Made by DreamBooth Studio for **diffusers ${DIFFUSERS_TARGET.version}** (tag ${DIFFUSERS_TARGET.tag}, commit
${DIFFUSERS_TARGET.commit}): \`train.sh\` runs \`examples/dreambooth/${script}\` of that release, and
\`ray_train.py\` runs the same job on a Ray cluster. Every option in \`train.sh\` exists in that release's script.

## Base model

${ref.value ? `\`${ref.value}\`${input.model.revision ? ` (revision \`${input.model.revision}\`)` : ''}: ${ref.note}.` : `**Provide it:** ${ref.note}.`}

## What is here

- \`instance_images/\`: ${files.instance} images, each photo with its crop applied at ${s.resolution} px${s.flip ? ' (and a mirrored copy)' : ''}: exactly what the studio would train on.
- \`class_images/\`: ${s.priorPreservation ? (files.classes ? `${files.classes} given class images.` : `empty: the script first generates ${s.classCount} images of "${s.classPrompt}" with the base model.`) : 'not used (no prior preservation).'}
- \`prompts.jsonl\`: each instance image's prompt (its caption, or the instance prompt)${input.images.some((p) => p.mask) ? ' and mask' : ''}.${input.images.some((p) => p.mask) ? "\n- `masks/`: each instance image's loss mask under its name (white = trained)." : ''}
- \`job.json\`: the run's settings and how each maps (below).
- \`train.sh\`, \`ray_train.py\`, \`requirements.txt\`.

## Run it on one GPU

\`\`\`
git clone --branch ${DIFFUSERS_TARGET.tag} https://github.com/huggingface/diffusers
pip install -r requirements.txt
${ref.value ? '' : 'export MODEL=...   # see "Base model"\n'}./train.sh
\`\`\`

The result is in \`output/\`: ${s.mode === 'lora' ? '`pytorch_lora_weights.safetensors`, which DreamBooth Studio loads back (`npm run cli -- sample --model <base> --lora output/pytorch_lora_weights.safetensors ...`, or `cli export ... --format lora-kohya`)' : 'a diffusers folder, which DreamBooth Studio loads as a model (`npm run cli -- sample --model output ...`, `cli export --model output --format full-single-file`)'}.

## Several GPUs

- **accelerate**: run \`accelerate config\` once on the machine (choose multi-GPU and the number of GPUs, fp16),
  or pass it inline: \`accelerate launch --multi_gpu --num_processes 4\` (edit the \`accelerate launch\` line of
  \`train.sh\`). Each GPU takes its own batch of 1, so the effective batch grows with the GPU count: lower
  \`--learning_rate\` or \`--max_train_steps\` to keep the same number of samples seen.
- **DeepSpeed**: in \`accelerate config\` answer yes to DeepSpeed (ZeRO stage 2 is what diffusers documents for
  DreamBooth on 8-16 GB GPUs), or \`accelerate launch --use_deepspeed --zero_stage 2 ...\`.${s.mode === 'lora' ? '' : ' ZeRO-3 is not supported by the full script with --train_text_encoder.'}
- **Several machines**: \`accelerate config\` per machine (machine rank, main process address), or Ray below.
- **Ray Train**: \`python ray_train.py --num-workers 8 --storage-path /shared/ray-results\` runs the same job as a
  TorchTrainer on 8 GPU workers (ScalingConfig), checkpointing every ${s.checkpointEvery || s.steps} steps with \`ray.train.report\`; a failed worker
  restarts from the last checkpoint (FailureConfig), and running the same command again restores the run
  (\`TorchTrainer.restore\`). It reads \`job.json\` and \`prompts.jsonl\`, so captions${s.mode === 'lora' ? ', the LoRA alpha' : ''}, offset noise and
  min-SNR (below) are honoured there.

## Settings and their counterparts

| setting | value | ${script} |
| --- | --- | --- |
${mapped.map((m) => `| ${m.setting} | ${cell(m.value)} | \`${m.option}\`${m.note ? ` (${m.note})` : ''} |`).join('\n')}

Pinned to what the engine does: ${fixedOptions(s)
    .map((o) => `\`${o}\``)
    .join(', ')}.

### No counterpart in ${script}

${none.map((m) => `- **${m.setting}** = ${cell(m.value)}: ${m.note ?? 'no option'}`).join('\n')}

Also different by design: the engine trains on the VAE posterior mean of each image (cached once), the scripts
sample the posterior every step; the engine averages its loss over the batch (instance and class sample), the
scripts add instance and weighted prior loss (the same gradient direction, twice the size, which AdamW mostly
absorbs); with prior preservation train_dreambooth.py's --snr_gamma weights only the instance term, the engine
(and ray_train.py) every sample; and the same seed does not give the same random draws in PyTorch.
`;
}

/**
 * The bundle's files for a run's inputs and settings (validated as a run validates them). `encodePng` is the
 * host's PNG encoder (RGB, 8 bits).
 */
export function jobBundle(input: BundleInput, encodePng: (rgb: Uint8Array, width: number, height: number) => Uint8Array): BundleFile[] {
  const s = input.settings;
  validateSettings(s);
  validatePrompt(input.prompt, 'the instance prompt');
  if (!input.images.length) throw new RunError('a job bundle needs the instance photos: add at least one');
  const r = s.resolution;
  const files: BundleFile[] = [];
  const prompts: { file: string; prompt: string; mask?: string }[] = [];
  const cropOf = (p: BundlePhoto) => (p.crop && p.image.original ? scaleCrop(p.crop, p.image.original, p.image) : (p.crop ?? 'center'));
  const square = (p: BundlePhoto, flip: boolean) => encodePng(toRgb(prepareImage(p.image, { resolution: r, crop: cropOf(p), flip, name: p.name }), r), r, r);
  /** The mask as the engine prepares it (its photo's crop, resize and mirror), as a grey PNG at R. */
  const maskPng = (p: BundlePhoto, flip: boolean) => {
    const photoSize = p.image.original ?? p.image;
    const m = prepareMask(p.mask!.image, photoSize, { resolution: r, crop: p.crop ?? 'center', flip, photoName: p.name, maskName: p.mask!.name });
    const rgb = new Uint8Array(3 * m.length);
    for (let i = 0; i < m.length; i++) rgb.fill(Math.round(255 * m[i]), 3 * i, 3 * i + 3);
    return encodePng(rgb, r, r);
  };
  input.images.forEach((p, i) => {
    for (const flip of s.flip ? [false, true] : [false]) {
      const name = fileName(i, p.name, flip ? '-flip' : '');
      const path = `instance_images/${name}`;
      files.push({ path, data: square(p, flip) });
      if (p.mask) files.push({ path: `masks/${name}`, data: maskPng(p, flip) });
      prompts.push({ file: path, prompt: p.caption?.trim() || input.prompt, ...(p.mask ? { mask: `masks/${name}` } : {}) });
    }
  });
  const classes = s.priorPreservation ? input.classImages : [];
  classes.forEach((p, i) => files.push({ path: `class_images/${fileName(i, p.name)}`, data: square(p, false) }));
  const mapping = mapSettings({
    ...input,
    instanceCount: prompts.length,
    classCount: classes.length,
    captions: input.images.filter((p) => p.caption?.trim()).length,
    masks: input.images.filter((p) => p.mask).length,
  });
  const ref = modelReference(input.model);
  const job = {
    version: 1,
    made_by: 'DreamBooth Studio',
    diffusers: DIFFUSERS_TARGET,
    script: scriptFor(s),
    model: { ...input.model, reference: ref.value, note: ref.note },
    instance_prompt: input.prompt,
    instance_data_dir: 'instance_images',
    ...(s.priorPreservation ? { class_data_dir: 'class_images', class_prompt: s.classPrompt, num_class_images: classes.length || s.classCount } : {}),
    settings: { ...s, alpha: s.mode === 'lora' ? s.alpha || s.rank : 0 },
    mapping,
  };
  files.push({ path: 'prompts.jsonl', data: prompts.map((p) => JSON.stringify(p)).join('\n') + '\n' });
  files.push({ path: 'job.json', data: JSON.stringify(job, null, 2) + '\n' });
  files.push({ path: 'train.sh', data: trainScript({ ...input, mapping }), executable: true });
  files.push({ path: 'ray_train.py', data: RAY_TRAIN_PY });
  files.push({
    path: 'requirements.txt',
    data:
      [
        `diffusers==${DIFFUSERS_TARGET.version}`,
        'accelerate>=0.31.0',
        'transformers>=4.41.2',
        'peft>=0.11.1',
        'torch',
        'torchvision',
        'ftfy',
        'tensorboard',
        'Jinja2',
        'safetensors',
        'ray[train]>=2.10',
      ].join('\n') + '\n',
  });
  files.push({ path: 'README.md', data: readme(input, mapping, { instance: prompts.length, classes: classes.length }) });
  files.push(...sdScriptsFiles(input, classes.length));
  return files;
}
