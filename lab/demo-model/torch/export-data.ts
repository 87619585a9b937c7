// The demo model's pretraining data as files, for the PyTorch path (torch/pretrain.py): the pictures the engine's
// pretraining draws (synthetic.ts, the same seeds and indices), their captions as CLIP token ids, the model's
// configs and the tokenizer. PyTorch reads only these files, so a machine without Node (a lent GPU) trains on
// exactly the engine's data once the folder is carried along.
//
//   npx tsx lab/demo-model/torch/export-data.ts --out <dir> [--size small|small-f4|tiny] [--data stars|v1]
//       [--data-seed N] [--data-size N] [--resolution px] [--solid-share p] [--exclude star,...] [--bpe <file.txt.gz>]
//
// The folder: data.json (what was drawn, the configs, the ids of the empty caption, and a SHA-256 of each file),
// pictures.u8.gz (N x R x R x 3 RGB bytes, rows top to bottom, gzip: the flat-coloured pictures shrink about
// tenfold), ids.i32 and bare_ids.i32 (N x 77 little-endian int32: each caption with and without its background),
// captions.txt (one per line) and tokenizer/ (vocab.json, merges.txt: the diffusers folder's tokenizer).
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { gunzipSync, gzipSync } from 'node:zlib';
import { ClipTokenizer } from '../../../src/io/tokenizer.ts';
import { clipParams, unetParams, vaeParams } from '../../../src/models/shapes.ts';
import { clipConfigFromJson } from '../../../src/nn/clip.ts';
import { unetConfigFromJson } from '../../../src/nn/unet.ts';
import { vaeConfigFromJson } from '../../../src/nn/vae.ts';
import { clipTokenizerFromBpe } from '../demo.ts';
import { PRETRAIN_DEFAULTS, PRETRAIN_SIZES, type PretrainConfigs } from '../pretrain.ts';
import {
  captionOf,
  checkDatasetOptions,
  dataSceneOptions,
  DATA_VERSIONS,
  drawScene,
  sceneAt,
  SHAPES,
  type DataVersion,
  type SceneOptions,
  type ShapeName,
} from '../synthetic.ts';

export const DATA_FORMAT = 'dbs-demo-pretrain-data/1';
const CLIP_LENGTH = 77;
const DEFAULT_BPE = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..', 'data', 'clip', 'bpe_simple_vocab_16e6.txt.gz');

export interface ExportOptions {
  size: keyof typeof PRETRAIN_SIZES;
  data: DataVersion;
  dataSeed: number;
  dataSize: number;
  resolution: number;
  solidShare: number | null;
  /** Shapes left out; absent, the data version's own (v1: star; stars: none). */
  exclude?: ShapeName[];
  bpe?: string;
}

/** What data.json records (and torch/pretrain.py checks a run against). */
export interface DataManifest {
  format: typeof DATA_FORMAT;
  size: string;
  data: DataVersion;
  dataSeed: number;
  dataSize: number;
  resolution: number;
  solidShare: number | null;
  exclude: ShapeName[];
  holdOut: SceneOptions['holdOut'];
  configs: PretrainConfigs;
  /** Every weight's name and shape by component, as the engine's loader expects them (src/models/shapes.ts). */
  params: Record<'unet' | 'vae' | 'text_encoder', [string, number[]][]>;
  emptyIds: number[];
  sha256: Record<string, string>;
}

/** Refuses options the export cannot honour, by name, before any file is written. */
export function checkExportOptions(o: ExportOptions): SceneOptions {
  if (!(o.size in PRETRAIN_SIZES)) throw new Error(`--size ${o.size}: use one of ${Object.keys(PRETRAIN_SIZES).join(', ')}`);
  const cfg = PRETRAIN_SIZES[o.size];
  const factor = 2 ** (cfg.vae.block_out_channels.length - 1);
  const scene = dataSceneOptions(o.data, { exclude: o.exclude, solidShare: o.solidShare ?? undefined }, '--data');
  checkDatasetOptions(
    { seed: o.dataSeed, size: o.resolution, factor, count: o.dataSize, exclude: scene.exclude, solidShare: o.solidShare ?? undefined },
    'dataset',
  );
  if (o.dataSize > 200000) throw new Error(`--data-size ${o.dataSize}: an export holds at most 200000 pictures (the files are read whole into memory)`);
  return scene;
}

