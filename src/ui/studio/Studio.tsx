// The studio page: one column of steps (model, photos, prompt and settings, train, export) under the
// environment notices (WebGPU, shader-f16, storage). Every control is a labelled native element, so the
// whole flow works from the keyboard and with a screen reader.
import { useEffect, useState, type DragEvent, type ReactNode } from 'react';
import { EXPORT_FORMATS, type ExportFormat } from '../../pipeline/run.ts';
import { AdvancedForm } from './AdvancedForm.tsx';
import { EXPORT_LABELS, PRESETS, type PresetName } from './presets.ts';
import { OutgrowPanel } from './Outgrow.tsx';
import { TryItPanel } from './TryIt.tsx';
import {
  addPhotos,
  applyPreset,
  cropAt,
  exportRun,
  initStudio,
  removePhoto,
  replacePhoto,
  requestPersistence,
  savePicker,
  updatePhoto,
  loadDemoModel,
  loadHubModel,
  loadModelFiles,
  loadModelFolder,
  refreshRuns,
} from './actions.ts';
import { filesFromDrop } from './drop-files.ts';
import { RunsPanel } from './Runs.tsx';
import { TrainPanel } from './TrainPanel.tsx';
import { bucketFor, bucketRegion } from '../../io/image.ts';
import { bucketNote } from './bucket-note.ts';
import { MaskEditor } from './MaskEditor.tsx';
import { autosave, fmtBytes, restoreProject, runBusy, useStudioStore, type PhotoItem } from './state.ts';

export function Studio() {
  useEffect(() => {
    void restoreProject()
      .then(() => initStudio())
      .then(() => refreshRuns());
    return autosave();
  }, []);
  const env = useStudioStore((s) => s.env);
  return (
    <main>
      <header>
        <h1>DreamBooth Studio</h1>
        <p>Teach Stable Diffusion a subject from a few photos, on your own GPU, in this tab. No image leaves your machine.</p>
      </header>
      {env.kind === 'loading' && <p role="status">Starting WebGPU…</p>}
      {env.kind === 'error' && <NoGpu noWebGpu={env.noWebGpu} message={env.message} />}
      {env.kind === 'ready' && (
        <>
          <SkipLinks />
          <Notices />
          <RunsPanel />
          <ModelPanel />
          <PhotosPanel />
          <SettingsPanel />
          <TrainPanel />
          <TryItPanel />
          <ExportPanel />
          <OutgrowPanel />
          <p className="footer">
            <span data-testid="gpu-summary">
              {env.adapter.description || [env.adapter.vendor, env.adapter.architecture].filter(Boolean).join(' ') || 'GPU'} · {env.hasF16 ? 'f16' : 'f32'} ·
              GEMM kernels: {env.gemm} · {env.tensorCores}
            </span>{' '}
            · <a href="?tools">GPU details, kernel self-test and text-to-image</a>
          </p>
        </>
      )}
    </main>
  );
}

/** Links to each step's heading: a keyboard reaches any section in a few presses (the headings are a screen reader's list too). */
function SkipLinks() {
  const steps = [
    ['model-title', 'Model'],
    ['photos-title', 'Photos'],
    ['settings-title', 'Settings'],
    ['train-title', 'Train'],
    ['tryit-title', 'Try it'],
    ['export-title', 'Export'],
    ['runs-title', 'Runs'],
  ] as const;
  const go = (id: string) => {
    const h = document.getElementById(id);
    if (!h) return;
    // A heading is not focusable by itself: it takes the focus for the jump, so the next Tab starts in its section.
    h.tabIndex = -1;
    h.focus();
  };
  return (
    <nav aria-label="Jump to a step" className="skip-links" data-testid="skip-links">
      {steps.map(([id, label]) => (
        <a
          key={id}
          href={`#${id}`}
          onClick={(e) => {
            e.preventDefault();
            go(id);
          }}
        >
          {label}
        </a>
      ))}
    </nav>
  );
}

