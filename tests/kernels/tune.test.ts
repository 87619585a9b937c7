import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { chooseGemm, gemmClass, heuristicGemm, matmul, matmulRef, traceGemms, type GemmProblem } from '../../src/ops/matmul.ts';
import { adapterKey, clearMatmulTuning, defaultCandidates, memoryTuningStore, tuneMatmul, TUNING_VERSION } from '../../src/ops/tune.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { matmulTol } from '../../src/selftest/cases/matmul.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { assertChecks, testGpu } from '../helpers.ts';

// A small weight-gradient-like problem: single batch, K long enough for split-K candidates.
const PROBLEM: GemmProblem = { M: 40, N: 36, K: 1028, batch: 1, dtype: 'f32', transA: true, transB: false };

describe('matmul tuner', () => {
  it('every default candidate computes the same product as the reference', async () => {
    const gpu = await testGpu();
    for (const dtype of gpu.hasF16 ? (['f32', 'f16'] as const) : (['f32'] as const)) {
      const p = { ...PROBLEM, dtype };
      const a = roundToF16(randomValues(p.K * p.M, 1));
      const b = roundToF16(randomValues(p.K * p.N, 2));
      const ta = gpu.upload(a, [p.K, p.M], dtype);
      const tb = gpu.upload(b, [p.K, p.N], dtype);
      const want = matmulRef(a, [p.K, p.M], b, [p.K, p.N], { transA: true });
      const candidates = defaultCandidates(gpu, p);
      assert.ok(candidates.length >= 4, `${candidates.length} candidates`);
      assert.ok(
        candidates.some((c) => c.splitK > 1),
        'split-K candidates for a long K',
      );
      const checks = [];
      for (const c of candidates) {
        const { result: y, gemms } = traceGemms(() => matmul(gpu, ta, tb, { transA: true, tile: c.tile, splitK: c.splitK }));
        // The tile as configured; K ranges of whole BK steps, so up to the requested count (1028 = 7 x 160 - 92).
        assert.deepEqual(gemms[0].config.tile, c.tile, 'the candidate ran with its tile');
        const ranges = gemms[0].config.splitK;
        assert.ok(c.splitK === 1 ? ranges === 1 : ranges > 1 && ranges <= c.splitK, `split-K ${c.splitK} ran as ${ranges} ranges`);
        checks.push(compare(`${dtype} ${JSON.stringify(c)}`, await gpu.read(y), want, matmulTol(dtype)));
        gpu.free(y);
      }
      gpu.free(ta, tb);
      assertChecks(checks);
    }
  });

  it('tunes, uses the winner, and the cache round-trips per adapter', async () => {
    const gpu = await testGpu();
    clearMatmulTuning(gpu);
    const store = memoryTuningStore();
    const small = (p: GemmProblem) => defaultCandidates(gpu, p).slice(0, 3);
    const [r] = await tuneMatmul(gpu, [PROBLEM], { store, reps: 1, candidates: small });
    assert.equal(r.cached, false);
    assert.equal(r.timings!.length, 3);
    assert.ok(r.timings!.every((t) => t.ms > 0 && Number.isFinite(t.ms)));
    assert.deepEqual(chooseGemm(gpu, PROBLEM), r.config, 'matmul consults the tuning table');
    // Same class (powers of two), other sizes: same config.
    assert.equal(gemmClass({ ...PROBLEM, M: 33, K: 2000 }), gemmClass(PROBLEM));
    const saved = JSON.parse(store.data.get(adapterKey(gpu))!);
    assert.equal(saved.version, TUNING_VERSION);
    assert.deepEqual(saved.entries[gemmClass(PROBLEM)].tile, r.config.tile);
    // A fresh table reads the cache instead of timing.
    clearMatmulTuning(gpu);
    assert.deepEqual(chooseGemm(gpu, PROBLEM), heuristicGemm(gpu, PROBLEM), 'cleared: the heuristic again');
    const [again] = await tuneMatmul(gpu, [PROBLEM], {
      store,
      candidates: () => {
        throw new Error('should not time a cached class');
      },
    });
    assert.equal(again.cached, true);
    assert.deepEqual(again.config, r.config);
    assert.deepEqual(chooseGemm(gpu, PROBLEM), r.config);
    clearMatmulTuning(gpu);
  });

  it('a corrupt cache, a stale version and a bad entry are ignored with a warning', async () => {
    const gpu = await testGpu();
    const key = adapterKey(gpu);
    const one = (p: GemmProblem) => [heuristicGemm(gpu, p)];
    for (const [what, text, expect] of [
      ['not JSON', '{"version": 1, "entr', /not valid JSON/],
      ['old version', JSON.stringify({ version: TUNING_VERSION - 1, entries: {} }), /version 0, not 1/],
      [
        'a tile that does not fit',
        JSON.stringify({
          version: TUNING_VERSION,
          entries: { [gemmClass(PROBLEM)]: { tile: { BM: 4096, BN: 4096, BK: 32, TM: 4, TN: 4 }, splitK: 1, ms: 1 } },
        }),
        /ignoring the cached entry .* does not fit/,
      ],
      [
        'a malformed entry',
        JSON.stringify({ version: TUNING_VERSION, entries: { [gemmClass(PROBLEM)]: { tile: 'big', splitK: 0 } } }),
        /ignoring the cached entry/,
      ],
    ] as const) {
      clearMatmulTuning(gpu);
      const store = memoryTuningStore();
      store.data.set(key, text);
      const warnings: string[] = [];
      const [r] = await tuneMatmul(gpu, [PROBLEM], { store, reps: 1, candidates: one, warn: (m) => warnings.push(m) });
      assert.equal(r.cached, false, what);
      assert.equal(warnings.length, 1, `${what}: ${warnings.join('; ')}`);
      assert.match(warnings[0], expect, what);
      // The store now holds a valid entry again.
      assert.equal(JSON.parse(store.data.get(key)!).entries[gemmClass(PROBLEM)].splitK, r.config.splitK, what);
    }
    clearMatmulTuning(gpu);
  });

  it('a tuned config stays correct for other shapes of its class (ragged sizes)', async () => {
    const gpu = await testGpu();
    clearMatmulTuning(gpu);
    // Force a tuned entry with split-K and a big tile, then run a ragged member of the class.
    await tuneMatmul(gpu, [PROBLEM], { reps: 1, candidates: () => [{ tile: { BM: 64, BN: 64, BK: 32, TM: 8, TN: 8 }, splitK: 4 }] });
    const [M, N, K] = [33, 35, 1025];
    assert.equal(gemmClass({ ...PROBLEM, M, N, K: 2047 }), gemmClass(PROBLEM));
    const a = randomValues(K * M, 3);
    const b = randomValues(K * N, 4);
    const { result: y, gemms } = traceGemms(() => matmul(gpu, gpu.upload(a, [K, M], 'f32'), gpu.upload(b, [K, N], 'f32'), { transA: true }));
    assert.equal(gemms[0].config.splitK, 4);
    assertChecks([compare('ragged member of a tuned class', await gpu.read(y), matmulRef(a, [K, M], b, [K, N], { transA: true }), matmulTol('f32'))]);
    clearMatmulTuning(gpu);
  });
});
