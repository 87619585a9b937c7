// The source tree's layers only point down: a module may import its own layer and the layers below it,
// never one above (docs/ARCHITECTURE.md, "Layers"). Every src/**/*.ts(x) is scanned for what it pulls in:
// static imports and re-exports (type-only ones too: a type import still ties the lower layer's meaning
// to the upper one's), side-effect imports, dynamic import() and import('…').Type, `new URL('…',
// import.meta.url)` (workers) and import.meta.glob. A file in a folder the table does not name fails too,
// so a new folder gets a place in the order before it gets code.
import assert from 'node:assert/strict';
import { readdirSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join, posix } from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';

/** Bottom to top; folders in one tier may import each other. */
const LAYERS: readonly (readonly string[])[] = [
  ['util'], // plain CPU helpers (bytes, f16, Rng): no project imports
  ['gpu'],
  ['ops'],
  ['nn'],
  ['io'],
  ['selftest'], // kernel cases + goldens (gpu, ops, io/safetensors); the tools page runs them
  ['models'],
  ['sample'],
  ['store'],
  ['train'],
  ['export'],
  ['pipeline'],
  ['cli', 'studio'],
  ['ui', '.'], // '.': files directly in src/ (main.tsx, the page's entry)
];
const RANK = new Map(LAYERS.flatMap((tier, rank) => tier.map((folder) => [folder, rank] as const)));

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');

/** src/a/b.ts -> 'a'; src/main.tsx -> '.'. */
function layerOf(path: string): string {
  const parts = path.split('/');
  return parts.length > 2 ? parts[1] : '.';
}

