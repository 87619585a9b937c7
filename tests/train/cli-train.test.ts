// `npm run cli -- train` on the tiny model: LoRA with engine-generated class images (prior preservation) and
// exports whose headers are checked; a run killed mid-way and continued with --resume ends with exactly the
// uninterrupted run's LoRA; full DreamBooth from the single file exports the base's key set, which loads
// back; --masks trains with kohya-style mask images and refuses a photo without one before any work; bad input
// exits 1 with a specific message.
import assert from 'node:assert/strict';
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import { copyFileSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { unzipSync } from 'fflate';
import { encode as encodePng } from 'fast-png';
import { kohyaName } from '../../src/export/lora.ts';
import { mergeLycoris } from '../../src/export/merge.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';
import { FIXTURES } from '../helpers.ts';
import { cliArgs } from '../cli.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-train-'));
const tiny = writeTinyModel(dir);
const configPath = join(dir, 'overrides.json');
writeFileSync(configPath, JSON.stringify(tiny.overrides));
const images = join(dir, 'images');
mkdirSync(images);
for (const f of ['quadrants.png', 'quadrants-o6.jpg', 'rgba.png']) copyFileSync(join(FIXTURES, 'images', f), join(images, f));

function cli(...args: string[]): { code: number; out: string; err: string } {
  const r = spawnSync(process.execPath, cliArgs(...args), { stdio: ['ignore', 'pipe', 'pipe'], encoding: 'utf8' });
  return { code: r.status ?? -1, out: r.stdout, err: r.stderr };
}

const loraArgs = (out: string) => [
  'train',
  '--model',
  tiny.folder,
  '--images',
  images,
  '--prompt',
  'a photo of sks dog',
  '--class-prompt',
  'a photo of a dog',
  '--class-images',
  '2',
  '--class-steps',
  '2',
  '--mode',
  'lora',
  '--rank',
  '4',
  '--steps',
  '6',
  '--seed',
  '3',
  '--resolution',
  '32',
  '--checkpoint-every',
  '2',
  '--lr',
  '1e-3',
  '--out',
  out,
];
const tensorsOf = (p: string) => readSafetensors(new Uint8Array(readFileSync(p)));

