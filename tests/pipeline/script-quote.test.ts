// Issue 46: every value a user types reaches the job bundle's generated scripts through one quoting function
// (src/pipeline/quote.ts) for train.sh, and through JSON (job.json / prompts.jsonl) for ray_train.py. A corpus of
// hostile strings (the issue's hub id, $(...), backticks, quotes, newlines, globs, unicode) must come back
// byte for byte from a real bash and dash, and from Python's json, and no command inside them may run.
import assert from 'node:assert/strict';
import { spawnSync, type SpawnSyncReturns } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { encode } from 'fast-png';
import type { RgbaImage } from '../../src/io/image.ts';
import { jobBundle, type BundleFile, type BundleInput } from '../../src/pipeline/bundle.ts';
import { shellComment, shellQuote } from '../../src/pipeline/quote.ts';
import { defaultSettings, SETTINGS } from '../../src/pipeline/settings.ts';
import { bundleZip, checkEntryPaths } from '../../src/studio/bundle-zip.ts';

/** Each would run a command (touch PWNED) or change the value if it reached a script unquoted. */
const HOSTILE = [
  'org/x}"; touch PWNED; echo "$(touch PWNED)',
  '$(touch PWNED)',
  '`touch PWNED`',
  "it's a 'quoted' dog",
  'say "hi" \\" \\\\ \\n',
  'line one\nline two\r\n; touch PWNED',
  '${HOME} $HOME $0 $$ $? !! !-1',
  '* ? [a-z] ~ ~root {a,b}',
  '; touch PWNED & | > PWNED < /dev/null',
  "'; touch PWNED; echo '",
  '-rf --help',
  'ünïcödé 犬 🐕 \u200b zero-width \u2028 line sep',
  "\\'\\''",
  '%s %n %x',
  ' leading and trailing spaces ',
  '#not a comment',
];

function tmp(): string {
  return mkdtempSync(join(tmpdir(), 'dbs-quote-'));
}

function pwned(dir: string): boolean {
  return existsSync(join(dir, 'PWNED'));
}

void describe('shellQuote: hostile strings through real shells', () => {
  for (const shell of ['bash', 'sh']) {
    void it(`${shell} reads every hostile string back unchanged and runs nothing`, () => {
      const cwd = tmp();
      const script = HOSTILE.map((s) => `printf '%s\\0' ${shellQuote(s)}`).join('\n');
      const r = spawnSync(shell, ['-c', script], { cwd, encoding: 'utf8' });
      assert.equal(r.status, 0, r.stderr);
      assert.deepEqual(r.stdout.split('\0').slice(0, -1), HOSTILE);
      assert.ok(!pwned(cwd), 'a command inside a value ran');
    });
  }

  void it('refuses a NUL (no process argument can carry it) instead of cutting the value', () => {
    assert.throws(() => shellQuote('a\0b', 'the prompt'), /the prompt holds a NUL character/);
  });

  void it('a comment cannot be ended by a line break in the value', () => {
    for (const s of HOSTILE) assert.ok(!/[\n\r\u2028\u2029]/.test(shellComment(s)), JSON.stringify(s));
  });
});

const png = (rgb: Uint8Array, width: number, height: number) => encode({ width, height, data: rgb, channels: 3, depth: 8 });

function photo(seed: number): RgbaImage {
  const data = new Uint8ClampedArray(16 * 16 * 4).map((_, i) => (i * 13 + seed) % 256);
  return { width: 16, height: 16, data };
}

/** A bundle whose every typed value is `s`: hub id, revision, instance, class and sample prompts, file name. */
function hostileBundle(s: string, classImages = 0): BundleFile[] {
  const input: BundleInput = {
    prompt: s,
    images: [{ name: `${s}.png`, image: photo(1) }],
    classImages: Array.from({ length: classImages }, (_, i) => ({ name: `${s}-${i}.png`, image: photo(2 + i) })),
    settings: {
      ...defaultSettings('lora'),
      resolution: 16,
      priorPreservation: true,
      classPrompt: s,
      sampleEvery: 10,
      samplePrompt: s,
    },
    model: { kind: 'hub', name: s, hubId: s, revision: s },
  };
  return jobBundle(input, png);
}

