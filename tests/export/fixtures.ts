// Shared by the export tests: the tiny SD1 model in both layouts (make-tiny.ts) in a temp dir, a fake but
// real "trained" UNet (every weight moved by a known delta), random LoRA adapters (rank 4, alpha 8) on all
// of the engine's targets, and a ByteSink that keeps what it is given and records every chunk's size.
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Gpu } from '../../src/gpu/device.ts';
import { roundToF16 } from '../../src/util/half.ts';
import type { ByteSink, NamedTensor, SafetensorsFile } from '../../src/io/safetensors.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import type { Weights } from '../../src/nn/blocks.ts';
import type { ModelSource } from '../../src/models/source.ts';
import type { Component } from '../../src/models/detect.ts';
import { writeTinyModel, type TinyModel } from '../fixtures/models/make-tiny.ts';
import { FIXTURES } from '../helpers.ts';

let tiny: TinyModel | null = null;
let tiny2: TinyModel | null = null;

export function tinyModel(): TinyModel {
  return (tiny ??= writeTinyModel(mkdtempSync(join(tmpdir(), 'dbs-export-'))));
}

export function tinySd2(): TinyModel {
  return (tiny2 ??= writeTinyModel(mkdtempSync(join(tmpdir(), 'dbs-export2-')), 'sd2'));
}

export const tempDir = () => mkdtempSync(join(tmpdir(), 'dbs-export-out-'));

export function readFolderTensors(folder: string, path: string): Map<string, NamedTensor> {
  return readSafetensors(new Uint8Array(readFileSync(join(folder, path)))).tensors;
}

/** Deterministic uniform [-1, 1) numbers (mulberry32). */
export function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (((t ^ (t >>> 14)) >>> 0) / 4294967296) * 2 - 1;
  };
}

/** The known training delta of element i: a few hundredths, different for every element. */
export const delta = (i: number) => (0.01 * (((i * 7919) % 13) - 6)) / 6;

/** The tiny UNet (diffusers names) with every weight moved by `delta`. */
export function trainedUnet(folder: string): Map<string, NamedTensor> {
  const base = readFolderTensors(folder, 'unet/diffusion_pytorch_model.safetensors');
  return new Map([...base].map(([n, t]) => [n, { shape: t.shape, data: t.data.map((v, i) => v + delta(i)) }]));
}

const UNET_TARGETS = /\.attn[12]\.(to_q|to_k|to_v|to_out\.0)\.weight$/;
const TE_TARGETS = /\.self_attn\.(q_proj|k_proj|v_proj|out_proj)\.weight$/;

/** Random adapters (rank r) on every target layer of `base` (diffusers weights): lora_A [r, in], lora_B [out, r]. */
export function randomAdapters(base: Map<string, NamedTensor>, te: boolean, rank: number, seed: number): Map<string, NamedTensor> {
  const r = rng(seed);
  const out = new Map<string, NamedTensor>();
  for (const [n, t] of base) {
    if (!(te ? TE_TARGETS : UNET_TARGETS).test(n)) continue;
    const layer = n.slice(0, -'.weight'.length);
    const [o, i] = t.shape;
    out.set(`${layer}.lora_A.weight`, { shape: [rank, i], data: Float32Array.from({ length: rank * i }, () => 0.3 * r()) });
    out.set(`${layer}.lora_B.weight`, { shape: [o, rank], data: Float32Array.from({ length: o * rank }, () => 0.3 * r()) });
  }
  return out;
}

export function rounded(t: Map<string, NamedTensor>, scaleB = 1): Map<string, NamedTensor> {
  return new Map(
    [...t].map(([n, v]) => [n, { shape: v.shape, data: roundToF16(n.endsWith('lora_B.weight') && scaleB !== 1 ? v.data.map((x) => x * scaleB) : v.data) }]),
  );
}

/** A sink that keeps the bytes and every chunk's length. */
export function memorySink(): ByteSink & { chunks: number[]; closed: boolean; bytes(): Uint8Array } {
  const parts: Uint8Array[] = [];
  const s = {
    chunks: [] as number[],
    closed: false,
    async write(c: Uint8Array) {
      if (s.closed) throw new Error('write after close');
      parts.push(c.slice());
      s.chunks.push(c.length);
    },
    async close() {
      s.closed = true;
    },
    bytes() {
      const out = new Uint8Array(parts.reduce((a, p) => a + p.length, 0));
      let o = 0;
      for (const p of parts) {
        out.set(p, o);
        o += p.length;
      }
      return out;
    },
  };
  return s;
}

/** Every chunk after the header is exactly one tensor, in header order: nothing bigger is ever built. */
export function tensorChunkSizes(file: SafetensorsFile): number[] {
  return [...file.header.entries.values()].sort((a, b) => a.begin - b.begin).map((e) => e.end - e.begin);
}

/** Uploads tensors (f32) as engine weights. */
export function upload(gpu: Gpu, tensors: Map<string, NamedTensor>, into: Weights = new Map()): Weights {
  for (const [n, t] of tensors) into.set(n, gpu.upload(t.data, t.shape, 'f32', 'weights', n));
  return into;
}

/** A component of a source, every tensor read, optionally rounded to f16. */
export async function readAll(src: ModelSource, c: Component, f16 = false): Promise<Map<string, NamedTensor>> {
  const out = new Map<string, NamedTensor>();
  for (const n of src.shapes(c).keys()) {
    const t = await src.read(c, n);
    out.set(n, f16 ? { shape: t.shape, data: roundToF16(t.data) } : t);
  }
  return out;
}

const unetInputs = () => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'unet_sd1.safetensors')))).tensors;

/** The module test's UNet inputs (sample, timestep, encoder_hidden_states) for a UNet of `family`. */
export function unetFixture(family: 'sd1' | 'sd2' = 'sd1'): Map<string, NamedTensor> {
  return family === 'sd1' ? unetInputs() : readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'unet_sd2.safetensors')))).tensors;
}

export function clipIds(family: 'sd1' | 'sd2' = 'sd1'): NamedTensor {
  return readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `clip_${family}.safetensors`)))).tensors.get('input_ids')!;
}

export const INFO = {
  family: 'sd1' as const,
  prediction: 'epsilon' as const,
  resolution: 512,
  steps: 800,
  lr: 1e-4,
  instancePrompt: 'a photo of sks dog, café',
  classPrompt: 'a photo of a dog',
  numImages: 5,
  numClassImages: 100,
  baseModelName: 'tiny-sd1.safetensors',
  baseModelHash: 'ab'.repeat(32),
  title: 'sks dog',
  date: new Date('2025-03-01T12:00:00Z'),
  startedAt: new Date('2025-03-01T11:00:00.500Z'),
  clipSkip: 1,
};
