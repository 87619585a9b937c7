// The one settings schema (src/pipeline/settings.ts) and the strict flag parser (src/cli/args.ts): the
// defaults are valid, every range is enforced at both ends with a message naming the setting as the host
// names it, model-level checks use the model's shape, and trainSettings maps the schema onto the trainer;
// the trainer's defaults, the page's labels, the presets and --help all come from the one schema.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { closestFlag, parseFlags, rangeText, tableNumber, UsageError } from '../../src/cli/args.ts';
import { COMMANDS, helpOf, helpText } from '../../src/cli/help.ts';
import { mergeLora } from '../../src/export/merge.ts';
import { trainSettings } from '../../src/pipeline/run.ts';
import {
  decimalProblem,
  defaultSettings,
  refuseInactive,
  SETTINGS,
  SettingsError,
  settingsHelp,
  TRAIN_DEFAULTS,
  validateForModel,
  validateSettings,
  type RunSettings,
} from '../../src/pipeline/settings.ts';
import { ENGINE_DEFAULTS, type TrainSettings } from '../../src/train/trainer.ts';
import { PRESETS, SETTING_LABELS } from '../../src/ui/studio/presets.ts';

void describe('settings schema', () => {
  void it('the defaults of both modes are valid', () => {
    for (const mode of ['lora', 'full'] as const) validateSettings(defaultSettings(mode));
  });

  void it('every numeric range is enforced at both ends, naming the flag', () => {
    for (const spec of SETTINGS) {
      if (spec.min === undefined || spec.max === undefined) continue;
      const mode = spec.onlyMode ?? 'lora';
      const step = spec.kind === 'number' ? Math.max(Math.abs(spec.max) * 1e-6, 1e-9) : 1;
      for (const bad of [spec.key === 'lr' ? 0 : spec.min - step, spec.max + (spec.kind === 'number' ? Math.max(spec.max, 1) : 1)]) {
        const s = { ...defaultSettings(mode), [spec.key]: bad } as RunSettings;
        assert.throws(
          () => validateSettings(s),
          (e: Error) => (e instanceof SettingsError && e.message.startsWith(`--${spec.flag ?? spec.key}`)) || e.message.startsWith(spec.key),
          `${spec.key} = ${bad}`,
        );
      }
      const ok = { ...defaultSettings(mode), [spec.key]: spec.key === 'lr' ? spec.max : spec.min } as RunSettings;
      validateSettings(ok);
    }
  });

  void it('non-numbers, fractions and missing values are refused; the host names settings its own way', () => {
    const labels = (k: string) => `"${k.toUpperCase()}"`;
    assert.throws(
      () => validateSettings({ ...defaultSettings(), steps: NaN }, labels),
      /^Error: "STEPS" must be a finite number|"STEPS" must be a finite number/,
    );
    assert.throws(() => validateSettings({ ...defaultSettings(), steps: 2.5 }), /--steps must be a whole number, got 2.5/);
    assert.throws(() => validateSettings({ ...defaultSettings(), lr: Infinity }), /--lr must be a finite number/);
    assert.throws(() => validateSettings({ ...defaultSettings(), mode: 'dora' as never }), /--mode must be lora or full/);
    const missing = { ...defaultSettings() } as Partial<RunSettings>;
    delete missing.seed;
    assert.throws(() => validateSettings(missing as RunSettings), /--seed is missing/);
    assert.throws(() => validateSettings({ ...defaultSettings('full'), trainTextEncoder: true }), /--train-text-encoder applies to LoRA training only/);
    assert.throws(() => validateSettings({ ...defaultSettings(), priorPreservation: true, classPrompt: '  ' }), /prior preservation needs a class prompt/);
  });

  void it('model checks: rank against the narrowest adapted layer, resolution against the factor', () => {
    const model = { resolutionFactor: 64, maxRank: 320 };
    validateForModel({ ...defaultSettings(), rank: 320, resolution: 512 }, model);
    assert.throws(
      () => validateForModel({ ...defaultSettings(), rank: 321, resolution: 512 }, model),
      /--rank 321 is larger than this model's narrowest adapted layer \(320 wide\)/,
    );
    assert.throws(
      () => validateForModel({ ...defaultSettings(), resolution: 72 }, model),
      /--resolution 72 does not suit this model: use a multiple of 64 \(e\.g\. 64 or 128\)/,
    );
    // A full run's rank is not checked (it has none).
    validateForModel({ ...defaultSettings('full'), rank: 100000, resolution: 512 }, model);
  });

  void it('trainSettings maps the schema onto the trainer (alpha 0 = rank, min-SNR 0 = off, LoRA fields zero in full runs)', () => {
    const t = trainSettings({ ...defaultSettings(), rank: 16, alpha: 0, minSnrGamma: 0, priorWeight: 0.5, offsetNoise: 0.1 });
    assert.equal(t.alpha, 16);
    assert.equal(t.minSnrGamma, null);
    assert.equal(t.priorLossWeight, 0.5);
    assert.equal(t.offsetNoise, 0.1);
    assert.equal(trainSettings({ ...defaultSettings(), minSnrGamma: 5, alpha: 4 }).minSnrGamma, 5);
    assert.equal(trainSettings({ ...defaultSettings(), alpha: 4 }).alpha, 4);
    // The text encoder's own rate reaches the trainer only with text-encoder LoRA (0: the run's lr, left out).
    assert.equal(trainSettings({ ...defaultSettings(), trainTextEncoder: true, textEncoderLr: 1e-5 }).textEncoderLr, 1e-5);
    assert.equal(trainSettings({ ...defaultSettings(), trainTextEncoder: true }).textEncoderLr, undefined);
    assert.equal(trainSettings({ ...defaultSettings(), trainTextEncoder: false, textEncoderLr: 1e-5 }).textEncoderLr, undefined);
    const full = trainSettings({ ...defaultSettings('full'), trainTextEncoder: false });
    assert.equal(full.rank, 0);
    assert.equal(full.textEncoderLora, false);
  });
});