/** Writes the bundle and runs train.sh with a fake `accelerate` that records its arguments (NUL-separated). */
function runTrainSh(
  files: BundleFile[],
  env: Record<string, string> = {},
  script = 'train.sh',
): { status: number | null; args: string[]; stderr: string; dir: string } {
  const dir = tmp();
  for (const f of files) {
    mkdirSync(dirname(join(dir, f.path)), { recursive: true });
    writeFileSync(join(dir, f.path), f.data);
    if (f.executable) chmodSync(join(dir, f.path), 0o755);
  }
  const bin = join(dir, 'fake-bin');
  mkdirSync(bin);
  writeFileSync(join(bin, 'accelerate'), `#!/usr/bin/env bash\nfor a in "$@"; do printf '%s\\0' "$a"; done > "${dir}/args"\n`);
  chmodSync(join(bin, 'accelerate'), 0o755);
  const r = spawnSync('bash', [join(dir, script)], { cwd: dir, env: { PATH: `${bin}:/usr/bin:/bin`, DIFFUSERS_EXAMPLES: '/x', ...env } });
  const args = existsSync(join(dir, 'args')) ? readFileSync(join(dir, 'args'), 'utf8').split('\0').slice(0, -1) : [];
  return { status: r.status, args, stderr: r.stderr.toString(), dir };
}

void describe('train.sh: every typed value is one quoted word', () => {
  for (const s of HOSTILE) {
    void it(`reaches accelerate unchanged and runs nothing: ${JSON.stringify(s).slice(0, 50)}`, () => {
      const files = hostileBundle(s);
      const sh = files.find((f) => f.path === 'train.sh')!.data as string;
      assert.equal(spawnSync('bash', ['-n', '-c', sh]).status, 0, `bash -n:\n${sh}`);
      const r = runTrainSh(files);
      assert.equal(r.status, 0, r.stderr);
      for (const opt of ['pretrained_model_name_or_path', 'revision', 'instance_prompt', 'class_prompt', 'validation_prompt'])
        assert.ok(r.args.includes(`--${opt}=${s}`), `--${opt} arrived as ${JSON.stringify(r.args.find((a) => a.startsWith(`--${opt}=`)))}`);
      assert.ok(!pwned(r.dir) && !readdirSync(r.dir).includes('PWNED'), 'a command inside a value ran');
    });
  }

  void it('every option word is a plain value, a single-quoted string or "$MODEL" (nothing else can expand)', () => {
    const sh = hostileBundle(HOSTILE[0]).find((f) => f.path === 'train.sh')!.data as string;
    const options = sh
      .split('\n')
      .filter((l) => /^ {2}--/.test(l))
      .map((l) => l.trim().replace(/ \\$/, ''));
    assert.ok(options.length > 15);
    // Single-quoted: '...' pieces joined by \' (how a ' is written), nothing outside them.
    const word = /^--[a-z_0-9]+(=([A-Za-z0-9._/+-]+|"\$MODEL"|'[^']*'(\\''[^']*')*))?$/;
    for (const o of options) assert.match(o, word);
  });
});

/** Debian's shellcheck, installed into the project by scripts/setup-shellcheck.sh (scripts/ensure-deps.sh runs it). */
const SHELLCHECK = join(import.meta.dirname, '..', '..', '.local', 'shellcheck', 'run');

/** Runs shellcheck (every severity, style included) on `files`; its gcc-format report. */
function shellcheck(files: string[]): { status: number | null; report: string } {
  assert.ok(existsSync(SHELLCHECK), `${SHELLCHECK} is missing: run bash scripts/setup-shellcheck.sh (scripts/ensure-deps.sh runs it)`);
  const r = spawnSync(SHELLCHECK, ['--severity=style', '--format=gcc', ...files], { encoding: 'utf8' });
  return { status: r.status, report: `${r.stdout}${r.stderr}` };
}

