// Byte counts for people, and sizes as people write them. The one formatter of the project: every message,
// progress line and gauge uses it.

const UNITS = ['KiB', 'MiB', 'GiB', 'TiB'] as const;

/**
 * "1.5 GiB", "300 bytes". `digits` decimals (1 by default); `exact` appends the byte count for logs
 * ("64.0 MiB (67108864 bytes)"); `unit` fixes the unit ("0.4 MiB").
 */
export function formatBytes(n: number, o: { digits?: number; exact?: boolean; unit?: (typeof UNITS)[number] } = {}): string {
  if (!Number.isFinite(n)) return `${n} bytes`;
  // A fixed unit keeps columns of a progress line comparable from line to line.
  if (o.unit) return `${(n / 1024 ** (UNITS.indexOf(o.unit) + 1)).toFixed(o.digits ?? 1)} ${o.unit}`;
  if (Math.abs(n) < 1024) return `${n} bytes`;
  let v = n / 1024;
  let u = 0;
  while (Math.abs(v) >= 1024 && u < UNITS.length - 1) {
    v /= 1024;
    u++;
  }
  const s = `${v.toFixed(o.digits ?? 1)} ${UNITS[u]}`;
  return o.exact ? `${s} (${n} bytes)` : s;
}

const SIZE_UNITS: Record<string, number> = { b: 1, kib: 2 ** 10, mib: 2 ** 20, gib: 2 ** 30, tib: 2 ** 40, kb: 1e3, mb: 1e6, gb: 1e9, tb: 1e12 };

/** "4GiB", "512 MiB", "3.5GB", a plain byte count; NaN when it cannot be read. */
export function parseBytes(s: string): number {
  const m = /^(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?$/i.exec(s.trim());
  if (!m) return NaN;
  return Math.round(Number(m[1]) * SIZE_UNITS[(m[2] ?? 'B').toLowerCase()]);
}