/** Comments blanked (newlines kept, so line numbers hold); strings kept as they are. */
function withoutComments(text: string): string {
  return text.replace(
    /("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|\/\/[^\n]*|\/\*[\s\S]*?\*\//g,
    (all, str: string | undefined) => str ?? all.replace(/[^\n]/g, ' '),
  );
}

const SPECIFIERS: readonly RegExp[] = [
  // import X / * as X / { … } / X, { … } [type] from '…'; export { … } / * / * as X [type] from '…'
  /^[ \t]*(?:import|export)[ \t]+(?:type[ \t]+)?(?:[\w$]+[ \t]*,[ \t]*)?(?:\{[^}]*\}|\*(?:[ \t]+as[ \t]+[\w$]+)?|[\w$]+)\s*from[ \t]*(['"])([^'"\n]+)\1/gm,
  /^[ \t]*import[ \t]*(['"])([^'"\n]+)\1/gm, // side effect
  /\bimport\s*\(\s*(['"])([^'"\n]+)\1/g, // dynamic import() and import('…').Type
  /\bnew\s+URL\s*\(\s*(['"])([^'"\n]+)\1\s*,\s*import\.meta\.url/g, // workers and assets
  /\bimport\.meta\.glob\s*\(\s*(['"])([^'"\n]+)\1/g,
];

interface Violation {
  file: string;
  /** 0: the file as a whole. */
  line: number;
  spec: string;
  why: string;
}

/** Upward (or unplaced) imports of the given sources, by repository-relative path ('src/…'). */
function layerViolations(files: ReadonlyMap<string, string>): Violation[] {
  const out: Violation[] = [];
  for (const [file, text] of files) {
    const from = layerOf(file);
    const fromRank = RANK.get(from);
    if (fromRank === undefined) {
      out.push({ file, line: 0, spec: '', why: `src/${from}/ is in no layer: give it a place in LAYERS (tests/layers.test.ts) and docs/ARCHITECTURE.md` });
      continue;
    }
    const code = withoutComments(text);
    for (const re of SPECIFIERS) {
      for (const m of code.matchAll(re)) {
        const spec = m[2];
        // Packages ('react', 'webgpu') are outside the layers; '/x' is relative to the project root (Vite).
        if (!spec.startsWith('.') && !spec.startsWith('/')) continue;
        const target = spec.startsWith('/') ? posix.normalize(spec.slice(1)) : posix.join(posix.dirname(file), spec);
        const line0 = () => code.slice(0, m.index).split('\n').length;
        // lab/ (the demo-model lab, lab/demo-model/README.md) sits on top of the product: it may import src/, never
        // the other way round, so nothing the product runs depends on a lab.
        if (target.startsWith('lab/'))
          out.push({ file, line: line0(), spec, why: `src/ imports lab/ (${target}): the product never depends on a lab (the lab imports src/)` });
        if (!target.startsWith('src/')) continue;
        const to = layerOf(target);
        const toRank = RANK.get(to);
        const line = code.slice(0, m.index).split('\n').length;
        if (toRank === undefined) out.push({ file, line, spec, why: `imports src/${to}/, which is in no layer` });
        else if (toRank > fromRank) out.push({ file, line, spec, why: `${from}/ (layer ${fromRank}) imports ${to}/ (layer ${toRank}), a layer above it` });
      }
    }
  }
  return out;
}

function sourceFiles(dir = 'src'): string[] {
  return readdirSync(join(ROOT, dir), { withFileTypes: true }).flatMap((e) => {
    const path = `${dir}/${e.name}`;
    if (e.isDirectory()) return sourceFiles(path);
    return /\.tsx?$/.test(e.name) ? [path] : [];
  });
}

const describeViolation = (v: Violation) => `${v.file}${v.line ? `:${v.line} import '${v.spec}'` : ''}: ${v.why}`;

describe('layers: imports only point down', () => {
  it('no file under src/ imports a layer above its own', () => {
    const files = new Map(sourceFiles().map((f) => [f, readFileSync(join(ROOT, f), 'utf8')]));
    assert.ok(files.size > 50, `found only ${files.size} source files under src/`);
    const bad = layerViolations(files);
    assert.deepEqual(bad.map(describeViolation), [], `upward imports:\n${bad.map(describeViolation).join('\n')}`);
  });

  it('the scan sees every form of import, ignores comments and strings, and names the file, line and import', () => {
    const files = new Map([
      ['src/models/a.ts', "import { Rng } from '../train/rng.ts';"],
      ['src/models/b.ts', "// a note\nimport type {\n  TensorProvider,\n} from '../export/provider.ts';"],
      ['src/models/c.ts', "export * as x from '../export/x.ts';\nexport { y } from '../nn/y.ts';"],
      ['src/io/d.ts', "const m = await import('../store/snapshot.ts');\ntype G = import('../gpu/device.ts').Gpu;"],
      ['src/gpu/e.ts', "import '../ops/side.ts';\nimport def, { z } from '../util/z.ts';"],
      ['src/studio/f.ts', "new Worker(new URL('../ui/w.ts', import.meta.url));\nconst g = import.meta.glob('/src/ui/*.tsx');"],
      ['src/util/g.ts', "// import x from '../gpu/device.ts'\n/* import('../ops/x.ts') */\nconst s = \"import y from '../io/y.ts'\";"],
      ['src/newdir/h.ts', ''],
      ['src/train/i.ts', "import { q } from '../newdir/q.ts';\nimport React from 'react';"],
      ['src/train/j.ts', "import { p } from '../../lab/demo-model/pretrain.ts';"],
      ['src/cli/k.ts', "const m = await import('../../lab/demo-model/cli.ts');"],
    ]);
    assert.deepEqual(layerViolations(files).map(describeViolation), [
      "src/models/a.ts:1 import '../train/rng.ts': models/ (layer 6) imports train/ (layer 9), a layer above it",
      "src/models/b.ts:2 import '../export/provider.ts': models/ (layer 6) imports export/ (layer 10), a layer above it",
      "src/models/c.ts:1 import '../export/x.ts': models/ (layer 6) imports export/ (layer 10), a layer above it",
      "src/io/d.ts:1 import '../store/snapshot.ts': io/ (layer 4) imports store/ (layer 8), a layer above it",
      "src/gpu/e.ts:1 import '../ops/side.ts': gpu/ (layer 1) imports ops/ (layer 2), a layer above it",
      "src/studio/f.ts:1 import '../ui/w.ts': studio/ (layer 12) imports ui/ (layer 13), a layer above it",
      "src/studio/f.ts:2 import '/src/ui/*.tsx': studio/ (layer 12) imports ui/ (layer 13), a layer above it",
      'src/newdir/h.ts: src/newdir/ is in no layer: give it a place in LAYERS (tests/layers.test.ts) and docs/ARCHITECTURE.md',
      "src/train/i.ts:1 import '../newdir/q.ts': imports src/newdir/, which is in no layer",
      "src/train/j.ts:1 import '../../lab/demo-model/pretrain.ts': src/ imports lab/ (lab/demo-model/pretrain.ts): the product never depends on a lab (the lab imports src/)",
      "src/cli/k.ts:1 import '../../lab/demo-model/cli.ts': src/ imports lab/ (lab/demo-model/cli.ts): the product never depends on a lab (the lab imports src/)",
    ]);
  });
});

// ------------------------------------------------------------------------------------------------ sizes
//
// Rooms a newcomer can read: no source file over MAX_FILE_LINES lines, no function (declaration, method,
// arrow or expression, nested ones counted on their own too) over MAX_FUNCTION_LINES, first line to last.
// Functions are found by parsing, with the classic TypeScript API that ESLint already installs
// (scripts/eslint-typescript: the root's TypeScript 7 has no JavaScript API).

const MAX_FILE_LINES = 800;
const MAX_FUNCTION_LINES = 120;

/**
 * Known rooms still too big, each named exactly and in files someone else was reworking when the check came in
 * (issue 45, "Smaller rooms"): split the room, then delete its line here (a line that no longer matches fails).
 */
const OVERSIZE_KNOWN: ReadonlyMap<string, string> = new Map<string, string>([]);

interface Oversize {
  /** 'path' for a file, 'path#name' for a function. */
  key: string;
  lines: number;
  line: number;
}

const classicTs = (): typeof import('../scripts/eslint-typescript/node_modules/typescript') =>
  createRequire(import.meta.url)(createRequire(join(ROOT, 'scripts/eslint-typescript/package.json')).resolve('typescript'));

/** Files over MAX_FILE_LINES and functions over MAX_FUNCTION_LINES among the given sources. */
function oversize(files: ReadonlyMap<string, string>, ts = classicTs()): Oversize[] {
  const out: Oversize[] = [];
  for (const [file, text] of files) {
    const lines = text.split('\n').length - (text.endsWith('\n') ? 1 : 0);
    if (lines > MAX_FILE_LINES) out.push({ key: file, lines, line: 0 });
    const sf = ts.createSourceFile(file, text, ts.ScriptTarget.Latest, true, file.endsWith('.tsx') ? ts.ScriptKind.TSX : ts.ScriptKind.TS);
    const visit = (n: import('../scripts/eslint-typescript/node_modules/typescript').Node): void => {
      if (ts.isFunctionLike(n) && 'body' in n && n.body) {
        const first = sf.getLineAndCharacterOfPosition(n.getStart(sf)).line;
        const span = sf.getLineAndCharacterOfPosition(n.end).line - first + 1;
        const name = n.name && ts.isIdentifier(n.name) ? n.name.text : ts.isVariableDeclaration(n.parent) ? n.parent.name.getText(sf) : '(anonymous)';
        if (span > MAX_FUNCTION_LINES) out.push({ key: `${file}#${name}`, lines: span, line: first + 1 });
      }
      ts.forEachChild(n, visit);
    };
    visit(sf);
  }
  return out;
}

describe('sizes: files and functions a newcomer can read', () => {
  it(`no file under src/ over ${MAX_FILE_LINES} lines, no function over ${MAX_FUNCTION_LINES} (beyond the named known ones)`, () => {
    const files = new Map(sourceFiles().map((f) => [f, readFileSync(join(ROOT, f), 'utf8')]));
    const found = oversize(files);
    const fmt = (o: Oversize) => `${o.key}${o.line ? ` (line ${o.line})` : ''}: ${o.lines} lines`;
    const unknown = found.filter((o) => !OVERSIZE_KNOWN.has(o.key));
    assert.deepEqual(unknown.map(fmt), [], `over the limits (split them):\n${unknown.map(fmt).join('\n')}`);
    const stale = [...OVERSIZE_KNOWN.keys()].filter((k) => !found.some((o) => o.key === k));
    assert.deepEqual(stale, [], `within the limits now: delete these lines from OVERSIZE_KNOWN:\n${stale.join('\n')}`);
  });

  it('the scan counts a file one line over, functions of every kind one line over, and not one at the limit', () => {
    const body = (n: number) => Array.from({ length: n - 2 }, (_, i) => `  x += ${i};`).join('\n');
    const files = new Map([
      ['src/a.ts', `${'\n'.repeat(MAX_FILE_LINES)}`],
      ['src/b.ts', `${'//\n'.repeat(MAX_FILE_LINES + 1)}`],
      ['src/c.ts', `export function f() {\n${body(MAX_FUNCTION_LINES + 1)}\n}\nfunction g() {\n${body(MAX_FUNCTION_LINES)}\n}\n`],
      ['src/d.ts', `class K {\n  m() {\n${body(MAX_FUNCTION_LINES + 1)}\n  }\n}\nconst h = () => {\n${body(MAX_FUNCTION_LINES + 1)}\n};\n`],
      ['src/e.tsx', `export function P() {\n${body(MAX_FUNCTION_LINES)}\n  return <div />;\n}\n`],
    ]);
    assert.deepEqual(
      oversize(files).map((o) => `${o.key}:${o.lines}`),
      ['src/b.ts:801', 'src/c.ts#f:121', 'src/d.ts#m:121', 'src/d.ts#h:121', 'src/e.tsx#P:121'],
    );
  });
});
