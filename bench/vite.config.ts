// Builds the benchmark page (bench/kernels.html) into bench/dist; run by bench/kernels.ts.
import { resolve } from 'node:path';
import { defineConfig } from 'vite';

export default defineConfig({
  root: resolve(import.meta.dirname, '..'),
  build: {
    outDir: resolve(import.meta.dirname, 'dist'),
    emptyOutDir: true,
    target: 'es2022',
    rollupOptions: { input: resolve(import.meta.dirname, 'kernels.html') },
  },
  assetsInclude: ['**/*.onnx'],
});
