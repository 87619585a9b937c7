// Job bundles (issue 17, pipeline/bundle.ts + cli/bundle.ts): train.sh uses only options that diffusers
// 0.40's train_dreambooth(_lora).py declare (tests/fixtures/diffusers/dreambooth-options.json, recorded from the
// release by extract_options.py), with values where the script takes one and shell quoting that survives a
// real bash; every setting of the schema is mapped or listed in the README as having no counterpart; the
// layout is what the scripts read (instance_data_dir / class_data_dir of images only, the crops applied);
// ray_train.py is Python that compiles and uses Ray Train's TorchTrainer with checkpoints and restore; a
// model the scripts cannot load says what to provide; and `cli train --bundle` writes it all without a GPU.
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { decode, encode } from 'fast-png';
import { prepareImage, type RgbaImage } from '../../src/io/image.ts';
import { bundleModel } from '../../src/cli/bundle.ts';
import { DIFFUSERS_TARGET, jobBundle, type BundleFile, type BundleInput } from '../../src/pipeline/bundle.ts';
import { defaultSettings, SETTINGS, type RunSettings } from '../../src/pipeline/settings.ts';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';
import { cliArgs } from '../cli.ts';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const FIXTURE = JSON.parse(readFileSync(join(root, 'tests/fixtures/diffusers/dreambooth-options.json'), 'utf8')) as {
  diffusers_version: string;
  commit: string;
  scripts: Record<string, { options: Record<string, { takes_value: boolean }> }>;
};
const png = (rgb: Uint8Array, width: number, height: number) => encode({ width, height, data: rgb, channels: 3, depth: 8 });

/** A photo whose left and right halves differ, so a crop that is not centred gives other pixels. */
function photo(width: number, height: number, seed: number): RgbaImage {
  const data = new Uint8ClampedArray(width * height * 4);
  for (let y = 0; y < height; y++)
    for (let x = 0; x < width; x++) data.set([(x * 7 + seed * 40) % 256, (y * 5) % 256, x < width / 2 ? 30 : 220, 255], (y * width + x) * 4);
  return { width, height, data };
}

function input(over: Partial<RunSettings>, extra: Partial<BundleInput> = {}): BundleInput {
  const mode = over.mode ?? 'lora';
  const settings = { ...defaultSettings(mode), ...(mode === 'lora' ? { alpha: 8 } : {}), resolution: 16, ...over };
  return {
    prompt: "a photo of sks dog's face",
    images: [
      { name: 'dog 1.jpg', image: photo(40, 24, 1), crop: { x: 16, y: 0, size: 24 }, caption: 'sks dog on grass' },
      { name: 'dog2.png', image: photo(24, 24, 2), mask: { name: 'dog2-mask.png', image: photo(24, 24, 9) } },
    ],
    classImages: [{ name: 'c1.png', image: photo(20, 30, 3) }],
    settings,
    model: { kind: 'hub', name: 'sd15', hubId: 'stable-diffusion-v1-5/stable-diffusion-v1-5', revision: 'abc123' },
    ...extra,
  };
}

const file = (files: BundleFile[], path: string) => {
  const f = files.find((x) => x.path === path);
  assert.ok(f, `${path} is in the bundle`);
  return f!.data;
};
const text = (files: BundleFile[], path: string) => file(files, path) as string;

/** The `--name[=value]` arguments train.sh passes to the script, as written (value unquoted by the shell later). */
function scriptOptions(sh: string): { name: string; hasValue: boolean }[] {
  const lines = sh.split('\n');
  const start = lines.findIndex((l) => l.startsWith('accelerate launch'));
  return lines
    .slice(start + 1)
    .map((l) => l.trim())
    .filter((l) => l.startsWith('--'))
    .map((l) => ({ name: /^--([A-Za-z0-9_]+)/.exec(l)![1], hasValue: l.includes('=') }));
}

/** Writes a bundle to a folder and runs its train.sh with a fake `accelerate` that records its arguments. */
function runTrainSh(files: BundleFile[], env: Record<string, string> = {}): { status: number | null; args: string[]; stderr: string; dir: string } {
  const dir = mkdtempSync(join(tmpdir(), 'dbs-bundle-'));
  for (const f of files) {
    mkdirSync(dirname(join(dir, f.path)), { recursive: true });
    writeFileSync(join(dir, f.path), f.data);
    if (f.executable) chmodSync(join(dir, f.path), 0o755);
  }
  const bin = join(dir, 'fake-bin');
  mkdirSync(bin);
  writeFileSync(join(bin, 'accelerate'), `#!/usr/bin/env bash\nfor a in "$@"; do printf '%s\\0' "$a"; done > "${dir}/args"\n`);
  chmodSync(join(bin, 'accelerate'), 0o755);
  const r = spawnSync('bash', [join(dir, 'train.sh')], { env: { PATH: `${bin}:/usr/bin:/bin`, ...env } });
  const args = existsSync(join(dir, 'args')) ? readFileSync(join(dir, 'args'), 'utf8').split('\0').slice(0, -1) : [];
  return { status: r.status, args, stderr: r.stderr.toString(), dir };
}

