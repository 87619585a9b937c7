// Strict command-line flags for every command, on node's util.parseArgs: an unknown flag or a typo is
// refused before any work, naming the closest known flag; a flag given twice, a value missing, or a value
// given to a switch are refused too. Negative numbers are accepted as values (`--lr -1` reaches the range
// check, which then says what the flag accepts). Numbers are read in decimal only (decimalProblem). `--help`
// and `-h` are answered before any parsing (main.ts, help.ts).
import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { decimalProblem } from '../pipeline/settings.ts';
import { jsonSyntaxProblem } from '../util/describe.ts';

/**
 * One flag of a command's table: how it parses, and what --help says of it (help.ts prints every entry: its
 * value, what it does, its default and range). A number flag's range here is also the one numberFlag checks.
 */
export interface FlagSpec {
  /** 'boolean': a switch; 'string': takes a value. */
  type: 'boolean' | 'string';
  /** The value's form in --help ('<path>', '<n>'); none for a switch. */
  arg?: string;
  /** What the flag does. */
  help?: string;
  /** Its default (a number flag's is what tableNumber returns when the flag is absent), or 'required'; a switch is off unless given. */
  default?: string | number;
  /** A number flag's range (numberFlag checks it). */
  min?: number;
  max?: number;
  integer?: boolean;
}

export type Flags = Record<string, FlagSpec>;
export type ParsedFlags = Record<string, string | boolean | undefined>;

export class UsageError extends Error {
  override name = 'UsageError';
}

/** Levenshtein distance (small strings: flags). */
function distance(a: string, b: string): number {
  const d = Array.from({ length: a.length + 1 }, (_, i) => [i, ...new Array<number>(b.length).fill(0)]);
  for (let j = 1; j <= b.length; j++) d[0][j] = j;
  for (let i = 1; i <= a.length; i++)
    for (let j = 1; j <= b.length; j++) d[i][j] = Math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] === b[j - 1] ? 0 : 1));
  return d[a.length][b.length];
}

/** The known flag nearest to `name` (by edit distance, or as a prefix), if any is close. */
export function closestFlag(name: string, known: Iterable<string>): string | null {
  let best: string | null = null;
  let bestD = Infinity;
  for (const k of known) {
    const d = k.startsWith(name) || name.startsWith(k) ? Math.min(1, distance(name, k)) : distance(name, k);
    if (d < bestD) {
      best = k;
      bestD = d;
    }
  }
  return best !== null && bestD <= Math.max(2, Math.floor(name.length / 3)) ? best : null;
}

/**
 * Parses `argv` against `flags`: returns the values by flag name and the positional arguments. `usage` is
 * appended to every refusal.
 */
export function parseFlags(argv: string[], flags: Flags, usage: string, o: { positionals?: number } = {}): { values: ParsedFlags; positionals: string[] } {
  const known = Object.keys(flags);
  const args: string[] = [];
  // Positionals are kept here, not handed to parseArgs, which would read a dash-led one ("-5") as an option.
  const positionals: string[] = [];
  const seen = new Set<string>();
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (!a.startsWith('-') || /^-\d/.test(a) || a === '-') {
      positionals.push(a);
      continue;
    }
    if (!a.startsWith('--')) throw new UsageError(`unknown option ${a}: options are written --name${suggest(a.replace(/^-+/, ''), known)}\n${usage}`);
    const [name, inline] = a.slice(2).split(/=(.*)/s, 2);
    const spec = flags[name];
    if (!spec) throw new UsageError(`unknown option --${name}${suggest(name, known)}\n${usage}`);
    if (seen.has(name)) throw new UsageError(`--${name} is given twice: give it once\n${usage}`);
    seen.add(name);
    if (spec.type === 'boolean') {
      if (inline !== undefined) throw new UsageError(`--${name} is a switch and takes no value (got "${inline}")\n${usage}`);
      args.push(a);
      continue;
    }
    let value = inline;
    if (value === undefined) {
      const next = argv[i + 1];
      // A value may be a negative number; any other dash-led word is the next flag, so this one has none.
      if (next === undefined || (next.startsWith('--') && !/^-\d/.test(next))) throw new UsageError(`--${name} needs a value\n${usage}`);
      value = next;
      i++;
    }
    args.push(`--${name}=${value}`);
  }
  const options = Object.fromEntries(Object.entries(flags).map(([k, f]) => [k, { type: f.type }]));
  const parsed = parseArgs({ args, options, strict: true, allowPositionals: false });
  const max = o.positionals ?? 0;
  if (positionals.length > max)
    throw new UsageError(`unexpected argument "${positionals[max]}"${max === 0 ? ': every value follows its --flag' : ''}\n${usage}`);
  return { values: parsed.values as ParsedFlags, positionals };
}