void describe('one schema for every host', () => {
  void it("the trainer's defaults are the schema's (seed 1 in both modes) plus the engine's own", () => {
    for (const mode of ['lora', 'full'] as const) {
      assert.deepEqual(TRAIN_DEFAULTS[mode], trainSettings(defaultSettings(mode)));
      assert.equal(TRAIN_DEFAULTS[mode].seed, 1);
      for (const [k, v] of Object.entries(ENGINE_DEFAULTS[mode])) assert.equal(TRAIN_DEFAULTS[mode][k as keyof TrainSettings], v, k);
    }
    assert.deepEqual([TRAIN_DEFAULTS.lora.steps, TRAIN_DEFAULTS.lora.alpha, TRAIN_DEFAULTS.full.rank, TRAIN_DEFAULTS.full.optimizer], [400, 8, 0, 'adamw8bit']);
  });

  void it('every entry has its own label and help; the page labels are the entries', () => {
    assert.equal(new Set(SETTINGS.map((s) => s.label)).size, SETTINGS.length, 'labels are unique (the page and its tests find fields by them)');
    for (const spec of SETTINGS) assert.ok(spec.help.length > 5 && spec.label.length > 2, spec.key);
    assert.deepEqual(SETTING_LABELS, Object.fromEntries(SETTINGS.map((s) => [s.key, s.label])));
  });

  void it("presets carry only their differences from the mode's schema defaults", () => {
    for (const [name, p] of Object.entries(PRESETS)) {
      const d = defaultSettings(p.settings.mode);
      const differ = Object.entries(p.settings).filter(([k, v]) => d[k as keyof RunSettings] !== v);
      assert.deepEqual(Object.fromEntries(differ), name === 'full' ? { priorPreservation: true } : {}, name);
    }
  });

  void it('numbers are read in decimal only; a whole number takes no exponent', () => {
    for (const ok of ['16', '-3', '2.5', '.5', '1e-4', '+7']) assert.equal(decimalProblem(ok, false), null, ok);
    for (const bad of ['0x10', '0b11', '0o7', ' 5', 'Infinity', '1_000']) assert.match(decimalProblem(bad, false) ?? '', /must be a number/, bad);
    assert.match(decimalProblem('0x10', true) ?? '', /written in decimal digits, got "0x10"/);
    assert.match(decimalProblem('1e3', true) ?? '', /whole number written in decimal digits \(e\.g\. 1000\), got "1e3"/);
    assert.equal(decimalProblem('1000', true), null);
  });

  void it('a flag that acts only with another is refused without it and accepted with it', () => {
    const given =
      (...flags: string[]) =>
      (spec: { flag: string | null }) =>
        flags.includes(spec.flag!);
    const s = defaultSettings();
    assert.throws(() => refuseInactive(s, given('sample-steps')), /--sample-steps does nothing without --sample-every/);
    refuseInactive({ ...s, sampleEvery: 10 }, given('sample-steps', 'sample-prompt'));
    assert.throws(() => refuseInactive(s, given('prior-weight')), /--prior-weight weighs the prior loss/);
    refuseInactive({ ...s, priorPreservation: true, classPrompt: 'a dog' }, given('prior-weight', 'class-steps'));
    assert.throws(() => refuseInactive(s, given('lr-cycles')), /--lr-cycles is for --lr-scheduler cosine_with_restarts only/);
    refuseInactive({ ...s, lrScheduler: 'cosine_with_restarts' }, given('lr-cycles'));
    refuseInactive(s, given('steps', 'lr', 'seed', 'rank')); // no condition: always act
  });

  void it('--help lists every flag of the schema with its description and default', () => {
    const text = settingsHelp().join('\n');
    for (const spec of SETTINGS.filter((x) => x.flag)) assert.match(text, new RegExp(`  --${spec.flag}\\b[^\\n]*\\n {6}[^\\n]*\\[default `), spec.key);
    assert.match(text, /--steps <n>\n\s+training steps \[default 400 \(lora\), 800 \(full\); whole, from 1 to 1000000 steps\]/);
  });
});

