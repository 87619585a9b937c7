// The loss-mask editor of one photo (masked loss, issue 15): the photo's training crop with the mask painted
// over it, white where the subject is (its loss counts), black where it is not (ignored). The mask covers the
// whole photo at up to MASK_SIDE px on its long side (the run resizes it onto the photo and takes it through
// the same crop), and is kept with the photo as a PNG: opaque white for the subject, transparent elsewhere
// (read as black: the run composites a mask over black, and kohya's R channel of a transparent black pixel is
// 0). A brush paints subject or background; Fill, Clear and Invert act on the whole mask (also from the
// keyboard). Where the mask keeps a pixel out of the loss the view darkens the photo; the brush's outline
// follows the pointer. The editor is a modal dialog over the page (Escape closes it), so the photos stay
// where they are.
import { useEffect, useRef, useState, type PointerEvent } from 'react';
import { setPhotoMask } from './actions.ts';
import type { PhotoItem } from './state.ts';

/** Long side of the stored mask, in pixels (a mask weight is averaged over 8x8 pixels of a 512 px crop anyway). */
export const MASK_SIDE = 512;
/** Side of the on-screen view of the crop, in CSS pixels. */
const VIEW = 320;

/** The mask's size for a photo: the photo's shape, the long side at most MASK_SIDE. */
export function maskSize(p: Pick<PhotoItem, 'width' | 'height'>): { width: number; height: number } {
  const k = Math.min(1, MASK_SIDE / Math.max(p.width, p.height));
  return { width: Math.max(1, Math.round(p.width * k)), height: Math.max(1, Math.round(p.height * k)) };
}

type Tool = 'subject' | 'background';

/** The photo upright and its mask canvas: the saved mask, else all subject (white: the whole photo trains). */
function useMaskCanvas(p: PhotoItem, size: { width: number; height: number }) {
  const mask = useRef<HTMLCanvasElement | null>(null);
  const photo = useRef<ImageBitmap | null>(null);
  const [ready, setReady] = useState(false);
  const [error, setError] = useState<string | null>(null);
  useEffect(() => {
    let live = true;
    void (async () => {
      try {
        const bitmap = await createImageBitmap(p.blob);
        const canvas = document.createElement('canvas');
        canvas.width = size.width;
        canvas.height = size.height;
        const ctx = canvas.getContext('2d')!;
        if (p.mask) ctx.drawImage(await createImageBitmap(p.mask), 0, 0, size.width, size.height);
        else {
          ctx.fillStyle = '#fff';
          ctx.fillRect(0, 0, size.width, size.height);
        }
        if (!live) return;
        photo.current = bitmap;
        mask.current = canvas;
        setReady(true);
      } catch (e) {
        if (live) setError(`Could not open ${p.name} for painting: ${(e as Error).message}`);
      }
    })();
    return () => {
      live = false;
    };
  }, [p.blob, p.mask, p.name, size.width, size.height]);
  return { mask, photo, ready, error, setError };
}

/**
 * Draws the view: the crop of the photo, darkened where the mask keeps it out of the loss, and the brush's
 * outline (radius `brush` view px) at `pointer`, light over dark so it shows on any photo.
 */
function drawView(
  c: HTMLCanvasElement,
  photo: ImageBitmap,
  mask: HTMLCanvasElement,
  crop: PhotoItem['crop'],
  k: number,
  pointer: { x: number; y: number } | null,
  brush: number,
): void {
  const ctx = c.getContext('2d')!;
  const { x, y, size: s } = crop;
  ctx.drawImage(photo, x, y, s, s, 0, 0, VIEW, VIEW);
  // A dark veil with the subject (the mask's opaque part) cut out of it, over the photo.
  const veil = document.createElement('canvas');
  veil.width = VIEW;
  veil.height = VIEW;
  const v = veil.getContext('2d')!;
  v.fillStyle = 'rgba(20, 24, 32, 0.7)';
  v.fillRect(0, 0, VIEW, VIEW);
  v.globalCompositeOperation = 'destination-out';
  v.drawImage(mask, x * k, y * k, s * k, s * k, 0, 0, VIEW, VIEW);
  ctx.drawImage(veil, 0, 0);
  if (!pointer) return;
  for (const [color, width] of [
    ['rgba(0, 0, 0, 0.8)', 3],
    ['#fff', 1],
  ] as const) {
    ctx.beginPath();
    ctx.arc(pointer.x, pointer.y, brush, 0, 2 * Math.PI);
    ctx.strokeStyle = color;
    ctx.lineWidth = width;
    ctx.stroke();
  }
}

/** Fill (all subject), Clear (all background) or Invert, on the whole mask. */
function whole(m: HTMLCanvasElement, op: 'fill' | 'clear' | 'invert'): void {
  const ctx = m.getContext('2d')!;
  if (op === 'clear') ctx.clearRect(0, 0, m.width, m.height);
  else {
    // Fill covers everything; invert is 'xor' with an opaque fill: alpha becomes 1 - alpha.
    ctx.globalCompositeOperation = op === 'invert' ? 'xor' : 'source-over';
    ctx.fillStyle = '#fff';
    ctx.fillRect(0, 0, m.width, m.height);
    ctx.globalCompositeOperation = 'source-over';
  }
}