describe('job bundle: train.sh against diffusers 0.40', () => {
  it('the fixture is the recorded release', () => {
    assert.equal(FIXTURE.diffusers_version, DIFFUSERS_TARGET.version);
    assert.equal(FIXTURE.commit, DIFFUSERS_TARGET.commit);
    assert.ok(Object.keys(FIXTURE.scripts['train_dreambooth_lora.py'].options).length > 50);
  });

  for (const [label, over, script] of [
    [
      'LoRA (text encoder, samples, prior preservation)',
      { mode: 'lora', trainTextEncoder: true, sampleEvery: 10, priorPreservation: true, classPrompt: 'a photo of a dog' },
      'train_dreambooth_lora.py',
    ],
    ['LoRA, defaults', { mode: 'lora' }, 'train_dreambooth_lora.py'],
    [
      'full (offset noise 0.1, min-SNR, samples, prior preservation)',
      { mode: 'full', offsetNoise: 0.1, minSnrGamma: 5, sampleEvery: 10, priorPreservation: true, classPrompt: 'a photo of a dog' },
      'train_dreambooth.py',
    ],
  ] as const) {
    it(`${label}: every option exists in ${script}, with a value exactly where it takes one`, () => {
      const files = jobBundle(input(over as Partial<RunSettings>), png);
      const sh = text(files, 'train.sh');
      assert.match(sh, new RegExp(`accelerate launch "\\$DIFFUSERS_EXAMPLES/${script.replace('.', '\\.')}"`));
      const known = FIXTURE.scripts[script].options;
      const used = scriptOptions(sh);
      assert.ok(used.length >= 15, `${used.length} options`);
      for (const o of used) {
        assert.ok(known[o.name], `--${o.name} is an option of ${script} ${FIXTURE.diffusers_version}`);
        assert.equal(o.hasValue, known[o.name].takes_value, `--${o.name} ${known[o.name].takes_value ? 'takes' : 'takes no'} value`);
      }
      const names = used.map((o) => o.name);
      for (const need of [
        'pretrained_model_name_or_path',
        'instance_data_dir',
        'instance_prompt',
        'resolution',
        'train_batch_size',
        'learning_rate',
        'max_train_steps',
        'seed',
        'mixed_precision',
        'gradient_checkpointing',
        'checkpointing_steps',
      ])
        assert.ok(names.includes(need), `--${need} is passed`);
      if (over.mode === 'lora') assert.ok(names.includes('rank'));
      if ('priorPreservation' in over)
        for (const need of ['with_prior_preservation', 'class_data_dir', 'class_prompt', 'num_class_images', 'prior_loss_weight'])
          assert.ok(names.includes(need), need);
      if ('sampleEvery' in over) assert.ok(names.includes('validation_prompt'));
      if (over.mode === 'full') assert.ok(names.includes('offset_noise') && names.includes('snr_gamma'), 'offset noise 0.1 and min-SNR map in the full script');
      assert.equal(new Set(names).size, names.length, 'no option twice');
    });
  }

  it('through a real bash: the values reach the script as written (quotes, spaces), MODEL overridable', () => {
    const files = jobBundle(input({ mode: 'lora', sampleEvery: 10, samplePrompt: 'sks dog "in" the $HOME snow' }), png);
    const r = runTrainSh(files, { DIFFUSERS_EXAMPLES: '/x' });
    assert.equal(r.status, 0, r.stderr);
    assert.deepEqual(r.args.slice(0, 2), ['launch', '/x/train_dreambooth_lora.py']);
    assert.ok(r.args.includes("--instance_prompt=a photo of sks dog's face"), r.args.join('\n'));
    assert.ok(r.args.includes('--validation_prompt=sks dog "in" the $HOME snow'));
    assert.ok(r.args.includes('--pretrained_model_name_or_path=stable-diffusion-v1-5/stable-diffusion-v1-5'));
    assert.ok(r.args.includes('--revision=abc123'));
    assert.ok(r.args.includes('--rank=8') && r.args.includes('--resolution=16') && r.args.includes('--max_train_steps=400'));
    const again = runTrainSh(files, { MODEL: '/models/mine', DIFFUSERS_EXAMPLES: '/x' });
    assert.ok(again.args.includes('--pretrained_model_name_or_path=/models/mine'));
  });
});

