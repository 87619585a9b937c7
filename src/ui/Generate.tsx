// Text to image in the page: a diffusers-layout model from a hub (downloaded once, cached in IndexedDB),
// the engine's CLIP, UNet and VAE on this GPU, DDIM or DPM-Solver++ with classifier-free guidance.
import { encode } from 'fast-png';
import { useState } from 'react';
import type { Gpu } from '../gpu/device.ts';
import { idbDownloadCache } from '../io/cache-idb.ts';
import { downloadDiffusersModel } from '../io/hub.ts';
import { BlobSource, type ByteSource } from '../io/source.ts';
import { ClipTokenizer } from '../io/tokenizer.ts';
import { folderFromSources, tokenizerFilesFrom } from '../models/source.ts';
import { loadDiffusers } from '../models/load.ts';
import { scheduleFromJson, SD_SCHEDULE } from '../sample/schedulers.ts';
import { txt2img } from '../sample/txt2img.ts';
import { PhaseClock, phaseLine, type PhaseReport } from '../pipeline/progress.ts';
import { formatBytes } from '../util/bytes.ts';

/** A dropped or chosen diffusers folder: paths relative to its top folder -> files, read by slices. */
function folderFromFiles(list: FileList | File[]): { name: string; files: Map<string, ByteSource> } {
  const files = new Map<string, ByteSource>();
  let name = 'folder';
  for (const f of Array.from(list)) {
    const rel = (f as File & { webkitRelativePath?: string }).webkitRelativePath || f.name;
    const parts = rel.split('/');
    if (parts.length > 1) name = parts[0];
    files.set(parts.length > 1 ? parts.slice(1).join('/') : rel, new BlobSource(f, f.name));
  }
  return { name, files };
}

/** The model from a chosen folder or downloaded from a hub (cached), loaded onto the GPU, with its tokenizer and scheduler config. */
async function openModel(
  gpu: Gpu,
  from: { folder: { name: string; files: Map<string, ByteSource> } } | { repo: string; endpoint: string },
  setStatus: (s: string) => void,
) {
  let m: { files: Map<string, ByteSource> };
  if ('folder' in from) m = from.folder;
  else {
    setStatus('Downloading the model (cached after the first time)…');
    m = await downloadDiffusersModel(from.repo, {
      endpoint: from.endpoint,
      cache: idbDownloadCache(),
      onProgress: (p) => setStatus(`Downloading ${p.path}: ${formatBytes(p.loaded)}${p.total ? ` of ${formatBytes(p.total)}` : ''}`),
    });
  }
  setStatus('Loading the model onto the GPU…');
  const files = folderFromSources('folder' in from ? from.folder.name : from.repo, m.files);
  const model = await loadDiffusers(gpu, files, { dtype: gpu.computeDType });
  const tokFiles = await tokenizerFilesFrom(files);
  if (!tokFiles) throw new Error('the model has no tokenizer/ folder');
  const tokenizer = ClipTokenizer.fromFiles(tokFiles);
  const sched = m.files.has('scheduler/scheduler_config.json') ? await files.readJson('scheduler/scheduler_config.json') : {};
  return { model, tokenizer, sched };
}