function BrushTools({
  id,
  tool,
  setTool,
  brush,
  setBrush,
}: {
  id: string;
  tool: Tool;
  setTool: (t: Tool) => void;
  brush: number;
  setBrush: (b: number) => void;
}) {
  return (
    <fieldset className="row-wrap">
      <legend>Brush</legend>
      <label className="radio">
        <input type="radio" name={`tool-${id}`} checked={tool === 'subject'} onChange={() => setTool('subject')} /> Subject
      </label>
      <label className="radio">
        <input type="radio" name={`tool-${id}`} checked={tool === 'background'} onChange={() => setTool('background')} /> Background
      </label>
      <label>
        Brush size
        <input type="range" min={4} max={64} value={brush} onChange={(e) => setBrush(Number(e.target.value))} />
      </label>
    </fieldset>
  );
}

export function MaskEditor({ p, onClose }: { p: PhotoItem; onClose: () => void }) {
  const dialog = useRef<HTMLDialogElement>(null);
  const view = useRef<HTMLCanvasElement>(null);
  const painting = useRef(false);
  const pointer = useRef<{ x: number; y: number } | null>(null);
  const [tool, setTool] = useState<Tool>('subject');
  const [brush, setBrush] = useState(24);
  const size = maskSize(p);
  const k = size.width / p.width;
  const { mask, photo, ready, error, setError } = useMaskCanvas(p, size);
  useEffect(() => {
    const d = dialog.current;
    if (d && !d.open) d.showModal();
  }, []);

  const redraw = () => {
    if (view.current && photo.current && mask.current) drawView(view.current, photo.current, mask.current, p.crop, k, pointer.current, brush);
  };
  useEffect(redraw, [ready, brush]); // eslint-disable-line react-hooks/exhaustive-deps

  /** Follows the pointer (the outline) and, while the button is down, paints a dab there, in mask pixels. */
  const move = (e: PointerEvent<HTMLCanvasElement>, paint: boolean) => {
    const r = e.currentTarget.getBoundingClientRect();
    const fx = (e.clientX - r.left) / r.width;
    const fy = (e.clientY - r.top) / r.height;
    pointer.current = { x: fx * VIEW, y: fy * VIEW };
    const m = mask.current;
    if (paint && m) {
      const { x, y, size: s } = p.crop;
      const ctx = m.getContext('2d')!;
      // Subject: opaque white; background: erased to transparent.
      ctx.globalCompositeOperation = tool === 'subject' ? 'source-over' : 'destination-out';
      ctx.fillStyle = '#fff';
      ctx.beginPath();
      ctx.arc((x + fx * s) * k, (y + fy * s) * k, (brush / VIEW) * s * k, 0, 2 * Math.PI);
      ctx.fill();
      ctx.globalCompositeOperation = 'source-over';
    }
    redraw();
  };

  const save = async () => {
    const m = mask.current;
    if (!m) return;
    const blob = await new Promise<Blob | null>((res) => m.toBlob(res, 'image/png'));
    if (!blob) return setError('The browser could not encode the mask as PNG.');
    setPhotoMask(p.id, blob);
    onClose();
  };
  const act = (op: 'fill' | 'clear' | 'invert') => {
    if (mask.current) whole(mask.current, op);
    redraw();
  };
  const button = (label: string, onClick: () => void, primary = false) => (
    <button type="button" className={primary ? 'small' : 'small secondary'} disabled={!ready} onClick={onClick}>
      {label}
    </button>
  );

  return (
    <dialog ref={dialog} className="mask-editor" aria-label={`Loss mask of ${p.name}`} onClose={onClose}>
      <h3>Loss mask of {p.name}</h3>
      <p className="hint">
        Paint the subject: only the painted part of {p.name} counts in the loss (darkened: ignored). The brush needs a pointer; Fill, Clear and Invert work from
        the keyboard; Escape closes without saving.
      </p>
      {error && (
        <p className="error" role="alert">
          {error}
        </p>
      )}
      <canvas
        ref={view}
        width={VIEW}
        height={VIEW}
        className="mask-view"
        data-testid="mask-canvas"
        aria-label={`Mask painting area for ${p.name}`}
        onPointerDown={(e) => {
          painting.current = true;
          e.currentTarget.setPointerCapture(e.pointerId);
          move(e, true);
        }}
        onPointerMove={(e) => move(e, painting.current)}
        onPointerUp={() => (painting.current = false)}
        onPointerCancel={() => (painting.current = false)}
        onPointerLeave={() => {
          pointer.current = null;
          redraw();
        }}
      />
      <BrushTools id={p.id} tool={tool} setTool={setTool} brush={brush} setBrush={setBrush} />
      <div className="row-wrap">
        {button('Fill', () => act('fill'))}
        {button('Clear', () => act('clear'))}
        {button('Invert', () => act('invert'))}
        {button('Save mask', () => void save(), true)}
        {p.mask && (
          <button
            type="button"
            className="small secondary"
            onClick={() => {
              setPhotoMask(p.id, null);
              onClose();
            }}
          >
            Remove mask
          </button>
        )}
        <button type="button" className="small secondary" onClick={onClose}>
          Cancel
        </button>
      </div>
    </dialog>
  );
}
