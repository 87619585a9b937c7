// CLIP tokenizer for Stable Diffusion prompts, on @huggingface/tokenizers. A model folder gives
// either tokenizer.json (used as is) or CLIPTokenizer's vocab.json + merges.txt, from which we build
// the equivalent tokenizer.json: NFC, whitespace runs -> one space, lowercase; CLIP's split regex;
// byte-level BPE with the "</w>" end-of-word suffix; <|startoftext|> ... <|endoftext|> around the ids.
// SD feeds the text encoder exactly 77 ids: bos, up to 75 prompt ids (truncated), eos, then padding
// (eos for SD1's CLIPTokenizer, "!" = id 0 for SD2's OpenCLIP tokenizer config).
import { Tokenizer } from '@huggingface/tokenizers';

export const CLIP_MAX_LENGTH = 77;
const BOS = '<|startoftext|>';
const EOS = '<|endoftext|>';

export interface ClipTokenizerFiles {
  /** tokenizer.json, when the folder has one. */
  tokenizerJson?: Record<string, unknown>;
  /** vocab.json (token -> id). */
  vocab?: Record<string, number>;
  /** merges.txt contents (first line "#version..." allowed). */
  merges?: string;
  /** tokenizer_config.json / special_tokens_map.json (pad_token, model_max_length). */
  config?: Record<string, unknown>;
}

export class TokenizerError extends Error {
  override name = 'TokenizerError';
}

/** tokenizer.json equivalent to HF's CLIPTokenizerFast for a CLIP vocab and merges. */
function clipTokenizerJson(vocab: Record<string, number>, merges: string[]): Record<string, unknown> {
  const special = (content: string) => ({ id: vocab[content], content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
  for (const t of [BOS, EOS]) if (vocab[t] === undefined) throw new TokenizerError(`vocab.json has no ${t} token: not a CLIP tokenizer`);
  return {
    version: '1.0',
    added_tokens: [special(BOS), special(EOS)],
    normalizer: {
      type: 'Sequence',
      normalizers: [{ type: 'NFC' }, { type: 'Replace', pattern: { Regex: '\\s+' }, content: ' ' }, { type: 'Lowercase' }],
    },
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [
        {
          type: 'Split',
          pattern: { Regex: "<\\|startoftext\\|>|<\\|endoftext\\|>|'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+" },
          behavior: 'Removed',
          invert: true,
        },
        { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false },
      ],
    },
    post_processor: { type: 'RobertaProcessing', sep: [EOS, vocab[EOS]], cls: [BOS, vocab[BOS]], trim_offsets: false, add_prefix_space: false },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: 'BPE', dropout: null, unk_token: EOS, continuing_subword_prefix: '', end_of_word_suffix: '</w>', fuse_unk: false, vocab, merges },
  };
}

/** vocab.json must map tokens to distinct whole-number ids: anything else tokenizes into nonsense. */
function checkVocab(vocab: unknown): void {
  if (typeof vocab !== 'object' || vocab === null || Array.isArray(vocab)) throw new TokenizerError('tokenizer vocab.json is not a map of tokens to ids');
  const entries = Object.entries(vocab);
  if (!entries.length) throw new TokenizerError('tokenizer vocab.json is empty: give the model its own tokenizer files');
  const bad = entries.find(([, id]) => !(Number.isInteger(id) && (id as number) >= 0));
  if (bad) throw new TokenizerError(`tokenizer vocab.json: token ${JSON.stringify(bad[0])} has id ${JSON.stringify(bad[1])}, not a whole number`);
}

/**
 * merges.txt's merge rules: UTF-8 text of "a b" lines after an optional #version header. A header with no merges is
 * a byte-level vocabulary (the tiny test models' tokenizers); a file with neither is an empty or truncated copy.
 */
function checkMerges(text: string): string[] {
  if (text.includes('\uFFFD') || text.includes('\0'))
    throw new TokenizerError('tokenizer merges.txt is not UTF-8 text (a binary file?): give the model its own merges.txt');
  const header = text.startsWith('#version');
  const lines = text.split('\n').filter((l) => l.length > 0 && !l.startsWith('#version'));
  if (!lines.length && !header) throw new TokenizerError('tokenizer merges.txt holds no merges (empty): give the model its own merges.txt');
  const i = lines.findIndex((l) => l.replace(/\r$/, '').split(' ').length !== 2);
  if (i >= 0) throw new TokenizerError(`tokenizer merges.txt: line ${JSON.stringify(lines[i].slice(0, 40))} is not a merge ("a b")`);
  return lines;
}

export class ClipTokenizer {
  private constructor(
    private readonly tok: Tokenizer,
    readonly bosId: number,
    readonly eosId: number,
    readonly padId: number,
  ) {}

  static fromFiles(files: ClipTokenizerFiles): ClipTokenizer {
    let json = files.tokenizerJson;
    if (!json) {
      if (!files.vocab || files.merges === undefined) throw new TokenizerError('the tokenizer needs tokenizer.json, or vocab.json and merges.txt');
      checkVocab(files.vocab);
      const merges = checkMerges(files.merges);
      json = clipTokenizerJson(files.vocab, merges);
    }
    const tok = new Tokenizer(json, files.config ?? {});
    const id = (t: string) => {
      const v = tok.token_to_id(t);
      if (v === undefined) throw new TokenizerError(`tokenizer has no ${t} token: not a CLIP tokenizer`);
      return v;
    };
    const pad = files.config?.pad_token;
    const padToken = typeof pad === 'string' ? pad : typeof pad === 'object' && pad && 'content' in pad ? String((pad as { content: unknown }).content) : EOS;
    return new ClipTokenizer(tok, id(BOS), id(EOS), id(padToken));
  }

  /** Prompt ids without bos/eos. */
  encode(text: string): number[] {
    return this.tok.encode(text, { add_special_tokens: false }).ids;
  }

  /** SD's text-encoder input: bos, ids truncated to 75, eos, padding to 77. */
  encodePadded(text: string, maxLength = CLIP_MAX_LENGTH): Int32Array {
    const ids = this.encode(text).slice(0, maxLength - 2);
    const out = new Int32Array(maxLength).fill(this.padId);
    out[0] = this.bosId;
    out.set(ids, 1);
    out[ids.length + 1] = this.eosId;
    return out;
  }

  decode(ids: number[]): string {
    return this.tok.decode(ids, { skip_special_tokens: true });
  }
}
