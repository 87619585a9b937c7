// What the page does with a Blob itself: hands it to the user as a download, or draws a small thumbnail of it.

/** Downloads a Blob under `name` (an <a download> click). */
export function download(blob: Blob, name: string): void {
  const url = URL.createObjectURL(blob);
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

/** A small PNG of `blob` (at most 64 px a side) for the runs list; null where the browser cannot draw it. */
export async function thumbnailOf(blob: Blob): Promise<Blob | null> {
  try {
    const bmp = await createImageBitmap(blob);
    const scale = Math.min(1, 64 / Math.max(bmp.width, bmp.height));
    const [w, h] = [Math.max(1, Math.round(bmp.width * scale)), Math.max(1, Math.round(bmp.height * scale))];
    const canvas = new OffscreenCanvas(w, h);
    canvas.getContext('2d')!.drawImage(bmp, 0, 0, w, h);
    bmp.close();
    return await canvas.convertToBlob({ type: 'image/png' });
  } catch {
    return null;
  }
}