/** Draws the data and writes the folder's files; returns the manifest written. */
export function exportData(out: string, o: ExportOptions): DataManifest {
  const scene = checkExportOptions(o);
  const bpe = o.bpe ?? DEFAULT_BPE;
  if (!existsSync(bpe)) throw new Error(`--bpe ${bpe}: no such file; give CLIP's merge list bpe_simple_vocab_16e6.txt.gz`);
  if (existsSync(out) && readdirSync(out).length > 0)
    throw new Error(`--out ${out}: the folder is not empty; give a new folder (an export is never overwritten)`);
  const configs = PRETRAIN_SIZES[o.size];
  const tokFiles = clipTokenizerFromBpe(gunzipSync(readFileSync(bpe)).toString('utf8'), configs.text_encoder.vocab_size);
  const tokenizer = ClipTokenizer.fromFiles(tokFiles);
  const R = o.resolution;
  const pictures = new Uint8Array(o.dataSize * R * R * 3);
  const ids = new Int32Array(o.dataSize * CLIP_LENGTH);
  const bareIds = new Int32Array(o.dataSize * CLIP_LENGTH);
  const captions: string[] = [];
  for (let i = 0; i < o.dataSize; i++) {
    const s = sceneAt(o.dataSeed, i, scene);
    pictures.set(drawScene(s, R), i * R * R * 3);
    const caption = captionOf(s);
    captions.push(caption);
    ids.set(tokenizer.encodePadded(caption), i * CLIP_LENGTH);
    bareIds.set(tokenizer.encodePadded(captionOf(s, { background: false })), i * CLIP_LENGTH);
  }
  const files: Record<string, Uint8Array> = {
    'pictures.u8.gz': gzipSync(pictures, { level: 6 }),
    'ids.i32': new Uint8Array(ids.buffer),
    'bare_ids.i32': new Uint8Array(bareIds.buffer),
    'captions.txt': new TextEncoder().encode(captions.join('\n') + '\n'),
  };
  const manifest: DataManifest = {
    format: DATA_FORMAT,
    size: o.size,
    data: o.data,
    dataSeed: o.dataSeed,
    dataSize: o.dataSize,
    resolution: R,
    solidShare: o.solidShare,
    exclude: scene.exclude ? [...scene.exclude] : [],
    holdOut: scene.holdOut ?? [],
    configs,
    params: {
      unet: [...unetParams(unetConfigFromJson(configs.unet))],
      vae: [...vaeParams(vaeConfigFromJson(configs.vae))],
      text_encoder: [...clipParams(clipConfigFromJson(configs.text_encoder))],
    },
    emptyIds: [...tokenizer.encodePadded('')],
    sha256: Object.fromEntries(Object.entries(files).map(([n, b]) => [n, createHash('sha256').update(b).digest('hex')])),
  };
  mkdirSync(join(out, 'tokenizer'), { recursive: true });
  for (const [n, b] of Object.entries(files)) writeFileSync(join(out, n), b);
  writeFileSync(join(out, 'tokenizer', 'vocab.json'), JSON.stringify(tokFiles.vocab, null, 2));
  writeFileSync(join(out, 'tokenizer', 'merges.txt'), tokFiles.merges);
  writeFileSync(join(out, 'data.json'), JSON.stringify(manifest, null, 2));
  return manifest;
}

const USAGE =
  'usage: export-data.ts --out <dir> [--size small|small-f4|tiny] [--data stars|v1] [--data-seed N] [--data-size N] [--resolution px] [--solid-share p] [--exclude star,...] [--bpe <file.txt.gz>]';

/** Parses the command line into export options (numbers checked by checkExportOptions). */
export function exportOptionsFromArgs(args: string[]): { out: string; options: ExportOptions } {
  const { values } = parseArgs({
    args,
    options: {
      out: { type: 'string' },
      size: { type: 'string', default: 'small-f4' },
      data: { type: 'string', default: 'stars' },
      'data-seed': { type: 'string' },
      'data-size': { type: 'string' },
      resolution: { type: 'string' },
      'solid-share': { type: 'string' },
      exclude: { type: 'string' },
      bpe: { type: 'string' },
    },
  });
  if (!values.out) throw new Error(`--out is required\n${USAGE}`);
  const size = values.size as ExportOptions['size'];
  if (!(size in PRETRAIN_SIZES)) throw new Error(`--size ${size}: use one of ${Object.keys(PRETRAIN_SIZES).join(', ')}`);
  if (!(DATA_VERSIONS as readonly string[]).includes(values.data)) throw new Error(`--data ${values.data}: use one of ${DATA_VERSIONS.join(', ')}`);
  const num = (flag: string, v: string | undefined, dflt: number) => {
    if (v === undefined) return dflt;
    const n = Number(v);
    if (v.trim() === '' || !Number.isFinite(n)) throw new Error(`--${flag} ${v}: not a number`);
    return n;
  };
  const exclude = values.exclude === undefined ? undefined : values.exclude === '' ? [] : values.exclude.split(',').map((x) => x.trim());
  for (const s of exclude ?? [])
    if (!(SHAPES as readonly string[]).includes(s)) throw new Error(`--exclude ${s}: not a shape the generator draws (${SHAPES.join(', ')})`);
  return {
    out: values.out,
    options: {
      size,
      data: values.data as DataVersion,
      dataSeed: num('data-seed', values['data-seed'], PRETRAIN_DEFAULTS.dataSeed),
      dataSize: num('data-size', values['data-size'], 5000),
      resolution: num('resolution', values.resolution, PRETRAIN_SIZES[size].vae.sample_size),
      solidShare: num('solid-share', values['solid-share'], PRETRAIN_DEFAULTS.solidShare ?? 0.5),
      ...(exclude ? { exclude: exclude as ShapeName[] } : {}),
      ...(values.bpe ? { bpe: values.bpe } : {}),
    },
  };
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  try {
    const { out, options } = exportOptionsFromArgs(process.argv.slice(2));
    const t0 = performance.now();
    const m = exportData(out, options);
    console.log(
      `wrote ${m.dataSize} pictures (${m.resolution} px, data ${m.data}, seed ${m.dataSeed}) to ${out} in ${((performance.now() - t0) / 1000).toFixed(1)} s`,
    );
  } catch (e) {
    console.error((e as Error).message);
    process.exit(2);
  }
}
