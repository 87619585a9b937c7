// Per-adapter GEMM tuning (src/ops/tune.ts): the search's choices on a known cost table, real timings on lavapipe
// applied and cached per adapter, cache entries that cannot be used timed again, the Node file cache, the command
// line's DBS_GPU_TUNE, and the claim the trainer's resume rests on: the register block never changes a result.
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { tuneCliGpu } from '../../src/cli/gpu-tuning.ts';
import { GEMM_CONFIG_VALUES, type GemmConfig } from '../../src/gpu/device.ts';
import { nodeTuningCache } from '../../src/io/tuning-node.ts';
import { matmul, matmulRef } from '../../src/ops/matmul.ts';
import { compare } from '../../src/selftest/check.ts';
import { matmulTol } from '../../src/selftest/cases/matmul.ts';
import {
  CPU_TUNE_SHAPES,
  describeGemmConfig,
  GPU_TUNE_SHAPES,
  searchGemmConfigs,
  TUNE_VERSION,
  tuneGemm,
  tuningKey,
  type ConfigTiming,
  type TuneShape,
  type TuningCache,
} from '../../src/ops/tune.ts';
import { Rng } from '../../src/util/rng.ts';
import { assertChecks, recordDispatches, testGpu } from '../helpers.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';

/** A cache in memory that counts its calls. */
function memoryCache(): TuningCache & { entries: Map<string, string>; loads: number; saves: number } {
  const entries = new Map<string, string>();
  const c = {
    entries,
    loads: 0,
    saves: 0,
    async load(key: string) {
      c.loads++;
      return entries.get(key) ?? null;
    },
    async save(key: string, value: string) {
      c.saves++;
      entries.set(key, value);
    },
  };
  return c;
}

/** One small shape and few samples: the tuner's real timing path in well under a second per comparison. */
const QUICK = { shapes: [{ name: 'small', M: 64, N: 96, K: 128, transB: true }] as TuneShape[], samples: 3, sampleMs: 4, cpuAdapters: true };

const sameConfig = (a: GemmConfig, b: GemmConfig) => a.registerBlock === b.registerBlock && a.fillWorkgroups === b.fillWorkgroups && a.splitK === b.splitK;

describe('GEMM tuning: the search', () => {
  // A cost table over the 2 x 3 x 2 configs: 4x4 blocks 30 % faster, fill 64 10 % faster, split-K 3 % faster
  // (below the 5 % a change must gain, so noise-sized gains leave the config as it is).
  const cost = (c: GemmConfig) => 100 * (c.registerBlock === 4 ? 0.7 : 1) * (c.fillWorkgroups === 64 ? 0.9 : 1) * (c.splitK ? 0.97 : 1);
  const compare = async (a: GemmConfig, b: GemmConfig): Promise<[ConfigTiming, ConfigTiming]> => [
    { config: a, ms: cost(a), perShape: [cost(a)] },
    { config: b, ms: cost(b), perShape: [cost(b)] },
  ];

  it('walks one field at a time from the start, keeps a value only when it gains at least minGain twice, times each alternative once (winners twice)', async () => {
    const start: GemmConfig = { registerBlock: 8, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false, direct: false };
    const { best, timings } = await searchGemmConfigs(start, compare, 0.05);
    assert.deepEqual(best, { registerBlock: 4, fillWorkgroups: 64, splitK: false, bk: 16, prefetch: false, direct: false });
    // the start, every other value of each field once, and a confirming comparison for each of the 2 winners
    const alternatives = Object.values(GEMM_CONFIG_VALUES).reduce((n, vs) => n + vs.length - 1, 0);
    assert.equal(timings.length, 1 + alternatives + 2);
    assert.deepEqual(timings[0].config, start);
    // a 3 % gain passes a 2 % threshold
    assert.equal((await searchGemmConfigs(start, compare, 0.02)).best.splitK, true);
  });

  it('a win the confirming comparison does not repeat (noise) leaves the config as it was', async () => {
    const start: GemmConfig = { registerBlock: 8, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false, direct: false };
    let calls = 0;
    const flaky = async (a: GemmConfig, b: GemmConfig): Promise<[ConfigTiming, ConfigTiming]> => {
      calls++;
      const lucky = calls === 1; // the first challenger looks 20 % faster once
      return [
        { config: a, ms: 100, perShape: [100] },
        { config: b, ms: lucky ? 80 : 100, perShape: [lucky ? 80 : 100] },
      ];
    };
    const { best } = await searchGemmConfigs(start, flaky, 0.05);
    assert.deepEqual(best, start);
  });
});