void describe('strict flags', () => {
  void it("every command's --help prints each flag of the table it parses with: what it does, its default and range", async () => {
    const inspect = { usage: 'usage: inspect <model>', flags: { config: { type: 'string' as const, arg: '<json>', help: 'overrides', default: 'none' } } };
    for (const command of COMMANDS) {
      const text = await helpText(command, inspect);
      assert.match(text, new RegExp(`^usage: ${command} `), command);
      const { flags } = await helpOf(command, inspect);
      assert.ok(Object.keys(flags).length > 0, command);
      for (const [flag, f] of Object.entries(flags)) {
        assert.ok((f.help ?? '').length > 5, `${command} --${flag} says what it does`);
        assert.ok(f.type === 'boolean' || f.default !== undefined, `${command} --${flag} has a default (or 'required')`);
        const said = f.type === 'boolean' ? 'off unless given' : f.default === 'required' ? 'required' : `default ${f.default}`;
        const range = rangeText(f);
        const line = `  --${flag}${f.arg ? ` ${f.arg}` : ''}\n      ${f.help} [${said}${range ? `; ${range}` : ''}]`;
        assert.ok(text.includes(line), `${command} --help prints --${flag}: ${line}`);
      }
    }
    assert.match(await helpText('sample', inspect), /\n {2}--steps <n>\n {6}denoising steps \[default 25; whole, from 1 to 1000\]\n/);
    assert.match(await helpText('train', inspect), /\n {2}--overwrite\n {6}replace the run in --out \[off unless given\]\n[\s\S]*\n {2}--rank <n>\n/);
    const all = await helpText(undefined, inspect);
    for (const command of COMMANDS) assert.ok(all.includes(await helpText(command, inspect)), `cli --help holds ${command}'s help`);
  });

  void it("a number flag's default and range are its table entry's (tableNumber)", () => {
    const table = { steps: { type: 'string' as const, default: 25, min: 1, max: 1000, integer: true }, text: { type: 'string' as const, default: 'none' } };
    assert.equal(tableNumber({}, table, 'steps'), 25);
    assert.equal(tableNumber({ steps: '1000' }, table, 'steps'), 1000);
    assert.throws(() => tableNumber({ steps: '1001' }, table, 'steps'), /--steps must be from 1 to 1000, got 1001/);
    assert.throws(() => tableNumber({ steps: '2.5' }, table, 'steps'), /--steps must be a whole number/);
    assert.throws(() => tableNumber({}, table, 'text'), /--text: its table entry has no number default/);
  });

  const flags = {
    steps: { type: 'string' as const },
    lr: { type: 'string' as const },
    flip: { type: 'boolean' as const },
    'class-prompt': { type: 'string' as const },
  };
  void it('values, switches, negative numbers and = forms', () => {
    const { values } = parseFlags(['--steps', '-3', '--flip', '--lr=1e-4', '--class-prompt', '-a dog-'], flags, 'usage');
    assert.deepEqual({ ...values }, { steps: '-3', flip: true, lr: '1e-4', 'class-prompt': '-a dog-' });
  });
  void it('unknown flags name the closest known one; twice, missing values and stray words are refused', () => {
    assert.throws(
      () => parseFlags(['--step', '2'], flags, 'usage'),
      (e: Error) => e instanceof UsageError && /unknown option --step \(did you mean --steps\?\)/.test(e.message),
    );
    assert.throws(() => parseFlags(['--clas-prompt', 'x'], flags, 'usage'), /did you mean --class-prompt\?/);
    assert.throws(() => parseFlags(['--zzzzzzzz', 'x'], flags, 'usage'), /unknown option --zzzzzzzz \(known: --steps, --lr, --flip, --class-prompt\)/);
    assert.throws(() => parseFlags(['--steps', '1', '--steps', '2'], flags, 'usage'), /--steps is given twice/);
    assert.throws(() => parseFlags(['--steps', '--flip'], flags, 'usage'), /--steps needs a value/);
    assert.throws(() => parseFlags(['--flip=yes'], flags, 'usage'), /--flip is a switch and takes no value/);
    assert.throws(() => parseFlags(['oops'], flags, 'usage'), /unexpected argument "oops"/);
  });
  void it('closestFlag stays quiet when nothing is close', () => {
    assert.equal(closestFlag('resolutoin', ['resolution', 'rank']), 'resolution');
    assert.equal(closestFlag('xyz', ['resolution', 'rank']), null);
  });
});

void describe('LoRA merge (export/merge.ts)', () => {
  void it('W + scale · B · A, against a hand computation', () => {
    // W [2, 3], A [1, 3], B [2, 1], scale 0.5: W' = W + 0.5 * [[2], [-1]] [1, 2, 3]
    const w = Float32Array.from([1, 1, 1, 0, 0, 0]);
    const out = mergeLora(w, Float32Array.from([1, 2, 3]), Float32Array.from([2, -1]), 2, 0.5);
    assert.deepEqual([...out], [2, 3, 4, -0.5, -1, -1.5]);
    assert.throws(() => mergeLora(new Float32Array(6), new Float32Array(4), new Float32Array(2), 2, 1), /shapes do not agree/);
  });
});
