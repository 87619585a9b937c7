// ESLint for the TypeScript in src/, tests/, e2e/, bench/ and scripts/ (npm run lint; scripts/test.sh runs it).
//
// TypeScript 7 and typescript-eslint: the project's `typescript` is 7 (the native port), whose package has no
// JavaScript compiler API; typescript-eslint's parser (and its rules' helpers) `require('typescript')` for that
// API (peer range >=4.8.4 <6.1.0). So:
// - scripts/eslint-typescript/ is a local package whose only dependency is the classic TypeScript 6.0. npm must
//   nest it (scripts/eslint-typescript/node_modules/typescript) because the root already holds `typescript` 7,
//   so it never claims node_modules/.bin/tsc: `npx tsc` stays TypeScript 7. (An npm alias at the root such as
//   "npm:typescript@6" would link its own `tsc` over 7's on the next npm install.)
// - package.json's "overrides" let typescript-eslint's peer `typescript` be the root's 7, so npm installs it.
// - Below, before typescript-eslint loads, the root `typescript` module is replaced in require's cache by
//   TypeScript 6, so every `require('typescript')` in this ESLint process (all CommonJS) gets the classic API.
//   The project service also requires `typescript/lib/tsserverlibrary`, which 7's package does not export (the
//   resolution fails before the cache is consulted), so that one request is resolved to TypeScript 6's file.
// The rule sets are the non-type-aware ones (tsc checks types), plus two type-aware rules for the project's many
// promises (a Web Worker behind Comlink, IndexedDB, streams, the GPU queue): no-floating-promises (a promise nobody
// awaits loses its rejection) and no-misused-promises (an async function where a caller expects a plain one, such
// as a React event handler). Those need a type-checked program: parserOptions.projectService builds it from
// tsconfig.json with the classic TypeScript 6 compiler API swapped in below.
import Module, { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
const classicRequire = createRequire(require.resolve('eslint-typescript/package.json'));
const classicTypeScript = classicRequire.resolve('typescript');
require(classicTypeScript);
require.cache[require.resolve('typescript')] = require.cache[classicTypeScript];
const classicServer = classicRequire.resolve('typescript/lib/tsserverlibrary');
const resolveFilename = Module._resolveFilename;
Module._resolveFilename = function (request, ...rest) {
  return request === 'typescript/lib/tsserverlibrary' ? classicServer : resolveFilename.call(this, request, ...rest);
};

const { defineConfig } = await import('eslint/config');
const { default: js } = await import('@eslint/js');
const { default: tseslint } = await import('typescript-eslint');
const { default: reactHooks } = await import('eslint-plugin-react-hooks');
const { default: prettier } = await import('eslint-config-prettier');

export default defineConfig(
  {
    ignores: ['dist/', '.cache/', 'bench/dist/', 'bench/results/', '.local/', '.dev/', 'test-results/', 'scripts/eslint-typescript/'],
  },
  {
    files: ['{src,tests,e2e,bench,scripts,lab}/**/*.{ts,tsx}', '*.ts', 'eslint.config.js'],
    extends: [js.configs.recommended, ...tseslint.configs.recommended],
    plugins: { 'react-hooks': reactHooks },
    rules: {
      'react-hooks/rules-of-hooks': 'error',
      'react-hooks/exhaustive-deps': 'error',
      // A leading underscore marks a binding kept on purpose (a skipped parameter, a key dropped by a rest pattern).
      '@typescript-eslint/no-unused-vars': [
        'error',
        { argsIgnorePattern: '^_', varsIgnorePattern: '^_', caughtErrorsIgnorePattern: '^_', destructuredArrayIgnorePattern: '^_', ignoreRestSiblings: true },
      ],
    },
  },
  {
    // Type-aware: every TypeScript file tsconfig.json includes.
    files: ['{src,tests,e2e,bench,scripts,lab}/**/*.{ts,tsx}', '*.ts'],
    languageOptions: { parserOptions: { projectService: true, tsconfigRootDir: import.meta.dirname } },
    rules: {
      // A deliberate fire-and-forget is written `void promise`, with a comment saying who handles its failure.
      // node:test's describe/it/test return promises the runner itself awaits and reports; a file registers them
      // at top level without awaiting (typescript-eslint's documented allowance for node:test).
      '@typescript-eslint/no-floating-promises': [
        'error',
        {
          allowForKnownSafeCalls: [
            { from: 'package', package: 'node:test', name: ['describe', 'it', 'test', 'suite', 'before', 'after', 'beforeEach', 'afterEach'] },
          ],
        },
      ],
      '@typescript-eslint/no-misused-promises': 'error',
    },
  },
  // Last: turns off the style rules that Prettier owns.
  prettier,
);
