// Learning-rate schedules: transformers' (and diffusers') get_scheduler formulas, as the factor the base
// rate is multiplied by for the update after `step` completed updates (LambdaLR's current_step). A pure
// function of the step, so a resumed run's rates are the uninterrupted run's. With warm-up W every schedule
// first rises as step / W; then, with T the run's steps and p = (step - W) / max(1, T - W):
//   constant              1 (transformers' constant ignores warm-up; here a warm-up makes it
//                         constant_with_warmup, so --lr-warmup alone does what it says)
//   constant_with_warmup  1
//   linear                max(0, (T - step) / max(1, T - W))
//   cosine                max(0, (1 + cos(pi * 2 * 0.5 * p)) / 2)               (half a cosine, to 0)
//   cosine_with_restarts  p >= 1 ? 0 : max(0, (1 + cos(pi * ((cycles * p) mod 1))) / 2)  (hard restarts)
//   polynomial            step > T ? end / lr : ((lr - end) * (1 - (step - W) / (T - W))^power + end) / lr,
//                         end = 1e-7 (get_polynomial_decay_schedule_with_warmup's lr_end)

export const LR_SCHEDULERS = ['constant', 'constant_with_warmup', 'cosine', 'cosine_with_restarts', 'linear', 'polynomial'] as const;
export type LrScheduler = (typeof LR_SCHEDULERS)[number];

/** transformers' lr_end of the polynomial schedule: the rate it decays to (the base rate must be above it). */
export const POLYNOMIAL_LR_END = 1e-7;

export interface LrSchedule {
  scheduler: LrScheduler;
  /** Warm-up steps (0: none). */
  warmup: number;
  /** The run's steps (num_training_steps). */
  steps: number;
  /** The base learning rate (polynomial's lr_init). */
  lr: number;
  /** cosine_with_restarts: hard restarts (num_cycles). */
  cycles: number;
  /** polynomial: the decay's power. */
  power: number;
}

/** The schedule's name as transformers knows it: constant with a warm-up is constant_with_warmup. */
export function effectiveScheduler(scheduler: LrScheduler, warmup: number): LrScheduler {
  return scheduler === 'constant' && warmup > 0 ? 'constant_with_warmup' : scheduler;
}

/** The factor of the base rate for the update after `step` completed updates. */
export function scheduleFactor(o: LrSchedule, step: number): number {
  const { warmup: W, steps: T } = o;
  const scheduler = effectiveScheduler(o.scheduler, W);
  if (scheduler === 'constant') return 1;
  if (step < W) return step / Math.max(1, W);
  const progress = (step - W) / Math.max(1, T - W);
  switch (scheduler) {
    case 'constant_with_warmup':
      return 1;
    case 'linear':
      return Math.max(0, (T - step) / Math.max(1, T - W));
    case 'cosine':
      return Math.max(0, 0.5 * (1 + Math.cos(Math.PI * 0.5 * 2 * progress)));
    case 'cosine_with_restarts':
      if (progress >= 1) return 0;
      return Math.max(0, 0.5 * (1 + Math.cos(Math.PI * ((o.cycles * progress) % 1))));
    case 'polynomial': {
      const end = POLYNOMIAL_LR_END;
      if (step > T) return end / o.lr;
      const remaining = 1 - (step - W) / (T - W);
      return ((o.lr - end) * remaining ** o.power + end) / o.lr;
    }
  }
}