void describe('shellcheck: every generated script is clean with every hostile string', () => {
  void it('train.sh and train-sd-scripts.sh (LoRA and full; hub, single-file and folder models) report nothing', () => {
    const dir = tmp();
    const paths: string[] = [];
    const models = (s: string) => [
      { kind: 'hub' as const, name: s, hubId: s, revision: s },
      { kind: 'single-file' as const, name: s },
      { kind: 'diffusers' as const, name: s },
    ];
    // Every string with each model kind (the MODEL line differs); LoRA and full options alternate (each is one word either way).
    HOSTILE.forEach((s, i) => {
      const mode = i % 2 ? 'full' : 'lora';
      for (const model of models(s)) {
        const files = jobBundle(
          {
            prompt: s,
            images: [{ name: `${s}.png`, image: photo(1), caption: s }],
            classImages: [{ name: `${s}-0.png`, image: photo(2) }],
            settings: { ...defaultSettings(mode), resolution: 16, priorPreservation: true, classPrompt: s, sampleEvery: 10, samplePrompt: s },
            model,
          },
          png,
        );
        const scripts = files.filter((f) => f.executable || /\.(sh|bash)$/.test(f.path) || String(f.data).startsWith('#!/usr/bin/env bash'));
        assert.deepEqual(scripts.map((f) => f.path).sort(), ['train-sd-scripts.sh', 'train.sh'], "the bundle's shell scripts");
        for (const f of scripts) {
          const path = join(dir, `${i}-${mode}-${model.kind}-${f.path}`);
          writeFileSync(path, f.data);
          paths.push(path);
        }
      }
    });
    const r = shellcheck(paths);
    assert.equal(r.status, 0, `shellcheck reports:\n${r.report.slice(0, 4000)}`);
  });

  void it('the check can fail: an unquoted expansion in a script is reported (SC2086)', () => {
    const path = join(tmp(), 'bad.sh');
    writeFileSync(path, '#!/usr/bin/env bash\nname=$1\necho $name\n');
    const r = shellcheck([path]);
    assert.equal(r.status, 1, r.report);
    assert.match(r.report, /SC2086/);
  });
});

/** Every option sd-scripts' train_network.py / train_db.py parse that the bundle writes (library/train_util.py, train_network.py). */
const SD_SCRIPTS_OPTIONS = new Set(
  (
    'pretrained_model_name_or_path dataset_config output_dir output_name save_model_as network_module network_dim network_alpha ' +
    'network_train_unet_only learning_rate text_encoder_lr max_train_steps lr_scheduler lr_warmup_steps lr_scheduler_num_cycles ' +
    'lr_scheduler_power mixed_precision seed prior_loss_weight noise_offset min_snr_gamma save_every_n_steps optimizer_type max_grad_norm gradient_checkpointing'
  ).split(' '),
);

