import { defineConfig } from 'vite';

export default defineConfig({
  // JSX without a plugin: the automatic runtime.
  oxc: { jsx: { runtime: 'automatic' } },
  server: { host: '127.0.0.1', fs: { allow: ['.'] } },
  build: { target: 'es2022', outDir: 'dist', assetsInlineLimit: 0 },
  assetsInclude: ['**/*.safetensors'],
});