describe('cli train', () => {
  it('LoRA with generated class images: a progress line per step, kohya and PEFT exports', () => {
    const out = join(dir, 'lora');
    const r = cli(...loraArgs(out));
    assert.equal(r.code, 0, r.err);
    const steps = r.out.split('\n').filter((l) => l.startsWith('step '));
    assert.equal(steps.length, 6);
    assert.match(steps[5], /^step 6\/6 loss \d+\.\d+ \d+\.\d+ s\/step ETA \d+:\d\d:\d\d gpu [\d.]+ MiB \(peak [\d.]+ MiB\) storage [\d.]+ MiB/);
    // The long phases before step 1 say what they do, i of n, and the time left once an item is measured.
    assert.match(r.err, /^Generating class images of "a photo of a dog": image 1 of 2 · estimating the time left$/m);
    assert.match(r.err, /^Generating class images of "a photo of a dog": image 2 of 2 · about \d+:\d\d left$/m);
    assert.match(r.err, /^Encoding with the VAE and the text encoder: image 2 of 5 · about \d+:\d\d left$/m);
    assert.match(r.err, /^Training step 1 of 6 \(warm-up: it also compiles the GPU pipelines\)/m);
    const kohya = tensorsOf(join(out, 'lora-kohya.safetensors'));
    assert.ok([...kohya.tensors.keys()].some((k) => /^lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q\.lora_down\.weight$/.test(k)));
    assert.equal(kohya.metadata.ss_network_dim, '4');
    assert.equal(kohya.metadata.ss_max_train_steps ?? kohya.metadata.ss_steps, '6');
    const peft = tensorsOf(join(out, 'lora-peft.safetensors'));
    assert.ok([...peft.tensors.keys()].every((k) => k.startsWith('unet.') && /lora_[AB]\.weight$/.test(k)));
    // Training moved the up-projections away from PEFT's zero init.
    const ups = [...kohya.tensors].filter(([k]) => k.endsWith('.lora_up.weight'));
    assert.ok(
      ups.some(([, t]) => t.data.some((v) => v !== 0)),
      'lora_up trained',
    );
  });

  it("a run killed after a checkpoint and resumed ends with the uninterrupted run's LoRA, bit for bit", async () => {
    const out = join(dir, 'lora-resumed');
    // Kill the process as soon as step 3 is printed (checkpoint at step 2, step 3 is lost).
    await new Promise<void>((resolve, reject) => {
      const p = spawn(process.execPath, cliArgs(...loraArgs(out)), { stdio: ['ignore', 'pipe', 'pipe'] });
      let buf = '';
      p.stdout.on('data', (d) => {
        buf += d;
        if (buf.includes('step 3/6')) p.kill('SIGKILL');
      });
      p.on('exit', (code, sig) => (sig === 'SIGKILL' ? resolve() : reject(new Error(`exited ${code} before the kill: ${buf}`))));
    });
    const r = cli('train', '--resume', out);
    assert.equal(r.code, 0, r.err);
    assert.match(r.err, /resumed at step 2/);
    assert.equal(r.out.split('\n').filter((l) => l.startsWith('step ')).length, 4, 'steps 3..6 run again');
    const want = tensorsOf(join(dir, 'lora', 'lora-kohya.safetensors')).tensors;
    const got = tensorsOf(join(out, 'lora-kohya.safetensors')).tensors;
    assert.deepEqual([...got.keys()], [...want.keys()]);
    for (const [k, t] of want) assert.deepEqual(got.get(k)!.data, t.data, `${k} differs after resume`);
  });

  it("captions: a .txt beside each photo trains, shuffled and dropped out per step; its tags are the export's ss_tag_frequency", () => {
    const photos = join(dir, 'captioned');
    mkdirSync(photos);
    for (const f of ['quadrants.png', 'quadrants-o6.jpg', 'rgba.png']) copyFileSync(join(FIXTURES, 'images', f), join(photos, f));
    writeFileSync(join(photos, 'quadrants.txt'), 'sks dog, Red collar, grass\n');
    writeFileSync(join(photos, 'rgba.txt'), 'sks dog,close-up');
    const out = join(dir, 'lora-captions');
    const r = cli(
      'train',
      '--model',
      tiny.folder,
      '--images',
      photos,
      '--prompt',
      'a photo of sks dog',
      '--mode',
      'lora',
      '--rank',
      '4',
      '--steps',
      '2',
      '--seed',
      '1',
      '--resolution',
      '32',
      '--shuffle-tags',
      '--keep-tokens',
      '1',
      '--caption-dropout',
      '0.25',
      '--out',
      out,
    );
    assert.equal(r.code, 0, r.err);
    const md = tensorsOf(join(out, 'lora-kohya.safetensors')).metadata;
    // sd-scripts counts each photo's caption (the prompt for the one without), tags stripped and lower-cased.
    assert.deepEqual(JSON.parse(md.ss_tag_frequency), {
      instance_images: { 'a photo of sks dog': 1, 'sks dog': 2, 'red collar': 1, grass: 1, 'close-up': 1 },
    });
    const subset = JSON.parse(md.ss_datasets)[0].subsets[0];
    assert.deepEqual([subset.shuffle_caption, subset.keep_tokens, md.ss_caption_dropout_rate], [true, 1, '0.25']);
    // --keep-tokens does nothing without --shuffle-tags: refused by name before any work.
    const refused = cli('train', '--model', tiny.folder, '--images', photos, '--prompt', 'sks dog', '--keep-tokens', '1', '--out', join(dir, 'kt'));
    assert.equal(refused.code, 1);
    assert.match(refused.err, /--keep-tokens keeps tags in place while they are shuffled: add --shuffle-tags/);
    assert.equal(existsSync(join(dir, 'kt')), false);
  });

  it('LoRA on the text encoder too: lora_te_* adapters trained and exported', () => {
    const out = join(dir, 'lora-te');
    const r = cli(
      'train',
      '--model',
      tiny.folder,
      '--images',
      images,
      '--prompt',
      'a photo of sks dog',
      '--mode',
      'lora',
      '--rank',
      '4',
      '--steps',
      '3',
      '--seed',
      '2',
      '--resolution',
      '32',
      '--lr',
      '1e-2',
      '--train-text-encoder',
      '--text-encoder-lr',
      '5e-3',
      '--out',
      out,
    );
    assert.equal(r.code, 0, r.err);
    // The text encoder's own rate is recorded as kohya records it (ss_unet_lr is the run's --lr).
    const md = tensorsOf(join(out, 'lora-kohya.safetensors')).metadata;
    assert.deepEqual([md.ss_unet_lr, md.ss_text_encoder_lr], ['0.01', '0.005']);
    const kohya = tensorsOf(join(out, 'lora-kohya.safetensors')).tensors;
    const teUps = [...kohya].filter(([k]) => k.startsWith('lora_te_text_model_encoder_layers_') && k.endsWith('.lora_up.weight'));
    assert.ok(teUps.length > 0, 'text-encoder adapters exported');
    assert.ok(
      teUps.some(([, t]) => t.data.some((v) => v !== 0)),
      'text-encoder lora_up trained',
    );
  });

  it("a LoHa + DoRA run exports its LyCORIS file and full models merged by the loaders' rule; lora-diffusers is refused up front", () => {
    const out = join(dir, 'loha-full');
    const args = ['train', '--model', tiny.folder, '--images', images, '--prompt', 'a photo of sks dog', '--rank', '4', '--network', 'loha', '--dora'];
    const refused = cli(...args, '--export', 'lora-diffusers', '--out', out);
    assert.equal(refused.code, 1);
    assert.match(
      refused.err,
      /--export lora-diffusers holds plain LoRA adapters: a --network loha run exports lora-kohya .*, full-single-file or diffusers-zip/,
    );
    assert.equal(existsSync(out), false, 'nothing written');
    const r = cli(
      ...args,
      '--steps',
      '2',
      '--seed',
      '4',
      '--resolution',
      '32',
      '--lr',
      '1e-2',
      '--export',
      'lora-kohya,full-single-file,diffusers-zip',
      '--out',
      out,
    );
    assert.equal(r.code, 0, r.err);
    const kohya = tensorsOf(join(out, 'lora-kohya.safetensors')).tensors;
    const zipped = unzipSync(new Uint8Array(readFileSync(join(out, 'model-diffusers.zip'))));
    const unet = readSafetensors(zipped['unet/diffusion_pytorch_model.safetensors']).tensors;
    const base = readSafetensors(new Uint8Array(readFileSync(join(tiny.folder, 'unet', 'diffusion_pytorch_model.safetensors')))).tensors;
    const spec = { type: 'loha', rank: 4, alpha: 4, convRank: 4, convAlpha: 4, factor: -1, dora: true } as const;
    let [adapted, worst, moved] = [0, 0, 0];
    for (const [name, t] of unet) {
      const k = kohyaName('unet', name.slice(0, -'.weight'.length));
      if (!name.endsWith('.weight') || !kohya.has(`${k}.alpha`)) {
        // an unadapted tensor is the base's, rounded to the file's f16
        assert.deepEqual(t.data, roundToF16(base.get(name)!.data), name);
        continue;
      }
      adapted++;
      // the LyCORIS file's f16 factors merged by export/merge.ts (checked against PyTorch and the trained model's
      // own weights in tests/train/lycoris.test.ts): the zip holds this run's merge, not the base or another's
      const expect = mergeLycoris(Float32Array.from(base.get(name)!.data), t.shape, spec, (f) => kohya.get(`${k}.${f}`)?.data);
      const w = base.get(name)!.data;
      const delta = expect.reduce((m, v, i) => Math.max(m, Math.abs(v - w[i])), 0);
      moved = Math.max(moved, delta);
      // f16 rounding of the merged weight (2^-11 relative, 2^-10 allowed) and 1% of the layer's ΔW for the
      // file's f16 factors (2^-11 each, products of four), as tests/train/lycoris.test.ts allows
      for (let i = 0; i < t.data.length; i++) worst = Math.max(worst, Math.abs(t.data[i] - expect[i]) / (2 ** -10 * Math.abs(expect[i]) + 0.01 * delta));
    }
    assert.ok(adapted >= 32, `${adapted} adapted layers in the zip`);
    assert.ok(worst <= 1, `the zip's merged weights are off by ${worst} of f16 rounding`);
    assert.ok(moved > 1e-3, `the merged weights moved ${moved} from the base (f16 rounding of W is ~1e-4)`);
    // the single file holds the same merged UNet tensors under its own names
    const single = tensorsOf(join(out, 'model.safetensors')).tensors;
    const key = (d: Float32Array) => Buffer.from(d.buffer, d.byteOffset, d.byteLength).toString('base64');
    const inSingle = new Set([...single].filter(([n]) => n.startsWith('model.diffusion_model.')).map(([, t]) => key(t.data)));
    for (const [name, t] of unet) assert.ok(inSingle.has(key(t.data)), `${name} of the zip is in the single file`);
  });

  it('full DreamBooth from a single file: model.safetensors has the base key set and loads back', () => {
    const out = join(dir, 'full');
    const r = cli(
      'train',
      '--model',
      tiny.singleFile,
      '--config',
      configPath,
      '--tokenizer',
      join(tiny.folder, 'tokenizer'),
      '--images',
      images,
      '--prompt',
      'a photo of sks dog',
      '--mode',
      'full',
      '--steps',
      '2',
      '--seed',
      '1',
      '--resolution',
      '32',
      '--out',
      out,
    );
    assert.equal(r.code, 0, r.err);
    const base = tensorsOf(tiny.singleFile);
    const exported = tensorsOf(join(out, 'model.safetensors'));
    assert.deepEqual([...exported.tensors.keys()].sort(), [...base.tensors.keys()].sort());
    const res = JSON.parse(r.out.trim().split('\n').at(-1)!);
    assert.ok(res.exports['model-diffusers.zip'] > 0);
    const zipped = Object.keys(unzipSync(new Uint8Array(readFileSync(join(out, 'model-diffusers.zip')))));
    for (const f of ['model_index.json', 'unet/diffusion_pytorch_model.safetensors', 'tokenizer/vocab.json'])
      assert.ok(zipped.includes(f), `zip has ${f}: ${zipped}`);
    // The exported file is a model the engine loads: inspect reads it as SD1 and, given the tiny model's configs
    // (a single file has none, and its widths are not SD's), lists no problem (it exits 1 when it lists one).
    const inspect = execFileSync(process.execPath, cliArgs('inspect', join(out, 'model.safetensors'), '--config', configPath), { encoding: 'utf8' });
    assert.equal(JSON.parse(inspect).architecture, 'sd1');
    assert.deepEqual(JSON.parse(inspect).problems, []);
  });

  it("full DreamBooth in the compact default (adamw8bit + compact master): killed after a checkpoint and resumed, the uninterrupted run's model bit for bit", async () => {
    const args = (out: string) => [
      'train',
      '--model',
      tiny.folder,
      '--images',
      images,
      '--prompt',
      'a photo of sks dog',
      '--mode',
      'full',
      '--steps',
      '4',
      '--seed',
      '5',
      '--resolution',
      '32',
      '--checkpoint-every',
      '2',
      '--export',
      'full-single-file',
      '--out',
      out,
    ];
    const whole = join(dir, 'full-compact');
    const r0 = cli(...args(whole));
    assert.equal(r0.code, 0, r0.err);
    assert.equal(JSON.parse(readFileSync(join(whole, 'run.json'), 'utf8')).settings.optimizer, 'adamw8bit', 'the full default');
    const out = join(dir, 'full-compact-resumed');
    await new Promise<void>((resolve, reject) => {
      const p = spawn(process.execPath, cliArgs(...args(out)), { stdio: ['ignore', 'pipe', 'pipe'] });
      let buf = '';
      p.stdout.on('data', (d) => {
        buf += d;
        if (buf.includes('step 3/4')) p.kill('SIGKILL');
      });
      p.on('exit', (code, sig) => (sig === 'SIGKILL' ? resolve() : reject(new Error(`exited ${code} before the kill: ${buf}`))));
    });
    const r = cli('train', '--resume', out);
    assert.equal(r.code, 0, r.err);
    assert.match(r.err, /resumed at step 2/);
    const want = tensorsOf(join(whole, 'model.safetensors')).tensors;
    const got = tensorsOf(join(out, 'model.safetensors')).tensors;
    assert.deepEqual([...got.keys()], [...want.keys()]);
    for (const [k, t] of want) assert.deepEqual(got.get(k)!.data, t.data, `${k} differs after resume`);
  });

  it('--masks: each photo trains under the mask named like it (cached with its latents); a photo without one is refused before any work', () => {
    // White left half, black right half, at each photo's upright size (the EXIF-rotated JPEG is 32x48 upright).
    const mask = (w: number, h: number) => {
      const data = new Uint8Array(w * h * 3);
      for (let i = 0; i < w * h; i++) data.fill(i % w < w / 2 ? 255 : 0, i * 3, i * 3 + 3);
      return encodePng({ width: w, height: h, data, channels: 3 });
    };
    const masks = join(dir, 'masks');
    mkdirSync(masks);
    writeFileSync(join(masks, 'quadrants.png'), mask(48, 32));
    writeFileSync(join(masks, 'rgba.png'), mask(48, 32));
    const partial = join(dir, 'masks-partial');
    mkdirSync(partial);
    writeFileSync(join(partial, 'quadrants.png'), mask(48, 32));
    const args = (m: string, out: string) =>
      ['train', '--model', tiny.folder, '--images', images, '--masks', m, '--prompt', 'a photo of sks dog', '--steps', '2', '--resolution', '32'].concat([
        '--mode',
        'lora',
        '--rank',
        '4',
        '--export',
        'lora-kohya',
        '--out',
        out,
      ]);
    let r = cli(...args(partial, join(dir, 'masked-bad')));
    assert.equal(r.code, 1);
    assert.match(r.err, /--masks \S+masks-partial has no mask for quadrants-o6\.jpg, rgba\.png: add an image with the same name/);
    assert.equal(existsSync(join(dir, 'masked-bad', 'run.json')), false, 'nothing written');
    writeFileSync(join(masks, 'quadrants-o6.png'), mask(32, 48));
    const out = join(dir, 'masked');
    r = cli(...args(masks, out));
    assert.equal(r.code, 0, r.err);
    assert.equal(r.out.split('\n').filter((l) => l.startsWith('step ')).length, 2);
    // The validation loss (default every 100 steps): before the first step and after the last.
    assert.match(r.err, /validation loss at step 0: photos \d+\.\d{5} \(/);
    assert.match(r.err, /validation loss at step 2: photos \d+\.\d{5} \(/);
    const cached = readdirSync(join(out, 'store'), { recursive: true }).map(String);
    assert.ok(cached.some((f) => /i0-mask/.test(f)) && cached.some((f) => /i2-mask/.test(f)), `masks cached: ${cached.join(', ')}`);
  });

  it('--aspect bucket: the 48x32 photos train at their own aspect ratio (a bucket shape in the cache), the upright JPEG at its own', () => {
    const out = join(dir, 'bucketed');
    const r = cli(
      ...['train', '--model', tiny.folder, '--images', images, '--prompt', 'a photo of sks dog', '--steps', '2', '--resolution', '32'],
      ...['--aspect', 'bucket', '--mode', 'lora', '--rank', '4', '--export', 'lora-kohya', '--out', out],
    );
    assert.equal(r.code, 0, r.err);
    assert.doesNotMatch(r.err, /not square/, 'no centre-crop warning with buckets');
    assert.equal(r.out.split('\n').filter((l) => l.startsWith('step ')).length, 2);
    // The cache snapshot's record names each bucketed sample's latent shape: landscape for the PNGs, portrait for
    // the EXIF-rotated JPEG (32x48 upright).
    const texts = readdirSync(join(out, 'store'), { recursive: true })
      .map(String)
      .filter((f) => /cache/.test(f))
      .map((f) => {
        try {
          return readFileSync(join(out, 'store', f), 'utf8');
        } catch {
          return '';
        }
      })
      .join('\n');
    const shapes = /"shapes":(\{[^}]*\})/.exec(texts);
    assert.ok(shapes, 'a shapes record in the cache');
    const byPrefix = JSON.parse(shapes[1]) as Record<string, number[]>;
    const kinds = Object.values(byPrefix).map(([, h, w]) => (w > h ? 'landscape' : h > w ? 'portrait' : 'square'));
    assert.deepEqual(kinds.sort(), ['landscape', 'landscape', 'portrait']);
  });

  it('a full run recorded before the optimizer modes (no optimizer / master in run.json) resumes as the fp32 AdamW run it was', () => {
    const out = join(dir, 'old-full');
    let r = cli(
      ...['train', '--model', tiny.folder, '--images', images, '--prompt', 'a photo of sks dog', '--steps', '2', '--resolution', '32'],
      ...['--mode', 'full', '--optimizer', 'adamw', '--master', 'fp32', '--checkpoint-every', '1', '--export', 'full-single-file', '--out', out],
    );
    assert.equal(r.code, 0, r.err);
    const record = JSON.parse(readFileSync(join(out, 'run.json'), 'utf8'));
    delete record.settings.optimizer;
    delete record.settings.master;
    writeFileSync(join(out, 'run.json'), JSON.stringify(record));
    r = cli('train', '--resume', out, '--steps', '3');
    assert.equal(r.code, 0, r.err);
    assert.match(r.out, /^step 3\/3 /m);
  });

  it('bad input: a folder with no images, a missing folder, a wrong mode', () => {
    const empty = join(dir, 'empty');
    mkdirSync(empty);
    writeFileSync(join(empty, 'notes.jpg'), 'this is text, not a photo');
    let r = cli('train', '--model', tiny.folder, '--images', empty, '--prompt', 'x', '--steps', '1', '--resolution', '32', '--out', join(dir, 'bad1'));
    assert.equal(r.code, 1);
    assert.match(r.err, /notes\.jpg/);
    assert.match(r.err, /add at least one image/);
    r = cli('train', '--model', tiny.folder, '--images', join(dir, 'nope'), '--prompt', 'x', '--out', join(dir, 'bad2'));
    assert.equal(r.code, 1);
    assert.match(r.err, /not a folder of images/);
    r = cli('train', '--model', tiny.folder, '--images', images, '--prompt', 'x', '--mode', 'dora', '--out', join(dir, 'bad3'));
    assert.equal(r.code, 1);
    assert.match(r.err, /--mode must be lora or full/);
    // A GPU budget the run cannot fit is refused before any training step, saying what it needs.
    r = cli(
      'train',
      '--model',
      tiny.folder,
      '--images',
      images,
      '--prompt',
      'x',
      '--mode',
      'full',
      '--steps',
      '1',
      '--resolution',
      '32',
      '--budget',
      '64KiB',
      '--out',
      join(dir, 'bad4'),
    );
    assert.equal(r.code, 1);
    assert.match(r.err, /budget/i);
    assert.doesNotMatch(r.out, /^step /m);
  });
});