void describe('sd-scripts target: train-sd-scripts.sh and sd-scripts.toml carry hostile values unchanged', () => {
  void it('the launch gets each value as one word, the TOML parses (tomllib) to the same strings, nothing runs', () => {
    const python = ['/usr/bin/python3', 'python3'].find((p) => spawnSync(p, ['--version']).status === 0);
    assert.ok(python, 'python3 is installed (Debian base system)');
    const got: unknown[] = [];
    for (const s of HOSTILE) {
      const files = hostileBundle(s, 1);
      const sh = files.find((f) => f.path === 'train-sd-scripts.sh')!.data as string;
      assert.equal(spawnSync('bash', ['-n', '-c', sh]).status, 0, `bash -n:\n${sh}`);
      const r = runTrainSh(files, { SD_SCRIPTS: '/sd' }, 'train-sd-scripts.sh');
      assert.equal(r.status, 0, r.stderr);
      assert.equal(r.args[1], '/sd/train_network.py');
      assert.ok(r.args.includes(`--pretrained_model_name_or_path=${s}`), 'the hub id arrived as one word');
      for (const a of r.args.slice(2)) assert.ok(SD_SCRIPTS_OPTIONS.has(a.replace(/^--/, '').split('=')[0]), `${a}: an option sd-scripts parses`);
      assert.ok(!pwned(r.dir) && !readdirSync(r.dir).includes('PWNED'), 'a command inside a value ran');
      const t: SpawnSyncReturns<string> = spawnSync(
        python!,
        ['-c', 'import json,sys,tomllib\nd=tomllib.load(open("sd-scripts.toml","rb"))\nprint(json.dumps(d))'],
        {
          cwd: r.dir,
          encoding: 'utf8',
        },
      );
      assert.equal(t.status, 0, t.stderr);
      got.push(JSON.parse(t.stdout));
    }
    const subsets = (s: string) => [
      { image_dir: 'instance_images', class_tokens: s, num_repeats: 1 },
      { is_reg: true, image_dir: 'class_images', class_tokens: s, num_repeats: 1 },
    ];
    assert.deepEqual(
      got,
      HOSTILE.map((s) => ({ general: { enable_bucket: false }, datasets: [{ resolution: 16, batch_size: 1, subsets: subsets(s) }] })),
    );
  });

  void it('full runs launch train_db.py; every setting is mapped or listed as not carried in README-sd-scripts.md', () => {
    const files = jobBundle(
      {
        prompt: 'sks dog',
        images: [{ name: 'a.png', image: photo(1) }],
        classImages: [],
        settings: { ...defaultSettings('full'), resolution: 16 },
        model: { kind: 'hub', name: 'm', hubId: 'm' },
      },
      png,
    );
    const r = runTrainSh(files, { SD_SCRIPTS: '/sd' }, 'train-sd-scripts.sh');
    assert.equal(r.args[1], '/sd/train_db.py');
    assert.ok(!r.args.some((a) => a.startsWith('--network_')), 'no LoRA options for train_db.py');
    const readme = files.find((f) => f.path === 'README-sd-scripts.md')!.data as string;
    for (const spec of SETTINGS) assert.match(readme, new RegExp(`^\\| ${spec.key} \\|`, 'm'), `${spec.key} has its row`);
    assert.match(readme, /^\| optimizer \| .*not carried/m);
  });

  void it("the noise, loss, optimizer and caption knobs reach sd-scripts as its own options; captions in the photos' subset only", () => {
    const python = ['/usr/bin/python3', 'python3'].find((p) => spawnSync(p, ['--version']).status === 0);
    const knobs = {
      zeroTerminalSnr: true,
      debiasedEstimation: true,
      multiresNoiseIterations: 6,
      multiresNoiseDiscount: 0.4,
      ipNoiseGamma: 0.1,
      minTimestep: 100,
      maxTimestep: 900,
      loss: 'huber' as const,
      huberC: 0.2,
      huberSchedule: 'exponential' as const,
      optimizer: 'prodigy' as const,
      prodigyDCoef: 2,
      prodigySafeguardWarmup: true,
      captionDropout: 0.1,
      shuffleTags: true,
      keepTokens: 2,
      priorPreservation: true,
      classPrompt: 'a dog',
    };
    const files = jobBundle(
      {
        prompt: 'sks dog',
        images: [{ name: 'a.png', image: photo(1) }],
        classImages: [{ name: 'c.png', image: photo(2) }],
        settings: { ...defaultSettings('lora'), resolution: 16, ...knobs },
        model: { kind: 'hub', name: 'm', hubId: 'm' },
      },
      png,
    );
    const r = runTrainSh(files, { SD_SCRIPTS: '/sd' }, 'train-sd-scripts.sh');
    assert.equal(r.status, 0, r.stderr);
    const args = r.args.slice(2);
    for (const a of [
      '--zero_terminal_snr',
      '--debiased_estimation_loss',
      '--multires_noise_iterations=6',
      '--multires_noise_discount=0.4',
      '--ip_noise_gamma=0.1',
      '--min_timestep=100',
      '--max_timestep=900',
      '--loss_type=huber',
      '--huber_c=0.2',
      '--huber_schedule=exponential',
      '--optimizer_type=Prodigy',
    ])
      assert.ok(args.includes(a), `${a} in ${args.join(' ')}`);
    assert.ok(!args.includes('--optimizer_type=AdamW'), 'one optimizer');
    // --optimizer_args takes the words up to the next option, each read by ast.literal_eval after the '='.
    const at = args.indexOf('--optimizer_args');
    assert.deepEqual(args.slice(at + 1, at + 5), ['d_coef=2', 'd0=0.000001', 'safeguard_warmup=True', 'use_bias_correction=False']);
    assert.ok(args[at + 5].startsWith('--'));
    const known = new Set([
      ...SD_SCRIPTS_OPTIONS,
      ...'zero_terminal_snr debiased_estimation_loss multires_noise_iterations multires_noise_discount ip_noise_gamma min_timestep max_timestep loss_type huber_c huber_schedule optimizer_args'.split(
        ' ',
      ),
    ]);
    for (const a of args.filter((a) => a.startsWith('--'))) assert.ok(known.has(a.slice(2).split('=')[0]), `${a}: an option sd-scripts parses`);
    const t = spawnSync(python!, ['-c', 'import json,tomllib\nprint(json.dumps(tomllib.load(open("sd-scripts.toml","rb"))))'], {
      cwd: r.dir,
      encoding: 'utf8',
    });
    assert.equal(t.status, 0, t.stderr);
    const [photos, reg] = (JSON.parse(t.stdout) as { datasets: { subsets: Record<string, unknown>[] }[] }).datasets[0].subsets;
    assert.deepEqual([photos.caption_dropout_rate, photos.shuffle_caption, photos.keep_tokens], [0.1, true, 2]);
    assert.deepEqual([reg.is_reg, 'shuffle_caption' in reg, 'caption_dropout_rate' in reg], [true, false, false]);
  });
});

