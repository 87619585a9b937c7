// Files brought back into the studio from elsewhere ("Bring results back", ui/studio/Outgrow.tsx): what an export
// of them is called, and what a file that is not a safetensors file is, in a person's words.
import { EXPORT_FORMATS, type ExportFormat } from '../pipeline/run.ts';

const stem = (name: string) => name.replace(/\.(safetensors|ckpt|pt|bin|zip)$/i, '');

/**
 * The download's name: a LoRA format keeps the LoRA's own name; a full model with a LoRA merged names both
 * (`<model>+<lora>-merged`), so the merged checkpoint never passes for the small LoRA file it came from.
 */
export function importedExportName(loraName: string | null, modelName: string, format: ExportFormat): string {
  const suffix = EXPORT_FORMATS[format].suffix;
  if (!loraName) return `${stem(modelName)}${suffix}`;
  if (format === 'lora-kohya' || format === 'lora-diffusers') return `${stem(loraName)}${suffix}`;
  return `${stem(modelName)}+${stem(loraName)}-merged${suffix}`;
}

/** What the first bytes of a file say it is, where that is not safetensors. */
export function fileKind(head: Uint8Array): string {
  const at = (i: number, ...b: number[]) => b.every((x, k) => head[i + k] === x);
  const ascii = (i: number, s: string) => [...s].every((c, k) => head[i + k] === c.charCodeAt(0));
  if (head.length === 0) return 'an empty file';
  if (at(0, 0x89, 0x50, 0x4e, 0x47)) return 'a PNG image';
  if (at(0, 0xff, 0xd8, 0xff)) return 'a JPEG image';
  if (ascii(0, 'RIFF') && ascii(8, 'WEBP')) return 'a WebP image';
  if (ascii(0, 'GIF8')) return 'a GIF image';
  if (at(0, 0x50, 0x4b, 0x03, 0x04)) return 'a zip archive (a PyTorch .ckpt/.bin, or a zipped folder)';
  if (head[0] === 0x80 && head[1] >= 2 && head[1] <= 5) return 'a PyTorch pickle (.ckpt/.pt/.bin)';
  if (ascii(0, '%PDF')) return 'a PDF document';
  const text = head.subarray(0, 64).every((b) => b === 9 || b === 10 || b === 13 || (b >= 32 && b < 127));
  if (text) return 'a text file';
  return 'not a file this page knows';
}

/** The refusal of a file that is not a safetensors file: its name, what it is, and what to bring instead. */
export function notSafetensorsMessage(name: string, head: Uint8Array, what: 'LoRA' | 'model'): string {
  const kind = fileKind(head);
  const looks = kind === 'not a file this page knows' ? 'is not a safetensors file' : `is ${kind}, not a safetensors file`;
  const want =
    what === 'LoRA'
      ? "Choose the LoRA as a .safetensors file (kohya's, or diffusers' pytorch_lora_weights.safetensors)"
      : 'Choose a Stable Diffusion checkpoint saved as .safetensors, or a diffusers folder';
  const convert = /pickle|zip archive/.test(kind) ? ', or convert it to .safetensors first' : '';
  return `${name} ${looks}. ${want}${convert}.`;
}
