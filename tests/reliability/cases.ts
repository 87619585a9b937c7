// The bad-input corpus: what a hostile new user tried on the command line, and what each must now get. Each
// row says how the case went before the corpus (`before`: clear, wrong = a silently wrong result, unclear = an
// internal message, hung) and what it must say now; tests/reliability/corpus.test.ts runs every row through
// the real command line (harness.ts checks the code, the message, that no internal wording leaks, the time
// limit, and that nothing changed on disk where a row says so).
import { chmodSync, copyFileSync, cpSync, mkdirSync, readFileSync, symlinkSync, writeFileSync } from 'node:fs';
import { readSafetensors, writeSafetensors } from '../../src/io/safetensors.ts';
import { join } from 'node:path';
import { FIXTURES } from '../helpers.ts';
import { trainArgs, type Case, type Workspace } from './harness.ts';

/** The tiny model `npm run lab:pretrain` made (tests/fixtures/models/make-pretrained-tiny.sh): the pretraining rows' model to start from. */
const PRETRAINED_TINY = join(FIXTURES, 'models', 'pretrained-tiny');

const train = (ws: Workspace, ...extra: string[]) => [...trainArgs(ws, ws.path('out')), ...extra];
/** trainArgs with one flag's value replaced. */
function withFlag(ws: Workspace, flag: string, value: string | null): string[] {
  const a = trainArgs(ws, ws.path('out'));
  const i = a.indexOf(flag);
  if (i >= 0) a.splice(i, 2);
  return value === null ? [...a, flag] : [...a, flag, value];
}
const sample = (ws: Workspace, ...extra: string[]) => [
  'sample',
  '--model',
  ws.tiny.folder,
  '--prompt',
  'a photo of a dog',
  '--width',
  '32',
  '--height',
  '32',
  '--steps',
  '1',
  '--out',
  ws.path('img') + '.png',
  ...extra,
];
const NO_STEP = /^step /m;

