// No export ever holds a NaN or an infinity: the streamed writer checks every tensor after encoding it to
// the file's dtype (an f32 1e30 is finite but is inf in F16), names the tensor and the counts, and the
// export stops; through the Node file sink nothing is left at the final name (nor a temp file), and a file
// already there is untouched. The LoRA exporter goes through the same writer, so it refuses too.
import assert from 'node:assert/strict';
import { existsSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { writeSingleFile } from '../../src/export/full.ts';
import { writeKohyaLora, writePeftLora, type LoraAdapters } from '../../src/export/lora.ts';
import { mergedLycorisProvider } from '../../src/export/merge.ts';
import { ExportError, mapProvider } from '../../src/export/provider.ts';
import { countNonFinite, pump, safetensorsChunks, type OutTensor } from '../../src/export/stream.ts';
import { SafetensorsFile } from '../../src/io/safetensors.ts';
import { nodeFileSink } from '../../src/io/sink-node.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import { INFO, memorySink, randomAdapters, readFolderTensors, tempDir, tinyModel } from './fixtures.ts';

const f32 = (name: string, dtype: 'F16' | 'F32', values: number[]): OutTensor => ({
  name,
  dtype,
  shape: [values.length],
  data: async () => Float32Array.from(values),
});
const raw = (name: string, dtype: string, bytes: Uint8Array, n: number): OutTensor => ({ name, dtype, shape: [n], data: async () => bytes });
const u16 = (...v: number[]) => new Uint8Array(Uint16Array.from(v).buffer);
const write = (...tensors: OutTensor[]) => pump(safetensorsChunks(tensors), memorySink());

describe('non-finite values are refused', () => {
  it('an f32 value past F16 range is refused in an F16 tensor (it would be inf) and accepted in an F32 one', async () => {
    await assert.rejects(write(f32('ok', 'F16', [1, 2]), f32('unet.up.weight', 'F16', [1, 1e30, -7e4, 65519])), (e: Error) => {
      assert.ok(e instanceof ExportError);
      assert.match(
        e.message,
        /^tensor 'unet\.up\.weight' \(F16 \[4\]\): 2 of 4 values would be written as NaN or infinity \(2 infinite; 2 of them are finite f32 values too large for F16 \(max ±65504\)\)/,
      );
      assert.match(e.message, /export was stopped/);
      return true;
    });
    await write(f32('big', 'F32', [1e30, -3.4e38]));
    await write(f32('edge', 'F16', [65504, -65504, 65519])); // 65519 still rounds down to 65504
  });

  it('NaN and infinity in f32 values are counted by kind, in either file dtype', async () => {
    await assert.rejects(
      write(f32('te.q.weight', 'F32', [NaN, 1, Infinity, NaN, -Infinity])),
      /: tensor 'te\.q\.weight' \(F32 \[5\]\): 4 of 5 values .*\(2 NaN, 2 infinite\)/,
    );
    await assert.rejects(write(f32('h', 'F16', [0, NaN])), /'h' \(F16 \[2\]\): 1 of 2 values .*\(1 NaN\)/);
  });

  it('raw float bytes are checked in their own dtype; integer tensors are not floats', async () => {
    await assert.rejects(write(raw('copied.f16', 'F16', u16(0x3c00, 0x7c00, 0xfe00), 3)), /'copied\.f16' \(F16 \[3\]\): 2 of 3 .*\(1 NaN, 1 infinite\)/);
    await assert.rejects(write(raw('copied.bf16', 'BF16', u16(0x3f80, 0xff80), 2)), /'copied\.bf16' \(BF16 \[2\]\): 1 of 2 .*\(1 infinite\)/);
    await assert.rejects(write(raw('copied.f64', 'F64', new Uint8Array(Float64Array.of(1, NaN).buffer), 2)), /'copied\.f64' .*1 of 2 .*\(1 NaN\)/);
    // The same bit patterns as integers are ordinary numbers.
    await write(raw('ids', 'I16', u16(0x7c00, 0xfe00), 2), raw('ids64', 'I64', new Uint8Array(Float64Array.of(NaN).buffer), 1));
  });

  it('countNonFinite reads unaligned bytes and every float dtype', () => {
    const buf = new Uint8Array(9);
    buf.set(new Uint8Array(Float32Array.of(Infinity, NaN).buffer), 1); // offset 1: not 4-aligned
    assert.deepEqual(countNonFinite(buf.subarray(1), 'F32'), { nan: 1, inf: 1 });
    assert.deepEqual(countNonFinite(Uint8Array.of(0x7c, 0xfd, 0x3c), 'F8_E5M2'), { nan: 1, inf: 1 });
    assert.deepEqual(countNonFinite(Uint8Array.of(0x7f, 0xff, 0x7e), 'F8_E4M3'), { nan: 2, inf: 0 });
    assert.deepEqual(countNonFinite(u16(0x7bff, 0x0001, 0x8000), 'F16'), { nan: 0, inf: 0 }, 'max, subnormal and -0 are finite');
  });
});

describe('a refused export leaves nothing behind on disk', () => {
  const tiny = tinyModel();
  const unet = randomAdapters(readFolderTensors(tiny.folder, 'unet/diffusion_pytorch_model.safetensors'), false, 4, 3);
  const [firstB] = [...unet.keys()].filter((n) => n.endsWith('.lora_B.weight'));
  const poisoned = new Map(unet);
  const b = unet.get(firstB)!;
  poisoned.set(firstB, { shape: b.shape, data: b.data.map((v, i) => (i === 5 ? NaN : v)) });
  const adapters: LoraAdapters = { rank: 4, alpha: 8, unet: mapProvider(poisoned) };

  for (const [format, writer] of [
    ['kohya', writeKohyaLora],
    ['peft', writePeftLora],
  ] as const)
    it(`${format}: the error names the tensor; no file at the final name, no temp file, an older file untouched`, async () => {
      const dir = tempDir();
      await assert.rejects(
        writer(await nodeFileSink(join(dir, 'new.safetensors')), adapters, INFO),
        (e: Error) => e instanceof ExportError && /lora_(up|B)\.weight' \(F16 .*: 1 of \d+ values .*\(1 NaN\)/.test(e.message),
      );
      assert.deepEqual(readdirSync(dir), []);
      writeFileSync(join(dir, 'old.safetensors'), 'the previous export');
      await assert.rejects(writer(await nodeFileSink(join(dir, 'old.safetensors')), adapters, INFO), ExportError);
      assert.deepEqual(readdirSync(dir), ['old.safetensors']);
      assert.equal(readFileSync(join(dir, 'old.safetensors'), 'utf8'), 'the previous export');
      // And the same export without the NaN completes at the final name.
      await writer(await nodeFileSink(join(dir, 'old.safetensors')), { ...adapters, unet: mapProvider(unet) }, INFO);
      assert.ok(existsSync(join(dir, 'old.safetensors')) && readFileSync(join(dir, 'old.safetensors')).length > 1000);
      assert.deepEqual(readdirSync(dir), ['old.safetensors']);
    });
});

describe("a LyCORIS run's merged full export is checked too", () => {
  it('finite factors whose merged weight is past F16 range: the single file is refused, naming the UNet tensor', async () => {
    const tiny = tinyModel();
    const unet = readFolderTensors(tiny.folder, 'unet/diffusion_pytorch_model.safetensors');
    const layer = [...unet.keys()].find((n) => n.endsWith('.attn1.to_q.weight'))!.slice(0, -'.weight'.length);
    const [out, inn] = unet.get(`${layer}.weight`)!.shape;
    // LoHa rank 1, scale 1: ΔW = (300 · 300) ∘ (1 · 1) = 9e4 per element, finite in f32 and past F16's 65504
    const fill = (n: number, v: number) => new Float32Array(n).fill(v);
    const factors = new Map([
      [`${layer}.hada_w1_a`, fill(out, 300)],
      [`${layer}.hada_w1_b`, fill(inn, 300)],
      [`${layer}.hada_w2_a`, fill(out, 1)],
      [`${layer}.hada_w2_b`, fill(inn, 1)],
    ]);
    const spec = { type: 'loha' as const, rank: 1, alpha: 1, convRank: 1, convAlpha: 1, factor: -1 };
    const merged = mergedLycorisProvider({ shape: (n) => unet.get(n)!.shape, read: async (n) => Float32Array.from(unet.get(n)!.data) }, factors, spec);
    const base = await SafetensorsFile.open(await NodeFileSource.open(tiny.singleFile));
    const dir = tempDir();
    await assert.rejects(
      writeSingleFile(await nodeFileSink(join(dir, 'model.safetensors')), base, merged, {
        title: 't',
        date: new Date(0),
        family: 'sd1',
        overrides: tiny.overrides,
      }),
      (e: Error) =>
        e instanceof ExportError &&
        /tensor 'model\.diffusion_model\.\S+attn1\.to_q\.weight' \(F16 \[\d+,\d+\]\): \d+ of \d+ values would be written as NaN or infinity/.test(e.message),
    );
    assert.deepEqual(readdirSync(dir), [], 'nothing left at the final name');
    await base.source.close?.();
  });
});
