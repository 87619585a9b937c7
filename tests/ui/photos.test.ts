// Photos are checked in full when they are dropped (ui/studio/photo-check.ts): a PNG, JPEG or WebP cut short
// anywhere after its header, or one whose pixels do not decode, is refused at once with the file named, and
// nothing of it reaches the page's state or the project database; whole photos pass with their upright size.
import 'fake-indexeddb/auto';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { describe, it } from 'node:test';
import { decodeImageNode } from '../../src/io/image-node.ts';
import { checkPhoto, type PhotoDecoder } from '../../src/ui/studio/photo-check.ts';
import { splitMasks } from '../../src/ui/studio/mask-files.ts';

const dir = new URL('../fixtures/images/', import.meta.url);
/** The Node decoders (jpeg-js, fast-png, libwebp) stand where the browser's createImageBitmap decodes on the page. */
const nodeDecoder: PhotoDecoder = async (blob, _kind, name) => void (await decodeImageNode(new Uint8Array(await blob.arrayBuffer()), name));
const file = (bytes: Uint8Array, name: string) => new File([bytes as Uint8Array<ArrayBuffer>], name);
const FIXTURES = ['quadrants.png', 'quadrants.jpg', 'quadrants.webp'];

describe('photos are decoded in full at drop time', () => {
  for (const name of FIXTURES) {
    const whole = new Uint8Array(readFileSync(new URL(name, dir)));
    it(`${name}: whole passes; cut after its header, half-way or one byte short is refused naming the file`, async () => {
      const ok = await checkPhoto(file(whole, name), nodeDecoder);
      assert.ok(!('error' in ok), JSON.stringify(ok).slice(0, 200));
      assert.ok(ok.width > 0 && ok.height > 0);
      // 64 bytes holds every header's size field (PNG IHDR ends at 33, WebP VP8 frame header at 30, this JPEG's SOF at < 64 is
      // not guaranteed, so the JPEG cut goes to the first byte after its frame header instead).
      const afterHeader = name.endsWith('.jpg') ? jpegAfterFrameHeader(whole) : 64;
      for (const cut of [afterHeader, Math.floor(whole.length / 2), whole.length - 1]) {
        const r = await checkPhoto(file(whole.slice(0, cut), `cut-${name}`), nodeDecoder);
        assert.ok('error' in r, `${name} cut at ${cut} of ${whole.length} bytes was accepted as ${JSON.stringify(r).slice(0, 80)}`);
        assert.match(r.error, new RegExp(`cut-${name.replace('.', '\\.')}.*truncated`), r.error);
      }
    });
  }

  it('a complete PNG whose pixel data is damaged is refused by the decode, not stored', async () => {
    const png = new Uint8Array(readFileSync(new URL('quadrants.png', dir)));
    const idat = findChunk(png, 'IDAT');
    const bad = png.slice();
    for (let i = idat + 8 + 2; i < idat + 8 + 40; i++) bad[i] ^= 0x5a; // past the zlib header: the deflate stream breaks
    const r = await checkPhoto(file(bad, 'damaged.png'), nodeDecoder);
    assert.ok('error' in r, 'accepted');
    assert.match(r.error, /damaged\.png/);
  });

  it('addPhotos: a truncated photo among good ones is named and nothing of it is kept or saved', async () => {
    const { addPhotos, setPhotoDecoder } = await import('../../src/ui/studio/actions.ts');
    const { useStudioStore, saveProject } = await import('../../src/ui/studio/state.ts');
    const { createStore, keys } = await import('idb-keyval');
    setPhotoDecoder(nodeDecoder);
    (globalThis as { URL: typeof URL }).URL.createObjectURL ??= () => 'blob:test';
    useStudioStore.getState().set({ restored: true, photos: [] });
    const png = new Uint8Array(readFileSync(new URL('quadrants.png', dir)));
    await addPhotos([file(png, 'good.png'), file(png.slice(0, 64), 'short.png')]);
    const st = useStudioStore.getState();
    assert.deepEqual(
      st.photos.map((p) => p.name),
      ['good.png'],
    );
    assert.equal(st.photoErrors.length, 1);
    assert.match(st.photoErrors[0], /^short\.png is truncated/);
    await saveProject();
    const stored = (await keys(createStore('dreambooth-studio-project', 'project'))).map(String).filter((k) => k.startsWith('photo:'));
    assert.deepEqual(stored, [`photo:${st.photos[0].id}`], 'only the good photo is stored');
  });
});

