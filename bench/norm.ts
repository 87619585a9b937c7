// npm run bench:norm — GPU milliseconds of the GroupNorm/LayerNorm kernels (forward, backward dx, backward
// parameter gradients) on the shapes of the pretraining model's step (batch 8) and a few SD 1.5 shapes (batch 1),
// from GPU timestamps (gpu.startProfile), median of --reps runs (default 10, after one warm-up run).
// SwiftShader instead of lavapipe (f32 only, it lacks shader-f16):
//   bash scripts/gpu-env.sh env VK_ICD_FILENAMES=/usr/lib/chromium/vk_swiftshader_icd.json npx tsx bench/norm.ts --dtypes f32
// Flags: --reps N, --dtypes f32,f16 (default: f32, plus f16 where the adapter has it), --only name,name (substrings),
// --lanes 1,8,256 (time each forced lanes-per-segment choice instead of normLanes's; for tuning it).
import { nodeGpu } from '../src/gpu/node.ts';
import type { DType } from '../src/gpu/tensor.ts';
import { groupNorm, groupNormBackward, layerNorm, layerNormBackward, setNormLanes } from '../src/ops/norm.ts';
import { randomValues } from '../src/selftest/check.ts';

interface NormShape {
  name: string;
  kind: 'group' | 'layer';
  shape: number[];
  groups?: number;
}

const SHAPES: NormShape[] = [
  // pretraining model (src/train/pretrain.ts PRETRAIN_CONFIGS, batch 8): 8 groups, latents 8x8 .. 1x1
  { name: 'pt GN [8,32,8,8]/8', kind: 'group', shape: [8, 32, 8, 8], groups: 8 },
  { name: 'pt GN [8,128,4,4]/8', kind: 'group', shape: [8, 128, 4, 4], groups: 8 },
  { name: 'pt GN [8,64,2,2]/8', kind: 'group', shape: [8, 64, 2, 2], groups: 8 },
  { name: 'pt GN [8,64,1,1]/8', kind: 'group', shape: [8, 64, 1, 1], groups: 8 },
  { name: 'pt LN text [616,64]', kind: 'layer', shape: [616, 64] },
  { name: 'pt LN unet [512,32]', kind: 'layer', shape: [512, 32] },
  // SD 1.5 (batch 1): 32 groups; transformer LayerNorm over 4096 tokens
  { name: 'sd GN [1,320,64,64]/32', kind: 'group', shape: [1, 320, 64, 64], groups: 32 },
  { name: 'sd GN [1,1280,8,8]/32', kind: 'group', shape: [1, 1280, 8, 8], groups: 32 },
  { name: 'sd LN [4096,320]', kind: 'layer', shape: [4096, 320] },
  { name: 'sd LN [77,768]', kind: 'layer', shape: [77, 768] },
];

const args = process.argv.slice(2);
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const reps = Number(arg('--reps')) || 10;
const only = arg('--only')?.split(',');
const gpu = await nodeGpu();
const dtypes = (arg('--dtypes')?.split(',') ?? (gpu.hasF16 ? ['f32', 'f16'] : ['f32'])) as DType[];
const laneChoices = arg('--lanes')?.split(',').map(Number) ?? [null];
const median = (v: number[]) => [...v].sort((a, b) => a - b)[Math.floor(v.length / 2)];

for (const lanes of laneChoices) {
  setNormLanes(lanes);
  for (const dtype of dtypes) {
    for (const s of SHAPES.filter((c) => !only || only.some((o) => c.name.includes(o)))) {
      const n = s.shape.reduce((a, b) => a * b, 1);
      const c = s.kind === 'group' ? s.shape[1] : s.shape[s.shape.length - 1];
      const x = gpu.upload(randomValues(n, 1, 2), s.shape, dtype);
      const dy = gpu.upload(randomValues(n, 2), s.shape, dtype);
      const gamma = gpu.upload(
        randomValues(c, 3).map((v) => v + 1),
        [c],
        dtype,
      );
      const beta = gpu.upload(randomValues(c, 4), [c], dtype);
      const step = () => {
        const f = s.kind === 'group' ? groupNorm(gpu, x, gamma, beta, s.groups) : layerNorm(gpu, x, gamma, beta);
        const g = s.kind === 'group' ? groupNormBackward(gpu, x, gamma, f, dy, s.groups) : layerNormBackward(gpu, x, gamma, f, dy);
        gpu.free(f.y, f.mean, f.rstd, g.dx, g.dgamma, g.dbeta);
      };
      step();
      await gpu.sync();
      const times: Record<string, number[]> = {};
      for (let r = 0; r < reps; r++) {
        gpu.startProfile();
        step();
        const prof = await gpu.stopProfile();
        for (const [k, v] of Object.entries(prof.byKernel)) (times[k] ??= []).push(v.ms);
      }
      const cols = Object.entries(times).map(([k, v]) => `${k.replace('norm.norm_', '')} ${median(v).toFixed(3)}`);
      const total = median(Object.values(times).reduce((acc, v) => acc.map((a, i) => a + v[i]), new Array<number>(reps).fill(0)));
      console.log(`${lanes === null ? '' : `lanes ${lanes} `}${dtype} ${s.name.padEnd(24)} total ${total.toFixed(3)} ms | ${cols.join(' | ')}`);
      gpu.free(x, dy, gamma, beta);
    }
  }
}
gpu.destroy();