describe('GEMM tuning on this adapter (lavapipe)', () => {
  it('times the candidates, applies the fastest and caches it under the adapter; the next call reads the cache and times nothing', async () => {
    const gpu = await testGpu();
    const before = gpu.gemmConfig;
    try {
      const cache = memoryCache();
      const r = await tuneGemm(gpu, { ...QUICK, cache });
      assert.equal(r.source, 'timed');
      const alternatives = Object.values(GEMM_CONFIG_VALUES).reduce((n, vs) => n + vs.length - 1, 0);
      assert.ok(r.timings.length >= 1 + alternatives && r.timings.length <= 1 + 2 * alternatives, `${r.timings.length} timings`);
      assert.ok(r.timings.every((t) => t.ms > 0 && t.perShape.length === 1 && Number.isFinite(t.ms)));
      assert.ok(
        r.timings.some((t) => sameConfig(t.config, r.config)),
        'the chosen config was one of those timed',
      );
      assert.deepEqual(gpu.gemmConfig, r.config);
      assert.equal(r.key, tuningKey(gpu));
      assert.match(r.key, new RegExp(`^gemm\\|v${TUNE_VERSION}\\|`));
      assert.ok(r.key.includes(gpu.adapter.description) && r.key.endsWith(`|${gpu.computeDType}`));
      const stored = JSON.parse(cache.entries.get(r.key)!);
      assert.deepEqual(stored.config, r.config);

      // Another config in force: the cached one is applied again, with no dispatch.
      const other: GemmConfig = { ...r.config, registerBlock: r.config.registerBlock === 8 ? 4 : 8 };
      gpu.setGemmConfig(other);
      const dispatches = gpu.dispatchCount;
      const again = await tuneGemm(gpu, { ...QUICK, cache });
      assert.equal(again.source, 'cache');
      assert.equal(gpu.dispatchCount, dispatches);
      assert.deepEqual(gpu.gemmConfig, r.config);
      assert.equal(cache.saves, 1);

      // force: timed again and the entry replaced
      const forced = await tuneGemm(gpu, { ...QUICK, cache, force: true });
      assert.equal(forced.source, 'timed');
      assert.equal(cache.saves, 2);
    } finally {
      gpu.setGemmConfig(before);
    }
  });

  it('times the 3x3 convolutions (implicit GEMMs, or im2col where lowered), forward and backward, under each config it compares (both shape lists have them)', async () => {
    for (const list of [CPU_TUNE_SHAPES, GPU_TUNE_SHAPES]) {
      const convs = list.filter((s) => 'conv' in s);
      assert.deepEqual(
        convs.map((s) => [s.conv.kernel, !!s.conv.backward]),
        [
          [3, false],
          [3, true],
        ],
      );
    }
    const gpu = await testGpu();
    const before = gpu.gemmConfig;
    const shapes: TuneShape[] = [
      ...QUICK.shapes,
      { name: 'conv', conv: { batch: 1, channels: 8, out: 16, side: 8, kernel: 3 } },
      { name: 'conv backward', conv: { batch: 1, channels: 8, out: 16, side: 8, kernel: 3, backward: true } },
    ];
    // Which config was in force at each convolution pass: the implicit GEMM by its MODE, or, where the config
    // lowers the forward and grad input to im2col (the direct core on a CPU adapter), their im2col / col2im kernels.
    const seen = new Map<string, Set<string>>();
    const passOf: Record<string, string> = { im2col: '0', col2im: '1' };
    const run = gpu.run;
    gpu.run = (k, call) => {
      const pass = k.entry.startsWith('conv_gemm') ? String(call.defs?.MODE ?? '?') : passOf[k.entry];
      if (pass) seen.set(pass, (seen.get(pass) ?? new Set()).add(describeGemmConfig(gpu.gemmConfig)));
      return run.call(gpu, k, call);
    };
    try {
      const r = await tuneGemm(gpu, { ...QUICK, shapes });
      assert.deepEqual(r.shapes, ['small', 'conv', 'conv backward']);
      assert.ok(r.timings.every((t) => t.perShape.length === 3 && t.perShape.every((ms) => ms > 0)));
      // forward, input gradient and weight gradient: each timed under every config of the search
      assert.equal(seen.size, 3, [...seen.keys()].join());
      const timed = [...new Set(r.timings.map((t) => describeGemmConfig(t.config)))].sort();
      assert.ok(timed.length >= 2);
      for (const configs of seen.values()) assert.deepEqual([...configs].sort(), timed);
    } finally {
      gpu.run = run;
      gpu.setGemmConfig(before);
    }
  });

  for (const [what, text, problem] of [
    ['not JSON', '{"version": 1, "conf', /not JSON/],
    [
      'an older version',
      JSON.stringify({ version: TUNE_VERSION - 1, config: { registerBlock: 8, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false } }),
      new RegExp(`version ${TUNE_VERSION - 1}, expected ${TUNE_VERSION}`),
    ],
    [
      'a config no kernel has',
      JSON.stringify({ version: TUNE_VERSION, config: { registerBlock: 16, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false } }),
      /registerBlock is 16/,
    ],
  ] as const)
    it(`a cache entry that is ${what} is reported by key and timed again, and replaced`, async () => {
      const gpu = await testGpu();
      const before = gpu.gemmConfig;
      try {
        const cache = memoryCache();
        cache.entries.set(tuningKey(gpu), text);
        const lines: string[] = [];
        const r = await tuneGemm(gpu, { ...QUICK, cache, log: (l) => lines.push(l) });
        assert.equal(r.source, 'timed');
        const warning = lines.find((l) => l.includes('unusable'));
        assert.ok(warning && warning.includes(tuningKey(gpu)) && problem.test(warning), lines.join('\n'));
        assert.deepEqual(JSON.parse(cache.entries.get(r.key)!).config, r.config);
      } finally {
        gpu.setGemmConfig(before);
      }
    });

  it('a CPU adapter keeps its defaults unless asked: nothing timed, the cache untouched', async () => {
    const gpu = await testGpu();
    assert.ok(gpu.facts.software, 'lavapipe is a CPU adapter');
    const cache = memoryCache();
    const dispatches = gpu.dispatchCount;
    const r = await tuneGemm(gpu, { cache });
    assert.equal(r.source, 'defaults');
    assert.deepEqual(r.config, { registerBlock: 8, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false, direct: true });
    assert.equal(gpu.dispatchCount, dispatches);
    assert.equal(cache.loads + cache.saves, 0);
  });

  it('a timing that fails puts back the config the device had and says why', async () => {
    const gpu = await testGpu();
    const before = gpu.gemmConfig;
    const had: GemmConfig = { registerBlock: 4, fillWorkgroups: 64, splitK: true, bk: 16, prefetch: false, direct: false }; // not the start of the search
    try {
      gpu.setGemmConfig(had);
      const bad: TuneShape[] = [{ name: 'an output too big for one buffer', M: 1 << 16, N: 1 << 16, K: 1 }]; // fails in matmul, after the config is set
      await assert.rejects(tuneGemm(gpu, { ...QUICK, shapes: bad }), /maxBufferSize|larger than/);
      assert.deepEqual(gpu.gemmConfig, had);
      // setGemmConfig refuses a config no kernel has
      assert.throws(
        () => gpu.setGemmConfig({ registerBlock: 2 as 4, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false, direct: false }),
        /invalid GEMM config .*registerBlock is 2/,
      );
      assert.throws(
        () => gpu.setGemmConfig({ registerBlock: 8, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false, direct: 1 as unknown as boolean }),
        /invalid GEMM config .*direct is 1/,
      );
      // a config recorded before `direct` existed (a checkpoint's, an old cache entry's) is accepted and keeps the
      // device's own choice of core, both ways
      const old = { registerBlock: 8, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false } as unknown as GemmConfig;
      for (const direct of [true, false]) {
        gpu.setGemmConfig({ ...had, direct });
        gpu.setGemmConfig(old);
        assert.deepEqual(gpu.gemmConfig, { ...old, direct });
      }
    } finally {
      gpu.setGemmConfig(before);
    }
  });

  it('the register block, step depth, prefetch and the direct core change speed, never a result: the same bits at every transpose', async () => {
    const gpu = await testGpu();
    const before = gpu.gemmConfig;
    const rng = new Rng(7);
    try {
      // f32 at one ragged shape (every new tile variant is a pipeline lavapipe takes ~2 s to compile); f16 stores
      // the same f32 sums, rounded once.
      for (const dtype of ['f32'] as const)
        for (const [transA, transB] of [
          [false, false],
          [true, false],
          [false, true],
        ])
          for (const [M, N, K] of [[130, 135, 301]]) {
            const [av, bv] = [rng.normals(M * K), rng.normals(K * N)];
            const [aShape, bShape] = [transA ? [K, M] : [M, K], transB ? [N, K] : [K, N]];
            const a = gpu.upload(av, aShape, dtype);
            const b = gpu.upload(bv, bShape, dtype);
            const results: number[][] = [];
            for (const [registerBlock, bk, prefetch, direct] of [
              [8, 16, false, true], // lavapipe's default: matmuls on the direct core
              [8, 16, false, false], // the staged core
              [4, 32, true, false], // a GPU's default
              [8, 32, true, false],
            ] as const) {
              gpu.setGemmConfig({ registerBlock, fillWorkgroups: 8, splitK: false, bk, prefetch, direct });
              let c!: Tensor;
              const seen = recordDispatches(gpu, () => (c = matmul(gpu, a, b, { transA, transB })));
              assert.deepEqual(
                seen.filter((d) => d.entry === 'matmul').map((d) => d.defs.DIRECT),
                [direct],
                'the config picks the core',
              );
              results.push(Array.from(await gpu.read(c)));
              gpu.free(c);
            }
            gpu.free(a, b);
            for (const [i, r] of results.entries()) assert.deepEqual(r, results[0], `config ${i}: ${dtype} ${M}x${N}x${K} transA=${transA} transB=${transB}`);
            // and the shared result is the product (not, say, zeros from every config): f32 sums over K = 301 of unit normals
            assertChecks([compare('vs matmulRef', Float32Array.from(results[0]), matmulRef(av, aShape, bv, bShape, { transA, transB }), matmulTol(dtype))]);
          }
    } finally {
      gpu.setGemmConfig(before);
    }
  });
});

