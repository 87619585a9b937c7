// Training images from a folder: symlinked images and captions are followed, a broken link is reported by
// name; a caption .txt that is binary is ignored with a warning (the prompt is used), a long one is used
// with a warning (the text encoder reads 75 tokens). And small-image warnings are relative to the training
// resolution: a 48 px photo is fine for a 32 px model.
import assert from 'node:assert/strict';
import { copyFileSync, mkdirSync, mkdtempSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { CAPTION_MAX_BYTES, CaptionError, checkCaptionFiles, loadImageDir, loadImageFile } from '../../src/io/image-node.ts';
import { checkImageSet } from '../../src/io/image.ts';

const FIXTURES = join(import.meta.dirname, '../fixtures/images');
const sq = (name: string, side: number) => ({ name, width: side, height: side });

describe('checkImageSet: sizes against the training resolution', () => {
  it('no size warning when the short side reaches the resolution, however small both are', () => {
    assert.deepEqual(checkImageSet([sq('a.png', 48), sq('b.png', 32), sq('c.png', 64)], { resolution: 32 }).warnings, []);
    assert.deepEqual(checkImageSet([sq('a.png', 200), sq('b.png', 300), sq('c.png', 256)], { resolution: 128 }).warnings, []);
  });

  it('below the resolution: upscaled (soft); below half of it (and under 256 px): blurry', () => {
    const r = checkImageSet([sq('soft.png', 20), sq('blurry.png', 15), sq('ok.png', 40)], { resolution: 32 });
    assert.deepEqual(r.warnings, [
      'soft.png is 20x20, smaller than 32 px: it will be upscaled and slightly soft',
      'blurry.png is only 15x15; sides under 16 px come out blurry after upscaling, use a larger photo if you have one',
    ]);
    // At SD's resolutions the bar stays 256 px.
    const sd = checkImageSet([sq('a.jpg', 255), sq('b.jpg', 300), sq('c.jpg', 512)], { resolution: 512 });
    assert.deepEqual(sd.warnings, [
      'a.jpg is only 255x255; sides under 256 px come out blurry after upscaling, use a larger photo if you have one',
      'b.jpg is 300x300, smaller than 512 px: it will be upscaled and slightly soft',
    ]);
    // Without a resolution (nothing to compare with), only the absolute bar.
    assert.deepEqual(checkImageSet([sq('a.jpg', 200), sq('b.jpg', 300), sq('c.jpg', 300)]).warnings, [
      'a.jpg is only 200x200; sides under 256 px come out blurry after upscaling, use a larger photo if you have one',
    ]);
  });
});

describe('loadImageDir: symlinks and caption files', () => {
  const photos = mkdtempSync(join(tmpdir(), 'dbs-photos-'));
  copyFileSync(join(FIXTURES, 'quadrants.png'), join(photos, 'real.png'));
  writeFileSync(join(photos, 'real-caption.txt'), 'a photo of sks dog\n');

  function folder(): string {
    const d = mkdtempSync(join(tmpdir(), 'dbs-set-'));
    return d;
  }

  it('a symlinked image and a symlinked caption are followed; a broken link is an error naming it', async () => {
    const d = folder();
    copyFileSync(join(FIXTURES, 'quadrants.jpg'), join(d, 'a.jpg'));
    symlinkSync(join(photos, 'real.png'), join(d, 'b.png'));
    symlinkSync(join(photos, 'real-caption.txt'), join(d, 'b.txt'));
    symlinkSync(join(photos, 'gone.jpg'), join(d, 'c.jpg'));
    symlinkSync(photos, join(d, 'linked-folder')); // a link to a folder is skipped like a folder
    mkdirSync(join(d, 'sub'));
    const warnings: string[] = [];
    const { images, errors } = await loadImageDir(d, { onWarning: (w) => warnings.push(w) });
    assert.deepEqual(
      images.map((i) => i.name),
      ['a.jpg', 'b.png'],
    );
    assert.deepEqual(
      images.map((i) => i.caption),
      [undefined, 'a photo of sks dog'],
    );
    assert.deepEqual([images[1].image.width, images[1].image.height], [48, 32], 'the linked PNG decoded');
    assert.deepEqual(
      errors.map((e) => [e.file, e.message]),
      [['c.jpg', `c.jpg is a broken link (${join(photos, 'gone.jpg')} does not exist): fix or remove it`]],
    );
    assert.deepEqual(warnings, []);
  });

  it('a broken caption link is a warning naming it; the image is still trained, with the prompt', async () => {
    const d = folder();
    symlinkSync(join(photos, 'real.png'), join(d, 'dog.png'));
    symlinkSync(join(photos, 'missing.txt'), join(d, 'dog.txt'));
    const warnings: string[] = [];
    const { images, errors } = await loadImageDir(d, { onWarning: (w) => warnings.push(w) });
    assert.deepEqual(
      images.map((i) => [i.name, i.caption]),
      [['dog.png', undefined]],
    );
    assert.deepEqual(errors, []);
    assert.deepEqual(warnings, [`dog.txt is a broken link (${join(photos, 'missing.txt')} does not exist): ignored, dog.png is trained with the prompt`]);
  });

  it('binary, non-UTF-8 or empty captions are ignored with a warning naming the photo; UTF-16 with a BOM is text', async () => {
    const d = folder();
    for (const n of ['nul', 'latin1', 'utf16', 'fine', 'empty']) copyFileSync(join(FIXTURES, 'quadrants.png'), join(d, `${n}.png`));
    writeFileSync(join(d, 'empty.txt'), '  \nthe second line is not read\n');
    writeFileSync(join(d, 'nul.txt'), Uint8Array.of(0x89, 0x50, 0x4e, 0x47, 0, 0, 0, 13)); // a PNG saved as .txt
    writeFileSync(join(d, 'latin1.txt'), Uint8Array.of(0x63, 0x61, 0x66, 0xe9)); // "café" in Latin-1
    writeFileSync(join(d, 'utf16.txt'), Buffer.concat([Buffer.of(0xff, 0xfe), Buffer.from('sks dog\r\nignored', 'utf16le')]));
    writeFileSync(join(d, 'fine.txt'), '\uFEFFsks dog, café');
    const warnings: string[] = [];
    const { images } = await loadImageDir(d, { onWarning: (w) => warnings.push(w) });
    assert.deepEqual(Object.fromEntries(images.map((i) => [i.name, i.caption])), {
      'empty.png': undefined,
      'fine.png': 'sks dog, café',
      'latin1.png': undefined,
      'nul.png': undefined,
      'utf16.png': 'sks dog',
    });
    assert.deepEqual(warnings, [
      'empty.txt is empty (kohya reads its first line): empty.png is trained with the prompt; write its caption there, or remove the file',
      'latin1.txt is not a text file (binary data or not UTF-8): ignored as the caption of latin1.png, which is trained with the prompt',
      'nul.txt is not a text file (binary data or not UTF-8): ignored as the caption of nul.png, which is trained with the prompt',
    ]);
  });

  it("refuseBadCaptions (the command line's rule): each bad caption is a CaptionError naming the file, folder and photo", async () => {
    for (const [name, bytes, why] of [
      ['empty', '  \nthe second line is not read\n', /empty\.txt in \S+ is empty \(kohya reads its first line\), so empty\.png would have no caption: write/],
      ['latin1', Uint8Array.of(0x63, 0x61, 0x66, 0xe9), /latin1\.txt in \S+ is not UTF-8 text .*caption of latin1\.png: save it as UTF-8 text, or remove it/],
      ['nul', Uint8Array.of(0x89, 0x50, 0x4e, 0x47, 0, 0, 0, 13), /nul\.txt in \S+ is not UTF-8 text/],
    ] as const) {
      const d = folder();
      copyFileSync(join(FIXTURES, 'quadrants.png'), join(d, 'fine.png'));
      writeFileSync(join(d, 'fine.txt'), 'sks dog');
      copyFileSync(join(FIXTURES, 'quadrants.png'), join(d, `${name}.png`));
      writeFileSync(join(d, `${name}.txt`), bytes);
      const isRefusal = (e: Error) => e instanceof CaptionError && why.test(e.message) && e.message.includes(d);
      await assert.rejects(loadImageDir(d, { refuseBadCaptions: true }), isRefusal);
      await assert.rejects(checkCaptionFiles(d), isRefusal);
    }
    // good captions pass both; a .txt beside no photo is no caption
    const d = folder();
    copyFileSync(join(FIXTURES, 'quadrants.png'), join(d, 'fine.png'));
    writeFileSync(join(d, 'fine.txt'), '\uFEFFsks dog');
    writeFileSync(join(d, 'notes.txt'), '');
    await checkCaptionFiles(d);
    assert.equal((await loadImageDir(d, { refuseBadCaptions: true })).images[0].caption, 'sks dog');
  });

  it('a caption longer than the text encoder reads, or a large file, is used with a warning; a huge one is ignored', async () => {
    const d = folder();
    for (const n of ['long', 'tags', 'big', 'huge', 'short']) copyFileSync(join(FIXTURES, 'quadrants.png'), join(d, `${n}.png`));
    const long = Array.from({ length: 80 }, (_, i) => `word${String.fromCharCode(97 + (i % 26))}`).join(' ');
    writeFileSync(join(d, 'long.txt'), long);
    // 40 tags: 40 words and 39 commas are at least 79 tokens, though only 40 words.
    const tags = Array.from({ length: 40 }, () => 'dog').join(', ');
    writeFileSync(join(d, 'tags.txt'), tags);
    writeFileSync(join(d, 'big.txt'), `sks dog\n${'notes '.repeat(1000)}`);
    writeFileSync(join(d, 'huge.txt'), Buffer.alloc(CAPTION_MAX_BYTES + 1, 'a'));
    writeFileSync(join(d, 'short.txt'), Array.from({ length: 75 }, () => 'dog').join(' ')); // exactly 75: fits
    const warnings: string[] = [];
    const { images } = await loadImageDir(d, { onWarning: (w) => warnings.push(w) });
    const captions = Object.fromEntries(images.map((i) => [i.name, i.caption]));
    assert.equal(captions['long.png'], long);
    assert.equal(captions['tags.png'], tags);
    assert.equal(captions['big.png'], 'sks dog');
    assert.equal(captions['huge.png'], undefined);
    assert.equal(captions['short.png']?.split(' ').length, 75);
    assert.deepEqual(warnings, [
      'big.txt is 5.9 KiB, large for a caption: only its first line is used (kohya convention)',
      'huge.txt is 1.0 MiB, far too large for a caption: ignored, huge.png is trained with the prompt',
      'long.txt: the caption is at least 80 tokens long but the text encoder reads only 75; the rest is ignored (shorten it to what matters most, first)',
      'tags.txt: the caption is at least 79 tokens long but the text encoder reads only 75; the rest is ignored (shorten it to what matters most, first)',
    ]);
  });

  it('loadImageFile reports caption problems too, to stderr by default', async () => {
    const d = folder();
    copyFileSync(join(FIXTURES, 'quadrants.png'), join(d, 'x.png'));
    writeFileSync(join(d, 'x.txt'), Uint8Array.of(0, 1, 2));
    const printed: unknown[][] = [];
    const original = console.error;
    console.error = (...a: unknown[]) => void printed.push(a);
    try {
      assert.equal((await loadImageFile(join(d, 'x.png'))).caption, undefined);
    } finally {
      console.error = original;
    }
    assert.deepEqual(printed, [
      ['warning: x.txt is not a text file (binary data or not UTF-8): ignored as the caption of x.png, which is trained with the prompt'],
    ]);
  });
});
