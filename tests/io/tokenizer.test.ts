// The CLIP tokenizer against the ids of CLIP's reference tokenizer (data/clip, vendored), built from
// vocab.json + merges.txt the way Hugging Face's CLIPTokenizer files are derived from CLIP's BPE file.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { gunzipSync } from 'node:zlib';
import { ClipTokenizer, TokenizerError } from '../../src/io/tokenizer.ts';

const clipDir = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'data', 'clip');

/** CLIP's bytes_to_unicode values in its order: printable bytes as themselves, then the rest as 256+. */
function bytesToUnicode(): string[] {
  const bs: number[] = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = [...bs];
  let n = 0;
  for (let b = 0; b < 256; b++)
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n++);
    }
  return cs.map((c) => String.fromCharCode(c));
}

/** vocab.json and merges.txt exactly as CLIP's simple_tokenizer / HF's CLIPTokenizer define them. */
function clipFiles(): { vocab: Record<string, number>; merges: string } {
  const lines = gunzipSync(readFileSync(join(clipDir, 'bpe_simple_vocab_16e6.txt.gz')))
    .toString('utf8')
    .split('\n');
  const merges = lines.slice(1, 49152 - 256 - 2 + 1);
  const tokens = bytesToUnicode();
  const all = [...tokens, ...tokens.map((t) => `${t}</w>`), ...merges.map((m) => m.split(' ').join('')), '<|startoftext|>', '<|endoftext|>'];
  const vocab: Record<string, number> = {};
  all.forEach((t, i) => (vocab[t] = i));
  return { vocab, merges: `#version: 0.2\n${merges.join('\n')}\n` };
}

const ref = JSON.parse(readFileSync(join(clipDir, 'token-vectors.json'), 'utf8')) as {
  bos: number;
  eos: number;
  vocab_size: number;
  cases: { text: string; ids: number[] }[];
};

describe('CLIP tokenizer', () => {
  const files = clipFiles();
  const tok = ClipTokenizer.fromFiles(files);

  it('builds the 49408-token vocabulary with bos/eos where CLIP has them', () => {
    assert.equal(Object.keys(files.vocab).length, ref.vocab_size);
    assert.equal(tok.bosId, ref.bos);
    assert.equal(tok.eosId, ref.eos);
  });

  for (const c of ref.cases)
    it(`ids of ${JSON.stringify(c.text.slice(0, 40))} equal CLIP's`, () => {
      assert.deepEqual(tok.encode(c.text), c.ids);
    });

  it('pads and truncates to 77 as SD does: bos, 75 ids at most, eos, then eos padding (SD1)', () => {
    const short = tok.encodePadded('a photo of sks dog');
    assert.equal(short.length, 77);
    assert.deepEqual([...short.slice(0, 7)], [49406, 320, 1125, 539, 48136, 1929, 49407]);
    assert.ok(short.slice(7).every((v) => v === 49407));
    const long = tok.encodePadded(Array.from({ length: 100 }, () => 'dog').join(' '));
    assert.equal(long[0], 49406);
    assert.equal(long[76], 49407);
    assert.ok(long.slice(1, 76).every((v) => v === 1929));
  });

  it('pads with "!" (id 0) when the tokenizer config says so (SD2 OpenCLIP)', () => {
    const sd2 = ClipTokenizer.fromFiles({ ...files, config: { pad_token: '!' } });
    const ids = sd2.encodePadded('a dog');
    assert.deepEqual([...ids.slice(0, 5)], [49406, 320, 1929, 49407, 0]);
    assert.ok(ids.slice(4).every((v) => v === 0));
  });

  it('refuses files that are no CLIP tokenizer', () => {
    assert.throws(() => ClipTokenizer.fromFiles({ vocab: { a: 0 }, merges: '' }), TokenizerError);
    assert.throws(() => ClipTokenizer.fromFiles({}), /needs tokenizer.json, or vocab.json and merges.txt/);
  });
});