export function Generate({ gpu }: { gpu: Gpu }) {
  const [folder, setFolder] = useState<{ name: string; files: Map<string, ByteSource> } | null>(null);
  const [endpoint, setEndpoint] = useState('https://huggingface.co');
  const [repo, setRepo] = useState('stable-diffusion-v1-5/stable-diffusion-v1-5');
  const [prompt, setPrompt] = useState('a photo of a dog in the snow');
  const [negative, setNegative] = useState('');
  const [steps, setSteps] = useState(25);
  const [seed, setSeed] = useState(1);
  const [size, setSize] = useState(512);
  const [sampler, setSampler] = useState<'dpm++2m' | 'ddim'>('dpm++2m');
  const [status, setStatus] = useState('');
  /** The denoising steps drawn so far and the time left (null outside the denoising loop). */
  const [denoise, setDenoise] = useState<PhaseReport | null>(null);
  const [busy, setBusy] = useState(false);
  const [image, setImage] = useState<string | null>(null);

  async function run() {
    setBusy(true);
    setImage(null);
    try {
      const { model, tokenizer, sched } = await openModel(gpu, folder ? { folder } : { repo, endpoint }, setStatus);
      const t0 = performance.now();
      // The first denoising step compiles the UNet's pipelines: the time left comes from the steps after it.
      const clock = new PhaseClock(steps);
      const progress = (done: number) => {
        const r = clock.at(done, (performance.now() - t0) / 1000);
        setDenoise(r);
        setStatus(phaseLine('Denoising step', r));
      };
      progress(0);
      const img = await txt2img(gpu, model, tokenizer, {
        prompt,
        negativePrompt: negative,
        steps,
        guidance: 7.5,
        seed,
        width: size,
        height: size,
        sampler,
        schedule: { ...SD_SCHEDULE, ...scheduleFromJson(sched, model.prediction) },
        onStep: (i, n) => {
          progress(i);
          if (i === n) setStatus('Decoding the image with the VAE…');
        },
      });
      for (const part of [model.unet.weights, model.vae.weights, model.textEncoder.weights]) gpu.free(...part.values());
      const png = encode({ width: img.width, height: img.height, data: img.rgb, channels: 3, depth: 8 });
      setImage(URL.createObjectURL(new Blob([new Uint8Array(png)], { type: 'image/png' })));
      setStatus(`Done in ${((performance.now() - t0) / 1000).toFixed(1)} s (${img.width}x${img.height}).`);
    } catch (e) {
      setStatus(`Could not generate: ${(e as Error).message}`);
    } finally {
      setDenoise(null);
      setBusy(false);
    }
  }

  return (
    <section aria-labelledby="gen-title">
      <h2 id="gen-title">Generate an image</h2>
      <form
        className="form"
        onSubmit={(e) => {
          e.preventDefault();
          void run();
        }}
      >
        <label>
          Model hub <input name="endpoint" value={endpoint} onChange={(e) => setEndpoint(e.target.value)} />
        </label>
        <label>
          Model (diffusers layout) <input name="repo" value={repo} onChange={(e) => setRepo(e.target.value)} />
        </label>
        <label>
          Or a diffusers folder on this computer
          <input
            name="folder"
            type="file"
            // @ts-expect-error non-standard but supported by Chrome: choose a whole folder
            webkitdirectory=""
            onChange={(e) => setFolder(e.target.files && e.target.files.length ? folderFromFiles(e.target.files) : null)}
          />
        </label>
        <label>
          Prompt <input name="prompt" value={prompt} onChange={(e) => setPrompt(e.target.value)} />
        </label>
        <label>
          Negative prompt <input name="negative" value={negative} onChange={(e) => setNegative(e.target.value)} />
        </label>
        <label>
          Steps <input name="steps" type="number" min={1} max={150} value={steps} onChange={(e) => setSteps(Number(e.target.value))} />
        </label>
        <label>
          Seed <input name="seed" type="number" value={seed} onChange={(e) => setSeed(Number(e.target.value))} />
        </label>
        <label>
          Size (px) <input name="size" type="number" min={8} step={8} value={size} onChange={(e) => setSize(Number(e.target.value))} />
        </label>
        <label>
          Sampler
          <select name="sampler" value={sampler} onChange={(e) => setSampler(e.target.value as 'dpm++2m' | 'ddim')}>
            <option value="dpm++2m">DPM-Solver++ 2M</option>
            <option value="ddim">DDIM</option>
          </select>
        </label>
        <button type="submit" disabled={busy}>
          {busy ? 'Generating…' : 'Generate'}
        </button>
      </form>
      {denoise && <progress aria-label="Denoising steps" data-testid="gen-progress" max={denoise.total} value={denoise.done} />}
      <p role="status" data-testid="gen-status">
        {status}
      </p>
      {image && <img src={image} alt={`Generated: ${prompt}`} data-testid="gen-image" className="generated" />}
    </section>
  );
}