export const CASES: Case[] = [
  // ---- flags: strict, checked before any work ----------------------------------------------------------
  {
    name: 'a typo of a flag (--step)',
    before: 'wrong',
    args: (ws) => withFlag(ws, '--step', '2'),
    code: 1,
    message: /unknown option --step \(did you mean --steps\?\)/,
    notOut: NO_STEP,
  },
  { name: 'an unknown flag (--bogus)', before: 'wrong', args: (ws) => train(ws, '--bogus', '3'), code: 1, message: /unknown option --bogus/, notOut: NO_STEP },
  { name: 'a flag given twice', before: 'wrong', args: (ws) => train(ws, '--steps', '1', '--steps', '2'), code: 1, message: /--steps is given twice/ },
  { name: 'a flag without its value', before: 'wrong', args: (ws) => [...trainArgs(ws, ws.path('out')), '--steps'], code: 1, message: /--steps needs a value/ },
  { name: 'a stray word', before: 'clear', args: (ws) => [...trainArgs(ws, ws.path('out')), 'extra'], code: 1, message: /unexpected argument "extra"/ },
  {
    name: 'a single-dash flag',
    before: 'clear',
    args: (ws) => train(ws, '-steps', '2'),
    code: 1,
    message: /unknown option -steps: options are written --name \(did you mean --steps\?\)/,
  },
  { name: 'steps 0', before: 'wrong', args: (ws) => withFlag(ws, '--steps', '0'), code: 1, message: /--steps must be from 1 to 1000000, got 0/ },
  { name: 'steps -3', before: 'wrong', args: (ws) => withFlag(ws, '--steps', '-3'), code: 1, message: /--steps must be from 1 to 1000000, got -3/ },
  { name: 'steps 2.5', before: 'wrong', args: (ws) => withFlag(ws, '--steps', '2.5'), code: 1, message: /--steps must be a whole number, got 2.5/ },
  { name: 'steps "ten"', before: 'clear', args: (ws) => withFlag(ws, '--steps', 'ten'), code: 1, message: /--steps must be a number, got "ten"/ },
  {
    name: 'lr 1e30',
    before: 'wrong',
    args: (ws) => withFlag(ws, '--lr', '1e30'),
    code: 1,
    message: /--lr must be greater than 0 and at most 1, got 1e\+30/,
    notOut: NO_STEP,
  },
  { name: 'lr 0', before: 'wrong', args: (ws) => withFlag(ws, '--lr', '0'), code: 1, message: /--lr must be greater than 0/ },
  { name: 'lr -1e-4', before: 'clear', args: (ws) => withFlag(ws, '--lr', '-1e-4'), code: 1, message: /--lr must be greater than 0/ },
  { name: 'lr NaN', before: 'clear', args: (ws) => withFlag(ws, '--lr', 'NaN'), code: 1, message: /--lr must be a number, got "NaN"/ },
  { name: 'lr Infinity', before: 'clear', args: (ws) => withFlag(ws, '--lr', 'Infinity'), code: 1, message: /--lr must be a number, got "Infinity"/ },
  // ---- issue 46 item 5: --help, decimal numbers, flags that would do nothing (one block) ----------------
  {
    name: 'cli --help lists every command',
    before: 'unclear',
    args: () => ['--help'],
    code: 0,
    message: /^(?![\s\S]*error:)/,
    out: /usage: npm run cli -- <command>[\s\S]*npm run lab:pretrain -- --help[\s\S]*usage: inspect[\s\S]*usage: sample[\s\S]*usage: train/,
  },
  {
    name: "train --help describes each setting's flag with its default and range (from the schema)",
    before: 'unclear',
    args: () => ['train', '--help'],
    code: 0,
    message: /^(?![\s\S]*error:)/,
    out: /^(?=[\s\S]*--rank <n>\n\s+LoRA rank .*\[default 8 \(lora\), 0 \(full\); whole, from 1 to 1024; --mode lora only\])(?=[\s\S]*--lr-warmup <n>\n\s+linear warm-up .*\[default 0; whole, from 0 to 1000000 steps\])/,
  },
  {
    name: 'train -h among other flags',
    before: 'unclear',
    args: (ws) => train(ws, '-h'),
    code: 0,
    message: /^(?![\s\S]*error:)/,
    out: /^usage: train/,
    notOut: NO_STEP,
  },
  ...['inspect', 'run', 'grad', 'sample', 'grid', 'export', 'lab:pretrain'].map((command): Case => ({
    name: `${command} --help`,
    before: 'unclear',
    args: () => [command, '--help'],
    code: 0,
    message: /^(?![\s\S]*error:)/,
    out: new RegExp(`^usage: ${command.replace('lab:', '')} `),
  })),
  {
    name: "cli pretrain (the demo-model lab's command, not the product's)",
    before: 'clear',
    args: (ws) => ['pretrain', '--out', ws.path('pt')],
    code: 1,
    message: /pretrain is the demo-model lab's command, not the product's: npm run lab:pretrain -- --help \(lab\/demo-model\/README\.md\)/,
    setup: (ws) => ({ absent: [ws.path('pt')] }),
  },
  {
    name: 'steps 0x10 (hexadecimal)',
    before: 'wrong',
    args: (ws) => withFlag(ws, '--steps', '0x10'),
    code: 1,
    message: /--steps must be a number written in decimal digits, got "0x10"/,
    notOut: NO_STEP,
  },
  {
    name: 'seed 1e3 (an exponent for a whole number)',
    before: 'wrong',
    args: (ws) => withFlag(ws, '--seed', '1e3'),
    code: 1,
    message: /--seed must be a whole number written in decimal digits \(e\.g\. 1000\), got "1e3"/,
  },
  {
    name: 'lr 0x1',
    before: 'wrong',
    args: (ws) => withFlag(ws, '--lr', '0x1'),
    code: 1,
    message: /--lr must be a number written in decimal digits, got "0x1"/,
  },
  {
    name: 'sample --seed 0b11 (binary)',
    before: 'wrong',
    args: (ws) => sample(ws, '--seed', '0b11'),
    code: 1,
    message: /--seed must be a number written in decimal digits, got "0b11"/,
  },
  {
    name: '--sample-steps without --sample-every',
    before: 'wrong',
    args: (ws) => train(ws, '--sample-steps', '5'),
    code: 1,
    message: /--sample-steps does nothing without --sample-every N \(samples are drawn only then\): add --sample-every, or leave it out/,
    notOut: NO_STEP,
  },
  {
    name: '--sample-prompt without --sample-every',
    before: 'wrong',
    args: (ws) => train(ws, '--sample-prompt', 'a dog'),
    code: 1,
    message: /--sample-prompt does nothing without --sample-every N/,
  },
  {
    name: '--prior-weight without --class-prompt',
    before: 'wrong',
    args: (ws) => train(ws, '--prior-weight', '2'),
    code: 1,
    message: /--prior-weight weighs the prior loss of prior preservation: add --class-prompt, or leave it out/,
  },
  {
    name: '--class-steps without --class-prompt',
    before: 'wrong',
    args: (ws) => train(ws, '--class-steps', '5'),
    code: 1,
    message: /--class-steps is for class images of prior preservation: add --class-prompt, or leave it out/,
  },
  {
    name: '--lr-power without --lr-scheduler polynomial',
    before: 'clear',
    args: (ws) => train(ws, '--lr-scheduler', 'cosine', '--lr-power', '2'),
    code: 1,
    message: /--lr-power is for --lr-scheduler polynomial only/,
  },
  {
    name: '--lr-cycles without --lr-scheduler cosine_with_restarts',
    before: 'clear',
    args: (ws) => train(ws, '--lr-cycles', '3'),
    code: 1,
    message: /--lr-cycles is for --lr-scheduler cosine_with_restarts only/,
  },
  {
    name: 'a warm-up longer than the run',
    before: 'clear',
    args: (ws) => train(ws, '--steps', '10', '--lr-warmup', '50'),
    code: 1,
    message: /--lr-warmup 50 is longer than the run \(--steps 10\): use at most 10/,
  },
  {
    name: 'polynomial schedule with a rate below its end rate',
    before: 'clear',
    args: (ws) => withFlag(ws, '--lr', '1e-8').concat('--lr-scheduler', 'polynomial'),
    code: 1,
    message: /--lr-scheduler polynomial decays to 1e-7: --lr must be above it \(got 1e-8\)/,
  },
  {
    name: 'an unknown schedule',
    before: 'clear',
    args: (ws) => train(ws, '--lr-scheduler', 'step'),
    code: 1,
    message: /--lr-scheduler must be constant or .* or polynomial, got "step"/,
  },
  // ---- the trainer's knobs (settings-knobs.ts): each refusal names the flag and the fix, before any work ----
  ...(
    [
      ['--ema-decay without --ema', ['--ema-decay', '0.99'], /--ema-decay sets the EMA of the trained weights: add --ema, or leave this out/],
      ['--ema-decay 1.5', ['--ema', '--ema-decay', '1.5'], /--ema-decay must be from 0 to 0\.999999, got 1\.5/],
      [
        '--ema-min-decay above --ema-decay',
        ['--ema', '--ema-decay', '0.9', '--ema-min-decay', '0.95'],
        /--ema-min-decay 0\.95 is above --ema-decay 0\.9: use at most the decay/,
      ],
      ['--export-ema without --ema', ['--export-ema'], /--export-ema exports the EMA: turn on --ema too/],
      ['--ema-power without --ema-warmup', ['--ema', '--ema-power', '0.5'], /--ema-power is the EMA warm-up's: add --ema --ema-warmup, or leave this out/],
      ["Prodigy's --prodigy-d-coef with AdamW", ['--prodigy-d-coef', '2'], /--prodigy-d-coef is for --optimizer prodigy only: add it, or leave this out/],
      ['--prodigy-d-coef 0', ['--optimizer', 'prodigy', '--prodigy-d-coef', '0'], /--prodigy-d-coef must be from 0\.01 to 100, got 0/],
      [
        'Adafactor with its relative step and a warm-up',
        ['--optimizer', 'adafactor', '--adafactor-relative-step', 'on', '--lr-warmup', '1'],
        /--optimizer adafactor with its relative step does not read the learning rate, so --lr-warmup would do nothing: set --adafactor-relative-step off, or leave the schedule out/,
      ],
      [
        '--adafactor-warmup-init without the relative step',
        ['--optimizer', 'adafactor', '--adafactor-relative-step', 'off', '--adafactor-warmup-init'],
        /--adafactor-warmup-init is for --optimizer adafactor with its relative step: add those, or leave this out/,
      ],
      ['an unknown --optimizer', ['--optimizer', 'lion'], /--optimizer must be adamw or adamw8bit or prodigy or adafactor, got "lion"/],
      ['--min-timestep above --max-timestep', ['--min-timestep', '500', '--max-timestep', '400'], /--min-timestep 500 must be below --max-timestep 400/],
      ['--max-timestep 5000', ['--max-timestep', '5000'], /--max-timestep must be from 1 to 1000, got 5000/],
      [
        'multires noise with offset noise',
        ['--multires-noise-iterations', '6', '--offset-noise', '0.05'],
        /--multires-noise-iterations and --offset-noise both reshape the noise .*: set one of them to 0/,
      ],
      [
        '--multires-noise-discount without iterations',
        ['--multires-noise-discount', '0.5'],
        /--multires-noise-discount is for multires noise: add --multires-noise-iterations N, or leave this out/,
      ],
      ['--ip-noise-gamma 5', ['--ip-noise-gamma', '5'], /--ip-noise-gamma must be from 0 to 1, got 5/],
      ['an unknown --loss', ['--loss', 'l3'], /--loss must be l2 or huber or smooth_l1, got "l3"/],
      ['--caption-dropout 1 (every step uncaptioned)', ['--caption-dropout', '1'], /--caption-dropout must be from 0 to 0\.99, got 1/],
      [
        '--keep-tokens without --shuffle-tags',
        ['--keep-tokens', '1'],
        /--keep-tokens keeps tags in place while they are shuffled: add --shuffle-tags, or leave this out/,
      ],
    ] as const
  ).map(([what, flags, message]): Case => ({
    name: `trainer knob: ${what}`,
    before: 'clear',
    args: (ws) => train(ws, ...flags),
    code: 1,
    message,
    notOut: NO_STEP,
  })),
  {
    // Trained into a WebGPU validation error before: LyCORIS adds its delta into the int8 weight's buffer.
    name: 'int8 base weights under a LyCORIS network',
    before: 'wrong',
    args: (ws) => train(ws, '--network', 'loha', '--base-weights', 'int8'),
    code: 1,
    message: /--base-weights int8 cannot hold the weights --network loha adds its delta to: use --base-weights f16 or auto, or --network lora/,
    notOut: NO_STEP,
  },
  // ---- end of the issue 46 item 5 block ------------------------------------------------------------------
  { name: 'rank 100000', before: 'unclear', args: (ws) => withFlag(ws, '--rank', '100000'), code: 1, message: /--rank must be from 1 to 1024, got 100000/ },
  {
    name: "rank wider than the model's layers",
    before: 'unclear',
    args: (ws) => withFlag(ws, '--rank', '100'),
    code: 1,
    message: /--rank 100 is larger than this model's narrowest adapted layer \(\d+ wide\): use 1 to \d+/,
    notOut: NO_STEP,
  },
  { name: 'rank 0', before: 'clear', args: (ws) => withFlag(ws, '--rank', '0'), code: 1, message: /--rank must be from 1/ },
  {
    name: 'resolution 100000',
    before: 'unclear',
    args: (ws) => withFlag(ws, '--resolution', '100000'),
    code: 1,
    message: /--resolution must be from 8 to 1024, got 100000/,
  },
  {
    name: "resolution not a multiple of the model's factor",
    before: 'unclear',
    args: (ws) => withFlag(ws, '--resolution', '30'),
    code: 1,
    message: /--resolution 30 does not suit this model: use a multiple of 4 \(e\.g\. 28 or 32\)/,
  },
  { name: 'seed -1', before: 'wrong', args: (ws) => withFlag(ws, '--seed', '-1'), code: 1, message: /--seed must be from 0/ },
  { name: 'budget "4XB"', before: 'clear', args: (ws) => train(ws, '--budget', '4XB'), code: 1, message: /--budget: cannot read "4XB" as a size/ },
  {
    name: 'budget 4096 (bytes: a typo of 4GiB)',
    before: 'clear',
    args: (ws) => train(ws, '--budget', '4096'),
    code: 1,
    message: /--budget must be from 1\.0 MiB to .*, got 4\.0 KiB/,
  },
  { name: 'mode dora', before: 'clear', args: (ws) => withFlag(ws, '--mode', 'dora'), code: 1, message: /--mode must be lora or full, got "dora"/ },
  { name: 'LoRA rank with a full run', before: 'wrong', args: (ws) => withFlag(ws, '--mode', 'full'), code: 1, message: /--rank applies to --mode lora only/ },
  {
    // Prodigy's and Adafactor's updates run on the host over every master in memory; full fine-tuning's chunked optimizer is AdamW's.
    name: 'Prodigy with a full run',
    before: 'wrong',
    args: (ws) => [...withFlag(ws, '--mode', 'full').filter((a, i, all) => a !== '--rank' && all[i - 1] !== '--rank'), '--optimizer', 'prodigy'],
    code: 1,
    message: /--optimizer prodigy is for LoRA runs: .*full fine-tuning's chunked GPU optimizer is AdamW's only: use adamw or adamw8bit for --mode full/,
  },
  {
    name: 'text-encoder LoRA with a full run',
    before: 'clear',
    args: (ws) => [
      'train',
      '--model',
      ws.tiny.folder,
      '--images',
      ws.images,
      '--prompt',
      'x',
      '--mode',
      'full',
      '--train-text-encoder',
      '--out',
      ws.path('out'),
    ],
    code: 1,
    message: /--train-text-encoder applies to --mode lora only/,
  },
  {
    name: 'a text-encoder learning rate without text-encoder LoRA',
    before: 'clear',
    args: (ws) => train(ws, '--text-encoder-lr', '1e-5'),
    code: 1,
    message: /--text-encoder-lr sets the learning rate of the text-encoder LoRA: add --train-text-encoder, or leave it out/,
  },
  {
    name: 'text-encoder learning rate 2',
    before: 'clear',
    args: (ws) => train(ws, '--train-text-encoder', '--text-encoder-lr', '2'),
    code: 1,
    message: /--text-encoder-lr must be from 0 to 1, got 2/,
  },
  { name: 'offset noise 5', before: 'wrong', args: (ws) => train(ws, '--offset-noise', '5'), code: 1, message: /--offset-noise must be from 0 to 1, got 5/ },
  { name: 'prior weight -1', before: 'wrong', args: (ws) => train(ws, '--prior-weight', '-1'), code: 1, message: /--prior-weight must be from 0 to 100/ },
  {
    name: 'class images without a class prompt',
    before: 'clear',
    args: (ws) => train(ws, '--class-images', '2'),
    code: 1,
    message: /--class-images needs --class-prompt/,
  },
  {
    name: 'an empty class prompt',
    before: 'clear',
    args: (ws) => train(ws, '--class-prompt', ' '),
    code: 1,
    message: /prior preservation needs a class prompt \(--class-prompt/,
  },
  { name: 'an empty prompt', before: 'wrong', args: (ws) => withFlag(ws, '--prompt', ''), code: 1, message: /--prompt is empty/ },
  { name: 'an unknown export format', before: 'clear', args: (ws) => train(ws, '--export', 'ckpt'), code: 1, message: /--export: unknown format "ckpt"/ },
  {
    name: 'a LoRA export from a full run',
    before: 'clear',
    args: (ws) => [
      'train',
      '--model',
      ws.tiny.folder,
      '--images',
      ws.images,
      '--prompt',
      'x',
      '--mode',
      'full',
      '--export',
      'lora-kohya',
      '--out',
      ws.path('out'),
    ],
    code: 1,
    message: /--export lora-kohya holds LoRA adapters/,
  },
  {
    name: 'missing required flags',
    before: 'clear',
    args: () => ['train', '--steps', '2'],
    code: 1,
    message: /train needs --model, --images, --prompt, --out/,
  },
  {
    name: 'a model path that does not exist',
    before: 'clear',
    args: (ws) => withFlag(ws, '--model', join(ws.dir, 'nope')),
    code: 1,
    message: /--model .*nope: no such file or folder/,
  },
  {
    name: 'an images folder that does not exist',
    before: 'clear',
    args: (ws) => withFlag(ws, '--images', join(ws.dir, 'nope')),
    code: 1,
    message: /--images .*nope is not a folder of images: no such folder/,
  },
  {
    name: 'an image file given as the images folder',
    before: 'clear',
    args: (ws) => withFlag(ws, '--images', join(ws.images, 'rgba.png')),
    code: 1,
    message: /not a folder of images/,
  },
  {
    name: 'a folder with no usable images',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /notes\.jpg[\s\S]*add at least one image/,
    setup: (ws) => {
      const empty = ws.path('empty');
      mkdirSync(empty);
      writeFileSync(join(empty, 'notes.jpg'), 'this is text, not a photo');
      return { args: withFlag(ws, '--images', empty) };
    },
  },
  {
    name: 'a budget the run cannot fit',
    before: 'clear',
    args: (ws) => [
      'train',
      '--model',
      ws.tiny.folder,
      '--images',
      ws.images,
      '--prompt',
      'x',
      '--mode',
      'full',
      '--steps',
      '1',
      '--resolution',
      '32',
      '--budget',
      '2MiB',
      '--out',
      ws.path('out'),
    ],
    code: 1,
    message: /needs at least [\d.]+ MiB of GPU memory at 32 px; the budget is 2\.00 MiB/,
    notOut: NO_STEP,
  },
  {
    name: 'a single file without --tokenizer',
    before: 'clear',
    args: (ws) => withFlag(ws, '--model', ws.tiny.singleFile),
    code: 1,
    message: /a single-file checkpoint carries no tokenizer: pass --tokenizer/,
  },
  {
    name: '--config that is not JSON',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /--config .*bad\.json: invalid JSON/,
    setup: (ws) => {
      const bad = join(ws.dir, 'bad.json');
      writeFileSync(bad, '{ "unet": { "attention_head_dim": 2, }');
      return { args: train(ws, '--config', bad) };
    },
  },
  {
    name: 'a prompt past 77 tokens',
    before: 'wrong',
    args: (ws) => withSample(ws, '--prompt', `a photo of ${'very '.repeat(80)}red dog`),
    code: 0,
    message: /warning: --prompt is \d+ tokens; the text encoder reads only the first 75, so ".*red dog" is cut/,
  },

  // ---- sample --------------------------------------------------------------------------------------------
  { name: 'sample --steps 0', before: 'wrong', args: (ws) => withSample(ws, '--steps', '0'), code: 1, message: /--steps must be from 1 to 1000, got 0/ },
  { name: 'sample --steps -3', before: 'wrong', args: (ws) => withSample(ws, '--steps', '-3'), code: 1, message: /--steps must be from 1 to 1000, got -3/ },
  {
    name: 'sample --width 30 (not a multiple of the factor)',
    before: 'unclear',
    args: (ws) => withSample(ws, '--width', '30'),
    code: 1,
    message: /--width must be a multiple of 4/,
  },
  { name: 'sample --height 0', before: 'unclear', args: (ws) => withSample(ws, '--height', '0'), code: 1, message: /--height must be from 8 to 2048, got 0/ },
  { name: 'sample --guidance nan', before: 'wrong', args: (ws) => withSample(ws, '--guidance', 'nan'), code: 1, message: /--guidance must be a number/ },
  {
    name: 'sample --sampler euler',
    before: 'clear',
    args: (ws) => sample(ws, '--sampler', 'euler'),
    code: 1,
    message: /--sampler must be ddim or dpm\+\+2m, got euler/,
  },
  {
    name: 'sample into a folder that does not exist',
    before: 'unclear',
    args: (ws) => withSample(ws, '--out', join(ws.dir, 'no', 'such', 'x.png')),
    code: 1,
    message: /--out .*x\.png: the folder .* does not exist/,
  },
  {
    name: 'sample with a typo (--seeds)',
    before: 'wrong',
    args: (ws) => sample(ws, '--seeds', '3'),
    code: 1,
    message: /unknown option --seeds \(did you mean --seed\?\)/,
  },

  // ---- run folders: one run per folder, one process per run ----------------------------------------------
  {
    name: 'train --out on a folder that holds another run',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /holds another run .* --resume .* --overwrite/,
    setup: (ws) => {
      const out = ws.trainedRun();
      return { args: trainArgs(ws, out).map((a) => (a === 'a photo of sks dog' ? 'a photo of zzx cat' : a)), unchanged: [out] };
    },
  },
  {
    name: '--overwrite on a folder that holds no run',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /--overwrite: .* holds no run to replace/,
    setup: (ws) => {
      const out = ws.path('plain');
      mkdirSync(out);
      writeFileSync(join(out, 'notes.txt'), 'mine');
      return { args: [...trainArgs(ws, out), '--overwrite'], unchanged: [out] };
    },
  },
  {
    name: 'two processes on one run (the lock)',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /is in use: process \d+ is training in it/,
    setup: (ws) => {
      const out = ws.path('locked');
      mkdirSync(out);
      copyFileSync(join(ws.trainedRun(), 'run.json'), join(out, 'run.json'));
      writeFileSync(join(out, 'lock'), String(process.pid)); // this test process is alive
      return { args: ['train', '--resume', out], unchanged: [out] };
    },
  },
  {
    name: '--resume with a setting that cannot change',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--lr cannot be given with --resume/,
    setup: (ws) => {
      const out = ws.trainedRun();
      return { args: ['train', '--resume', out, '--lr', '1e-2'], unchanged: [out] };
    },
  },
  {
    name: '--resume with fewer steps than done',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /checkpoint is at step 2, past the 1 steps asked for/,
    setup: (ws) => {
      const out = ws.trainedRun();
      return { args: ['train', '--resume', out, '--steps', '1'], unchanged: [join(out, 'run.json'), join(out, 'lora-kohya.safetensors')] };
    },
  },
  {
    name: '--resume with more steps extends the run from its checkpoint',
    before: 'wrong',
    args: () => [],
    code: 0,
    message: /--steps: the run had 2 steps; it now runs to step 3[\s\S]*resumed at step 2/,
    setup: (ws) => {
      const out = ws.path('extended');
      cpSync(ws.trainedRun(), out, { recursive: true });
      return { args: ['train', '--resume', out, '--steps', '3'] };
    },
    out: /^step 3\/3 [\s\S]*"done":true,"steps":3/m,
  },
  { name: '--resume on a folder that is not a run', before: 'clear', args: (ws) => ['train', '--resume', ws.images], code: 1, message: /no run\.json there/ },
  {
    name: '--resume with a damaged run.json',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /run\.json: invalid JSON/,
    setup: (ws) => {
      const out = ws.path('damaged');
      mkdirSync(out);
      writeFileSync(join(out, 'run.json'), '{"version": 2, "inputs": ');
      return { args: ['train', '--resume', out], unchanged: [out] };
    },
  },
  {
    name: '--resume with impossible settings in run.json',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /run\.json: settings\.steps must be from 1/,
    setup: (ws) => {
      const out = ws.path('tampered');
      mkdirSync(out);
      const run = JSON.parse(readFileSync(join(ws.trainedRun(), 'run.json'), 'utf8'));
      run.settings.steps = -5;
      writeFileSync(join(out, 'run.json'), JSON.stringify(run));
      return { args: ['train', '--resume', out], unchanged: [out] };
    },
  },
  {
    name: '--resume when the model moved',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /model .* is gone: pass --model <its new path> with --resume/,
    setup: (ws) => {
      const out = ws.path('moved');
      mkdirSync(out);
      const run = JSON.parse(readFileSync(join(ws.trainedRun(), 'run.json'), 'utf8'));
      run.inputs.model = join(ws.dir, 'moved-away');
      writeFileSync(join(out, 'run.json'), JSON.stringify(run));
      return { args: ['train', '--resume', out], unchanged: [out] };
    },
  },

  // ---- models and configs ------------------------------------------------------------------------------
  {
    name: 'train on a model with NaN weights',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /unet tensor down_blocks\.\d+\.resnets\.\d+\.conv1\.weight .*holds 1 non-finite value/,
    notOut: /^step |"done"/m,
    setup: (ws) => {
      const out = ws.path('out');
      return { args: withFlag(ws, '--model', modelCopy(ws, poisonUnet)).map((a, i, all) => (all[i - 1] === '--out' ? out : a)), unchanged: [] };
    },
  },
  {
    name: 'run a model with NaN weights',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /holds 1 non-finite value \(NaN\/Inf\)/,
    setup: (ws) => ({ args: withSample(ws, '--model', modelCopy(ws, poisonUnet)) }),
  },
  {
    name: "heads that do not divide the text encoder's width",
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /text_encoder: hidden_size 32 is not divisible by num_attention_heads 12/,
    setup: (ws) => ({ args: withConfig(ws, 'text_encoder', 'num_attention_heads', 12) }),
  },
  {
    name: 'a null field in a config',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /unet\/config\.json: attention_head_dim is null/,
    setup: (ws) => ({ args: withConfig(ws, 'unet', 'attention_head_dim', null) }),
  },
  {
    name: 'zero norm groups',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /vae\/config\.json: norm_num_groups is 0/,
    setup: (ws) => ({ args: withConfig(ws, 'vae', 'norm_num_groups', 0) }),
  },
  {
    name: 'a config that is not JSON inside the model folder',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /unet\/config\.json: invalid JSON/,
    setup: (ws) => ({
      args: withFlag(
        ws,
        '--model',
        modelCopy(ws, (f) => writeFileSync(join(f, 'unet', 'config.json'), '{"block_out_channels": [16, 32],')),
      ),
    }),
  },
  {
    name: 'a single file whose widths need configs it was not given',
    before: 'unclear',
    args: (ws) => withSample(ws, '--model', ws.tiny.singleFile).concat('--tokenizer', ws.tokenizer),
    code: 1,
    message: /a single file holds no configs.*pass --config/s,
  },
  {
    name: 'a safetensors header naming a tensor twice',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /names tensor 'a' twice/,
    setup: (ws) => {
      const file = ws.path('dup') + '.safetensors';
      const header = new TextEncoder().encode('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}');
      const bytes = new Uint8Array(8 + header.length + 4);
      new DataView(bytes.buffer).setBigUint64(0, BigInt(header.length), true);
      bytes.set(header, 8);
      writeFileSync(file, bytes);
      return { args: ['inspect', file] };
    },
  },
  {
    name: 'inspect a model the loader would refuse (a tensor missing): the report, and exit 1',
    before: 'wrong',
    args: () => [],
    code: 1,
    message:
      /: the loader would refuse this model: one problem, listed under "problems" in the report \(first: vae tensor decoder\.conv_out\.bias is missing\)/,
    setup: (ws) => {
      const folder = modelCopy(ws, (f) => {
        const file = join(f, 'vae', 'diffusion_pytorch_model.safetensors');
        const st = readSafetensors(new Uint8Array(readFileSync(file)));
        st.tensors.delete('decoder.conv_out.bias');
        writeFileSync(file, writeSafetensors(st.tensors));
      });
      return { args: ['inspect', folder] };
    },
    out: /"problems": \[\s*"vae tensor decoder\.conv_out\.bias is missing"/,
  },
  {
    name: 'a pickle checkpoint (.ckpt) is never unpickled',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /pickle|\.ckpt/i,
    setup: (ws) => {
      const file = ws.path('model') + '.ckpt';
      writeFileSync(file, Buffer.from([0x80, 0x02, 0x63, 0x6f, 0x73, 0x0a, 0x73, 0x79, 0x73, 0x74, 0x65, 0x6d, 0x0a]));
      return { args: ['inspect', file] };
    },
  },

  // ---- files -----------------------------------------------------------------------------------------------
  {
    name: 'a file given as --out',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /--out .* is a file: give a folder for the run/,
    setup: (ws) => {
      const file = ws.path('a-file');
      writeFileSync(file, 'x');
      chmodSync(file, 0o444);
      return { args: trainArgs(ws, file), unchanged: [file] };
    },
  },
  {
    name: '--out inside a file (a path that cannot be a folder)',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /--out .*: cannot create the run folder \(a file stands where a folder of its path should be\)/,
    setup: (ws) => {
      const file = ws.path('plain-file');
      writeFileSync(file, 'x');
      return { args: trainArgs(ws, join(file, 'run')), unchanged: [file] };
    },
  },
  {
    // The folder's only photo is a link: were links skipped, the run would stop at "add at least one image";
    // followed, it is encoded, and the tiny budget then stops the run at planning (no training needed).
    name: 'a symlinked photo is followed',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /Encoding with the VAE and the text encoder: image 1 of 1\n[\s\S]*needs at least/,
    setup: (ws) => {
      const dir = ws.path('linked');
      mkdirSync(dir);
      symlinkSync(join(FIXTURES, 'images', 'quadrants.png'), join(dir, 'link.png'));
      return { args: tinyBudgetRun(ws, dir) };
    },
  },
  {
    name: 'a broken symlink among the photos is named',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /gone\.png is a broken link[\s\S]*needs at least/,
    setup: (ws) => {
      const dir = ws.path('broken');
      mkdirSync(dir);
      copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(dir, 'real.png'));
      symlinkSync(join(ws.dir, 'nothing-here.png'), join(dir, 'gone.png'));
      return { args: tinyBudgetRun(ws, dir) };
    },
  },
  {
    name: 'a binary caption file is refused before any work, naming the photo and the file',
    before: 'wrong',
    args: () => [],
    code: 1,
    message:
      /real\.txt in \S+captions\S* is not UTF-8 text \(binary data or another encoding\), so it cannot be the caption of real\.png: save it as UTF-8 text, or remove it/,
    notOut: /step /,
    setup: (ws) => {
      const dir = ws.path('captions');
      mkdirSync(dir);
      copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(dir, 'real.png'));
      writeFileSync(join(dir, 'real.txt'), Buffer.from([0x00, 0xff, 0xfe, 0x00, 0x41]));
      return { args: tinyBudgetRun(ws, dir), absent: [ws.path('out')] };
    },
  },
  {
    name: 'an empty caption file is refused before any work, naming the photo and the file',
    before: 'wrong',
    args: () => [],
    code: 1,
    message:
      /real\.txt in \S+captions\S* is empty \(kohya reads its first line\), so real\.png would have no caption: write its caption on the first line, or remove the file/,
    notOut: /step /,
    setup: (ws) => {
      const dir = ws.path('captions');
      mkdirSync(dir);
      copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(dir, 'real.png'));
      writeFileSync(join(dir, 'real.txt'), ' \n\nsecond line only\n');
      return { args: tinyBudgetRun(ws, dir), absent: [ws.path('out')] };
    },
  },
  // ---- issue 17: job bundles out, LoRAs trained elsewhere back in -----------------------------------------
  {
    name: 'a job bundle for a local single file with no hub id says what to provide',
    before: 'clear',
    args: (ws) => [
      'train',
      '--model',
      ws.tiny.singleFile,
      '--images',
      ws.images,
      '--prompt',
      'a photo of sks dog',
      '--resolution',
      '32',
      '--bundle',
      ws.path('bundle'),
    ],
    code: 0,
    message: /warning: "tiny-sd1\.safetensors" is a single checkpoint file, which diffusers' training scripts cannot load: set MODEL to the Hub repo id/,
    out: /"bundle"/,
  },
  {
    name: '--out given with --bundle',
    before: 'clear',
    args: (ws) => [...trainArgs(ws, ws.path('out')), '--bundle', ws.path('bundle')],
    code: 1,
    message: /--out does not apply to --bundle: a bundle is not trained here/,
  },
  {
    name: '--revision without --hub-id',
    before: 'clear',
    args: (ws) => ['train', '--model', ws.tiny.folder, '--images', ws.images, '--prompt', 'x', '--revision', 'main', '--bundle', ws.path('bundle')],
    code: 1,
    message: /--revision needs --hub-id/,
  },
  {
    name: 'sample --lora with an SDXL LoRA (second text encoder)',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /'lora_te2_text_model_encoder_layers_0_self_attn_q_proj\.lora_down\.weight' is a key of a LoRA for SDXL/,
    setup: (ws) => {
      const f = ws.path('sdxl.safetensors');
      writeFileSync(
        f,
        writeSafetensors(new Map([['lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight', { shape: [4, 8], data: new Float32Array(32) }]])),
      );
      return { args: sample(ws, '--lora', f), unchanged: [f] };
    },
  },
  {
    name: 'sample --lora with a down weight but no up weight',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /'unet\.down_blocks\.0\.attentions\.0\.transformer_blocks\.0\.attn1\.to_q\.lora_A\.weight' has no matching up/,
    setup: (ws) => {
      const f = ws.path('half.safetensors');
      const l = 'unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q';
      writeFileSync(f, writeSafetensors(new Map([[`${l}.lora_A.weight`, { shape: [4, 16], data: new Float32Array(64) }]])));
      return { args: sample(ws, '--lora', f) };
    },
  },
  {
    name: 'sample --lora with an SD 2.x LoRA (1024-wide text) on an SD 1.x model',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /'unet\.down_blocks\.0\.attentions\.0\.transformer_blocks\.0\.attn2\.to_k\.lora_A\.weight' is \[4,1024\], made for a layer with 1024 inputs/,
    setup: (ws) => {
      const f = ws.path('sd2.safetensors');
      const layer = 'down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k';
      const unet = readSafetensors(new Uint8Array(readFileSync(join(ws.tiny.folder, 'unet', 'diffusion_pytorch_model.safetensors')))).tensors;
      const out = unet.get(`${layer}.weight`)!.shape[0];
      writeFileSync(
        f,
        writeSafetensors(
          new Map([
            [`unet.${layer}.lora_A.weight`, { shape: [4, 1024], data: new Float32Array(4096) }],
            [`unet.${layer}.lora_B.weight`, { shape: [out, 4], data: new Float32Array(out * 4) }],
          ]),
        ),
      );
      return { args: sample(ws, '--lora', f) };
    },
  },
  {
    name: 'sample --lora-scale without --lora',
    before: 'clear',
    args: (ws) => sample(ws, '--lora-scale', '0.5'),
    code: 1,
    message: /--lora-scale needs --lora <file>/,
  },
  {
    name: 'export of a LoRA format without --lora',
    before: 'clear',
    args: (ws) => ['export', '--model', ws.tiny.folder, '--format', 'lora-kohya', '--out', ws.path('x.safetensors')],
    code: 1,
    message: /--format lora-kohya holds LoRA adapters: give --lora <file>/,
  },
  {
    name: 'export --lora given a folder (the training output) instead of its file',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /--lora \S*output\S* is a folder: give the LoRA file \(e\.g\. .*pytorch_lora_weights\.safetensors\)/,
    setup: (ws) => {
      const output = ws.path('output');
      mkdirSync(output);
      return { args: ['export', '--model', ws.tiny.folder, '--lora', output, '--format', 'lora-kohya', '--out', ws.path('x.safetensors')] };
    },
  },
  // ---- issue 16: pretraining the demo model: a dataset that cannot be honoured is refused before any work ----
  {
    name: 'pretrain at a size the VAE cannot divide (--resolution 60)',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--resolution', '60'],
    code: 1,
    message: /dataset size 60: use a multiple of 8 \(the model's factor\) from 16 to 512 px/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: 'pretrain excluding a shape the generator does not draw',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--exclude', 'star,moon'],
    code: 1,
    message: /--exclude moon: not a shape the generator draws \(circle, square/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: 'pretrain --resume of a folder that is not a pretraining run',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--resume', ws.tiny.folder],
    code: 1,
    message: /--resume \S+: no pretrain\.json there \(not a pretraining run folder\)/,
    setup: (ws) => ({ unchanged: [ws.tiny.folder] }),
  },
  {
    name: 'pretrain --export without a run to write (--out instead of --resume)',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--export'],
    code: 1,
    message: /--export writes the model of an existing run: use it with --resume <dir>/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: 'pretrain --vae-from a folder with no VAE',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--vae-from', ws.path('nowhere')],
    code: 1,
    message: /--vae-from \S+nowhere\S*: no vae\/config\.json and vae\/diffusion_pytorch_model\.safetensors there; give a diffusers folder/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: 'pretrain --vae-from the VAE of another size (the tiny fixture for the small model)',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--vae-from', PRETRAINED_TINY],
    code: 1,
    message: /--vae-from \S+pretrained-tiny: its VAE has block_out_channels \[8,16\], this size's has \[16,32,64,64\]: start from a VAE of the same size/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: 'pretrain --vae-from with a VAE stage (--vae-steps 5)',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--vae-from', PRETRAINED_TINY, '--size', 'tiny', '--vae-steps', '5'],
    code: 1,
    message: /--vae-from and --vae-steps 5: a run that starts from a trained VAE has no VAE stage; leave --vae-steps out/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: 'pretrain --init-from and --vae-from together',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--size', 'tiny', '--init-from', PRETRAINED_TINY, '--vae-from', PRETRAINED_TINY],
    code: 1,
    message: /--vae-from and --init-from: --init-from \S+pretrained-tiny starts from that model's VAE too; give one of them/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: 'pretrain --init-from a model of another size than --size (the tiny fixture, --size small)',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--size', 'small', '--init-from', PRETRAINED_TINY],
    code: 1,
    message: /--init-from \S+pretrained-tiny: its VAE has block_out_channels \[8,16\], this size's has \[16,32,64,64\]: start from a VAE of the same size/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: "pretrain --init-from a model whose text encoder is another size (the tiny test model's 1000-token vocabulary)",
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--size', 'tiny', '--init-from', ws.tiny.folder],
    code: 1,
    message: /--init-from \S+: its text encoder has vocab_size 1000, this size's has 1024: start from a text encoder of the same size/,
    setup: (ws) => ({ unchanged: [ws.path('pt'), ws.tiny.folder] }),
  },
  {
    name: 'pretrain --init-from an epsilon model with --prediction v_prediction',
    before: 'clear',
    args: (ws) => ['lab:pretrain', '--out', ws.path('pt'), '--size', 'tiny', '--init-from', PRETRAINED_TINY, '--prediction', 'v_prediction'],
    code: 1,
    message:
      /--prediction v_prediction: the model of --init-from \S+pretrained-tiny predicts epsilon; going on, it must predict the same \(leave --prediction out\)/,
    setup: (ws) => ({ unchanged: [ws.path('pt')] }),
  },
  {
    name: 'pretrain --init-from a model folder without its tokenizer',
    before: 'clear',
    args: () => [],
    code: 1,
    message: /--init-from \S*no-tokenizer\S*: no tokenizer\/vocab\.json and tokenizer\/merges\.txt there, the tokenizer its text encoder reads/,
    setup: (ws) => {
      const model = ws.path('no-tokenizer');
      cpSync(PRETRAINED_TINY, model, { recursive: true, filter: (src) => !src.includes('tokenizer') });
      return { args: ['lab:pretrain', '--out', ws.path('pt'), '--init-from', model], unchanged: [ws.path('pt'), model] };
    },
  },
  {
    name: 'grid with an empty prompt between the separators',
    before: 'clear',
    args: (ws) => ['grid', '--model', ws.tiny.folder, '--prompts', 'a dog||a cat', '--out', ws.path('grid.png')],
    code: 1,
    message: /--prompts a dog\|\|a cat: an empty prompt between the \| separators/,
    setup: (ws) => ({ unchanged: [ws.tiny.folder, ws.path('grid.png')] }),
  },
  {
    name: 'grid with a seed that is not a whole number',
    before: 'clear',
    args: (ws) => ['grid', '--model', ws.tiny.folder, '--prompts', 'a dog', '--seeds', '1,two', '--out', ws.path('grid.png')],
    code: 1,
    message: /--seeds 1,two: use whole numbers separated by commas/,
    setup: (ws) => ({ unchanged: [ws.tiny.folder, ws.path('grid.png')] }),
  },
];

