// Samplers against their defining property: with a perfect denoiser for a fixed clean sample x0 and
// noise e (the model returns exactly e, or v = sqrt(a) e - sqrt(1-a) x0), the deterministic samplers
// follow the exact trajectory x_t = sqrt(a_t) x0 + sqrt(1 - a_t) e and DPM-Solver++ ends on x0.
// Plus the schedule itself (SD's scaled_linear betas) and the timestep spacings diffusers uses.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { alphasCumprod, Ddim, DpmSolverPP2M, randn, SD_SCHEDULE, type Sampler } from '../../src/sample/schedulers.ts';

const acp = alphasCumprod(SD_SCHEDULE);

function perfect(prediction: 'epsilon' | 'v_prediction', x0: Float32Array, e: Float32Array) {
  return (t: number) => {
    const a = Math.sqrt(acp[t]);
    const s = Math.sqrt(1 - acp[t]);
    return prediction === 'epsilon' ? e.slice() : Float32Array.from(e, (v, i) => a * v - s * x0[i]);
  };
}

function run(sampler: Sampler, x: Float32Array, model: (t: number) => Float32Array): Float32Array[] {
  const traj: Float32Array[] = [];
  for (let i = 0; i < sampler.timesteps.length; i++) {
    x = sampler.step(i, x, model(sampler.timesteps[i]));
    traj.push(x);
  }
  return traj;
}

const maxDiff = (a: ArrayLike<number>, b: ArrayLike<number>) => Array.from(a).reduce((m, v, i) => Math.max(m, Math.abs(v - b[i])), 0);

describe('noise schedule and samplers', () => {
  it("SD's scaled_linear schedule: alphā_0 = 1 - 0.00085, alphā_999 = 0.00466 (diffusers' values)", () => {
    assert.ok(Math.abs(acp[0] - 0.99915) < 1e-9);
    assert.ok(Math.abs(acp[999] - 0.00466) < 1e-5, String(acp[999]));
  });

  it('timestep spacings: DDIM leading + offset 1, DPM-Solver++ linspace', () => {
    assert.deepEqual(new Ddim(SD_SCHEDULE, 10).timesteps, [901, 801, 701, 601, 501, 401, 301, 201, 101, 1]);
    assert.deepEqual(new DpmSolverPP2M(SD_SCHEDULE, 5).timesteps, [999, 799, 599, 400, 200]);
  });

  for (const prediction of ['epsilon', 'v_prediction'] as const)
    it(`a perfect ${prediction} model: DDIM stays on the exact trajectory, DPM-Solver++ 2M lands on x0`, () => {
      const x0 = randn(64, 1);
      const e = randn(64, 2);
      const cfg = { ...SD_SCHEDULE, prediction };
      const ddim = new Ddim(cfg, 20);
      const start = (t: number) => Float32Array.from(x0, (v, i) => Math.sqrt(acp[t]) * v + Math.sqrt(1 - acp[t]) * e[i]);
      const traj = run(ddim, start(ddim.timesteps[0]), perfect(prediction, x0, e));
      traj.forEach((x, i) => {
        const next = i + 1 < ddim.timesteps.length ? ddim.timesteps[i + 1] : 0;
        assert.ok(maxDiff(x, start(next)) < 1e-5, `DDIM step ${i}: ${maxDiff(x, start(next))}`);
      });
      const dpm = new DpmSolverPP2M(cfg, 8);
      const dtraj = run(dpm, start(dpm.timesteps[0]), perfect(prediction, x0, e));
      dtraj.slice(0, -1).forEach((x, i) => assert.ok(maxDiff(x, start(dpm.timesteps[i + 1])) < 1e-5, `DPM step ${i}`));
      assert.ok(maxDiff(dtraj.at(-1)!, x0) < 1e-5, 'DPM-Solver++ ends on x0');
    });

  it('seeded noise is deterministic and standard normal', () => {
    const a = randn(20000, 7);
    assert.deepEqual(a, randn(20000, 7));
    assert.notDeepEqual(a.slice(0, 10), randn(10, 8));
    const mean = a.reduce((s, v) => s + v, 0) / a.length;
    const variance = a.reduce((s, v) => s + (v - mean) ** 2, 0) / a.length;
    assert.ok(Math.abs(mean) < 0.03 && Math.abs(variance - 1) < 0.05, `${mean} ${variance}`);
  });
});
