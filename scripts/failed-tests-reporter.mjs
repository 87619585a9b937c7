// A node:test reporter that writes only the failures: each failed test's file, name (with the names of the
// suites around it) and error. scripts/test.sh prints this list after the TAP output, so the last lines of a
// CI log name what failed even when only its tail is kept.
// The names of the tests and suites enclosing the current event, by nesting level, per file: with
// --test-concurrency above 1 the events of two files interleave.
const namesByFile = new Map();

function errorText(error) {
  if (!error) return '(no error recorded)';
  // node:test wraps a test's error: the cause is what the test threw.
  const inner = error.cause ?? error;
  const text = inner instanceof Error ? (inner.stack ?? inner.message) : String(inner);
  const ours = text.split('\n').filter((line) => !/\(node:|at node:|<anonymous>\)?$/.test(line));
  return ours.slice(0, 30).join('\n');
}

export default async function* failedTests(source) {
  let failures = 0;
  for await (const event of source) {
    const { type, data } = event;
    if (!data || (type !== 'test:start' && type !== 'test:fail')) continue;
    const names = namesByFile.get(data.file) ?? [];
    namesByFile.set(data.file, names);
    if (type === 'test:start') names[data.nesting] = data.name;
    if (type !== 'test:fail') continue;
    names[data.nesting] = data.name;
    const error = data.details?.error;
    // A suite fails when a test inside it fails: that test is reported already.
    if (error?.failureType === 'subtestsFailed') continue;
    failures++;
    // (data.line is the transpiled file's, not the source's: the stack below has the source lines.)
    yield `not ok: ${names.slice(0, data.nesting + 1).join(' > ')}\n  in ${data.file ?? '(no file)'}\n`;
    yield `${errorText(error).replace(/^/gm, '    ')}\n\n`;
  }
  yield failures ? `${failures} failed\n` : '';
}
