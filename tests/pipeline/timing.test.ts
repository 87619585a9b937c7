// The run's time accounting (src/pipeline/timing.ts), without a GPU: the first step's pipeline compilation
// is warm-up (not s/step), and the ETA counts the samples and checkpoints still to come at their measured
// cost, so it does not read 0:00 while a final sample is drawn; validation losses count the same way.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  checkpointsAfter,
  CHECKPOINT_PER_TRAIN_STEP,
  DENOISE_STEP_PER_TRAIN_STEP,
  FORWARD_PER_TRAIN_STEP,
  RunClock,
  samplesFrom,
  type RunSchedule,
} from '../../src/pipeline/timing.ts';
import { etaText, PhaseClock, phaseLine, phaseTicker } from '../../src/pipeline/progress.ts';

/** The e2e run's schedule: 6 steps, a sample every 3 (8 denoising steps), a checkpoint every 2. */
const SIX: RunSchedule = { steps: 6, sampleEvery: 3, sampleSteps: 8, checkpointEvery: 2 };

/** Seconds are sums of a few binary fractions here; 1e-9 only absorbs float rounding in the sums. */
const close = (a: number | null, b: number, what: string) => assert.ok(a !== null && Math.abs(a - b) < 1e-9, `${what}: ${a} vs ${b}`);

