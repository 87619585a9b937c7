// The job bundle's kohya sd-scripts target: `accelerate launch train_network.py` (LoRA, networks.lora) or
// `train_db.py` (full DreamBooth) with a dataset config, beside the diffusers one (bundle.ts) and over the
// same instance_images/ and class_images/:
//   sd-scripts.toml         [[datasets]] with resolution and batch_size; [[datasets.subsets]] for the photos
//                           (image_dir, class_tokens = the instance prompt, num_repeats) and, with prior
//                           preservation and class images given, the regularisation subset (is_reg = true)
//   train-sd-scripts.sh     the launch, every value one shell word (quote.ts), only options those scripts parse
//   README-sd-scripts.md    how to run it, and each setting: its option, or that it is not carried and why
// Each setting's sd-scripts counterpart is its schema entry's `sdScripts` row (pipeline/settings*.ts); an entry
// without one is listed as not carried, so a setting added to the schema is never silently dropped.
// TOML strings are basic strings with every character TOML forbids or interprets escaped (tomlString).
import type { BundleFile, BundleInput } from './bundle.ts';
import { SCRIPT_HEAD, shellComment, shellQuote } from './quote.ts';
import { sdScriptOf as scriptOf } from './sdscripts-row.ts';
import { SETTINGS, type RunSettings } from './settings.ts';

/** The sd-scripts release the options were checked against. */
export const SD_SCRIPTS_TARGET = 'v0.10.1';

const q = (s: string) => shellQuote(s, 'a value for train-sd-scripts.sh');

/** A TOML basic string: '"' and '\' escaped, control characters (and DEL) as \uXXXX, everything else as is. */
export function tomlString(s: string): string {
  // eslint-disable-next-line no-control-regex
  return `"${s.replace(/[\\"\u0000-\u001f\u007f]/g, (c) => (c === '\\' || c === '"' ? `\\${c}` : `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`))}"`;
}

export interface SdScriptsRow {
  setting: string;
  value: unknown;
  option: string | null;
  note?: string;
}

/** Every setting of the schema: its sd-scripts option, or listed as not carried and why. */
export function sdScriptsMapping(s: RunSettings): SdScriptsRow[] {
  const rows: SdScriptsRow[] = [];
  const seen = new Set<string>();
  for (const spec of SETTINGS) {
    if (seen.has(spec.key)) continue;
    seen.add(spec.key);
    const value = s[spec.key];
    if (spec.onlyMode && spec.onlyMode !== s.mode) {
      rows.push({ setting: spec.key, value, option: null, note: `not used: ${spec.onlyMode === 'lora' ? 'LoRA' : 'full'} runs only` });
      continue;
    }
    const row = spec.sdScripts?.(s) ?? null;
    if (row) rows.push({ setting: spec.key, value: 'value' in row ? row.value : value, option: row.option, ...(row.note ? { note: row.note } : {}) });
    else rows.push({ setting: spec.key, value, option: null, note: `not carried: no counterpart in sd-scripts' ${scriptOf(s)} (${spec.help})` });
  }
  return rows;
}

/** The dataset config: one DreamBooth dataset, the photos' subset and the class images' (is_reg) when given. */
export function sdScriptsToml(prompt: string, s: RunSettings, classImages: number): string {
  const lines = [
    '# kohya sd-scripts dataset config (--dataset_config) written by DreamBooth Studio',
    '[general]',
    'enable_bucket = false',
    '',
    '[[datasets]]',
    `resolution = ${s.resolution}`,
    'batch_size = 1',
    '',
    '  [[datasets.subsets]]',
    `  image_dir = ${tomlString('instance_images')}`,
    `  class_tokens = ${tomlString(prompt)}`,
    '  num_repeats = 1',
    // Caption dropout and tag shuffling act on the photos, not the class images (train/captions.ts).
    ...(s.captionDropout > 0 ? [`  caption_dropout_rate = ${s.captionDropout}`] : []),
    ...(s.shuffleTags ? ['  shuffle_caption = true', `  keep_tokens = ${s.keepTokens}`] : []),
  ];
  if (s.priorPreservation && classImages > 0)
    lines.push(
      '',
      '  [[datasets.subsets]]',
      '  is_reg = true',
      `  image_dir = ${tomlString('class_images')}`,
      `  class_tokens = ${tomlString(s.classPrompt)}`,
      '  num_repeats = 1',
    );
  return lines.join('\n') + '\n';
}

