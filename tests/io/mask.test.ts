// Loss masks follow their photo: the same crop, resize and mirror; R channel as the weight; transparent = 0;
// a mask of the photo's shape at another size is resized, another shape refused naming both files and sizes.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ImageError } from '../../src/io/image.ts';
import { maskImage, prepareMask } from '../../src/io/mask.ts';

/** A w x h mask with weight 1 where x < split, 0 elsewhere. */
const leftOf = (w: number, h: number, split: number) =>
  maskImage(
    Array.from({ length: w * h }, (_, i) => (i % w < split ? 1 : 0)),
    w,
    h,
  );
const names = { photoName: 'dog.jpg', maskName: 'masks/dog.png' };

describe('loss masks', () => {
  it('the R channel over the photo crop, resized to R x R, weights in [0, 1]', () => {
    // 8x4 photo, crop the right square (x 4..8); the mask is 1 left of x = 6: the crop's left half.
    const m = prepareMask(leftOf(8, 4, 6), { width: 8, height: 4 }, { resolution: 4, crop: { x: 4, y: 0, size: 4 }, ...names });
    assert.deepEqual(Array.from(m), [1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0]);
    // The centred crop (x 2..6) keeps the mask whole: all ones.
    assert.ok(prepareMask(leftOf(8, 4, 6), { width: 8, height: 4 }, { resolution: 2, ...names }).every((v) => v === 1));
  });

  it('mirrored with its photo; grey is a partial weight; transparent pixels are not trained', () => {
    const m = prepareMask(leftOf(4, 4, 2), { width: 4, height: 4 }, { resolution: 2, flip: true, ...names });
    assert.deepEqual(Array.from(m), [0, 1, 0, 1]);
    const grey = maskImage(new Array(16).fill(127 / 255), 4, 4);
    assert.ok(Math.abs(prepareMask(grey, { width: 4, height: 4 }, { resolution: 2, ...names })[0] - 127 / 255) < 1e-6);
    const clear = { width: 2, height: 2, data: new Uint8ClampedArray(16).fill(255).map((v, i) => (i % 4 === 3 ? 0 : v)) };
    assert.ok(prepareMask(clear, { width: 2, height: 2 }, { resolution: 2, ...names }).every((v) => v === 0));
  });

  it('a mask at another size of the same shape is resized onto the photo; another shape is refused by name', () => {
    const small = prepareMask(leftOf(8, 4, 6), { width: 16, height: 8 }, { resolution: 4, crop: { x: 8, y: 0, size: 8 }, ...names });
    assert.deepEqual(Array.from(small), [1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0]);
    assert.throws(
      () => prepareMask(leftOf(4, 4, 2), { width: 8, height: 4 }, { resolution: 4, ...names }),
      (e: unknown) => e instanceof ImageError && e.file === 'masks/dog.png' && /masks\/dog\.png: the mask is 4x4 but its photo dog\.jpg is 8x4/.test(e.message),
    );
  });
});