/**
 * A full run on the photos in `dir` under a 2 MiB budget: the photos are read and encoded, then the planner
 * refuses the budget, so a case sees what reading the folder did without training.
 */
function tinyBudgetRun(ws: Workspace, dir: string): string[] {
  return [
    'train',
    '--model',
    ws.tiny.folder,
    '--images',
    dir,
    '--prompt',
    'x',
    '--mode',
    'full',
    '--steps',
    '1',
    '--resolution',
    '32',
    '--budget',
    '2MiB',
    '--out',
    ws.path('out'),
  ];
}

/** A copy of the tiny diffusers model with one change made by `edit` (on the copy's folder). */
function modelCopy(ws: Workspace, edit: (folder: string) => void): string {
  const folder = ws.path('model');
  cpSync(ws.tiny.folder, folder, { recursive: true });
  edit(folder);
  return folder;
}

/** Puts NaN into one UNet tensor of a model folder; returns the tensor's name. */
function poisonUnet(folder: string): string {
  const file = join(folder, 'unet', 'diffusion_pytorch_model.safetensors');
  const st = readSafetensors(new Uint8Array(readFileSync(file)));
  const name = [...st.tensors.keys()].find((n) => n.endsWith('conv1.weight'))!;
  st.tensors.get(name)!.data[3] = NaN;
  writeFileSync(file, writeSafetensors(st.tensors));
  return name;
}

/** trainArgs on a copy of the tiny model whose `component` config has `field` set to `value`. */
function withConfig(ws: Workspace, component: string, field: string, value: unknown): string[] {
  return withFlag(
    ws,
    '--model',
    modelCopy(ws, (f) => editJson(join(f, component, 'config.json'), (j) => (j[field] = value))),
  );
}

function editJson(path: string, edit: (j: Record<string, unknown>) => void): void {
  const j = JSON.parse(readFileSync(path, 'utf8'));
  edit(j);
  writeFileSync(path, JSON.stringify(j));
}

function withSample(ws: Workspace, flag: string, value: string): string[] {
  const a = sample(ws);
  const i = a.indexOf(flag);
  if (i >= 0) a.splice(i, 2);
  return [...a, flag, value];
}