describe("mask files given with the photos (kohya: a mask has its photo's name)", () => {
  it('splits photos from masks: a masks/ folder or a _mask, -mask, .mask suffix; a mask with no photo is an orphan', () => {
    const split = splitMasks(
      [
        { path: 'set/dog.jpg' },
        { path: 'set/masks/dog.png' },
        { path: 'cat.png' },
        { path: 'cat_mask.png' },
        { path: 'old-mask.webp' },
        { path: 'bird.mask.png' },
        { path: 'masks/fish.png' },
        { path: 'mask.png' },
      ],
      ['old.png'],
    );
    assert.deepEqual(split.photos, [0, 2, 7], 'dog, cat and a photo that is only called mask');
    assert.deepEqual(split.masks, [
      { index: 1, stem: 'dog' },
      { index: 3, stem: 'cat' },
      { index: 4, stem: 'old' },
    ]);
    assert.deepEqual(split.orphans, [5, 6], 'bird and fish have no photo');
  });

  it('addPhotos: dog_mask.png becomes the mask of dog.png (not a photo); a mask of another shape or cut short is refused by name', async () => {
    const { addPhotos, setPhotoDecoder } = await import('../../src/ui/studio/actions.ts');
    const { useStudioStore } = await import('../../src/ui/studio/state.ts');
    setPhotoDecoder(nodeDecoder);
    (globalThis as { URL: typeof URL }).URL.createObjectURL ??= () => 'blob:test';
    useStudioStore.getState().set({ restored: true, photos: [], photoErrors: [] });
    const png = new Uint8Array(readFileSync(new URL('quadrants.png', dir)));
    const tall = new Uint8Array(readFileSync(new URL('quadrants-o6.jpg', dir)));
    await addPhotos([file(png, 'dog.png'), file(png, 'dog_mask.png'), file(png, 'cat.png'), file(tall, 'cat-mask.jpg'), file(png, 'bird.mask.png')]);
    const st = useStudioStore.getState();
    assert.deepEqual(
      st.photos.map((p) => [p.name, !!p.mask]),
      [
        ['dog.png', true],
        ['cat.png', false],
      ],
    );
    assert.equal(st.photoErrors.length, 2, st.photoErrors.join(' | '));
    assert.match(st.photoErrors[0], /^bird\.mask\.png: named like a mask, but no photo bird\.\* was given/);
    assert.match(st.photoErrors[1], /^cat-mask\.jpg: a mask must have its photo's shape/);
    await addPhotos([file(png.slice(0, 64), 'dog-mask.png')]);
    assert.match(useStudioStore.getState().photoErrors[0], /^dog-mask\.png is truncated/, 'a mask for a photo on the page, cut short');
  });

  it("addPhotos: dog.txt is dog.png's caption (first line); a caption that is not UTF-8, empty or without its photo is refused by name", async () => {
    const { addPhotos, setPhotoDecoder } = await import('../../src/ui/studio/actions.ts');
    const { useStudioStore } = await import('../../src/ui/studio/state.ts');
    setPhotoDecoder(nodeDecoder);
    (globalThis as { URL: typeof URL }).URL.createObjectURL ??= () => 'blob:test';
    useStudioStore.getState().set({ restored: true, photos: [], photoErrors: [] });
    const png = new Uint8Array(readFileSync(new URL('quadrants.png', dir)));
    const text = (s: string) => new TextEncoder().encode(s);
    await addPhotos([
      file(png, 'dog.png'),
      file(text('sks dog, red collar\nnot read'), 'dog.txt'),
      file(png, 'cat.png'),
      file(Uint8Array.of(0x63, 0x61, 0x66, 0xe9), 'cat.txt'), // "café" in Latin-1
      file(png, 'bird.png'),
      file(text(' \n'), 'bird.txt'),
      file(text('a fox'), 'fox.txt'),
    ]);
    const st = useStudioStore.getState();
    assert.deepEqual(
      st.photos.map((p) => [p.name, p.caption]),
      [
        ['dog.png', 'sks dog, red collar'],
        ['cat.png', ''],
        ['bird.png', ''],
      ],
    );
    assert.deepEqual(st.photoErrors, [
      'cat.txt is not UTF-8 text: not used as the caption of cat.png (save it as UTF-8, or type the caption under the photo)',
      'bird.txt is empty: bird.png keeps the prompt (write its caption on the first line, or type it under the photo)',
      'fox.txt: a caption, but no photo fox.* was given: add it with its photo',
    ]);
  });
});

function findChunk(png: Uint8Array, type: string): number {
  const dv = new DataView(png.buffer, png.byteOffset);
  for (let p = 8; p + 8 <= png.length; p += 12 + dv.getUint32(p)) if (String.fromCharCode(...png.subarray(p + 4, p + 8)) === type) return p;
  throw new Error(`no ${type}`);
}

/** The offset just past a JPEG's SOFn segment (its size is known there, its pixels are not). */
function jpegAfterFrameHeader(b: Uint8Array): number {
  for (let p = 2; p + 4 <= b.length;) {
    const marker = b[p + 1];
    const len = (b[p + 2] << 8) | b[p + 3];
    if (marker >= 0xc0 && marker <= 0xcf && marker !== 0xc4 && marker !== 0xc8 && marker !== 0xcc) return p + 2 + len;
    p += 2 + len;
  }
  throw new Error('no SOF');
}