void describe('sd-scripts target: LyCORIS networks', () => {
  // LyCORIS' kohya module (its README, "for kohya script"): --network_module=lycoris.kohya and --network_args
  // "algo=..." "conv_dim=..." "conv_alpha=..." ("factor=..." for lokr, "dora_wd=True" for DoRA); sd-scripts splits
  // each word at its first '=' into the create_network kwargs.
  const argsOf = (over: Partial<ReturnType<typeof defaultSettings>>) => {
    const files = jobBundle(
      {
        prompt: 'sks dog',
        images: [{ name: 'a.png', image: photo(1) }],
        classImages: [],
        settings: { ...defaultSettings('lora'), resolution: 16, rank: 8, ...over },
        model: { kind: 'hub', name: 'm', hubId: 'm' },
      },
      png,
    );
    const r = runTrainSh(files, { SD_SCRIPTS: '/sd' }, 'train-sd-scripts.sh');
    assert.equal(r.status, 0, r.stderr);
    const args = r.args.slice(2);
    const at = args.indexOf('--network_args');
    const next = args.findIndex((a, i) => i > at && a.startsWith('--'));
    const end = next < 0 ? args.length : next;
    const kwargs = at < 0 ? null : Object.fromEntries(args.slice(at + 1, end).map((w) => [w.slice(0, w.indexOf('=')), w.slice(w.indexOf('=') + 1)]));
    for (const a of args.filter((a) => a.startsWith('--')))
      assert.ok(SD_SCRIPTS_OPTIONS.has(a.slice(2).split('=')[0]) || a === '--network_args', `${a}: an option sd-scripts parses`);
    return {
      modules: args.filter((a) => a.startsWith('--network_module=')),
      kwargs,
      readme: files.find((f) => f.path === 'README-sd-scripts.md')!.data as string,
    };
  };

  void it('locon, loha, lokr and DoRA launch lycoris.kohya with their network_args; plain LoRA networks.lora', () => {
    const lora = argsOf({});
    assert.deepEqual([lora.modules, lora.kwargs], [['--network_module=networks.lora'], null]);
    const locon = argsOf({ network: 'locon', convRank: 4, convAlpha: 2 });
    assert.deepEqual(locon.modules, ['--network_module=lycoris.kohya'], 'one network module');
    assert.deepEqual(locon.kwargs, { algo: 'locon', conv_dim: '4', conv_alpha: '2' });
    // conv rank and alpha 0 resolve as the trainer does: the rank, then the conv rank
    assert.deepEqual(argsOf({ network: 'loha' }).kwargs, { algo: 'loha', conv_dim: '8', conv_alpha: '8' });
    const lokr = argsOf({ network: 'lokr', lokrFactor: 4, dora: true });
    assert.deepEqual(lokr.kwargs, { algo: 'lokr', conv_dim: '8', conv_alpha: '8', factor: '4', dora_wd: 'True' });
    assert.match(lokr.readme, /\| dora \| true \| not carried \| in --network_args \(dora_wd=True\) \|/);
    assert.match(lokr.readme, /\| lokrFactor \| 4 \| not carried \| in --network_args \(factor\) \|/);
  });
});

void describe('ray_train.py: values through JSON, never through its source', () => {
  void it("Python's json reads every hostile value back unchanged from job.json and prompts.jsonl", () => {
    const python = ['/usr/bin/python3', 'python3'].find((p) => spawnSync(p, ['--version']).status === 0);
    assert.ok(python, 'python3 is installed (Debian base system)');
    const dir = tmp();
    const got: unknown[] = [];
    for (const s of HOSTILE) {
      const files = hostileBundle(s);
      const ray = files.find((f) => f.path === 'ray_train.py')!.data as string;
      assert.ok(!ray.includes(s), 'the value is not written into the Python source');
      for (const f of files.filter((f) => f.path === 'job.json' || f.path === 'prompts.jsonl')) writeFileSync(join(dir, f.path), f.data);
      // The same reads ray_train.py makes (json.load / json.loads per line); printed back as ASCII-escaped JSON.
      const r: SpawnSyncReturns<string> = spawnSync(
        python!,
        [
          '-c',
          'import json,sys\nj=json.load(open("job.json",encoding="utf-8"))\np=[json.loads(l) for l in open("prompts.jsonl",encoding="utf-8") if l.strip()]\n' +
            'print(json.dumps([j["instance_prompt"],j["class_prompt"],j["model"]["reference"],j["model"]["revision"],p[0]["prompt"]]))',
        ],
        { cwd: dir, encoding: 'utf8' },
      );
      assert.equal(r.status, 0, r.stderr);
      got.push(JSON.parse(r.stdout));
    }
    assert.deepEqual(
      got,
      HOSTILE.map((s) => [s, s, s, s, s]),
    );
    assert.ok(!pwned(dir));
  });
});

