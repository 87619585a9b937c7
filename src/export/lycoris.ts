// LyCORIS files (nn/lycoris.ts's network types) in the layout A1111 (extensions-builtin/Lora: network_lora,
// network_hada, network_lokr) and ComfyUI (comfy/weight_adapter: lora, loha, lokr) load: kohya module names
// (lora_unet_<diffusers module path, '.' -> '_'>, lora_te_ for the text encoder) with per module
//   LoCon:  lora_down.weight [r, in] or a conv's [r, in, kh, kw], lora_up.weight [out, r] or [out, r, 1, 1], alpha;
//   LoHa:   hada_w1_a [out, r], hada_w1_b [r, in kh kw], hada_w2_a, hada_w2_b, alpha;
//   LoKr:   lokr_w1 [outL, inM], lokr_w2_a [outK, r] and lokr_w2_b [r, inN kh kw] or a full lokr_w2, alpha;
//   DoRA (any of them, LyCORIS dora_wd): dora_scale [1, in] or a conv's [1, in, 1, 1], the per-input-channel
//     magnitude; the loaders merge m (W + (alpha / r) ΔW) / ||W + (alpha / r) ΔW|| with the norm over every dim but
//     the input channels (ComfyUI weight_decompose: dora_scale.shape[0] != out picks that axis). Written F32: m is of
//     W's size, so f16 rounding of it would move the merged weight by ~5e-4 of W, more than a short run's ΔW.
// The loaders merge W + (alpha / r) ΔW with r = lora_down's rows, hada_w1_b's rows, or lokr_w2_b's rows (a full
// lokr_w2 is merged at scale 1), the ΔW of nn/lycoris.ts; LoHa's and LoKr's 2-D conv factors are reshaped to the
// conv's weight shape there, as LyCORIS itself saves them. alpha is a 0-d F32 tensor (read with .item()).
// ss_network_module is LyCORIS' lycoris.kohya with its algo in ss_network_args.
import type { ByteSink } from '../io/safetensors.ts';
import { exportedAlpha, type NetworkSpec } from '../nn/lycoris.ts';
import { addnetModelHash, hashedSafetensorsChunks } from './addnet-hash.ts';
import { kohyaMetadata, kohyaName, type LoraAdapters, type LoraComponent, type LoraInfo } from './lora.ts';
import { ExportError } from './provider.ts';
import { pump, pyJson, type OutTensor } from './stream.ts';

/** A LyCORIS run's adapters: the LoRA writers' providers, the network, and each adapted layer's base weight shape. */
export interface LycorisAdapters extends LoraAdapters {
  network: NetworkSpec;
  baseShape: (component: LoraComponent, layer: string) => readonly number[];
}

const FACTOR = /^(.*)\.(lora_A\.weight|lora_B\.weight|hada_w[12]_[ab]|lokr_w1|lokr_w2|lokr_w2_[ab]|dora_scale)$/;
/** The engine factor's name in the file (LoHa's and LoKr's names are LyCORIS' own). */
const FILE_NAME: Record<string, string> = { 'lora_A.weight': 'lora_down.weight', 'lora_B.weight': 'lora_up.weight' };

function lycorisTensors(a: LycorisAdapters): OutTensor[] {
  if (a.network.type === 'lora') throw new ExportError('a plain LoRA run is written by writeKohyaLora');
  const out: OutTensor[] = [];
  const groups: [LoraComponent, LoraAdapters['unet'] | undefined][] = [
    ['text_encoder', a.textEncoder],
    ['unet', a.unet],
  ];
  for (const [component, provider] of groups) {
    if (!provider) continue;
    const layers = new Map<string, string[]>();
    for (const n of provider.names()) {
      const m = FACTOR.exec(n);
      if (!m) throw new ExportError(`${component} adapter tensor '${n}' is not a ${a.network.type} factor`);
      layers.set(m[1], [...(layers.get(m[1]) ?? []), m[2]]);
    }
    for (const [layer, factors] of layers) {
      const k = kohyaName(component, layer);
      const base = a.baseShape(component, layer);
      out.push({ name: `${k}.alpha`, dtype: 'F32', shape: [], data: async () => Float32Array.of(exportedAlpha(a.network, base)) });
      for (const f of factors) {
        const src = `${layer}.${f}`;
        let shape = [...provider.shape(src)];
        // a conv's LoCon pair as conv weights: down [r, in, kh, kw], up [out, r, 1, 1]
        if (base.length === 4 && f === 'lora_A.weight') shape = [shape[0], base[1], base[2], base[3]];
        if (base.length === 4 && (f === 'lora_B.weight' || f === 'dora_scale')) shape = [...shape, 1, 1];
        out.push({ name: `${k}.${FILE_NAME[f] ?? f}`, dtype: f === 'dora_scale' ? 'F32' : 'F16', shape, data: () => provider.read(src) });
      }
    }
  }
  if (!out.length) throw new ExportError('no LyCORIS adapters to export');
  return out;
}

/** kohya's metadata with LyCORIS' module and its network_args (algo, conv_dim, conv_alpha, factor, dora_wd). */
function lycorisMetadata(a: LycorisAdapters, info: LoraInfo): Record<string, string> {
  const n = a.network;
  const args: Record<string, string> = { algo: n.type, conv_dim: String(n.convRank), conv_alpha: String(n.convAlpha) };
  if (n.type === 'lokr') args.factor = String(n.factor);
  if (n.dora) args.dora_wd = 'True';
  return { ...kohyaMetadata(a, info), ss_network_module: 'lycoris.kohya', ss_network_args: pyJson(new Map(Object.entries(args))) };
}

/** sshs_model_hash of the LyCORIS file of `a` (metadata aside). */
export async function lycorisHash(a: LycorisAdapters): Promise<string> {
  return addnetModelHash(lycorisTensors(a));
}

/** Writes the LyCORIS file of a locon / loha / lokr run to `sink` and closes it (hashes as writeKohyaLora). */
export async function writeLycoris(sink: ByteSink, a: LycorisAdapters, info: LoraInfo): Promise<void> {
  await pump(hashedSafetensorsChunks(lycorisTensors(a), lycorisMetadata(a, info)), sink);
}