describe('job bundle: settings never dropped', () => {
  it('every setting of the schema is in job.json; those without a counterpart are named in the README', () => {
    for (const over of [
      {
        mode: 'lora',
        offsetNoise: 0.05,
        minSnrGamma: 5,
        flip: true,
        priorPreservation: true,
        classPrompt: 'a photo of a dog',
        trainTextEncoder: true,
        textEncoderLr: 1e-5,
      },
      { mode: 'full', offsetNoise: 0.2, sampleEvery: 5 },
    ] as const) {
      const files = jobBundle(input(over as Partial<RunSettings>), png);
      const job = JSON.parse(text(files, 'job.json'));
      const readme = text(files, 'README.md');
      const mapped = new Set(job.mapping.map((m: { setting: string }) => m.setting));
      for (const spec of SETTINGS) assert.ok(mapped.has(spec.key), `${spec.key} is in job.json's mapping`);
      const none = readme.slice(readme.indexOf('### No counterpart'));
      for (const m of job.mapping as { setting: string; option: string | null }[])
        if (m.option === null) assert.ok(none.includes(`**${m.setting}**`), `${m.setting} is listed under "No counterpart"`);
        else assert.ok(readme.includes(m.option.split('=')[0]), `${m.option} is in the README's table`);
      assert.match(readme, /diffusers 0\.40\.0/);
      assert.match(readme, /accelerate config/);
      assert.match(readme, /--multi_gpu/);
      assert.match(readme, /DeepSpeed/);
      if (over.mode === 'lora') {
        assert.match(none, /\*\*minSnrGamma\*\* = 5: train_dreambooth_lora\.py has no --snr_gamma/);
        assert.match(none, /\*\*offsetNoise\*\* = 0\.05/);
        assert.match(none, /\*\*alpha\*\* = 8/);
        assert.match(none, /\*\*captions\*\* = 1/);
        assert.match(none, /\*\*masks\*\* = 1: masked loss/);
        assert.match(none, /\*\*textEncoderLr\*\* = 0\.00001: train_dreambooth_lora\.py trains the text encoder at --learning_rate/);
      } else assert.match(none, /\*\*offsetNoise\*\* = 0\.2: train_dreambooth\.py's --offset_noise is fixed at 0\.1/);
    }
  });
});

describe('job bundle: the layout the scripts read', () => {
  it('instance_data_dir and class_data_dir hold only images at the resolution, the crop applied and flips added', () => {
    const inp = input({ mode: 'lora', flip: true, priorPreservation: true, classPrompt: 'a photo of a dog' });
    const files = jobBundle(inp, png);
    const args = Object.fromEntries(
      text(files, 'train.sh')
        .split('\n')
        .map((l) => /^\s*--(instance_data_dir|class_data_dir)=(\S+) \\$/.exec(l))
        .filter((m) => m)
        .map((m) => [m![1], m![2]]),
    );
    assert.deepEqual(args, { instance_data_dir: 'instance_images', class_data_dir: 'class_images' });
    const under = (dir: string) => files.filter((f) => f.path.startsWith(`${dir}/`));
    // The scripts open every file of these folders as an image (DreamBoothDataset: Path(dir).iterdir()).
    for (const [dir, count] of [
      ['instance_images', 4],
      ['class_images', 1],
    ] as const) {
      assert.equal(under(dir).length, count, dir);
      for (const f of under(dir)) {
        const img = decode(f.data as Uint8Array);
        assert.deepEqual([img.width, img.height, img.channels], [16, 16, 3], f.path);
      }
    }
    // The first photo's chosen crop (its right square), not the scripts' centre crop.
    const first = decode(file(files, 'instance_images/001-dog-1.png') as Uint8Array);
    const want = prepareImage(inp.images[0].image, { resolution: 16, crop: inp.images[0].crop });
    const centre = prepareImage(inp.images[0].image, { resolution: 16, crop: 'center' });
    const rgbAt = (chw: Float32Array, p: number) => [0, 1, 2].map((c) => Math.round((chw[c * 256 + p] + 1) * 127.5));
    for (let p = 0; p < 256; p++) assert.deepEqual([...first.data.slice(3 * p, 3 * p + 3)], rgbAt(want, p), `pixel ${p}`);
    assert.notDeepEqual(rgbAt(centre, 0), rgbAt(want, 0), 'the crop matters for this photo');
    const flipped = decode(file(files, 'instance_images/001-dog-1-flip.png') as Uint8Array);
    assert.deepEqual([...flipped.data.slice(0, 3)], [...first.data.slice(3 * 15, 3 * 16)], 'the mirrored copy');
    // prompts.jsonl: captions and masks per image; the masks sit outside the image folders.
    const prompts = text(files, 'prompts.jsonl')
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l));
    assert.deepEqual(
      prompts.map((p) => [p.file, p.prompt, p.mask ?? null]),
      [
        ['instance_images/001-dog-1.png', 'sks dog on grass', null],
        ['instance_images/001-dog-1-flip.png', 'sks dog on grass', null],
        ['instance_images/002-dog2.png', "a photo of sks dog's face", 'masks/002-dog2.png'],
        ['instance_images/002-dog2-flip.png', "a photo of sks dog's face", 'masks/002-dog2-flip.png'],
      ],
    );
    for (const p of prompts) if (p.mask) assert.equal(decode(file(files, p.mask) as Uint8Array).width, 16);
  });

  it('generated class images: class_images/ starts empty and the script is asked for the count', () => {
    const files = jobBundle(input({ mode: 'lora', priorPreservation: true, classPrompt: 'a photo of a dog', classCount: 12 }, { classImages: [] }), png);
    assert.equal(files.filter((f) => f.path.startsWith('class_images/')).length, 0);
    assert.match(text(files, 'train.sh'), /--num_class_images=12 \\/);
    assert.match(text(files, 'README.md'), /generates 12 images of "a photo of a dog"/);
  });
});