void describe("the studio's bundle download (studio/bundle-zip.ts): the same scripts, every entry inside its folder", () => {
  void it('hostile prompt, photo, caption and model names: zip entries stay in dreambooth-job/, train.sh runs nothing', async () => {
    const names = [
      '../../escape.png',
      '/etc/passwd.png',
      '..\\..\\win.png',
      'C:evil.png',
      '$(touch PWNED).png',
      'a\nb.png',
      '..png',
      'same.png',
      'same.png',
      `${HOSTILE[0]}.png`,
    ];
    const prompt = HOSTILE.slice(0, 6).join(' ');
    const input: BundleInput = {
      prompt,
      images: names.map((name, i) => ({ name, image: photo(i), caption: i === 0 ? HOSTILE[1] : '' })),
      classImages: [],
      settings: { ...defaultSettings('lora'), resolution: 16 },
      model: { kind: 'single-file', name: `${HOSTILE[0]}.safetensors` },
    };
    const zip = await bundleZip(input);
    assert.equal(zip.name, 'dreambooth-job.zip');
    const dir = tmp();
    writeFileSync(join(dir, 'bundle.zip'), new Uint8Array(await zip.blob.arrayBuffer()));
    // The names as stored in the zip (zipinfo prints them raw), checked independently of checkEntryPaths.
    const entries = spawnSync('zipinfo', ['-1', 'bundle.zip'], { cwd: dir, encoding: 'utf8' }).stdout.trim().split('\n');
    assert.equal(entries.filter((e) => e.startsWith('dreambooth-job/instance_images/')).length, names.length, entries.join('\n'));
    for (const e of entries) assert.match(e, /^dreambooth-job\/([A-Za-z0-9_-][A-Za-z0-9._-]*\/)*[A-Za-z0-9_-][A-Za-z0-9._-]*$/, `entry ${JSON.stringify(e)}`);
    const unzipped = spawnSync('unzip', ['-q', 'bundle.zip'], { cwd: dir, encoding: 'utf8' });
    assert.equal(unzipped.status, 0, unzipped.stderr);
    assert.deepEqual(readdirSync(dir).sort(), ['bundle.zip', 'dreambooth-job']);
    const job = join(dir, 'dreambooth-job');
    assert.ok(statSync(join(job, 'train.sh')).mode & 0o100, 'train.sh is executable');
    const files: BundleFile[] = readdirSync(job, { recursive: true, encoding: 'utf8' })
      .filter((path) => statSync(join(job, path)).isFile())
      .map((path) => ({ path, data: readFileSync(join(job, path)), executable: path === 'train.sh' }));
    const r = runTrainSh(files, { MODEL: 'stable-diffusion-v1-5/stable-diffusion-v1-5' });
    assert.equal(r.status, 0, r.stderr);
    assert.ok(r.args.includes(`--instance_prompt=${prompt}`), r.args.join(' | '));
    assert.ok(!pwned(dir) && !pwned(r.dir), 'a command inside a value ran');
    // Without MODEL the script stops, saying what to provide (the single file's name quoted in the message).
    const stop = runTrainSh(files);
    assert.equal(stop.status, 2);
    assert.ok(stop.stderr.includes(`"${HOSTILE[0]}.safetensors" is a single checkpoint file`), stop.stderr);
    assert.ok(!pwned(stop.dir));
  });

  void it('refuses an entry that would unpack outside its folder or be written twice', () => {
    for (const bad of ['../x', '/x', 'a//b', 'a\\b', './x', 'a/../b', 'a/..', 'C:x', 'x\n', ''])
      assert.throws(() => checkEntryPaths([bad]), { name: 'BundleEntryError', message: /would unpack outside dreambooth-job\// }, JSON.stringify(bad));
    assert.throws(() => checkEntryPaths(['a.png', 'a.png']), { name: 'BundleEntryError', message: /"a\.png" is written twice/ });
    assert.doesNotThrow(() => checkEntryPaths(['train.sh', 'instance_images/001-..png', 'masks/001-a.png']));
  });
});
