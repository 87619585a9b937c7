// The app shell's state (zustand): the GPU, its summary, and the self-test rows. The studio's own store is
// useStudioStore in studio/state.ts.
import { create } from 'zustand';
import type { AdapterSummary, Gpu } from '../gpu/device.ts';
import type { PhaseReport } from '../pipeline/progress.ts';
import type { CaseResult } from '../selftest/runner.ts';

export type GpuStatus = { kind: 'loading' } | { kind: 'ready'; gpu: Gpu; adapter: AdapterSummary } | { kind: 'error'; title: string; message: string };

interface AppState {
  gpu: GpuStatus;
  results: CaseResult[];
  running: boolean;
  done: boolean;
  /** Stop was pressed: the self-test ends after the case under way. */
  stopAsked: boolean;
  /** Cases checked of all, and the time left (pipeline/progress.ts). */
  progress: PhaseReport | null;
  setGpu(g: GpuStatus): void;
  startRun(total: number): void;
  addResult(r: CaseResult, progress: PhaseReport): void;
  askStop(): void;
  finishRun(): void;
}

export const useAppStore = create<AppState>((set) => ({
  gpu: { kind: 'loading' },
  results: [],
  running: false,
  done: false,
  stopAsked: false,
  progress: null,
  setGpu: (gpu) => set({ gpu }),
  startRun: (total) => set({ results: [], running: true, done: false, stopAsked: false, progress: { done: 0, total, etaSeconds: null, provisional: false } }),
  addResult: (r, progress) => set((s) => ({ results: [...s.results, r], progress })),
  askStop: () => set({ stopAsked: true }),
  finishRun: () => set({ running: false, done: true }),
}));