describe('job bundle: ray_train.py', () => {
  const py = text(jobBundle(input({ mode: 'lora' }), png), 'ray_train.py');

  it('is a Ray Train TorchTrainer over N workers with checkpoints and restore', () => {
    for (const need of [
      'from ray.train.torch import TorchTrainer',
      'ScalingConfig(num_workers=args.num_workers',
      'ray.train.get_checkpoint()',
      'ray.train.Checkpoint.from_directory',
      'ray.train.report(metrics, checkpoint=',
      'TorchTrainer.can_restore(path)',
      'TorchTrainer.restore(path',
      'FailureConfig(max_failures=',
      'ray.train.torch.prepare_model(unet)',
      '"lr": s.get("textEncoderLr") or s["lr"]',
      'read_job()',
    ])
      assert.ok(py.includes(need), need);
  });

  it('compiles as Python 3 (/usr/bin/python3 -m py_compile; Debian always has python3)', () => {
    const python = ['/usr/bin/python3', 'python3'].find((p) => spawnSync(p, ['--version']).status === 0);
    assert.ok(python, 'python3 is installed (Debian base system)');
    const dir = mkdtempSync(join(tmpdir(), 'dbs-ray-'));
    writeFileSync(join(dir, 'ray_train.py'), py);
    const r = spawnSync(python!, ['-m', 'py_compile', join(dir, 'ray_train.py')]);
    assert.equal(r.status, 0, r.stderr.toString());
    // And its argument parser runs without Ray or torch installed (the imports are inside the functions).
    const help = spawnSync(python!, [join(dir, 'ray_train.py'), '--help']);
    assert.equal(help.status, 0, help.stderr.toString());
    assert.match(help.stdout.toString(), /--num-workers/);
  });
});