function launch(input: BundleInput, rows: SdScriptsRow[]): string {
  const s = input.settings;
  const lora = s.mode === 'lora';
  const model = input.model.hubId
    ? `if [ -z "\${MODEL:-}" ]; then MODEL=${q(input.model.hubId)}; fi`
    : `if [ -z "\${MODEL:-}" ]; then printf '%s\\n' ${q(`set MODEL first: the Hub repo id, diffusers folder or .safetensors checkpoint of "${input.model.name}" (sd-scripts loads all three)`)} >&2; exit 2; fi`;
  const options = [
    '--pretrained_model_name_or_path="$MODEL"',
    '--dataset_config=sd-scripts.toml',
    '--output_dir=output-sd-scripts',
    `--output_name=${q(lora ? 'dreambooth-lora' : 'dreambooth')}`,
    '--save_model_as=safetensors',
    // A LyCORIS run's network row gives LyCORIS' module and its --network_args (settings-network.ts lycorisArgs).
    ...(lora && !rows.some((r) => r.setting === 'network' && r.option) ? ['--network_module=networks.lora'] : []),
    '--mixed_precision=fp16',
    // The optimizer row gives Prodigy's or Adafactor's --optimizer_type and --optimizer_args.
    ...(rows.some((r) => r.setting === 'optimizer' && r.option) ? [] : ['--optimizer_type=AdamW']),
    '--max_grad_norm=1.0',
    '--gradient_checkpointing',
    ...rows.map((r) => r.option).filter((o): o is string => o !== null),
  ];
  return [
    ...SCRIPT_HEAD,
    `# DreamBooth Studio job for kohya sd-scripts ${SD_SCRIPTS_TARGET}: ${lora ? 'LoRA' : 'full'} DreamBooth of ${shellComment(input.prompt)}`,
    '# SD 2.x: pass --v2 (and --v_parameterization for 768-v models) as extra arguments, e.g. ./train-sd-scripts.sh --v2',
    'set -euo pipefail',
    'cd "$(dirname "$0")"',
    model,
    'SD_SCRIPTS="${SD_SCRIPTS:-sd-scripts}"',
    `accelerate launch "$SD_SCRIPTS/${scriptOf(s)}" \\`,
    ...options.map((o) => `  ${o} \\`),
    '  "$@"',
    '',
  ].join('\n');
}

function readme(input: BundleInput, rows: SdScriptsRow[], classImages: number): string {
  const s = input.settings;
  const cell = (v: unknown) => shellComment(JSON.stringify(v) ?? '').replace(/\|/g, '\\|');
  const lines = [
    `# kohya sd-scripts target (${SD_SCRIPTS_TARGET})`,
    '',
    `\`./train-sd-scripts.sh\` runs \`accelerate launch train_network.py\` (LoRA) or \`train_db.py\` (full) from a checkout of`,
    'kohya-ss/sd-scripts (set SD_SCRIPTS to its folder) on instance_images/ and class_images/ as sd-scripts.toml describes.',
    'Each photo trains with the instance prompt as its class_tokens (per-photo captions are in prompts.jsonl only).',
    ...(s.priorPreservation && classImages === 0
      ? [
          '',
          'Prior preservation is on but no class images were given: sd-scripts does not generate them. Put class images in class_images/ and add an `is_reg = true` subset to sd-scripts.toml.',
        ]
      : []),
    '',
    '| setting | value | sd-scripts option | note |',
    '| --- | --- | --- | --- |',
    ...rows.map(
      (r) => `| ${r.setting} | ${cell(r.value)} | ${r.option ? `\`${r.option.replace(/\|/g, '\\|')}\`` : 'not carried'} | ${cell(r.note ?? '').slice(1, -1)} |`,
    ),
    '',
  ];
  return lines.join('\n');
}

/** The sd-scripts target's files for a bundle with `classImages` class images in class_images/. */
export function sdScriptsFiles(input: BundleInput, classImages: number): BundleFile[] {
  const rows = sdScriptsMapping(input.settings);
  return [
    { path: 'sd-scripts.toml', data: sdScriptsToml(input.prompt, input.settings, classImages) },
    { path: 'train-sd-scripts.sh', data: launch(input, rows), executable: true },
    { path: 'README-sd-scripts.md', data: readme(input, rows, classImages) },
  ];
}
