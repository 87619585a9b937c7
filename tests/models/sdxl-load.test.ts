// SDXL loading: the tiny SDXL model (tests/fixtures/models/make-tiny-sdxl.ts) as an SGM single file and as a
// diffusers folder loads to the same weights, equal to the generator's; the single file's UNet and text
// encoders (through the key maps: label_emb, OpenCLIP bigG's fused in_proj split and text_projection
// transposed) reproduce the PyTorch goldens of tests/modules (f32: 5e-4 + 2e-4 relative for the UNet, 1e-4
// for the encoders, as there); refiners, inpainting models, mixed keys, a missing embedder and text widths
// that do not add up are refused naming the file.
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { readSafetensors, SafetensorsFile } from '../../src/io/safetensors.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import { nodeDownloadCache } from '../../src/io/cache-node.ts';
import { downloadDiffusersModel } from '../../src/io/hub.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { folderFromSources } from '../../src/models/source.ts';
import {
  detectSdxlDiffusers,
  detectSdxlSingleFile,
  isSdxlDiffusers,
  isSdxlSingleFile,
  loadSdxl,
  openSdxlDiffusers,
  openSdxlSingleFile,
  type LoadedSdxl,
} from '../../src/models/sdxl.ts';
import { sdxlTextEncode } from '../../src/nn/sdxl.ts';
import { unetForward } from '../../src/nn/unet.ts';
import { compare } from '../../src/selftest/check.ts';
import { writeTinySdxl, type TinySdxl } from '../fixtures/models/make-tiny-sdxl.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

let dir: string;
let tiny: TinySdxl;
before(() => {
  dir = mkdtempSync(join(tmpdir(), 'sdxl-load-'));
  tiny = writeTinySdxl(dir);
});
after(() => rmSync(dir, { recursive: true, force: true }));

const components = ['unet', 'vae', 'textEncoder', 'textEncoder2'] as const;
const source = { unet: 'unet', vae: 'vae', textEncoder: 'text_encoder', textEncoder2: 'text_encoder_2' } as const;