describe('job bundle: the base model reference', () => {
  it('a local single file with no hub id: train.sh refuses to start without MODEL and says what to provide', () => {
    const files = jobBundle(input({ mode: 'lora' }, { model: { kind: 'single-file', name: 'my-model.safetensors' } }), png);
    const r = runTrainSh(files);
    assert.notEqual(r.status, 0);
    assert.match(r.stderr, /^set MODEL first: "my-model\.safetensors" is a single checkpoint file, which diffusers' training scripts cannot load/);
    assert.deepEqual(r.args, [], 'accelerate was not run');
    assert.match(text(files, 'README.md'), /\*\*Provide it:\*\* "my-model\.safetensors" is a single checkpoint file/);
    assert.equal(runTrainSh(files, { MODEL: 'org/repo' }).status, 0);
  });

  it('a Hugging Face cache snapshot gives its repo and commit; --hub-id wins', () => {
    const dir = mkdtempSync(join(tmpdir(), 'dbs-hf-'));
    const snap = join(dir, 'models--stabilityai--stable-diffusion-2-1', 'snapshots', 'a'.repeat(40));
    mkdirSync(snap, { recursive: true });
    assert.deepEqual(bundleModel(snap, undefined, undefined), {
      kind: 'hub',
      name: 'a'.repeat(40),
      hubId: 'stabilityai/stable-diffusion-2-1',
      revision: 'a'.repeat(40),
    });
    assert.deepEqual(bundleModel(dir, 'org/x', 'main'), { kind: 'hub', name: dir.split('/').pop(), hubId: 'org/x', revision: 'main' });
    assert.equal(bundleModel(dir, undefined, undefined).kind, 'diffusers');
  });
});

describe('cli train --bundle', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dbs-cli-bundle-'));
  const tiny = writeTinyModel(dir);
  const images = join(dir, 'photos');
  mkdirSync(images);
  for (const [i, name] of ['a.png', 'b.png'].entries()) {
    const p = photo(24, 16, i);
    writeFileSync(join(images, name), encode({ width: p.width, height: p.height, data: new Uint8Array(p.data.buffer), channels: 4, depth: 8 }));
  }
  writeFileSync(join(images, 'a.txt'), 'sks dog running');
  const cli = (...args: string[]) => spawnSync(process.execPath, cliArgs('train', ...args));

  it('writes the bundle from the same flags (no GPU, no --out), validated against the model', () => {
    const out = join(dir, 'job');
    const r = cli(
      '--model',
      tiny.folder,
      '--images',
      images,
      '--prompt',
      'a photo of sks dog',
      '--resolution',
      '16',
      '--steps',
      '30',
      '--rank',
      '2',
      '--bundle',
      out,
    );
    assert.equal(r.status, 0, r.stderr.toString());
    // .dbs-written.json: the folder's manifest of what the bundle wrote (src/io/outpath.ts; --overwrite removes only those).
    assert.deepEqual(readdirSync(out).sort(), [
      '.dbs-written.json',
      'README-sd-scripts.md',
      'README.md',
      'instance_images',
      'job.json',
      'prompts.jsonl',
      'ray_train.py',
      'requirements.txt',
      'sd-scripts.toml',
      'train-sd-scripts.sh',
      'train.sh',
    ]);
    assert.deepEqual(readdirSync(join(out, 'instance_images')).sort(), ['001-a.png', '002-b.png']);
    const sh = readFileSync(join(out, 'train.sh'), 'utf8');
    assert.match(sh, /--max_train_steps=30 \\/);
    assert.match(sh, /--rank=2 \\/);
    assert.match(r.stderr.toString(), /warning: the local diffusers folder "tiny-sd1-diffusers": copy it to the training machine and set MODEL/);
    assert.ok(readFileSync(join(out, 'prompts.jsonl'), 'utf8').includes('sks dog running'));
    execFileSync('bash', ['-n', join(out, 'train.sh')]);
    // --masks: every photo's mask goes into masks/ and the README lists the masked loss as having no counterpart.
    const masks = join(dir, 'masks');
    mkdirSync(masks);
    for (const name of ['a.png', 'b.png']) writeFileSync(join(masks, name), readFileSync(join(images, name)));
    const m = cli(
      '--model',
      tiny.folder,
      '--images',
      images,
      '--prompt',
      'a photo of sks dog',
      '--resolution',
      '16',
      '--masks',
      masks,
      '--bundle',
      join(dir, 'masked'),
    );
    assert.equal(m.status, 0, m.stderr.toString());
    assert.deepEqual(readdirSync(join(dir, 'masked', 'masks')).sort(), ['001-a.png', '002-b.png']);
    assert.match(readFileSync(join(dir, 'masked', 'README.md'), 'utf8'), /\*\*masks\*\* = 2: masked loss: the scripts have none/);
  });

  it('refuses: --out with --bundle, an existing bundle without --overwrite, a rank the model cannot take; nothing written', () => {
    const out = join(dir, 'job2');
    const base = ['--model', tiny.folder, '--images', images, '--prompt', 'a photo of sks dog', '--resolution', '16'];
    const withOut = cli(...base, '--bundle', out, '--out', join(dir, 'run'));
    assert.equal(withOut.status, 1);
    assert.match(withOut.stderr.toString(), /--out does not apply to --bundle/);
    assert.ok(!existsSync(out));
    const rank = cli(...base, '--rank', '999', '--bundle', out);
    assert.equal(rank.status, 1);
    assert.match(rank.stderr.toString(), /--rank 999 is larger than this model's narrowest adapted layer/);
    assert.ok(!existsSync(out));
    assert.equal(cli(...base, '--bundle', out).status, 0);
    const again = cli(...base, '--bundle', out);
    assert.equal(again.status, 1);
    assert.match(again.stderr.toString(), /holds a bundle already: choose another folder, or add --overwrite/);
    assert.equal(cli(...base, '--bundle', out, '--overwrite').status, 0);
  });
});
