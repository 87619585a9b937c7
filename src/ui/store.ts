// The app shell's state (zustand): the GPU, its summary, and the self-test rows. The studio's own store is
// useStudioStore in studio/state.ts.
import { create } from 'zustand';
import type { AdapterSummary, Gpu } from '../gpu/device.ts';
import type { CaseResult } from '../selftest/runner.ts';

export type GpuStatus = { kind: 'loading' } | { kind: 'ready'; gpu: Gpu; adapter: AdapterSummary } | { kind: 'error'; title: string; message: string };

interface AppState {
  gpu: GpuStatus;
  results: CaseResult[];
  running: boolean;
  done: boolean;
  setGpu(g: GpuStatus): void;
  startRun(): void;
  addResult(r: CaseResult): void;
  finishRun(): void;
}

export const useAppStore = create<AppState>((set) => ({
  gpu: { kind: 'loading' },
  results: [],
  running: false,
  done: false,
  setGpu: (gpu) => set({ gpu }),
  startRun: () => set({ results: [], running: true, done: false }),
  addResult: (r) => set((s) => ({ results: [...s.results, r] })),
  finishRun: () => set({ running: false, done: true }),
}));
