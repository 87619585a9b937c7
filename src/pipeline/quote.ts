// The one quoting function for the scripts a job bundle generates. A value a user typed (prompt, hub id,
// revision, file name) reaches train.sh only as one POSIX single-quoted word: inside '...' the shell
// expands nothing ($(...), backticks, $VAR, globs, !, newlines are all literal), and the only character
// that cannot appear is ' itself, written as '\'' (close, an escaped quote, reopen). A NUL cannot be passed
// in any process argument, so it is refused rather than silently cut. ray_train.py never has values written
// into its source: it reads them from job.json / prompts.jsonl (JSON), so Python sees them unchanged.

/**
 * The first lines of every generated shell script: the interpreter, and shellcheck's two exceptions, both
 * notes on what shellQuote does on purpose: SC2016 ("expressions don't expand in single quotes": a $ or
 * backtick in a value must stay text) and SC1003 ("want to escape a single quote?": a value's own \' is
 * text, and a ' in it is written '\'' already). Every other check stays on
 * (tests/pipeline/script-quote.test.ts runs shellcheck on every script with hostile values).
 */
export const SCRIPT_HEAD: readonly string[] = [
  '#!/usr/bin/env bash',
  '# shellcheck disable=SC2016,SC1003 # typed values are single-quoted on purpose: everything in them stays text',
];

/** A value a script cannot carry (a NUL character). */
export class ScriptValueError extends Error {}

/** `s` as one shell word that bash and POSIX sh read back byte for byte. */
export function shellQuote(s: string, what = 'a value'): string {
  if (s.includes('\0')) throw new ScriptValueError(`${what} holds a NUL character, which no command-line argument can carry: remove it`);
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

/** `s` for a `#` comment line: line breaks and other control characters become spaces, so it cannot end the comment. */
export function shellComment(s: string): string {
  // eslint-disable-next-line no-control-regex
  return s.replace(/[\u0000-\u001f\u007f\u2028\u2029]/g, ' ');
}