describe('run time accounting', () => {
  it('counts the samples and checkpoints the schedule still holds', () => {
    // Samples at 3 and 6 (the one before step 1 is drawn before any step is trained).
    assert.deepEqual(
      [0, 1, 2, 3, 4, 5, 6, 7].map((d) => samplesFrom(d, SIX)),
      [2, 2, 2, 2, 1, 1, 1, 0],
      'the sample at the step just trained is still to come',
    );
    // 7 steps: samples at 3, 6 and after the last (7).
    assert.deepEqual(
      [0, 6, 7].map((d) => samplesFrom(d, { ...SIX, steps: 7 })),
      [3, 2, 1],
    );
    assert.equal(samplesFrom(0, { ...SIX, sampleEvery: 0 }), 0, 'samples off');
    // Checkpoints at 2, 4, 6 (each written with its step) and the final one after the last step.
    assert.deepEqual(
      [0, 1, 2, 5, 6].map((d) => checkpointsAfter(d, SIX)),
      [4, 4, 3, 2, 1],
    );
    assert.equal(checkpointsAfter(0, { ...SIX, checkpointEvery: 0 }), 1, 'only the final checkpoint');
  });

  it('the first step is warm-up, left out of s/step; s/step is the median of the recent warm steps', () => {
    const clock = new RunClock(SIX);
    assert.equal(clock.recordStep(13.4), 'warm-up');
    assert.equal(clock.secondsPerStep, null, 'no warm step yet');
    assert.equal(clock.warmupSeconds, 13.4);
    for (const s of [0.5, 0.75, 0.625]) assert.equal(clock.recordStep(s), 'warm');
    assert.equal(clock.secondsPerStep, 0.625);
    assert.equal(clock.afterStep(4).warmupSeconds, 13.4);
  });

  it('nothing timed: no ETA; then first estimates, marked provisional, until each part is measured', () => {
    const clock = new RunClock(SIX);
    assert.equal(clock.afterStep(0).etaSeconds, null, 'no step timed: no ETA');
    clock.recordStep(4);
    // The warm-up step stands in for s/step; a sample is 8 denoising steps of 2/3 of a step; a checkpoint 1 step
    // (at 2, 4, 6 and the final one).
    const first = clock.afterStep(1);
    const sample = 8 * DENOISE_STEP_PER_TRAIN_STEP * 4;
    close(first.etaSeconds, 5 * 4 + 2 * sample + 4 * CHECKPOINT_PER_TRAIN_STEP * 4, 'first estimate');
    assert.equal(first.provisional, true);
    clock.recordStep(0.5);
    clock.recordSample(6); // the session's first sample compiled its pipelines
    clock.recordSample(2);
    clock.recordCheckpoint(0.25);
    const measured = clock.afterStep(3);
    // 3 steps of 0.5, the samples at 3 and 6 at the warm sample's 2 s, checkpoints at 4, 6 and the final one.
    close(measured.etaSeconds, 3 * 0.5 + 2 * 2 + 3 * 0.25, 'measured');
    assert.equal(measured.provisional, false);
  });

  it('the first sample counts until a warm one is measured', () => {
    const clock = new RunClock(SIX);
    clock.recordStep(1);
    clock.recordStep(1);
    clock.recordSample(6);
    assert.deepEqual(clock.sampleEstimate(), { seconds: 6, measured: true });
    clock.recordSample(2);
    clock.recordSample(3);
    assert.deepEqual(clock.sampleEstimate(), { seconds: 2.5, measured: true }, 'median of the warm ones (2, 3)');
  });

  it('after the last step the ETA is the final sample and checkpoint, and it counts down inside the sample, never 0 before its end', () => {
    const clock = new RunClock(SIX);
    clock.recordStep(10);
    for (let i = 0; i < 5; i++) clock.recordStep(1);
    clock.recordSample(20);
    clock.recordSample(8);
    clock.recordCheckpoint(0.5);
    const last = clock.afterStep(6);
    close(last.etaSeconds, 8 + 0.5, 'the final sample and the final checkpoint');
    // Denoising step 2 of 8 after 2 s: 6 more at 1 s (pace) vs 8 - 2 (estimate): 6 s, plus the checkpoint.
    close(clock.duringSample(6, 2, 8, 2).etaSeconds, 6 + 0.5, 'inside the sample');
    // All 8 denoised after 7 s: the decode is left; the estimate says 1 s more.
    close(clock.duringSample(6, 8, 8, 7).etaSeconds, 1 + 0.5, 'decoding');
    // Slower than its estimate: the pace rules (2 s per denoising step, 4 left).
    close(clock.duringSample(6, 4, 8, 8).etaSeconds, 8 + 0.5, 'slower than estimated');
    // The sample at step 3 is followed by 3 steps, the sample at 6 and checkpoints at 4, 6 and the final one.
    close(clock.duringSample(3, 0, 8, 0).etaSeconds, 8 + 3 * 1 + 8 + 3 * 0.5, 'a mid-run sample and the rest of the run');
  });

  it('validations: counted every validateEvery steps and after the last, first estimated from their forwards, then measured', () => {
    // 6 steps, validation every 4 (at 4 and after the last, 6), 40 batch-1 forwards each; no samples, 1 final checkpoint.
    const V: RunSchedule = { steps: 6, sampleEvery: 0, sampleSteps: 8, checkpointEvery: 0, validateEvery: 4, validationForwards: 40 };
    const clock = new RunClock(V);
    clock.recordStep(2);
    clock.recordStep(1);
    const estimate = 40 * FORWARD_PER_TRAIN_STEP * 1;
    const checkpoint = CHECKPOINT_PER_TRAIN_STEP * 1;
    const first = clock.afterStep(2);
    close(first.etaSeconds, 4 * 1 + 2 * estimate + checkpoint, 'two validations to come, estimated');
    assert.equal(first.provisional, true);
    clock.recordValidation(0.5);
    clock.recordCheckpoint(0.25);
    const at4 = clock.afterStep(4);
    close(at4.etaSeconds, 2 * 1 + 2 * 0.5 + 0.25, 'the one at step 4 (just trained) and the last, measured');
    assert.equal(at4.provisional, false);
    close(clock.afterStep(5).etaSeconds, 1 + 0.5 + 0.25, 'only the last');
    close(clock.afterStep(6).etaSeconds, 0.5 + 0.25, 'the last validation and the final checkpoint');
    close(new RunClock({ ...V, validateEvery: 0 }).afterStep(0).etaSeconds ?? 0, 0, 'nothing timed, nothing counted');
  });
});

