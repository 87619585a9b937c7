// Issue 46's rows of the bad-input corpus: what a command writes, and what it must never take for a result. One output-path guard (src/io/outpath.ts):
// never over an input, never through a link or into a device or FIFO, partial files created exclusively,
// --overwrite removing only what the project wrote (the folder's manifest); and "validate fully, then
// create": a new run refused before its first step leaves no folder and no run.json; NaN/Inf reaching a
// sample or an op's output is an error naming the stage (nothing written); scheduler configs checked by field;
// a FIFO in place of a file refused at once.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { copyFileSync, cpSync, existsSync, mkdirSync, readdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { readSafetensors, writeSafetensors } from '../../src/io/safetensors.ts';
import { join } from 'node:path';
import { FIXTURES } from '../helpers.ts';
import { cli, trainArgs, type Case, type Workspace } from './harness.ts';

/** A special file made by a system tool (mkfifo, mknod; `{}` in `cmd` is the path); the path. */
function special(path: string, ...cmd: string[]): string {
  const r = spawnSync(
    cmd[0],
    cmd.slice(1).map((a) => (a === '{}' ? path : a)),
    { encoding: 'utf8' },
  );
  assert.equal(r.status, 0, `${cmd.join(' ')} ${path}: ${r.stderr}`);
  return path;
}

/** A file outside every output, which a followed link would overwrite. */
function victim(ws: Workspace): string {
  const file = ws.path('victim');
  writeFileSync(file, 'the user owns this file');
  return file;
}

const exportArgs = (ws: Workspace, out: string) => ['export', '--model', ws.tiny.folder, '--format', 'full-single-file', '--out', out];

const sampleArgs = (ws: Workspace, model: string, out: string) => [
  'sample',
  '--model',
  model,
  '--tokenizer',
  ws.tokenizer,
  '--config',
  ws.config,
  '--prompt',
  'a dog',
  '--width',
  '32',
  '--height',
  '32',
  '--steps',
  '1',
  '--out',
  out,
];

/** The same valid LoRA run as trainArgs, with one flag's value replaced and --out at a new path (returned too). */
function newRun(ws: Workspace, flag: string | null, value?: string): { out: string; args: string[] } {
  const out = ws.path('new-run');
  const a = trainArgs(ws, out);
  if (flag) {
    const i = a.indexOf(flag);
    if (i >= 0) a.splice(i, 2);
    a.push(flag, value!);
  }
  return { out, args: a };
}

/** A folder of images made by `fill` (under the workspace). */
function imageDir(ws: Workspace, fill: (dir: string) => void): string {
  const dir = ws.path('photos');
  mkdirSync(dir);
  fill(dir);
  return dir;
}

const bundleArgs = (ws: Workspace, out: string, ...extra: string[]) => [
  'train',
  '--model',
  ws.tiny.folder,
  '--images',
  ws.images,
  '--prompt',
  'a photo of sks dog',
  '--resolution',
  '32',
  '--hub-id',
  'org/tiny',
  '--bundle',
  out,
  ...extra,
];

