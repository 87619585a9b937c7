// Issue 46's rows for run folders and their inputs: --overwrite validates the new run fully before the old one
// goes (the old run is set aside, and put back when the new run is refused); a resumed run's inputs are the
// ones it started with (fingerprints of the base model's headers and sampled bytes, and of every photo, mask
// and caption, naming what changed); a stale lock is judged by process identity, not by its pid; loss masks
// pair with photos by a rule that never guesses (masks.ts), and masks that would train nothing are refused;
// a folder or value the user meant is used as meant.
import assert from 'node:assert/strict';
import { copyFileSync, cpSync, existsSync, mkdirSync, readdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { encode as encodePng } from 'fast-png';
import { readSafetensors, writeSafetensors } from '../../src/io/safetensors.ts';
import { crc32 } from '../../src/store/chunkstore.ts';
import { chunkFileName, FS_HEADER_BYTES } from '../../src/store/fs-store.ts';
import { FIXTURES } from '../helpers.ts';
import { trainArgs, type Case, type Workspace } from './harness.ts';

/** Where --overwrite keeps the old run until the new one is validated (src/io/outpath.ts ASIDE). */
const ASIDE = '.dbs-replaced';
const NO_STEP = /^step /m;
/** A message that says nothing went wrong (a run that succeeds may still print notes). */
const NO_ERROR = /^(?![\s\S]*error:)/;

/** A copy of the corpus's trained run (2 steps, checkpointed) to change. */
function runCopy(ws: Workspace): string {
  const out = ws.path('run-copy');
  cpSync(ws.trainedRun(), out, { recursive: true });
  return out;
}

/** A folder of images made by `fill`. */
function folder(ws: Workspace, fill: (dir: string) => void): string {
  const dir = ws.path('dir');
  mkdirSync(dir);
  fill(dir);
  return dir;
}

/** A black (all-zero, opaque) PNG mask of width x height. */
function blackPng(width: number, height: number): Uint8Array {
  const data = new Uint8Array(width * height * 4);
  for (let i = 3; i < data.length; i += 4) data[i] = 255;
  return encodePng({ width, height, data, channels: 4, depth: 8 });
}

/** Rewrites a JSON chunk of a run's store through `edit`, with a correct header (magic, CRC-32, length): what a careful editor does. */
function editChunk(file: string, edit: (json: Record<string, unknown>) => void): void {
  const bytes = readFileSync(file);
  const json = JSON.parse(bytes.subarray(FS_HEADER_BYTES).toString('utf8')) as Record<string, unknown>;
  edit(json);
  const payload = new TextEncoder().encode(JSON.stringify(json));
  const header = Buffer.from(bytes.subarray(0, FS_HEADER_BYTES));
  header.writeUInt32LE(crc32(payload), 4);
  header.writeBigUInt64LE(BigInt(payload.length), 8);
  writeFileSync(file, Buffer.concat([header, payload]));
}

const bundleArgs = (ws: Workspace, images: string, out: string, ...extra: string[]) => [
  'train',
  '--model',
  ws.tiny.folder,
  '--images',
  images,
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

export const RESUME_CASES: Case[] = [
  // ---- --overwrite: validate fully, then remove, then create -------------------------------------------------
  {
    name: 'train --overwrite refused for its new settings (--rank 64) keeps the old run whole',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--rank 64 is larger than this model's narrowest adapted layer/,
    notOut: NO_STEP,
    setup: (ws) => {
      const out = runCopy(ws);
      const args = trainArgs(ws, out).map((a, i, all) => (all[i - 1] === '--rank' ? '64' : a));
      return { args: [...args, '--overwrite'], unchanged: [out], absent: [join(out, ASIDE), join(out, 'lock')] };
    },
  },
  {
    name: 'train --overwrite that passes its checks replaces the old run (nothing set aside is left)',
    before: 'clear',
    args: () => [],
    code: 0,
    message: NO_ERROR,
    out: /"done":true,"steps":1/,
    setup: (ws) => {
      const out = runCopy(ws);
      return {
        args: [...trainArgs(ws, out), '--steps', '1', '--overwrite', '--export', 'lora-kohya'],
        absent: [join(out, ASIDE), join(out, 'lock')],
        after: () => assert.equal(JSON.parse(readFileSync(join(out, 'run.json'), 'utf8')).settings.steps, 1, "run.json is the new run's"),
      };
    },
  },
  // ---- resume: the inputs the run started with ----------------------------------------------------------------
  {
    name: 'resume with another base model of the same architecture',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--model \S+ is not the model this run started with \(unet\/diffusion_pytorch_model\.safetensors changed since\): another base model/,
    notOut: NO_STEP,
    setup: (ws) => {
      const other = ws.path('other-model');
      cpSync(ws.tiny.folder, other, { recursive: true });
      const file = join(other, 'unet', 'diffusion_pytorch_model.safetensors');
      const st = readSafetensors(new Uint8Array(readFileSync(file)));
      for (const t of st.tensors.values()) for (let i = 0; i < t.data.length; i++) t.data[i] *= 0.5; // same shapes, other weights
      writeFileSync(file, writeSafetensors(st.tensors, st.metadata));
      const out = runCopy(ws);
      return { args: ['train', '--resume', out, '--model', other], unchanged: [out] };
    },
  },
  {
    name: 'resume after a photo in --images was replaced',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /this run's --images \S+ changed since it started \(rgba\.png changed\)/,
    notOut: NO_STEP,
    setup: (ws) => {
      const images = ws.path('images');
      cpSync(ws.images, images, { recursive: true });
      const out = runCopy(ws);
      const run = JSON.parse(readFileSync(join(out, 'run.json'), 'utf8'));
      run.inputs.images = images; // the run's photos, in a folder this case may change
      writeFileSync(join(out, 'run.json'), JSON.stringify(run));
      copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(images, 'rgba.png'));
      return { args: ['train', '--resume', out], unchanged: [out] };
    },
  },
  {
    name: "resume from a checkpoint whose step counter was edited (the store's CRC recomputed)",
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /this run's last checkpoint \(run\/ckpt\/HEAD in \S+\) cannot be trusted: its record says step 1, but it was written at step 2/,
    notOut: NO_STEP,
    setup: (ws) => {
      const out = runCopy(ws);
      // The careful edit: step, applied updates and the loss list agree with each other, and the chunk's CRC is right.
      editChunk(join(out, 'store', chunkFileName('run/ckpt/HEAD')), (head) => {
        const m = head.meta as { step: number; applied: number; losses: number[] };
        Object.assign(m, { step: 1, applied: 1, losses: m.losses.slice(0, 1) });
      });
      return { args: ['train', '--resume', out], unchanged: [out] };
    },
  },
  {
    name: 'resume from a checkpoint whose step counter was edited and whose binding was deleted',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /this run's last checkpoint \(run\/ckpt\/HEAD in \S+\) cannot be trusted: it has no binding to what was written.*Start the run again/,
    notOut: NO_STEP,
    setup: (ws) => {
      const out = runCopy(ws);
      editChunk(join(out, 'store', chunkFileName('run/ckpt/HEAD')), (head) => {
        const m = head.meta as { step: number; applied: number; losses: number[] };
        Object.assign(m, { step: 1, applied: 1, losses: m.losses.slice(0, 1) });
        delete head.bind;
      });
      return { args: ['train', '--resume', out], unchanged: [out] };
    },
  },
  // ---- locks: judged by process identity --------------------------------------------------------------------
  {
    name: 'a stale lock of pid 1 written before identities (a bare pid) is named and taken over',
    before: 'unclear',
    args: () => [],
    code: 1,
    // After the takeover the resume goes on to this case's own refusal (fewer steps than done), proving it was not "in use".
    message: /lock: a stale lock \(process 1 is "[^"]*", not a run of this program \(pid 1 is the system's first process\)\)[\s\S]*past the 1 steps asked for/,
    setup: (ws) => {
      const out = runCopy(ws);
      writeFileSync(join(out, 'lock'), '1');
      return { args: ['train', '--resume', out, '--steps', '1'], absent: [join(out, 'lock')] };
    },
  },
  // ---- masks ----------------------------------------------------------------------------------------------------
  {
    name: 'every mask black (nothing would be trained)',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--masks \S+: every mask is black \(quadrants-o6\.jpg, quadrants\.png, rgba\.png\), so nothing would be trained/,
    notOut: NO_STEP,
    setup: (ws) => {
      const masks = folder(ws, (d) => {
        writeFileSync(join(d, 'quadrants.png'), blackPng(48, 32));
        writeFileSync(join(d, 'quadrants-o6.jpg'), blackPng(32, 48)); // a PNG under a .jpg name: decoded by its bytes
        writeFileSync(join(d, 'rgba.png'), blackPng(48, 32));
      });
      const out = ws.path('out');
      return { args: [...trainArgs(ws, out), '--masks', masks], absent: [out] };
    },
  },
  {
    name: '--masks the same folder as --images',
    before: 'wrong',
    args: (ws) => [...trainArgs(ws, ws.path('out')), '--masks', ws.images],
    code: 1,
    message: /--masks \S+ is the --images folder: each photo would be its own mask/,
    notOut: NO_STEP,
  },
  {
    name: 'photos a.png and a.jpg with masks a.png and a.jpg pair by their full names',
    before: 'wrong',
    args: () => [],
    code: 0,
    message: NO_ERROR,
    setup: (ws) => {
      // The two photos have different shapes (48x32 and, upright, 32x48): a mask paired with the wrong photo is refused for its shape.
      const fill = (d: string) => {
        copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(d, 'a.png'));
        copyFileSync(join(FIXTURES, 'images', 'quadrants-o6.jpg'), join(d, 'a.jpg'));
      };
      const out = ws.path('bundle');
      return { args: bundleArgs(ws, folder(ws, fill), out, '--masks', folder(ws, fill)), after: () => assert.equal(readdirSync(join(out, 'masks')).length, 2) };
    },
  },
  {
    name: 'photos a.png and a.jpg with only a mask a.png are refused by name (not both given the one mask)',
    before: 'wrong',
    args: () => [],
    code: 1,
    message:
      /cannot tell which mask is whose for photos a\.jpg and a\.png with masks a\.png: name each mask exactly like its photo \(a\.jpg has no mask of its full name\)/,
    setup: (ws) => {
      const images = folder(ws, (d) => {
        copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(d, 'a.png'));
        copyFileSync(join(FIXTURES, 'images', 'quadrants.jpg'), join(d, 'a.jpg'));
      });
      const masks = folder(ws, (d) => copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(d, 'a.png')));
      const out = ws.path('bundle');
      return { args: bundleArgs(ws, images, out, '--masks', masks), absent: [out] };
    },
  },
  // ---- folders and values as the user meant them --------------------------------------------------------------
  {
    name: 'a folder named p0.txt beside p0.png keeps the photo (a folder is no caption)',
    before: 'wrong',
    args: () => [],
    code: 0,
    message: /p0\.txt is not a file \(a folder or device\), so not a caption: ignored, p0\.png is trained with the prompt/,
    setup: (ws) => {
      const images = folder(ws, (d) => {
        copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(d, 'p0.png'));
        mkdirSync(join(d, 'p0.txt'));
      });
      const out = ws.path('bundle');
      return { args: bundleArgs(ws, images, out), after: () => assert.equal(readdirSync(join(out, 'instance_images')).length, 1) };
    },
  },
  {
    name: '--class-images 7 with a folder named 7 here uses the folder',
    before: 'wrong',
    args: () => [],
    code: 0,
    message: /--class-images 7: the folder \S+\/7 \(its images are the class images/,
    setup: (ws) => {
      const here = ws.path('cwd');
      mkdirSync(join(here, '7'), { recursive: true });
      copyFileSync(join(FIXTURES, 'images', 'quadrants.png'), join(here, '7', 'dog.png'));
      const out = ws.path('bundle');
      return {
        cwd: here,
        args: bundleArgs(ws, ws.images, out, '--class-prompt', 'a photo of a dog', '--class-images', '7'),
        after: () => assert.equal(existsSync(join(out, 'class_images')) && readdirSync(join(out, 'class_images')).length, 1, "the folder's one class image"),
      };
    },
  },
  // ---- messages that name the cause --------------------------------------------------------------------------
  {
    name: 'a weights file that is a symlink loop is named as one (not "weights are missing")',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /unet\/diffusion_pytorch_model\.safetensors is a link that loops back on itself: fix or remove the link/,
    setup: (ws) => {
      const model = ws.path('loop-model');
      cpSync(ws.tiny.folder, model, { recursive: true });
      const file = join(model, 'unet', 'diffusion_pytorch_model.safetensors');
      rmSync(file);
      symlinkSync('diffusion_pytorch_model.safetensors', file);
      return { args: ['inspect', model] };
    },
  },
  {
    name: 'a truncated vocab.json is named as cut short (not "Unterminated string in JSON")',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /tokenizer\/vocab\.json: invalid JSON \(it stops in the middle \(after 300 characters\): the file is damaged or cut short; get it again\)/,
    setup: (ws) => {
      const model = ws.path('cut-vocab');
      cpSync(ws.tiny.folder, model, { recursive: true });
      const vocab = join(model, 'tokenizer', 'vocab.json');
      writeFileSync(vocab, readFileSync(vocab).subarray(0, 300));
      const out = ws.path('img') + '.png';
      return { args: ['sample', '--model', model, '--prompt', 'a dog', '--width', '32', '--height', '32', '--steps', '1', '--out', out], absent: [out] };
    },
  },
  {
    // Dawn's native source line under its warning is filtered where stderr is a terminal or a pipe (node.ts);
    // here stderr is a socket (Node's child-process stdio), which native-stderr.ts cannot reopen.
    name: 'DBS_SYSTEM_VULKAN=1 without a Vulkan driver says what to do',
    before: 'unclear',
    args: () => [],
    code: 1,
    message: /error: no GPU adapter: DBS_SYSTEM_VULKAN=1 uses this system's Vulkan driver, and Dawn found none that works[\s\S]*leave DBS_SYSTEM_VULKAN unset/,
    setup: (ws) => {
      // No driver anywhere: the system's loader pointed at a driver list that does not exist, the project's lavapipe off the path.
      const none = join(ws.dir, 'no-vulkan-driver.json');
      const out = ws.path('img') + '.png';
      return {
        args: ['sample', '--model', ws.tiny.folder, '--prompt', 'a dog', '--width', '32', '--height', '32', '--steps', '1', '--out', out],
        env: { DBS_SYSTEM_VULKAN: '1', VK_ICD_FILENAMES: none, VK_DRIVER_FILES: none, LD_LIBRARY_PATH: '' },
        absent: [out],
      };
    },
  },
  {
    name: 'pretrain --steps 0 --vae-steps 0 (an untrained model)',
    before: 'wrong',
    args: () => [],
    code: 1,
    message: /--steps 0 and --vae-steps 0: no stage would train a step, so the run would write an untrained model/,
    setup: (ws) => {
      const out = ws.path('pretrain');
      return { args: ['lab:pretrain', '--out', out, '--size', 'tiny', '--steps', '0', '--vae-steps', '0'], absent: [out] };
    },
  },
];