// A long phase's i of n and time left (src/pipeline/progress.ts): class images, encoding, validation, export,
// the self-test and text to image all report through it.
describe('phase progress', () => {
  /** Feeds the clock a phase whose first item takes `first` s (it compiles) and each later one `warm` s. */
  function etaAfter(clock: PhaseClock, first: number, warm: number, done: number): number | null {
    let r = clock.at(0, 0);
    for (let i = 1; i <= done; i++) r = clock.at(i, first + (i - 1) * warm);
    return r.etaSeconds;
  }

  it('after the first (compiling) item, the time left is the warm items pace: within 1.5x of what follows', () => {
    // Ten class images on a software adapter: the first 12 s (pipelines compile), each later one 1 s. After two,
    // 8 s follow; the whole phase's average pace (13 s / 2 items) would say 52 s, 6.5x too long.
    const eta = etaAfter(new PhaseClock(10), 12, 1, 2);
    assert.ok(eta !== null && eta <= 8 * 1.5 && eta >= 8 / 1.5, `ETA after item 2: ${eta} s, 8 s follow`);
    close(etaAfter(new PhaseClock(10), 12, 1, 5), 5, 'after item 5: five warm items left');
  });

  it('counts down inside an item reported fractionally, and reads 0 once every item is done', () => {
    const clock = new PhaseClock(4);
    clock.at(1, 12);
    const r = clock.at(2.5, 15); // 1.5 warm items took 3 s: 2 s each, 1.5 items left
    close(r.etaSeconds, 3, 'ETA mid-item');
    assert.equal(r.provisional, false);
    assert.deepEqual(clock.at(4, 20), { done: 4, total: 4, etaSeconds: 0, provisional: false });
  });

  it('before anything is measured: the prior estimate (provisional), else no number', () => {
    assert.deepEqual(new PhaseClock(3, 2).at(0, 1), { done: 0, total: 3, etaSeconds: 5, provisional: true });
    assert.equal(new PhaseClock(3).at(0, 1).etaSeconds, null);
    const first = new PhaseClock(3).at(1, 4);
    assert.deepEqual([first.etaSeconds, first.provisional], [8, true], 'only the compiling item measured: its pace, marked provisional');
  });

  it('the line says what it does, i of n (the item under way) and the time left', () => {
    assert.equal(
      phaseLine('Generating class image', { done: 0, total: 4, etaSeconds: null, provisional: false }),
      'Generating class image 1 of 4 · estimating the time left',
    );
    assert.equal(
      phaseLine('Generating class image', { done: 1.4, total: 4, etaSeconds: 40, provisional: true }),
      'Generating class image 2 of 4 · about 0:40 left',
    );
    assert.equal(phaseLine('Kernel check', { done: 139, total: 140, etaSeconds: 3725, provisional: false }), 'Kernel check 140 of 140 · 1:02:05 left');
    assert.equal(phaseLine('Denoising step', { done: 25, total: 25, etaSeconds: 0, provisional: false }), 'Denoising step 25 of 25');
    assert.equal(etaText({ done: 2, total: 2, etaSeconds: 0, provisional: false }), '');
  });
});

describe('warm-up estimate and the phase ticker', () => {
  it("the warm-up step's estimate comes from what the first sample compiled: within 1.5x of a 12 s warm-up", () => {
    // As in tests/studio/eta.test.ts: the first denoising step 6 s (compiling) against 0.3 s warm, the warm-up
    // step 12 s against 0.5 s warm.
    const clock = new RunClock(SIX);
    assert.equal(clock.warmupEstimate(), null, 'nothing drawn yet: no estimate');
    let t = 0;
    for (let i = 1; i <= 8; i++) clock.duringSample(0, i, 8, (t += i === 1 ? 6 : 0.3));
    clock.recordSample(t + 0.5);
    const est = clock.warmupEstimate();
    assert.ok(est !== null && est <= 12 * 1.5 && est >= 12 / 1.5, `warm-up estimate ${est} s, 12 s actual`);
  });

  it('reports the first and last items always and at most one report per `every` seconds between', () => {
    let now = 0;
    const seen: string[] = [];
    const tick = phaseTicker('Writing model.safetensors: UNet tensor', 10, (line) => seen.push(line), { every: 1, now: () => now });
    for (let i = 0; i <= 10; i++) {
      tick(i);
      now += 0.3;
    }
    assert.equal(seen[0], 'Writing model.safetensors: UNet tensor 1 of 10 · estimating the time left');
    assert.equal(seen.at(-1), 'Writing model.safetensors: UNet tensor 10 of 10');
    assert.ok(seen.length >= 3 && seen.length <= 5, `${seen.length} reports over 3 s at most one a second, plus the last`);
  });
});
