// A long phase's progress, the same for every host: what it does, item i of n, and the time left.
// PhaseClock is pure (the caller hands it elapsed seconds), so the CLI's lines, the studio's status and the tools
// page's self-test and text to image say the same thing and a Node test checks the numbers; phaseTicker times a
// phase with the host's clock.
//
// The first item of a phase often compiles GPU pipelines (the session's first denoising step, the first
// kernel of a family, the first VAE encode): on a software adapter it takes several times a warm item. Once
// a second item has finished, the pace is that of the items after the first; before that, the first item's own
// pace stands (an over-estimate, marked provisional), or a prior estimate from the caller before anything
// finished. Items may be reported fractionally (a class image 3 denoising steps of 10 in: 0.3).

export interface PhaseReport {
  /** Items finished (fractional inside one), 0..total. */
  done: number;
  total: number;
  /** Seconds left; null while nothing is measured and no prior estimate was given. */
  etaSeconds: number | null;
  /** The ETA rests on the compiling first item or on the prior estimate. */
  provisional: boolean;
}

export class PhaseClock {
  /** When item 1 finished (seconds since the phase began); the warm pace is measured from there. */
  private firstDoneAt: number | null = null;

  /**
   * @param total the phase's items.
   * @param priorSecondsPerItem an estimate for one item before any is measured (e.g. from the run's own step
   *   times), or null.
   */
  constructor(
    readonly total: number,
    private readonly priorSecondsPerItem: number | null = null,
  ) {}

  /** The report with `done` items finished `elapsed` seconds after the phase began. */
  at(done: number, elapsed: number): PhaseReport {
    const total = this.total;
    done = Math.min(Math.max(done, 0), total);
    if (done >= 1 && this.firstDoneAt === null) this.firstDoneAt = elapsed;
    const left = total - done;
    let etaSeconds: number | null;
    let provisional = false;
    if (left <= 0) etaSeconds = 0;
    else if (done > 1 && this.firstDoneAt !== null) etaSeconds = ((elapsed - this.firstDoneAt) / (done - 1)) * left;
    else if (done > 0) {
      etaSeconds = (elapsed / done) * left;
      provisional = true;
    } else if (this.priorSecondsPerItem !== null) {
      etaSeconds = Math.max(0, this.priorSecondsPerItem * total - elapsed);
      provisional = true;
    } else etaSeconds = null;
    return { done, total, etaSeconds, provisional };
  }
}

/** "0:07", "1:30", "1:02:03". */
export function fmtClock(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  return `${h ? `${h}:` : ''}${String(Math.floor(s / 60) % 60).padStart(h ? 2 : 1, '0')}:${String(s % 60).padStart(2, '0')}`;
}

/**
 * The time left in words: "0:40 left", "about 0:40 left" (provisional), "estimating the time left" (nothing
 * measured yet), "" once done.
 */
export function etaText(r: Pick<PhaseReport, 'etaSeconds' | 'provisional' | 'done' | 'total'>): string {
  if (r.done >= r.total) return '';
  if (r.etaSeconds === null) return 'estimating the time left';
  return `${r.provisional ? 'about ' : ''}${fmtClock(r.etaSeconds)} left`;
}

/**
 * One line for a phase: what it does to the item under way, i of n (the one being worked on: "1 of 4" from the
 * start, "4 of 4" during the last), and the time left: "Generating class image 2 of 4 · about 0:40 left".
 */
export function phaseLine(what: string, r: PhaseReport): string {
  const current = Math.max(1, Math.min(r.total, Math.floor(r.done) + 1));
  const eta = etaText(r);
  return `${what} ${current} of ${r.total}${eta ? ` · ${eta}` : ''}`;
}

/**
 * A phase's progress as it goes, timed from the call: `tick(done)` reports its line (phaseLine of `what`) and
 * report. `every`: at most one report per that many seconds (the first and the last always go). `now` is the
 * clock in seconds (performance.now by default; tests pass their own).
 */
export function phaseTicker(
  what: string,
  total: number,
  report: (line: string, r: PhaseReport) => void,
  o: { prior?: number | null; every?: number; now?: () => number } = {},
): (done: number) => void {
  const now = o.now ?? (() => performance.now() / 1000);
  const t0 = now();
  const clock = new PhaseClock(total, o.prior ?? null);
  let last = -Infinity;
  return (done) => {
    const t = now() - t0;
    const r = clock.at(done, t);
    if (o.every && done > 0 && done < total && t - last < o.every) return;
    last = t;
    report(phaseLine(what, r), r);
  };
}