describe('GEMM tuning: the Node cache file and the command line (DBS_GPU_TUNE)', () => {
  it('the file keeps entries by key, replaces a damaged file on save, and names it when it cannot be read', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'dbs-tune-'));
    const file = join(dir, 'sub', 'gpu-tuning.json');
    const cache = nodeTuningCache(file);
    assert.equal(await cache.load('a'), null);
    await cache.save('a', 'one');
    await cache.save('b', 'two');
    assert.equal(await cache.load('a'), 'one');
    assert.equal(await nodeTuningCache(file).load('b'), 'two');
    writeFileSync(file, '{"a": "on');
    await assert.rejects(cache.load('a'), (e: Error) => e.message.includes(file) && /not JSON/.test(e.message) && /delete it/.test(e.message));
    await cache.save('c', 'three');
    assert.deepEqual(JSON.parse(readFileSync(file, 'utf8')), { c: 'three' });
  });

  it('DBS_GPU_TUNE: on times a CPU adapter and caches it in DBS_CACHE_DIR, the next run reads it silently; off does nothing; a wrong value is refused by name', async () => {
    const gpu = await testGpu();
    const before = gpu.gemmConfig;
    const dir = mkdtempSync(join(tmpdir(), 'dbs-tune-cli-'));
    try {
      const lines: string[] = [];
      const env = { DBS_GPU_TUNE: 'on', DBS_CACHE_DIR: dir };
      const first = await tuneCliGpu(gpu, env, (l) => lines.push(l), QUICK);
      assert.equal(first?.source, 'timed');
      const file = join(dir, 'gpu-tuning.json');
      assert.ok(
        lines.some((l) => l.startsWith('GEMM kernels timed on') && l.includes(file)),
        lines.join('\n'),
      );
      assert.deepEqual(JSON.parse(JSON.parse(readFileSync(file, 'utf8'))[first!.key]).config, first!.config);
      const later: string[] = [];
      const second = await tuneCliGpu(gpu, env, (l) => later.push(l), QUICK);
      assert.equal(second?.source, 'cache');
      assert.deepEqual(later, []);
      assert.equal(await tuneCliGpu(gpu, { DBS_GPU_TUNE: 'off', DBS_CACHE_DIR: dir }), null);
      assert.equal((await tuneCliGpu(gpu, { DBS_CACHE_DIR: dir }))?.source, 'defaults', 'auto leaves a CPU adapter alone');
      await assert.rejects(tuneCliGpu(gpu, { DBS_GPU_TUNE: 'fast' }), /DBS_GPU_TUNE=fast: expected one of auto, on, force, off/);
    } finally {
      gpu.setGemmConfig(before);
    }
  });
});
