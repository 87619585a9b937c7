// Values and parse failures in the words of an error message. Whatever a file holds (a 200,000-deep array, a
// megabyte string, bytes that are not UTF-8) is described in a bounded number of characters without recursing
// into it, and a JSON syntax error is said in terms of where the text stops or goes wrong, never as the
// engine's own wording ("Unterminated string in JSON at position 24" names neither the file nor the cause).

/** At most this many levels of arrays and objects are shown; deeper ones are elided as `[...]` / `{...}`. */
const PREVIEW_DEPTH = 2;
/** At most this many items of an array or object are shown. */
const PREVIEW_ITEMS = 6;

function show(v: unknown, depth: number): string {
  if (v === undefined) return 'nothing';
  if (v === null || typeof v === 'boolean' || typeof v === 'number') return String(v);
  if (typeof v === 'bigint') return `${v}n`;
  if (typeof v === 'string') return JSON.stringify(v.length > 60 ? `${v.slice(0, 60)}...` : v);
  if (typeof v !== 'object') return typeof v;
  const array = Array.isArray(v);
  if (depth >= PREVIEW_DEPTH) return array ? '[...]' : '{...}';
  const count = array ? v.length : Object.keys(v).length;
  const items = array
    ? v.slice(0, PREVIEW_ITEMS).map((x) => show(x, depth + 1))
    : Object.entries(v)
        .slice(0, PREVIEW_ITEMS)
        .map(([k, x]) => `${JSON.stringify(k)}: ${show(x, depth + 1)}`);
  if (count > PREVIEW_ITEMS) items.push(`... ${count - PREVIEW_ITEMS} more`);
  return array ? `[${items.join(', ')}]` : `{${items.join(', ')}}`;
}

/** `v` for a message: JSON-like, at most `max` characters, nested values elided; never throws. */
export function preview(v: unknown, max = 80): string {
  const s = show(v, 0);
  return s.length > max ? `${s.slice(0, max - 3)}...` : s;
}

/** Whether JSON.parse's `message` for a text of `length` characters says the text ended too soon. */
function endedEarly(message: string, length: number): boolean {
  if (/Unterminated string|Unexpected end/.test(message)) return true;
  const at = /at position (\d+)/.exec(message);
  return at !== null && Number(at[1]) >= length;
}

/**
 * The offset of the first character that cannot be there, for messages that give none ("Unexpected token 'Y',
 * ... is not valid JSON"): the shortest prefix that fails other than by ending too soon ends with it. Prefixes
 * before it parse or only end early, prefixes past it fail inside, so a binary search finds it.
 */
function firstBadCharacter(text: string): number {
  const failsInside = (t: string) => {
    try {
      JSON.parse(t);
      return false;
    } catch (e) {
      return !endedEarly(e instanceof Error ? e.message : '', t.length);
    }
  };
  let [lo, hi] = [0, text.length];
  while (hi - lo > 1) {
    const mid = (lo + hi) >>> 1;
    if (failsInside(text.slice(0, mid))) hi = mid;
    else lo = mid;
  }
  return hi - 1;
}

/**
 * Why `text` did not parse as JSON (`e` is what JSON.parse threw), in plain words: where it stops early (a
 * file cut short) or the line and column of the first character that cannot be there.
 */
export function jsonSyntaxProblem(e: unknown, text: string): string {
  const message = e instanceof Error ? e.message : '';
  const end = text.trimEnd().length;
  if (end === 0) return 'it is empty';
  if (endedEarly(message, end)) return `it stops in the middle (after ${end} characters)`;
  const at = /at position (\d+)/.exec(message);
  // Locating by search parses up to 2 x log2(length) prefixes: done for texts up to 1 MiB.
  const pos = at ? Number(at[1]) : text.length <= 1 << 20 ? firstBadCharacter(text) : -1;
  if (pos < 0) return 'it is not valid JSON';
  const before = text.slice(0, pos);
  const line = before.split('\n').length;
  const column = pos - before.lastIndexOf('\n');
  return `it is not valid JSON at line ${line}, column ${column} (near ${JSON.stringify(text.slice(Math.max(0, pos - 10), pos + 10))})`;
}

/** The offset of the first byte that is not part of valid UTF-8 in `b`, or -1 when all of it is. */
export function firstNonUtf8(b: Uint8Array): number {
  for (let i = 0; i < b.length;) {
    const c = b[i];
    // Sequence length and the allowed range of the second byte (excludes overlongs, surrogates, > U+10FFFF).
    const [n, lo, hi] =
      c < 0x80
        ? [1, 0, 0]
        : c >= 0xc2 && c <= 0xdf
          ? [2, 0x80, 0xbf]
          : c === 0xe0
            ? [3, 0xa0, 0xbf]
            : c === 0xed
              ? [3, 0x80, 0x9f]
              : c >= 0xe1 && c <= 0xef
                ? [3, 0x80, 0xbf]
                : c === 0xf0
                  ? [4, 0x90, 0xbf]
                  : c >= 0xf1 && c <= 0xf3
                    ? [4, 0x80, 0xbf]
                    : c === 0xf4
                      ? [4, 0x80, 0x8f]
                      : [0, 0, 0];
    if (n === 0 || i + n > b.length) return i;
    if (n > 1 && (b[i + 1] < lo || b[i + 1] > hi)) return i;
    for (let k = 2; k < n; k++) if (b[i + k] < 0x80 || b[i + k] > 0xbf) return i;
    i += n;
  }
  return -1;
}

/**
 * How deeply `text`'s arrays and objects nest (brackets inside strings not counted), stopping once past
 * `limit`. A scan, not a parse: JSON.parse of very deep text (200,000 levels) takes seconds even to fail.
 */
export function jsonDepth(text: string, limit = Infinity): number {
  let depth = 0;
  let max = 0;
  for (let i = 0; i < text.length && max <= limit; i++) {
    const c = text.charCodeAt(i);
    if (c === 0x22) {
      // Skip the string: a backslash escapes the next character.
      for (i++; i < text.length && text.charCodeAt(i) !== 0x22; i++) if (text.charCodeAt(i) === 0x5c) i++;
    } else if (c === 0x5b || c === 0x7b) max = Math.max(max, ++depth);
    else if (c === 0x5d || c === 0x7d) depth--;
  }
  return max;
}
