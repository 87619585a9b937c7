// Exposes browser-host pieces to the Playwright tests (built into dist/e2e/harness.html).
import { idbDownloadCache } from '../src/io/cache-idb.ts';
import { downloadDiffusersModel } from '../src/io/hub.ts';
import { SafetensorsFile } from '../src/io/safetensors.ts';

async function hubDownload(endpoint: string, repo: string): Promise<{ files: string[]; unetTensors: string[] }> {
  const m = await downloadDiffusersModel(repo, { endpoint, cache: idbDownloadCache() });
  const unet = m.files.get('unet/diffusion_pytorch_model.safetensors') ?? m.files.get('unet/diffusion_pytorch_model.fp16.safetensors');
  const f = await SafetensorsFile.open(unet!);
  return { files: [...m.files.keys()].sort(), unetTensors: f.names };
}

(window as unknown as { __harness: unknown }).__harness = { hubDownload };
