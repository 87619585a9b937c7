// Outgrowing the tab (issue 17): hand the run to the PyTorch trainers people use on bigger machines (a job
// bundle for diffusers' DreamBooth scripts and Ray Train), and bring what they trained back: a LoRA file
// (diffusers' pytorch_lora_weights.safetensors, kohya) tried on the loaded base model and exported in our
// formats; a full diffusers folder is loaded as the model itself (Model above) and exported here with no LoRA.
import { useState } from 'react';
import { EXPORT_FORMATS, type ExportFormat } from '../../pipeline/run.ts';
import { checkLoraFile, downloadBundle, exportImportedLora, tryImportedLora } from './actions.ts';
import { EXPORT_LABELS } from './presets.ts';
import { fmtBytes, useStudioStore } from './state.ts';

/** The LoRA file, read as it is chosen: a wrong file is refused now, by name, not at Try or Export. */
function LoraFileInput(p: { setLora: (f: File | null) => void; setError: (m: string) => void; setChecking: (b: boolean) => void }) {
  return (
    <label className="span-2">
      LoRA trained elsewhere (pytorch_lora_weights.safetensors or kohya); none: the loaded model itself
      <input
        type="file"
        name="imported-lora"
        accept=".safetensors"
        onChange={(e) => {
          const input = e.target;
          const file = input.files?.[0] ?? null;
          p.setLora(null);
          p.setError('');
          if (!file) return;
          p.setChecking(true);
          void checkLoraFile(file)
            .then((problem) => {
              if (problem) {
                p.setError(problem);
                input.value = '';
              } else p.setLora(file);
            })
            .finally(() => p.setChecking(false));
        }}
      />
    </label>
  );
}

export function OutgrowPanel() {
  const modelReady = useStudioStore((s) => s.model.status === 'ready');
  const defaultPrompt = useStudioStore((s) => s.prompt);
  const [busy, setBusy] = useState<'bundle' | 'try' | 'export' | null>(null);
  const [message, setMessage] = useState('');
  const [error, setError] = useState('');
  const [lora, setLora] = useState<File | null>(null);
  /** A chosen LoRA is being read: Try it and Export wait for the verdict. */
  const [checking, setChecking] = useState(false);
  const [prompt, setPrompt] = useState<string | null>(null);
  const [strength, setStrength] = useState(1);
  const [steps, setSteps] = useState(20);
  const [image, setImage] = useState<string | null>(null);
  const [format, setFormat] = useState<ExportFormat>('lora-kohya');
  const formats = (Object.keys(EXPORT_FORMATS) as ExportFormat[]).filter((f) => lora || EXPORT_FORMATS[f].modes.includes('full'));
  const chosen = formats.includes(format) ? format : formats[0];
  const act = async (what: 'bundle' | 'try' | 'export', fn: () => Promise<string>) => {
    setBusy(what);
    setError('');
    setMessage('');
    try {
      setMessage(await fn());
    } catch (e) {
      setError((e as Error).message);
    } finally {
      setBusy(null);
    }
  };
  return (
    <section aria-labelledby="outgrow-title">
      <h2 id="outgrow-title">6. Bigger machines</h2>
      <p className="hint">
        Train this run with diffusers' DreamBooth scripts (one or many GPUs, DeepSpeed) or Ray Train instead: the bundle holds the cropped photos, captions,
        class images, train.sh, ray_train.py and a README naming every setting with no counterpart.
      </p>
      <button
        type="button"
        disabled={busy !== null}
        onClick={() =>
          void act('bundle', async () => {
            const out = await downloadBundle();
            return `Downloaded ${out.name} (${fmtBytes(out.size)}).`;
          })
        }
      >
        {busy === 'bundle' ? 'Packing…' : 'Download job bundle (.zip)'}
      </button>
      <h3>Bring results back</h3>
      <form className="form" onSubmit={(e) => e.preventDefault()}>
        <LoraFileInput setLora={setLora} setError={setError} setChecking={setChecking} />
        <label className="span-2">
          Prompt to try
          <input type="text" name="try-prompt" value={prompt ?? defaultPrompt} onChange={(e) => setPrompt(e.target.value)} />
        </label>
        <label>
          LoRA strength
          <input type="number" name="lora-strength" min={-2} max={2} step={0.1} value={strength} onChange={(e) => setStrength(Number(e.target.value))} />
        </label>
        <label>
          Try-it steps
          <input
            type="number"
            name="try-steps"
            min={1}
            max={100}
            step={1}
            value={steps}
            onChange={(e) => setSteps(Math.max(1, Math.round(Number(e.target.value) || 1)))}
          />
        </label>
        <button
          type="button"
          disabled={busy !== null || checking || !modelReady}
          onClick={() =>
            void act('try', async () => {
              const url = await tryImportedLora(lora, { prompt: prompt ?? defaultPrompt, seed: 1, steps, strength });
              setImage((old) => {
                if (old) URL.revokeObjectURL(old);
                return url;
              });
              return lora ? `${lora.name} on the loaded model.` : 'The loaded model without a LoRA.';
            })
          }
        >
          {busy === 'try' ? 'Generating…' : 'Try it'}
        </button>
        <label className="span-2">
          Export as
          <select name="imported-format" value={chosen} onChange={(e) => setFormat(e.target.value as ExportFormat)}>
            {formats.map((f) => (
              <option key={f} value={f}>
                {EXPORT_LABELS[f]}
              </option>
            ))}
          </select>
        </label>
        <button
          type="button"
          disabled={busy !== null || checking || !modelReady}
          onClick={() =>
            void act('export', async () => {
              const out = await exportImportedLora(lora, chosen);
              return [`Exported ${out.name} (${fmtBytes(out.size)}).`, ...out.warnings].join(' ');
            })
          }
        >
          {busy === 'export' ? 'Exporting…' : 'Export the imported result'}
        </button>
      </form>
      {!modelReady && <p className="hint">Load the base model (Model above) to try or export a LoRA.</p>}
      {image && <img src={image} alt="Generated with the imported LoRA" width={256} height={256} data-testid="imported-sample" />}
      {message && <p role="status">{message}</p>}
      {error && (
        <p className="error" role="alert">
          {error}
        </p>
      )}
    </section>
  );
}