describe('SDXL loading, both layouts', () => {
  it('detects the single file and the folder as SDXL, and both load to the generator weights', async () => {
    const gpu = await testGpu();
    const file = await SafetensorsFile.open(await NodeFileSource.open(tiny.singleFile));
    assert.ok(isSdxlSingleFile(file.names));
    const single = await loadSdxl(gpu, await openSdxlSingleFile(file, { overrides: tiny.overrides }), 'f32');
    await file.source.close?.();
    const folderSrc = await openSdxlDiffusers(nodeFolder(tiny.folder));
    const folder = await loadSdxl(gpu, folderSrc, 'f32');
    await folderSrc.close();
    for (const m of [single, folder]) {
      assert.deepEqual(m.unet.config.transformerLayers, [1, 2]);
      assert.deepEqual(m.unet.config.textTime, { timeEmbedDim: 8, projectionInputDim: 88 });
      assert.deepEqual(m.unet.config.heads, [2, 4]);
      assert.equal(m.vae.config.scalingFactor, 0.13025);
      assert.equal(m.textEncoder2.config.projectionDim, 40);
      assert.equal(m.textEncoder2.config.act, 'gelu');
      assert.equal(m.textEncoder.config.act, 'quick_gelu');
      for (const [, t] of m.vae.weights) assert.equal(t.dtype, 'f32', 'the VAE stays f32');
    }
    assert.deepEqual({ ...single.unet.config }, { ...folder.unet.config });
    assert.deepEqual(single.textEncoder2.config, folder.textEncoder2.config);
    const same = async (a: LoadedSdxl, name: string) => {
      for (const c of components) {
        const want = tiny.weights[source[c]];
        assert.deepEqual([...a[c].weights.keys()].sort(), [...want.keys()].sort(), `${name} ${c}: the generator's tensor names`);
        for (const [n, t] of a[c].weights) assert.deepEqual(await gpu.read(t), want.get(n)!.data, `${name} ${c} ${n}`);
      }
    };
    await same(single, 'single file');
    await same(folder, 'folder');
  });

  it("the single file's UNet and text encoders reproduce the PyTorch goldens", async () => {
    const gpu = await testGpu();
    const file = await SafetensorsFile.open(await NodeFileSource.open(tiny.singleFile));
    const m = await loadSdxl(gpu, await openSdxlSingleFile(file, { overrides: tiny.overrides }), 'f32');
    await file.source.close?.();
    const load = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`)))).tensors;
    const u = load('unet_sdxl');
    const up = (k: string) => gpu.upload(u.get(k)!.data, u.get(k)!.shape, 'f32');
    const out = unetForward(gpu, m.unet.config, m.unet.weights, up('sample'), up('timestep'), up('encoder_hidden_states'), null, 1, false, {
      textEmbeds: up('text_embeds'),
      timeIds: up('time_ids'),
    });
    const c = load('clip_sdxl');
    const r = sdxlTextEncode(gpu, m.textEncoder, m.textEncoder2, c.get('input_ids')!.data, c.get('input_ids_2')!.data, 2);
    assertChecks([
      compare('unet out', await gpu.read(out), u.get('out')!.data, { atol: 5e-4, rtol: 2e-4 }),
      compare('prompt_embeds', await gpu.read(r.context), c.get('prompt_embeds')!.data, { atol: 1e-4, rtol: 1e-4 }),
      compare('pooled', await gpu.read(r.pooled), c.get('pooled')!.data, { atol: 1e-4, rtol: 1e-4 }),
    ]);
  });
});

describe('SDXL refusals name the file and what is wrong', () => {
  const base = async () => {
    const file = await SafetensorsFile.open(await NodeFileSource.open(tiny.singleFile));
    const shapes = new Map(file.names.map((n) => [n, file.entry(n).shape] as const));
    await file.source.close?.();
    return shapes;
  };
  const what = 'models/x.safetensors';
  it('a refiner (only the bigG embedder)', async () => {
    const s = new Map([...(await base())].filter(([n]) => !n.startsWith('conditioner.embedders.0.') && !n.startsWith('conditioner.embedders.1.')));
    s.set('conditioner.embedders.0.model.token_embedding.weight', [1000, 48]);
    assert.ok(isSdxlSingleFile([...s.keys()]));
    assert.throws(() => detectSdxlSingleFile(s, what), /models\/x\.safetensors is an SDXL refiner/);
  });
  it('an inpainting UNet (9 input channels)', async () => {
    const s = await base();
    s.set('model.diffusion_model.input_blocks.0.0.weight', [16, 9, 3, 3]);
    assert.throws(() => detectSdxlSingleFile(s, what), /models\/x\.safetensors is an SDXL inpainting model/);
  });
  it('SD 1 and SDXL keys mixed', async () => {
    const s = await base();
    s.set('cond_stage_model.transformer.text_model.final_layer_norm.weight', [768]);
    assert.throws(() => detectSdxlSingleFile(s, what), /models\/x\.safetensors mixes SD 1.x\/2.x keys/);
  });
  it('a missing embedder, either one', async () => {
    const all = await base();
    const without = (p: string) => new Map([...all].filter(([n]) => !n.startsWith(p)));
    assert.throws(
      () => detectSdxlSingleFile(without('conditioner.embedders.1.'), what),
      /x\.safetensors: SDXL checkpoint missing its OpenCLIP bigG text encoder/,
    );
    assert.throws(() => detectSdxlSingleFile(without('conditioner.embedders.0.'), what), /x\.safetensors: SDXL checkpoint missing its CLIP ViT-L text encoder/);
  });
  it("text widths that do not add up to the UNet's cross-attention width", async () => {
    const s = await base();
    s.set('conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight', [1000, 64]);
    assert.throws(
      () => detectSdxlSingleFile(s, what),
      /x\.safetensors: the text encoders are 64 \+ 48 = 112 wide but the UNet's cross-attention .* expects 80/,
    );
  });
  it("a single file at widths other than SDXL's, without the sizes its shapes cannot tell: each named, refused before a read", async () => {
    // The tiny model's widths (16/32 UNet channels, 8/16 VAE, 32 and 48 wide encoders) are not multiples of SDXL's
    // 64-wide heads and 32 norm groups, so inferring them would build another model: every one is asked for.
    const file = await SafetensorsFile.open(await NodeFileSource.open(tiny.singleFile));
    try {
      const gpu = await testGpu();
      await assert.rejects(
        loadSdxl(gpu, await openSdxlSingleFile(file), 'f32'),
        new RegExp(
          'tiny-sdxl\\.safetensors: a single file holds no configs.*unet attention_head_dim \\(widths 16, 32\\); unet norm_num_groups \\(widths 16\\); ' +
            'vae norm_num_groups \\(widths 8, 16\\); text_encoder num_attention_heads \\(widths 32\\); text_encoder_2 num_attention_heads \\(widths 48\\)',
        ),
      );
      // Given all but one, the one left is named alone.
      const { text_encoder_2: _, ...most } = tiny.overrides;
      await assert.rejects(
        loadSdxl(gpu, await openSdxlSingleFile(file, { overrides: most }), 'f32'),
        /inferred from the tensor shapes: text_encoder_2 num_attention_heads \(widths 48\): give/,
      );
    } finally {
      await file.source.close?.();
    }
  });
  it('the same for a diffusers folder', async () => {
    const folder = nodeFolder(tiny.folder);
    const unet = JSON.parse(readFileSync(join(tiny.folder, 'unet/config.json'), 'utf8'));
    const te = JSON.parse(readFileSync(join(tiny.folder, 'text_encoder/config.json'), 'utf8'));
    const te2 = JSON.parse(readFileSync(join(tiny.folder, 'text_encoder_2/config.json'), 'utf8'));
    assert.ok(isSdxlDiffusers(undefined, unet));
    assert.throws(
      () => detectSdxlDiffusers({ unet, textEncoder2: te2, modelIndex: { _class_name: 'StableDiffusionXLImg2ImgPipeline' } }, 'f'),
      /f is an SDXL refiner/,
    );
    assert.throws(() => detectSdxlDiffusers({ unet: { ...unet, in_channels: 9 }, textEncoder: te, textEncoder2: te2 }, 'f'), /f is an SDXL inpainting model/);
    assert.throws(() => detectSdxlDiffusers({ unet, textEncoder: te }, 'f'), /f: SDXL folder missing text_encoder_2/);
    assert.throws(
      () => detectSdxlDiffusers({ unet: { ...unet, cross_attention_dim: 96 }, textEncoder: te, textEncoder2: te2 }, 'f'),
      /32 \+ 48 wide but .* cross_attention_dim is 96/,
    );
    // A text_encoder_2 whose projection does not feed the UNet's add embedding: refused before any weight is read.
    const src = await openSdxlDiffusers(folder, { overrides: { text_encoder_2: { projection_dim: 24 } } });
    const gpu = await testGpu();
    await assert.rejects(loadSdxl(gpu, src, 'f32'), /add embedding takes 88 = 40 pooled \+ 6 x 8 time-id values, but text_encoder_2 projects to 24/);
    await src.close();
  });
});

describe('SDXL from a hub id', () => {
  it('downloads text_encoder_2 and tokenizer_2 with the rest and loads the generator weights', async () => {
    const requests: string[] = [];
    const server = createServer((req, res) => {
      const path = decodeURIComponent(/^\/org\/tiny-sdxl\/resolve\/main\/(.+)$/.exec(req.url ?? '')?.[1] ?? '');
      requests.push(path);
      const file = join(tiny.folder, path);
      if (!path || path.includes('..') || !existsSync(file)) return void res.writeHead(404).end();
      const body = readFileSync(file);
      res.writeHead(200, { 'content-length': body.length }).end(body);
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    try {
      const port = (server.address() as { port: number }).port;
      const m = await downloadDiffusersModel('org/tiny-sdxl', { endpoint: `http://127.0.0.1:${port}`, cache: nodeDownloadCache(join(dir, 'hub-cache')) });
      for (const p of ['text_encoder_2/config.json', 'text_encoder_2/model.safetensors', 'tokenizer_2/vocab.json', 'tokenizer_2/merges.txt'])
        assert.ok(m.files.has(p), `downloaded ${p}`);
      const src = await openSdxlDiffusers(folderFromSources('org/tiny-sdxl', m.files));
      const gpu = await testGpu();
      const model = await loadSdxl(gpu, src, 'f32');
      await src.close();
      for (const c of components) for (const [n, t] of model[c].weights) assert.deepEqual(await gpu.read(t), tiny.weights[source[c]].get(n)!.data, `${c} ${n}`);
      assert.ok(requests.includes('text_encoder_2/model.fp16.safetensors'), 'asked for the fp16 variant first');
    } finally {
      server.close();
    }
  });
});
