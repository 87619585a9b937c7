// Ships a pretrained model as the studio's demo model: copies the diffusers folder a `lab:pretrain` run wrote
// (<run>/model, after the run or `pretrain --resume <run> --export`) into public/demo-model/ and writes its
// manifest (every file's size and SHA-256, the pretraining stage, step and settings).
//   npx tsx lab/demo-model/scripts/ship-demo-model.ts <run>/model [--name demo-sd1-small]
import { cpSync, existsSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { readSafetensors } from '../../../src/io/safetensors.ts';
import { SHIPPED_DEMO_DIR, SHIPPED_DEMO_MANIFEST, sha256Hex, type ShippedDemoManifest } from '../../../src/models/shipped-demo.ts';

/** The ceiling for what the page downloads. */
const MAX_BYTES = 20e6;

const [src, ...rest] = process.argv.slice(2);
const name = rest[0] === '--name' ? rest[1] : 'demo-sd1-small';
if (!src || !existsSync(join(src, 'model_index.json'))) {
  console.error('usage: npx tsx lab/demo-model/scripts/ship-demo-model.ts <pretraining run>/model [--name demo-sd1-small]  (a diffusers folder)');
  process.exit(1);
}
const walk = (dir: string): string[] => readdirSync(dir).flatMap((f) => (statSync(join(dir, f)).isDirectory() ? walk(join(dir, f)) : [join(dir, f)]));
const paths = walk(src)
  .map((p) => relative(src, p))
  .sort();
const unet = readSafetensors(new Uint8Array(readFileSync(join(src, 'unet/diffusion_pytorch_model.safetensors')))).metadata;
if (!unet.settings) throw new Error(`${src}: its UNet carries no pretraining settings: ship a folder that lab:pretrain wrote`);
const settings = JSON.parse(unet.settings) as Record<string, unknown>;
const files: ShippedDemoManifest['files'] = [];
for (const p of paths) {
  const bytes = new Uint8Array(readFileSync(join(src, p)));
  files.push({ path: p, size: bytes.length, sha256: await sha256Hex(bytes) });
}
const total = files.reduce((a, f) => a + f.size, 0);
if (total > MAX_BYTES) throw new Error(`${src} is ${(total / 1e6).toFixed(1)} MB: the demo model must stay under ${MAX_BYTES / 1e6} MB`);
const manifest: ShippedDemoManifest = {
  name,
  resolution: settings.resolution as number,
  stage: unet.stage ?? 'done',
  // UNet steps in all: with --init-from, those of the model the run went on from too.
  step: Number(unet.total_steps ?? unet.step ?? settings.steps),
  settings,
  files,
};
const out = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..', 'public', SHIPPED_DEMO_DIR);
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
cpSync(src, out, { recursive: true });
writeFileSync(join(out, SHIPPED_DEMO_MANIFEST), JSON.stringify(manifest, null, 2) + '\n');
console.log(`shipped ${name} (${manifest.stage} step ${manifest.step}, ${manifest.resolution} px, ${(total / 1e6).toFixed(1)} MB) to ${out}`);
