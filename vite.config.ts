import { defineConfig } from 'vite';

export default defineConfig({
  // JSX without a plugin: the automatic runtime.
  oxc: { jsx: { runtime: 'automatic' } },
  server: { host: '127.0.0.1', fs: { allow: ['.'] } },
  build: {
    target: 'es2022',
    outDir: 'dist',
    assetsInlineLimit: 0,
    // The studio, and a small harness page that exposes browser-host pieces to the e2e tests.
    rollupOptions: { input: { main: 'index.html', harness: 'e2e/harness.html' } },
  },
  // The engine worker is an ES module (it imports the shaders and the engine like the page does).
  worker: { format: 'es' },
  assetsInclude: ['**/*.safetensors'],
});