export const WRITE_CASES: Case[] = [
  // ---- never write over an input ---------------------------------------------------------------------------
  {
    name: 'sample --out the model file itself (a typo)',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--out \S+tiny-\d+\.safetensors is --model \S+: writing it would destroy an input of this command; choose another --out/,
    setup: (ws) => {
      const model = ws.path('tiny') + '.safetensors';
      copyFileSync(ws.tiny.singleFile, model);
      return { args: sampleArgs(ws, model, model), unchanged: [model] };
    },
  },
  {
    name: 'sample --out a hard link of the model file',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--out \S+ is --model \S+: writing it would destroy an input/,
    setup: (ws) => {
      const model = ws.path('tiny') + '.safetensors';
      copyFileSync(ws.tiny.singleFile, model);
      const link = ws.path('same') + '.png';
      spawnSync('ln', [model, link]);
      return { args: sampleArgs(ws, model, link), unchanged: [model] };
    },
  },
  {
    name: 'train --out inside the --images folder',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--out \S+ lies inside --images \S+: the command never writes into its own inputs/,
    setup: (ws) => {
      const images = imageDir(ws, (d) => copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(d, 'a.png')));
      const a = trainArgs(ws, join(images, 'run'));
      a[a.indexOf('--images') + 1] = images;
      return { args: a, unchanged: [images] };
    },
  },
  // ---- never through a link, never into a device or FIFO ------------------------------------------------------
  {
    name: 'export --out whose .partial is a planted symlink to a file outside',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--out \S+o\.safetensors\.partial is a symbolic link: outputs are written only as regular files/,
    setup: (ws) => {
      const target = victim(ws);
      const out = join(ws.path('exp'), 'o.safetensors');
      mkdirSync(join(out, '..'));
      symlinkSync(target, `${out}.partial`);
      return { args: exportArgs(ws, out), unchanged: [target, join(out, '..')] };
    },
  },
  {
    name: 'export --out a device node',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--out \S+null-dev-\d+ is a device: outputs are written only as regular files/,
    setup: (ws) => {
      const dev = special(ws.path('null-dev'), 'mknod', '-m', '666', '{}', 'c', '1', '3');
      return { args: exportArgs(ws, dev), unchanged: [dev] };
    },
  },
  {
    name: 'sample --out a FIFO',
    before: 'hung',
    args: () => [],
    code: 1,
    message: /--out \S+fifo-\d+ is a FIFO \(named pipe\): outputs are written only as regular files/,
    setup: (ws) => {
      const fifo = special(ws.path('fifo'), 'mkfifo', '{}');
      return { args: sampleArgs(ws, ws.tiny.singleFile, fifo), unchanged: [fifo] };
    },
  },
  {
    name: 'sample --out a symlink to a file outside',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--out \S+link-\d+\.png is a symbolic link/,
    setup: (ws) => {
      const target = victim(ws);
      const link = ws.path('link') + '.png';
      symlinkSync(target, link);
      return { args: sampleArgs(ws, ws.tiny.singleFile, link), unchanged: [target, link] };
    },
  },
  // ---- --overwrite removes only what the project wrote ----------------------------------------------------------
  {
    name: "pretrain --out a model folder --overwrite (its tokenizer/ is not the run's)",
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--overwrite: \S+ holds no pretraining run to replace/,
    setup: (ws) => {
      const folder = ws.path('model');
      cpSync(ws.tiny.folder, folder, { recursive: true });
      return {
        args: ['lab:pretrain', '--out', folder, '--overwrite', '--size', 'tiny', '--steps', '1', '--vae-steps', '1', '--resolution', '16'],
        unchanged: [folder],
      };
    },
  },
  {
    name: 'pretrain --out a model folder (its tokenizer/ would be written over)',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--out \S+ already holds (model, )?tokenizer, which this project did not write: choose a new or empty folder/,
    setup: (ws) => {
      const folder = ws.path('model');
      cpSync(ws.tiny.folder, folder, { recursive: true });
      return { args: ['lab:pretrain', '--out', folder, '--size', 'tiny', '--steps', '1', '--vae-steps', '1', '--resolution', '16'], unchanged: [folder] };
    },
  },
  {
    name: "--bundle a folder of the user's --overwrite",
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--overwrite: \S+ holds no bundle to replace/,
    setup: (ws) => {
      const dir = ws.path('mine');
      mkdirSync(dir);
      writeFileSync(join(dir, 'README.md'), 'my notes');
      writeFileSync(join(dir, 'requirements.txt'), 'numpy');
      return { args: bundleArgs(ws, dir, '--overwrite'), unchanged: [dir] };
    },
  },
  {
    name: "re-bundle with --overwrite drops the old bundle's masks/",
    before: 'wrong',
    args: () => [],
    code: 0,
    message: /^/,
    out: /"bundle"/,
    setup: (ws) => {
      const dir = ws.path('bundle');
      const masks = imageDir(ws, (d) => {
        for (const f of readdirSync(ws.images)) copyFileSync(join(ws.images, f), join(d, f));
      });
      const first = cli(...bundleArgs(ws, dir, '--masks', masks));
      assert.equal(first.code, 0, first.err);
      assert.ok(existsSync(join(dir, 'masks')), 'the first bundle has masks/');
      writeFileSync(join(dir, 'my-notes.txt'), 'kept');
      return {
        args: bundleArgs(ws, dir, '--overwrite'),
        absent: [join(dir, 'masks'), join(dir, '.dbs-replaced')],
        after: () => assert.equal(readFileSync(join(dir, 'my-notes.txt'), 'utf8'), 'kept', 'a file the bundle never wrote is kept'),
      };
    },
  },
  // --overwrite sets the old outputs aside (outpath.ts) until the new ones are whole: a write refused part-way
  // (here a planted link at the new manifest's .partial) puts them back.
  {
    name: '--bundle --overwrite whose write is refused part-way keeps the old bundle whole',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--bundle \S+\.dbs-written\.json\.partial is a symbolic link: outputs are written only as regular files/,
    setup: (ws) => {
      const dir = ws.path('bundle');
      const first = cli(...bundleArgs(ws, dir));
      assert.equal(first.code, 0, first.err);
      const target = victim(ws);
      symlinkSync(target, join(dir, '.dbs-written.json.partial'));
      return { args: bundleArgs(ws, dir, '--overwrite'), unchanged: [dir, target], absent: [join(dir, '.dbs-replaced')] };
    },
  },
  {
    name: 'pretrain --overwrite whose write is refused part-way keeps the old run whole',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--out \S+\.dbs-written\.json\.partial is a symbolic link: outputs are written only as regular files/,
    setup: (ws) => {
      // A pretraining run's folder as the lab leaves it (its record, store and manifest); nothing is trained here.
      const dir = ws.path('pretrain-run');
      mkdirSync(join(dir, 'store'), { recursive: true });
      writeFileSync(join(dir, 'store', 'chunk'), 'the old run');
      writeFileSync(join(dir, 'pretrain.json'), '{"size":"tiny"}');
      writeFileSync(join(dir, '.dbs-written.json'), JSON.stringify({ written: ['pretrain.json', 'store'] }));
      const target = victim(ws);
      symlinkSync(target, join(dir, '.dbs-written.json.partial'));
      return {
        args: ['lab:pretrain', '--out', dir, '--overwrite', '--size', 'tiny', '--steps', '1', '--vae-steps', '1', '--resolution', '16'],
        unchanged: [dir, target],
        absent: [join(dir, '.dbs-replaced')],
      };
    },
  },
  // ---- validate fully, then create: a refused new run leaves nothing ----------------------------------------------
  ...(
    [
      [
        'an empty --images folder',
        /add at least one image/,
        (ws: Workspace) =>
          newRun(
            ws,
            '--images',
            imageDir(ws, () => undefined),
          ),
      ],
      [
        'a text file named photo.png',
        /photo\.png[\s\S]*add at least one image/,
        (ws: Workspace) =>
          newRun(
            ws,
            '--images',
            imageDir(ws, (d) => writeFileSync(join(d, 'photo.png'), 'not a picture')),
          ),
      ],
      [
        '--rank 64 on a model whose narrowest layer is narrower',
        /--rank 64 is larger than this model's narrowest adapted layer/,
        (ws: Workspace) => newRun(ws, '--rank', '64'),
      ],
      ['--resolution 30 on a model of factor 4', /--resolution 30 does not suit this model/, (ws: Workspace) => newRun(ws, '--resolution', '30')],
      [
        '--budget 1MiB with --base-weights f16',
        /needs at least [\d.]+ MiB of GPU memory .* the budget is 1\.00 MiB/,
        (ws: Workspace) => {
          const run = newRun(ws, '--budget', '1MiB');
          run.args.push('--base-weights', 'f16'); // auto would store the base in int8 and fit
          return run;
        },
      ],
    ] as const
  ).map(([what, message, make]): Case => ({
    name: `a new run refused for ${what} leaves no folder (the corrected retry is not "another run")`,
    before: 'wrong',
    args: () => [],
    code: 1,
    message,
    notOut: /^step /m,
    setup: (ws) => {
      const { out, args } = make(ws);
      return { args, absent: [out] };
    },
  })),
  {
    name: 'a refused new run in an existing folder leaves the folder as it was',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--rank 64 is larger/,
    setup: (ws) => {
      const { out, args } = newRun(ws, '--rank', '64');
      mkdirSync(out);
      writeFileSync(join(out, 'notes.txt'), 'mine');
      return { args, unchanged: [out] };
    },
  },
  // ---- non-finite values: an error naming the stage, nothing written ------------------------------------------
  {
    name: 'sample with a LoRA at --lora-scale 10 that overflows',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /non-finite values \(NaN\/Inf\) of \d+ with the LoRA at scale 10 .*no image was written/,
    setup: (ws) => {
      const f = ws.path('huge') + '.safetensors';
      const layer = 'down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q';
      const unet = readSafetensors(new Uint8Array(readFileSync(join(ws.tiny.folder, 'unet', 'diffusion_pytorch_model.safetensors')))).tensors;
      const [o, i] = unet.get(`${layer}.weight`)!.shape;
      // Within f16's range (the LoRA is accepted) but B·A = 4·3.6e9 per element at scale 1: past f16's 65504
      // (lavapipe computes in f16), so the UNet's output overflows.
      const big = (n: number) => new Float32Array(n).fill(6e4);
      writeFileSync(
        f,
        writeSafetensors(
          new Map([
            [`unet.${layer}.lora_A.weight`, { shape: [4, i], data: big(4 * i) }],
            [`unet.${layer}.lora_B.weight`, { shape: [o, 4], data: big(o * 4) }],
          ]),
        ),
      );
      const out = ws.path('black') + '.png';
      return { args: [...sampleArgs(ws, ws.tiny.singleFile, out), '--lora', f, '--lora-scale', '10'], absent: [out] };
    },
  },
  {
    name: 'run unet with a NaN timestep',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /input 'timestep' holds 1 non-finite value \(NaN\/Inf\) of 1: give finite inputs/,
    setup: (ws) => {
      const unetCfg = JSON.parse(readFileSync(join(ws.tiny.folder, 'unet', 'config.json'), 'utf8')) as { in_channels: number; cross_attention_dim: number };
      const input = ws.path('in') + '.safetensors';
      writeFileSync(
        input,
        writeSafetensors(
          new Map([
            ['sample', { shape: [1, unetCfg.in_channels, 8, 8], data: new Float32Array(unetCfg.in_channels * 64).fill(0.1) }],
            ['timestep', { shape: [1], data: new Float32Array([NaN]) }],
            ['encoder_hidden_states', { shape: [1, 8, unetCfg.cross_attention_dim], data: new Float32Array(8 * unetCfg.cross_attention_dim).fill(0.1) }],
          ]),
        ),
      );
      const out = ws.path('unet-out') + '.safetensors';
      return { args: ['run', 'unet', '--model', ws.tiny.folder, '--in', input, '--out', out], absent: [out] };
    },
  },
  // ---- model folders: scheduler configs checked by field, special files refused at once ---------------------------
  ...(
    [
      ['num_train_timesteps 0', { num_train_timesteps: 0 }, /num_train_timesteps must be a whole number from 2 to 100000, got 0/],
      ['beta_start above beta_end', { beta_start: 0.02, beta_end: 0.012 }, /beta_start 0\.02 is above beta_end 0\.012/],
      ['a beta above 1', { beta_end: 1.5 }, /beta_end must be a number between 0 and 1 \(exclusive\), got 1\.5/],
      [
        'an unknown beta_schedule',
        { beta_schedule: 'squaredcos_cap_v2' },
        /beta_schedule "squaredcos_cap_v2" is not one the engine implements \(linear, scaled_linear\)/,
      ],
    ] as const
  ).map(([what, fields, message]): Case => ({
    name: `a scheduler config with ${what} is refused naming the file and field`,
    before: 'wrong',
    args: () => [],
    code: 1,
    message: new RegExp(`scheduler[/\\\\]scheduler_config\\.json: ${message.source}`),
    setup: (ws) => {
      const folder = ws.path('model');
      cpSync(ws.tiny.folder, folder, { recursive: true });
      const path = join(folder, 'scheduler', 'scheduler_config.json');
      writeFileSync(path, JSON.stringify({ ...JSON.parse(readFileSync(path, 'utf8')), ...fields }));
      const out = ws.path('img') + '.png';
      return { args: sampleArgs(ws, folder, out).filter((a, i, all) => a !== '--config' && all[i - 1] !== '--config'), absent: [out] };
    },
  })),
  {
    name: 'a FIFO in place of the UNet weights is refused at once (no hang)',
    before: 'hung',
    args: () => [],
    code: 1,
    message: /diffusion_pytorch_model\.safetensors is a FIFO \(named pipe\): models, configs and inputs are read from regular files only/,
    setup: (ws) => {
      const folder = ws.path('model');
      cpSync(ws.tiny.folder, folder, { recursive: true });
      const weights = join(folder, 'unet', 'diffusion_pytorch_model.safetensors');
      rmSync(weights);
      special(weights, 'mkfifo', '{}');
      return { args: sampleArgs(ws, folder, ws.path('img') + '.png') };
    },
  },
  // ---- tokenizer files checked when loaded, naming the file; prompts of special tokens only refused ----------------
  ...(
    [
      ['an empty merges.txt', 'merges.txt', '', /merges\.txt holds no merges \(empty\)/],
      ['a binary merges.txt', 'merges.txt', Buffer.from([0x00, 0xff, 0xfe, 0x89, 0x50]), /merges\.txt is not UTF-8 text/],
      ['a truncated vocab.json', 'vocab.json', '{"a": 1, "b', /vocab\.json: invalid JSON/],
    ] as const
  ).map(([what, file, bytes, message]): Case => ({
    name: `a model folder with ${what} is refused naming the file`,
    before: 'unclear',
    args: () => [],
    code: 1,
    message,
    setup: (ws) => {
      const folder = ws.path('model');
      cpSync(ws.tiny.folder, folder, { recursive: true });
      writeFileSync(join(folder, 'tokenizer', file), bytes);
      const out = ws.path('img') + '.png';
      const args = sampleArgs(ws, folder, out);
      args[args.indexOf('--tokenizer') + 1] = join(folder, 'tokenizer');
      return { args, absent: [out] };
    },
  })),
  {
    name: 'a prompt of special tokens only',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--prompt "<\|endoftext\|><\|endoftext\|>" holds only special tokens/,
    setup: (ws) => {
      const out = ws.path('img') + '.png';
      const args = sampleArgs(ws, ws.tiny.singleFile, out);
      args[args.indexOf('--prompt') + 1] = '<|endoftext|><|endoftext|>';
      return { args, absent: [out] };
    },
  },
];
