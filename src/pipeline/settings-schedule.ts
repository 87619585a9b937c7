// The settings schema's entries for the learning-rate schedule (train/lr-schedule.ts: transformers' formulas):
// the warm-up, the scheduler and its restarts and decay power. settings.ts places SCHEDULE_SETTINGS after the
// learning rate; this file imports only types from it (settings.ts imports this one).
import { effectiveScheduler, LR_SCHEDULERS } from '../train/lr-schedule.ts';
import type { SettingKey, SettingSpec } from './settings.ts';

const entry = <K extends SettingKey>(e: SettingSpec<K>): SettingSpec => e as unknown as SettingSpec;

export const SCHEDULE_SETTINGS: readonly SettingSpec[] = [
  entry({
    key: 'lrWarmup',
    kind: 'int',
    flag: 'lr-warmup',
    label: 'Warm-up steps (the rate rises linearly from 0)',
    unit: 'steps',
    min: 0,
    max: 1_000_000,
    default: 0,
    help: 'linear warm-up of the learning rate over N steps (0: none); at most --steps',
    train: (v) => ({ lrWarmup: v }),
    bundle: (s) => ({ option: `--lr_warmup_steps=${s.lrWarmup}` }),
    sdScripts: (s) => ({ option: `--lr_warmup_steps=${s.lrWarmup}` }),
  }),
  entry({
    key: 'lrScheduler',
    kind: 'enum',
    flag: 'lr-scheduler',
    label: 'Rate schedule',
    values: LR_SCHEDULERS,
    default: 'constant',
    help: "the learning rate over the run, after --lr-warmup (transformers' formulas): constant (with a warm-up: constant_with_warmup), linear or cosine (to 0), cosine_with_restarts (--lr-cycles), polynomial (--lr-power, to 1e-7)",
    train: (v) => ({ lrScheduler: v }),
    bundle: (s) => ({ option: `--lr_scheduler=${effectiveScheduler(s.lrScheduler, s.lrWarmup)}` }),
    sdScripts: (s) => ({ option: `--lr_scheduler=${effectiveScheduler(s.lrScheduler, s.lrWarmup)}` }),
  }),
  entry({
    key: 'lrCycles',
    kind: 'int',
    flag: 'lr-cycles',
    label: 'Schedule restarts',
    min: 1,
    max: 1000,
    default: 1,
    help: 'cosine_with_restarts: the number of hard restarts (num_cycles)',
    showWhen: (s) => s.lrScheduler === 'cosine_with_restarts',
    activeWhen: { test: (s) => s.lrScheduler === 'cosine_with_restarts', why: 'is for --lr-scheduler cosine_with_restarts only: add it, or leave this out' },
    train: (v) => ({ lrCycles: v }),
    bundle: (s) =>
      s.lrScheduler === 'cosine_with_restarts' ? { option: `--lr_num_cycles=${s.lrCycles}` } : { option: null, note: 'not used: cosine_with_restarts only' },
    sdScripts: (s) =>
      s.lrScheduler === 'cosine_with_restarts'
        ? { option: `--lr_scheduler_num_cycles=${s.lrCycles}` }
        : { option: null, note: 'not used: cosine_with_restarts only' },
  }),
  entry({
    key: 'lrPower',
    kind: 'number',
    flag: 'lr-power',
    label: 'Schedule decay power',
    min: 0.01,
    max: 100,
    default: 1,
    help: 'polynomial: the power of the decay (1: linear to 1e-7)',
    showWhen: (s) => s.lrScheduler === 'polynomial',
    activeWhen: { test: (s) => s.lrScheduler === 'polynomial', why: 'is for --lr-scheduler polynomial only: add it, or leave this out' },
    train: (v) => ({ lrPower: v }),
    bundle: (s) => (s.lrScheduler === 'polynomial' ? { option: `--lr_power=${s.lrPower}` } : { option: null, note: 'not used: polynomial only' }),
    sdScripts: (s) => (s.lrScheduler === 'polynomial' ? { option: `--lr_scheduler_power=${s.lrPower}` } : { option: null, note: 'not used: polynomial only' }),
  }),
];