function NoGpu({ noWebGpu, message }: { noWebGpu: boolean; message: string }) {
  return (
    <section className="error" role="alert" aria-labelledby="nogpu-title" data-testid="no-webgpu">
      <h2 id="nogpu-title">{noWebGpu ? 'WebGPU is not available' : 'Could not start the GPU'}</h2>
      <p>{message}</p>
      {noWebGpu && (
        <p>
          DreamBooth Studio trains on your GPU through WebGPU: use Chrome or Edge 113 or newer with hardware acceleration turned on (chrome://settings/system),
          then reload this page. Your photos and settings stay saved in this browser.
        </p>
      )}
    </section>
  );
}

function Notices() {
  const env = useStudioStore((s) => s.env);
  const storage = useStudioStore((s) => s.storage);
  const [asked, setAsked] = useState<boolean | null>(null);
  if (env.kind !== 'ready') return null;
  return (
    <>
      {!env.hasF16 && (
        <p className="notice" role="note" data-testid="no-f16">
          This GPU does not offer <code>shader-f16</code>: training runs in 32-bit floats, which is slower and needs about twice the GPU memory. Everything
          still works; the memory plan accounts for it.
        </p>
      )}
      {storage.persisted === false && (
        <section className="notice" aria-labelledby="persist-title" data-testid="not-persistent">
          <h2 id="persist-title">Storage may be cleared by the browser</h2>
          <p>
            Training keeps its checkpoints in this browser's storage. Unless you allow it to persist, the browser may delete it when the disk runs low, and a
            long run would be lost.
          </p>
          <button type="button" onClick={() => void requestPersistence().then(setAsked)}>
            Keep my training data
          </button>
          {asked === false && (
            <p role="status">The browser did not grant persistent storage (Chrome grants it to bookmarked or installed sites). Training still works.</p>
          )}
        </section>
      )}
      {storage.persisted === true && (
        <p className="ok" role="status" data-testid="persistent">
          Storage is persistent: the browser will not clear your checkpoints.
        </p>
      )}
    </>
  );
}

// ---- model ---------------------------------------------------------------------------------------------

function DropZone({ label, onDrop, children, testId }: { label: string; onDrop: (e: DragEvent) => void; children: ReactNode; testId: string }) {
  const [over, setOver] = useState(false);
  return (
    <div
      className={`dropzone${over ? ' over' : ''}`}
      aria-label={label}
      role="group"
      data-testid={testId}
      onDragOver={(e) => {
        e.preventDefault();
        setOver(true);
      }}
      onDragLeave={() => setOver(false)}
      onDrop={(e) => {
        e.preventDefault();
        setOver(false);
        onDrop(e);
      }}
    >
      {children}
    </div>
  );
}

/** The model families' names as the page shows them. */
const FAMILY_NAMES: Record<string, string> = { sd1: 'Stable Diffusion 1.x', sd2: 'Stable Diffusion 2.x', sdxl: 'Stable Diffusion XL' };

function ModelPanel() {
  const model = useStudioStore((s) => s.model);
  const training = useStudioStore((s) => runBusy(s.run.status));
  const [endpoint, setEndpoint] = useState('https://huggingface.co');
  const [repo, setRepo] = useState('stable-diffusion-v1-5/stable-diffusion-v1-5');
  // The run trains on the model it loaded: no other model while it trains.
  const busy = model.status === 'loading' || training;
  const onDrop = async (e: DragEvent) => {
    if (busy) return;
    const { files, folder } = await filesFromDrop(e.dataTransfer.items);
    if (folder) await loadModelFolder(files, folder);
    else if (files.length)
      await loadModelFiles(
        files.map((f) => f.file),
        endpoint,
      );
  };
  return (
    <section aria-labelledby="model-title">
      <h2 id="model-title">1. Base model</h2>
      <DropZone label="Drop a model here" onDrop={(e) => void onDrop(e)} testId="model-drop">
        <p>Drop a Stable Diffusion 1.x, 2.x or XL checkpoint (.safetensors, with its config .json if it needs one) or a diffusers folder here, or:</p>
        <div className="row-wrap">
          <button type="button" onClick={() => void loadDemoModel()} disabled={busy}>
            Use the demo model
          </button>
          <label className="file-button">
            Choose a checkpoint file
            <input
              type="file"
              accept=".safetensors,.json"
              multiple
              disabled={busy}
              onChange={(e) => e.target.files?.length && void loadModelFiles(Array.from(e.target.files), endpoint)}
            />
          </label>
          <label className="file-button">
            Choose a diffusers folder
            <input
              type="file"
              disabled={busy}
              // @ts-expect-error non-standard but supported by Chrome: choose a whole folder
              webkitdirectory=""
              onChange={(e) => {
                const list = Array.from(e.target.files ?? []);
                if (!list.length) return;
                const files = list.map((f) => ({ path: (f as File & { webkitRelativePath: string }).webkitRelativePath || f.name, file: f }));
                void loadModelFolder(files, files[0].path.split('/')[0]);
              }}
            />
          </label>
        </div>
      </DropZone>
      <form
        className="form"
        onSubmit={(e) => {
          e.preventDefault();
          void loadHubModel(endpoint, repo);
        }}
      >
        <label>
          Model hub <input name="endpoint" value={endpoint} onChange={(e) => setEndpoint(e.target.value)} />
        </label>
        <label className="span-2">
          Hub model (diffusers layout) <input name="repo" value={repo} onChange={(e) => setRepo(e.target.value)} />
        </label>
        <button type="submit" disabled={busy}>
          Download from the hub
        </button>
      </form>
      {training && (
        <p className="hint" data-testid="model-locked">
          The model cannot change while the run trains: pause or cancel it first.
        </p>
      )}
      {model.download && (
        <div className="progress-line">
          <label htmlFor="dl-progress">Downloading {model.download.path}</label>
          <progress id="dl-progress" max={model.download.total ?? undefined} value={model.download.loaded} />
          <span>
            {fmtBytes(model.download.loaded)}
            {model.download.total ? ` of ${fmtBytes(model.download.total)}` : ''}
          </span>
        </div>
      )}
      <p role="status" data-testid="model-status" className={model.status === 'error' ? 'bad' : ''}>
        {model.status === 'loading' && (model.message || 'Loading…')}
        {model.status === 'error' && model.message}
        {model.status === 'needs-file' && model.message}
        {model.status === 'ready' && model.summary && (
          <>
            Loaded <strong>{model.summary.name}</strong>: {FAMILY_NAMES[model.summary.family] ?? model.summary.family} ({model.summary.layout},{' '}
            {model.summary.prediction}), {(model.summary.parameters / 1e6).toFixed(model.summary.parameters < 1e7 ? 2 : 0)} M parameters
            {model.ref?.kind === 'demo' &&
              ` (a small model pretrained from scratch on drawn, captioned shapes at ${model.summary.nativeResolution ?? 64} px, e.g. "a green triangle on a striped blue background": training teaches it your subject)`}
            .
          </>
        )}
        {model.status === 'none' && model.ref?.kind === 'demo' && 'The last run used the demo model: press "Use the demo model" to continue.'}
        {model.status === 'none' &&
          model.ref?.kind === 'hub' &&
          `The last run used ${model.ref.repo} from the hub: download it again (it comes from the cache).`}
      </p>
    </section>
  );
}

// ---- photos --------------------------------------------------------------------------------------------

function Thumb({ p, index, locked }: { p: PhotoItem; index: number; locked: boolean }) {
  const [painting, setPainting] = useState(false);
  const long = Math.max(p.width, p.height);
  const slack = long - p.crop.size;
  const t = slack > 0 ? (p.width >= p.height ? p.crop.x : p.crop.y) / slack : 0.5;
  // The thumbnail shows exactly the region that trains: the square crop, or with aspect-ratio buckets the region
  // of the bucket's shape (placed by the same slider), its long side at 128 px.
  const aspect = useStudioStore((s) => s.settings.aspect);
  const resolution = useStudioStore((s) => s.settings.resolution);
  const factor = useStudioStore((s) => s.model.summary?.resolutionFactor);
  const bucket = aspect === 'bucket' && factor ? bucketFor(p, resolution, factor) : null;
  const region = bucket ? bucketRegion(p, bucket, t) : { x: p.crop.x, y: p.crop.y, width: p.crop.size, height: p.crop.size };
  const scale = 128 / Math.max(region.width, region.height);
  return (
    <li className="photo">
      <div
        className="crop-preview"
        role="img"
        aria-label={`Crop of ${p.name}`}
        style={{
          width: `${Math.round(region.width * scale)}px`,
          height: `${Math.round(region.height * scale)}px`,
          backgroundImage: `url(${p.url})`,
          backgroundSize: `${p.width * scale}px ${p.height * scale}px`,
          backgroundPosition: `${-region.x * scale}px ${-region.y * scale}px`,
        }}
      />
      {bucket && (
        <span className="hint" data-testid="bucket">
          {bucketNote(p, resolution, factor!)}
        </span>
      )}
      <span className="name" title={p.name}>
        {p.name} ({p.width}×{p.height})
      </span>
      {slack > 0 && (
        <label>
          Crop position for {p.name}
          <input
            type="range"
            min={0}
            max={100}
            value={Math.round(t * 100)}
            disabled={locked}
            onChange={(e) => updatePhoto(p.id, { crop: cropAt(p, Number(e.target.value) / 100) })}
          />
        </label>
      )}
      <label>
        Caption for {p.name}
        <input type="text" placeholder="(the prompt)" value={p.caption} disabled={locked} onChange={(e) => updatePhoto(p.id, { caption: e.target.value })} />
      </label>
      <div className="row-wrap">
        <label className="file-button small">
          Replace photo {index + 1}
          <input
            type="file"
            accept="image/jpeg,image/png,image/webp"
            disabled={locked}
            onChange={(e) => e.target.files?.[0] && void replacePhoto(p.id, e.target.files[0])}
          />
        </label>
        <button type="button" className="small secondary" disabled={locked} onClick={() => removePhoto(p.id)} aria-label={`Remove ${p.name}`}>
          Remove
        </button>
        <button
          type="button"
          className="small secondary"
          disabled={locked}
          aria-expanded={painting}
          onClick={() => setPainting((v) => !v)}
          aria-label={`${p.mask ? 'Edit mask of' : 'Paint mask on'} ${p.name}`}
        >
          {p.mask ? 'Edit mask' : 'Paint mask'}
        </button>
      </div>
      {p.mask && !painting && (
        <span className="hint" data-testid="mask-status">
          Masked: only the painted subject counts in the loss
        </span>
      )}
      {painting && !locked && <MaskEditor p={p} onClose={() => setPainting(false)} />}
    </li>
  );
}

/** Photos dropped as files, or a folder (its masks/ subfolder holds masks named like the photos). */
function dropPhotos(e: DragEvent): void {
  const flat = Array.from(e.dataTransfer.files);
  const folder = Array.from(e.dataTransfer.items).some((i) => i.webkitGetAsEntry?.()?.isDirectory);
  if (!folder) return void addPhotos(flat);
  void filesFromDrop(e.dataTransfer.items).then(({ files }) =>
    addPhotos(
      files.map((f) => f.file),
      'photos',
      files.map((f) => f.path),
    ),
  );
}

function PhotosPanel() {
  const photos = useStudioStore((s) => s.photos);
  const errors = useStudioStore((s) => s.photoErrors);
  // The run reads its photos while it prepares and trains: they stay as they are until it pauses or stops.
  const locked = useStudioStore((s) => runBusy(s.run.status));
  return (
    <section aria-labelledby="photos-title">
      <h2 id="photos-title">2. Photos of your subject</h2>
      <DropZone label="Drop photos here" onDrop={(e) => !locked && dropPhotos(e)} testId="photo-drop">
        <p>
          Drop 3 to 5 photos (JPEG, PNG or WebP) of the same subject (loss masks too, named like their photos: dog_mask.png beside dog.jpg, or a masks/ folder
          in a dropped folder; captions as dog.txt beside dog.jpg), or
        </p>
        <label className="file-button">
          Add photos
          <input
            type="file"
            multiple
            accept="image/jpeg,image/png,image/webp,.txt"
            disabled={locked}
            onChange={(e) => void addPhotos(Array.from(e.target.files ?? []))}
          />
        </label>
        {locked && (
          <p className="hint" data-testid="photos-locked">
            Photos cannot change while the run trains: pause or cancel it first.
          </p>
        )}
      </DropZone>
      {errors.length > 0 && (
        <div role="alert" className="bad" data-testid="photo-errors">
          {errors.map((m, i) => (
            <p key={i}>{m}</p>
          ))}
        </div>
      )}
      <p role="status">
        {photos.length === 0 ? 'No photos yet.' : `${photos.length} photo${photos.length > 1 ? 's' : ''}.`}
        {photos.length > 0 && photos.length < 3 && ' Three or more give the model a better idea of the subject.'}
      </p>
      <ul className="photos" data-testid="photos">
        {photos.map((p, i) => (
          <Thumb key={p.id} p={p} index={i} locked={locked} />
        ))}
      </ul>
    </section>
  );
}

// ---- settings ------------------------------------------------------------------------------------------

function SettingsPanel() {
  const prompt = useStudioStore((s) => s.prompt);
  const preset = useStudioStore((s) => s.preset);
  const s = useStudioStore((st) => st.settings);
  const set = useStudioStore((st) => st.setSettings);
  const classPhotos = useStudioStore((st) => st.classPhotos);
  const runStatus = useStudioStore((st) => st.run.status);
  const setAll = useStudioStore((st) => st.set);
  return (
    <section aria-labelledby="settings-title">
      <h2 id="settings-title">3. Prompt and settings</h2>
      <form className="form" onSubmit={(e) => e.preventDefault()}>
        <label className="wide">
          Instance prompt (a rare token plus the class, e.g. "a photo of sks dog")
          <input name="prompt" value={prompt} onChange={(e) => setAll({ prompt: e.target.value })} />
        </label>
      </form>
      <fieldset className="presets">
        <legend>Preset</legend>
        {(Object.keys(PRESETS) as PresetName[]).map((k) => (
          <label key={k} className="radio">
            <input type="radio" name="preset" value={k} checked={preset === k} onChange={() => applyPreset(k)} />
            {PRESETS[k].label}
          </label>
        ))}
        <p className="hint">
          {preset === 'lora'
            ? 'Trains small adapters on the attention layers: fast, a few MB to export.'
            : 'Trains every UNet weight with prior preservation: slower, needs much more storage, exports a full model.'}
        </p>
      </fieldset>
      <details>
        <summary>Advanced settings</summary>
        <AdvancedForm
          settings={s}
          set={set}
          after={{
            classSteps: (
              <label className="file-button">
                Add class images ({classPhotos.length})
                <input
                  type="file"
                  multiple
                  accept="image/jpeg,image/png,image/webp"
                  disabled={runBusy(runStatus)}
                  onChange={(e) => void addPhotos(Array.from(e.target.files ?? []), 'classPhotos')}
                />
              </label>
            ),
          }}
        />
      </details>
    </section>
  );
}

// ---- export --------------------------------------------------------------------------------------------

function ExportPanel() {
  const run = useStudioStore((s) => s.run);
  const exports = useStudioStore((s) => s.exports);
  const exporting = useStudioStore((s) => s.exporting);
  const error = useStudioStore((s) => s.exportError);
  const exportMessage = useStudioStore((s) => s.exportMessage);
  const saveWithDialog = useStudioStore((s) => s.saveWithDialog);
  const hasDialog = savePicker() !== null;
  const mode = run.startedWith?.settings.mode ?? useStudioStore.getState().settings.mode;
  const formats = (Object.keys(EXPORT_FORMATS) as ExportFormat[]).filter((f) => EXPORT_FORMATS[f].modes.includes(mode));
  const [format, setFormat] = useState<ExportFormat>(formats[0]);
  const chosen = formats.includes(format) ? format : formats[0];
  const canExport =
    run.runId !== null && run.lastCheckpoint > 0 && ['paused', 'done', 'interrupted', 'device-lost', 'error', 'quota'].includes(run.status) && !exporting;
  return (
    <section aria-labelledby="export-title">
      <h2 id="export-title">5. Export</h2>
      <form
        className="form"
        onSubmit={(e) => {
          e.preventDefault();
          void exportRun(chosen);
        }}
      >
        <label className="span-2">
          Format
          <select name="format" value={chosen} onChange={(e) => setFormat(e.target.value as ExportFormat)}>
            {formats.map((f) => (
              <option key={f} value={f}>
                {EXPORT_LABELS[f]}
              </option>
            ))}
          </select>
        </label>
        {hasDialog && (
          <label className="check">
            <input type="checkbox" checked={saveWithDialog} onChange={(e) => useStudioStore.getState().set({ saveWithDialog: e.target.checked })} />
            Choose where to save (streams large files straight to disk)
          </label>
        )}
        <button type="submit" disabled={!canExport}>
          {exporting ? 'Exporting…' : 'Export and download'}
        </button>
      </form>
      {!canExport && !exporting && <p className="hint">Train (or pause a run) to export it.</p>}
      {exportMessage && (
        <p role="status" data-testid="export-status">
          {exportMessage}
        </p>
      )}
      {error && (
        <p role="alert" className="bad">
          {error}
        </p>
      )}
      {exports.length > 0 && (
        <ul className="exports" data-testid="exports">
          {exports.map((x) => (
            <li key={`${x.name}-${x.size}-${x.url}`}>
              {x.url ? (
                <a href={x.url} download={x.name}>
                  {x.name}
                </a>
              ) : (
                <span>{x.name} (saved where you chose)</span>
              )}{' '}
              — {fmtBytes(x.size)}
            </li>
          ))}
        </ul>
      )}
    </section>
  );
}
