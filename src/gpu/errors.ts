// Typed errors the engine throws, so callers (UI, CLI, training loop) can react to each kind.

export class NoWebGpuError extends Error {
  override name = 'NoWebGpuError';
}

export class GpuOutOfMemoryError extends Error {
  override name = 'GpuOutOfMemoryError';
  constructor(
    readonly bytes: number,
    readonly tag: string,
    readonly label: string,
    detail: string,
  ) {
    super(`GPU out of memory allocating ${bytes} bytes for ${tag} '${label}': ${detail}`);
  }
}

export class GpuDeviceLostError extends Error {
  override name = 'GpuDeviceLostError';
  constructor(
    readonly reason: string,
    message: string,
  ) {
    super(`GPU device lost (${reason}): ${message}`);
  }
}

export class GpuValidationError extends Error {
  override name = 'GpuValidationError';
}

/** A tensor reached an op with a shape or dtype the op cannot take. Names the op and the shapes. */
export class ShapeError extends Error {
  override name = 'ShapeError';
  constructor(op: string, detail: string) {
    super(`${op}: ${detail}`);
  }
}

export function fmtShape(shape: readonly number[]): string {
  return `[${shape.join(',')}]`;
}