function suggest(name: string, known: string[]): string {
  const c = closestFlag(name, known);
  return c ? ` (did you mean --${c}?)` : ` (known: ${known.map((k) => `--${k}`).join(', ')})`;
}

/** A number flag: a finite number in decimal within [min, max] (integer when asked), or the default when absent. */
export function numberFlag(values: ParsedFlags, name: string, d: number, o: { min?: number; max?: number; integer?: boolean } = {}): number {
  const v = values[name];
  if (v === undefined) return d;
  if (typeof v !== 'string') throw new UsageError(`--${name} must be a number, got ${JSON.stringify(v)}`);
  const problem = decimalProblem(v, o.integer === true);
  if (problem) throw new UsageError(`--${name} ${problem}`);
  const x = Number(v);
  if (o.integer && !Number.isInteger(x)) throw new UsageError(`--${name} must be a whole number, got ${x}`);
  if ((o.min !== undefined && x < o.min) || (o.max !== undefined && x > o.max))
    throw new UsageError(
      `--${name} must be ${o.max === undefined ? `at least ${o.min}` : o.min === undefined ? `at most ${o.max}` : `from ${o.min} to ${o.max}`}, got ${x}`,
    );
  return x;
}

/** The range of a number flag in words ('whole, from 1 to 1000'), or '' when it has none. */
export function rangeText(f: { min?: number; max?: number; integer?: boolean }): string {
  const whole = f.integer ? 'whole' : '';
  const bounds =
    f.min !== undefined && f.max !== undefined
      ? `from ${f.min} to ${f.max}`
      : f.min !== undefined
        ? `at least ${f.min}`
        : f.max !== undefined
          ? `at most ${f.max}`
          : '';
  return [whole, bounds].filter(Boolean).join(', ');
}

/** --help's lines for a command's flags: each flag and its value, then what it does [default; range]. */
export function flagsHelp(flags: Flags): string[] {
  return Object.entries(flags).flatMap(([name, f]) => {
    const facts = [
      f.type === 'boolean' ? 'off unless given' : f.default === 'required' ? 'required' : f.default !== undefined ? `default ${f.default}` : '',
      rangeText(f),
    ];
    const said = facts.filter(Boolean).join('; ');
    return [`  --${name}${f.arg ? ` ${f.arg}` : ''}`, `      ${f.help ?? ''}${said ? ` [${said}]` : ''}`];
  });
}

/** A number flag read by its entry in the command's table: its default and range are the entry's. */
export function tableNumber(values: ParsedFlags, flags: Flags, name: string): number {
  const f = flags[name];
  if (typeof f?.default !== 'number') throw new Error(`--${name}: its table entry has no number default`);
  return numberFlag(values, name, f.default, f);
}

/** A string flag's value (undefined when absent). */
export function stringFlag(values: ParsedFlags, name: string): string | undefined {
  const v = values[name];
  return typeof v === 'string' ? v : undefined;
}

/** A JSON file a flag names, with a message naming the flag and the file when it cannot be read. */
export function readJsonFile(path: string, flag: string): Record<string, unknown> {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (e) {
    throw new UsageError(`${flag} ${path}: cannot read it (${(e as NodeJS.ErrnoException).code ?? (e as Error).message})`);
  }
  let j: unknown;
  try {
    j = JSON.parse(text);
  } catch (e) {
    throw new UsageError(`${flag} ${path}: invalid JSON (${jsonSyntaxProblem(e, text)}: the file is damaged or cut short; get it again)`, { cause: e });
  }
  if (typeof j !== 'object' || j === null || Array.isArray(j))
    throw new UsageError(`${flag} ${path}: expected a JSON object ({...}), got ${Array.isArray(j) ? 'an array' : JSON.stringify(j)}`);
  return j as Record<string, unknown>;
}
