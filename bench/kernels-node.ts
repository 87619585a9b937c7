// npm run bench:kernels:node — our kernels on Dawn in Node (lavapipe here; a real GPU with
// DBS_SYSTEM_VULKAN=1), plus PyTorch on the same GPU when python3 has CUDA. Writes
// bench/results/kernels-node.json. Flags: --quick (scaled-down shapes), --reps N, --out FILE,
// --budget SECONDS (per shape), --naive-max-mib MIB (naive attention not timed past this much of
// scores; its peak is still planned by a dry run), --no-torch.
import { execFileSync } from 'node:child_process';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { nodeGpu } from '../src/gpu/node.ts';
import { benchOurs, flops, pickLimits, summarise, table, type Measurement, type ShapeCase } from './core.ts';

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const quick = args.includes('--quick');
const reps = Number(args[args.indexOf('--reps') + 1]) || (quick ? 3 : 5);
const outFile = args.includes('--out') ? args[args.indexOf('--out') + 1] : join(here, 'results', 'kernels-node.json');
const budgetMs = (Number(args[args.indexOf('--budget') + 1]) || 300) * 1000;
const naiveMaxScoreBytes = args.includes('--naive-max-mib') ? Number(args[args.indexOf('--naive-max-mib') + 1]) * 2 ** 20 : Infinity;
const size = quick ? 'quick' : 'full';
const shapes: ShapeCase[] = JSON.parse(readFileSync(join(here, 'shapes.json'), 'utf8'))[size];

const gpu = await nodeGpu();
const planner = await nodeGpu({ dryRun: true });
const adapter = `${gpu.adapter.vendor} ${gpu.adapter.architecture} ${gpu.adapter.description}`.trim();
console.log(`adapter: ${adapter}; compute dtype ${gpu.computeDType}; shapes: ${size}; reps ${reps}`);
const results: Measurement[] = [];
for (const c of shapes) {
  const ms = await benchOurs(gpu, c, { reps, budgetMs, planner, naiveMaxScoreBytes });
  results.push(...ms);
  for (const m of ms) console.log(`  ${m.label} ${m.impl}: ${m.ms.toFixed(2)} ms wall, ${m.gpuMs?.toFixed(3) ?? '-'} ms GPU${m.note ? ` (${m.note})` : ''}`);
}

let torchInfo: unknown;
try {
  if (args.includes('--no-torch')) throw new Error('--no-torch');
  const py = process.env.PYTHON ?? 'python3';
  const raw = execFileSync(py, [join(here, 'peers', 'torch_kernels.py'), size, String(reps)], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  const parsed = JSON.parse(raw.trim().split('\n').pop()!) as {
    device?: string;
    torch?: string;
    error?: string;
    results?: { id: string; impl: string; ms: number }[];
  };
  torchInfo = { device: parsed.device, torch: parsed.torch, error: parsed.error };
  for (const r of parsed.results ?? []) {
    const c = shapes.find((s) => s.id === r.id)!;
    const pass = r.impl.includes('fwd+bwd') ? 'fwdbwd' : 'fwd';
    results.push({
      id: r.id,
      label: c.label,
      impl: r.impl,
      dtype: r.impl.endsWith('f16') ? 'f16' : 'f32',
      ms: r.ms,
      gpuMs: r.ms,
      all: [r.ms],
      gflops: flops(c, pass) / r.ms / 1e6,
      note: 'CUDA event time',
    });
  }
} catch (e) {
  torchInfo = { error: `PyTorch peer not run: ${(e as Error).message.split('\n')[0]}` };
}

console.log(`\n${table(results)}\n`);
const summary = summarise(results, true);
for (const [k, v] of Object.entries(summary)) console.log(`${k}: ${typeof v === 'number' ? v.toFixed(2) : v}`);
mkdirSync(dirname(outFile), { recursive: true });
writeFileSync(
  outFile,
  JSON.stringify(
    {
      date: new Date().toISOString(),
      host: 'node (Dawn)',
      adapter,
      features: gpu.adapter.features,
      limits: pickLimits(gpu.adapter.limits),
      computeDType: gpu.computeDType,
      shapes: size,
      reps,
      torch: torchInfo,
      results,
      summary,
    },
    null,
    2,
  ),
);
console.log(`wrote ${outFile}`);
planner.destroy();
gpu.destroy();
process.exit(0);
