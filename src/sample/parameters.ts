// Generation parameters as AUTOMATIC1111's web UI writes them into a PNG (a tEXt chunk with the keyword
// "parameters"), so a downloaded "Try it" image reads back in A1111's PNG Info tab, ComfyUI's and civitai's
// readers. A1111 (modules/processing.py create_infotext) writes:
//   <prompt>
//   Negative prompt: <negative prompt>          (the line only when the negative prompt is not empty)
//   Steps: 20, Sampler: DPM++ 2M, CFG scale: 7.5, Seed: 42, Size: 512x512, Model: <name>, Lora hashes: "<name>: <hash12>"
// where each value containing ',', ':' or a newline is written as a JSON string (infotext_utils.quote), and a
// LoRA is part of the prompt itself as `<lora:NAME:STRENGTH>` (extra networks syntax).
import { decode, encode } from 'fast-png';

export interface GenerationParameters {
  prompt: string;
  negativePrompt: string;
  steps: number;
  guidance: number;
  seed: number;
  width: number;
  height: number;
  sampler: 'dpm++2m' | 'ddim';
  /** The checkpoint's name (A1111 writes its file name without the extension). */
  model: string;
  /**
   * A LoRA on the model: its name and strength, written into the prompt, and its sshs_model_hash
   * (export/addnet-hash.ts), written as A1111's `Lora hashes: "name: <first 12 hex digits>"`.
   */
  lora?: { name: string; strength: number; hash?: string };
}

/** A1111's sampler names for ours. */
const A1111_SAMPLERS: Record<GenerationParameters['sampler'], string> = { 'dpm++2m': 'DPM++ 2M', ddim: 'DDIM' };

/** The PNG text chunk's keyword A1111 reads and writes. */
const PARAMETERS_KEY = 'parameters';

/** A1111's infotext_utils.quote: a value with ',', ':' or a newline becomes a JSON string, others stay as they are. */
export function quoteValue(text: string): string {
  return /[,:\n]/.test(text) ? JSON.stringify(text) : text;
}

/** A number as Python's str() of a float or int prints it for these values (7.5, 1, 0.8). */
function num(x: number): string {
  return String(x);
}

/** The checkpoint name A1111 shows: the file name without its folder and .safetensors / .ckpt. */
export function modelNameOf(fileName: string): string {
  return (fileName.split('/').pop() ?? fileName).replace(/\.(safetensors|ckpt)$/i, '');
}

/** The "parameters" text for one image, the way A1111 writes it. */
export function formatParameters(p: GenerationParameters): string {
  const prompt = p.lora ? `${p.prompt}${p.prompt ? ' ' : ''}<lora:${p.lora.name}:${num(p.lora.strength)}>` : p.prompt;
  const negative = p.negativePrompt ? `\nNegative prompt: ${p.negativePrompt}` : '';
  const fields: [string, string][] = [
    ['Steps', num(p.steps)],
    ['Sampler', A1111_SAMPLERS[p.sampler]],
    ['CFG scale', num(p.guidance)],
    ['Seed', num(p.seed)],
    ['Size', `${p.width}x${p.height}`],
    ['Model', modelNameOf(p.model)],
  ];
  // A1111's extra_networks_lora: the alias with ':' and ',' removed, "alias: shorthash" pairs joined by ', '.
  if (p.lora?.hash) fields.push(['Lora hashes', `${p.lora.name.replace(/[:,]/g, '')}: ${p.lora.hash.slice(0, 12)}`]);
  return `${prompt}${negative}\n${fields.map(([k, v]) => `${k}: ${quoteValue(v)}`).join(', ')}`;
}

/** Text fast-png can put in a tEXt chunk (Latin-1 only). */
const isLatin1 = (text: string) => [...text].every((c) => c.charCodeAt(0) <= 0xff);

/**
 * An 8-bit RGB PNG carrying `parameters`: a tEXt chunk (fast-png) when the text is Latin-1, else an iTXt chunk
 * of UTF-8 text (what PIL, and so A1111, writes for such text), placed before IEND.
 */
export function pngWithParameters(rgb: Uint8Array, width: number, height: number, parameters: string): Uint8Array {
  if (isLatin1(parameters)) return encode({ width, height, data: rgb, channels: 3, depth: 8, text: { [PARAMETERS_KEY]: parameters } });
  const png = encode({ width, height, data: rgb, channels: 3, depth: 8 });
  const enc = new TextEncoder();
  // iTXt: keyword \0, compression flag 0, method 0, language tag \0, translated keyword \0, UTF-8 text.
  const body = concat([enc.encode(PARAMETERS_KEY), Uint8Array.of(0, 0, 0, 0, 0), enc.encode(parameters)]);
  const iend = png.length - 12; // IEND is the last chunk: length 0, type, CRC
  return concat([png.subarray(0, iend), chunk('iTXt', body), png.subarray(iend)]);
}

/** The "parameters" text of a PNG (tEXt or uncompressed iTXt), or null when it has none. */
export function readPngParameters(png: Uint8Array): string | null {
  const fromText = decode(png).text[PARAMETERS_KEY];
  if (fromText !== undefined) return fromText;
  const view = new DataView(png.buffer, png.byteOffset, png.byteLength);
  const latin1 = new TextDecoder('latin1');
  for (let at = 8; at + 12 <= png.length;) {
    const length = view.getUint32(at);
    const type = latin1.decode(png.subarray(at + 4, at + 8));
    const data = png.subarray(at + 8, at + 8 + length);
    if (type === 'iTXt') {
      const end = data.indexOf(0);
      // Compressed iTXt (flag 1) is not written here and not read.
      if (latin1.decode(data.subarray(0, end)) === PARAMETERS_KEY && data[end + 1] === 0) {
        const lang = data.indexOf(0, end + 3);
        const translated = data.indexOf(0, lang + 1);
        return new TextDecoder().decode(data.subarray(translated + 1));
      }
    }
    at += 12 + length;
  }
  return null;
}

function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** A PNG chunk: length, type, data, CRC-32 of type and data. */
function chunk(type: string, data: Uint8Array): Uint8Array {
  const out = new Uint8Array(12 + data.length);
  const view = new DataView(out.buffer);
  view.setUint32(0, data.length);
  for (let i = 0; i < 4; i++) out[4 + i] = type.charCodeAt(i);
  out.set(data, 8);
  view.setUint32(8 + data.length, crc32(out.subarray(4, 8 + data.length)));
  return out;
}

let crcTable: Uint32Array | null = null;

/** CRC-32 (ISO 3309, polynomial 0xEDB88320 reflected), as PNG chunks use. */
function crc32(bytes: Uint8Array): number {
  const table = (crcTable ??= Uint32Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  }));
  let c = 0xffffffff;
  for (const b of bytes) c = table[(c ^ b) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}
