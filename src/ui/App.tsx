import { useEffect } from 'react';
import { Gpu } from '../gpu/device.ts';
import { GpuDeviceLostError, NoWebGpuError } from '../gpu/errors.ts';
import { viteShaderSource } from '../gpu/shaders-vite.ts';
import { formatBytes } from '../util/bytes.ts';
import { describeCheck } from '../selftest/check.ts';
import { ALL_CASES } from '../selftest/cases/index.ts';
import { browserGolden } from '../selftest/browser.ts';
import { PhaseClock, phaseLine, type PhaseReport } from '../pipeline/progress.ts';
import { dtypesFor, notRunReason, runCase, type CaseResult } from '../selftest/runner.ts';
import { Generate } from './Generate.tsx';
import { Studio } from './studio/Studio.tsx';
import { useAppStore } from './store.ts';

const SHOWN_LIMITS = [
  'maxBufferSize',
  'maxStorageBufferBindingSize',
  'maxComputeWorkgroupStorageSize',
  'maxComputeInvocationsPerWorkgroup',
  'maxComputeWorkgroupsPerDimension',
  'maxStorageBuffersPerShaderStage',
];

declare global {
  interface Window {
    __selftest?: { done: boolean; results: CaseResult[]; adapter?: unknown };
  }
}

async function initGpu(): Promise<void> {
  const { setGpu } = useAppStore.getState();
  try {
    // Tensor cores are on where the start-up check passes; `?tools&tensorCores=0` turns them off.
    const tensorCores = new URLSearchParams(location.search).get('tensorCores') !== '0';
    const gpu = await Gpu.create(navigator.gpu, { shaders: viteShaderSource(), tensorCores, tensorCoreOptOut: 'the URL flag tensorCores=0' });
    gpu.onLost((e: GpuDeviceLostError) =>
      setGpu({ kind: 'error', title: 'The GPU device was lost', message: `${e.message}. Reload the page to start again.` }),
    );
    setGpu({ kind: 'ready', gpu, adapter: gpu.adapter });
    window.__selftest = { done: false, results: [], adapter: gpu.adapter };
    if (new URLSearchParams(location.search).has('autorun')) void runSelfTest();
  } catch (e) {
    const noWebGpu = e instanceof NoWebGpuError;
    setGpu({
      kind: 'error',
      title: noWebGpu ? 'WebGPU is not available' : 'Could not start the GPU',
      message: noWebGpu
        ? `${(e as Error).message} DreamBooth Studio trains on your GPU through WebGPU: use Chrome or Edge 113 or newer with hardware acceleration turned on (chrome://settings/system).`
        : String((e as Error).message ?? e),
    });
    window.__selftest = { done: true, results: [] };
  }
}

/** The cases the self-test runs on this GPU: (case, dtype) pairs; ?only=<text> keeps those whose family/name contains it. */
function selfTestCases(gpu: Gpu): { c: (typeof ALL_CASES)[number]; dtype: ReturnType<typeof dtypesFor>[number] }[] {
  const only = new URLSearchParams(location.search).get('only');
  return ALL_CASES.filter((k) => !only || `${k.family}/${k.name}`.includes(only)).flatMap((c) => dtypesFor(gpu, c).map((dtype) => ({ c, dtype })));
}

export async function runSelfTest(): Promise<void> {
  const st = useAppStore.getState();
  if (st.gpu.kind !== 'ready' || st.running) return;
  const gpu = st.gpu.gpu;
  const cases = selfTestCases(gpu);
  st.startRun(cases.length);
  const results: CaseResult[] = [];
  window.__selftest = { done: false, results, adapter: gpu.adapter };
  // The time left: each family's first case also loads its golden values and compiles its kernels, so the
  // pace comes from the cases after the first (pipeline/progress.ts).
  const clock = new PhaseClock(cases.length);
  const t0 = performance.now();
  for (const { c, dtype } of cases) {
    if (useAppStore.getState().stopAsked) break;
    const golden = await browserGolden(c.family).catch(() => null);
    const r = golden
      ? await runCase(gpu, c, dtype, golden)
      : { family: c.family, name: c.name, dtype, pass: false, checks: [], error: 'golden fixture failed to load', ms: 0 };
    results.push(r);
    useAppStore.getState().addResult(r, clock.at(results.length, (performance.now() - t0) / 1000));
  }
  useAppStore.getState().finishRun();
  window.__selftest = { done: true, results, adapter: gpu.adapter };
}

/** The check closest to (or furthest past) its tolerance, in one line. */
function worstCheck(r: CaseResult): string {
  const margin = (c: CaseResult['checks'][number]) => c.maxAbs / (c.tol.atol + c.tol.rtol + 1e-30);
  const worst = r.checks.reduce((a, b) => (margin(b) > margin(a) ? b : a), r.checks[0]);
  if (!worst) return 'no checks';
  return `${r.checks.length} checks; worst ${worst.label}: ${worst.maxAbs.toExponential(1)} (atol ${worst.tol.atol}, rtol ${worst.tol.rtol})`;
}

function AdapterPanel() {
  const g = useAppStore((s) => s.gpu);
  if (g.kind === 'loading') return <p role="status">Starting WebGPU…</p>;
  if (g.kind === 'error')
    return (
      <section className="error" role="alert" aria-labelledby="err-title">
        <h2 id="err-title">{g.title}</h2>
        <p>{g.message}</p>
      </section>
    );
  const a = g.adapter;
  return (
    <section aria-labelledby="adapter-title" data-testid="adapter">
      <h2 id="adapter-title">Your GPU</h2>
      {!g.gpu.hasF16 && (
        <p className="notice" role="note" data-testid="no-f16">
          This GPU does not offer <code>shader-f16</code>: the engine runs its f32 path, which is slower and needs twice the memory.
        </p>
      )}
      <dl className="grid">
        <dt>Vendor</dt>
        <dd>{a.vendor || 'unknown'}</dd>
        <dt>Architecture</dt>
        <dd>{a.architecture || 'unknown'}</dd>
        <dt>Description</dt>
        <dd>{a.description || a.device || 'unknown'}</dd>
        <dt>Compute precision</dt>
        <dd>{g.gpu.hasF16 ? 'f16 storage, f32 accumulation' : 'f32'}</dd>
        <dt>Tensor cores</dt>
        <dd data-testid="tensor-cores">{g.gpu.tensorCoreNote}</dd>
      </dl>
      <h3>Features</h3>
      <ul className="features">
        {a.features.map((f) => (
          <li key={f}>{f}</li>
        ))}
      </ul>
      <h3>Limits</h3>
      <dl className="grid">
        {SHOWN_LIMITS.map((k) => (
          <div key={k} className="row">
            <dt>{k}</dt>
            <dd>{k.includes('Size') ? formatBytes(a.limits[k] ?? 0) : String(a.limits[k] ?? '—')}</dd>
          </div>
        ))}
      </dl>
    </section>
  );
}

/** The self-test's line: the check under way and the time left while it runs, then what passed (or where it stopped). */
function selfTestStatus(
  s: { results: CaseResult[]; running: boolean; done: boolean; stopAsked: boolean; progress: PhaseReport | null },
  total: number,
): string {
  const failed = s.results.filter((r) => !r.pass).length;
  if (s.running && s.progress) return `${phaseLine('Kernel check', s.progress)}${s.stopAsked ? ' · stopping after this check' : ''}`;
  if (!s.done) return '';
  const stopped = s.results.length < total ? `Stopped after ${s.results.length} of ${total} kernel checks: ` : '';
  if (failed === 0) return `${stopped}${stopped ? 'all' : 'All'} ${s.results.length} kernel checks passed.`;
  return `${stopped}${failed} of ${s.results.length} kernel checks failed.`;
}

function SelfTestPanel() {
  const state = useAppStore();
  const { gpu, results, running, done } = state;
  if (gpu.kind !== 'ready') return null;
  const total = selfTestCases(gpu.gpu).length;
  const notRun = ALL_CASES.filter((c) => notRunReason(gpu.gpu, c) !== null);
  return (
    <section aria-labelledby="selftest-title">
      <h2 id="selftest-title">Kernel self-test</h2>
      <p>
        Runs every WGSL kernel on this GPU and compares it with PyTorch golden values and a reference implementation ({total} checks; several minutes on a
        software adapter).
      </p>
      <div className="row-wrap">
        <button type="button" onClick={() => void runSelfTest()} disabled={running} aria-describedby="selftest-status">
          {running ? 'Running…' : 'Run kernel self-test'}
        </button>
        <button type="button" className="secondary" onClick={() => state.askStop()} disabled={!running || state.stopAsked}>
          Stop
        </button>
      </div>
      {running && state.progress && <progress aria-label="Kernel checks" max={state.progress.total} value={state.progress.done} />}
      <p id="selftest-status" role="status" data-testid="selftest-status">
        {selfTestStatus(state, total)}
        {done && notRun.length > 0 && ` ${notRun.length} not run on this GPU: ${notRunReason(gpu.gpu, notRun[0])}.`}
      </p>
      {results.length > 0 && (
        <table>
          <thead>
            <tr>
              <th scope="col">Result</th>
              <th scope="col">Family</th>
              <th scope="col">Kernel case</th>
              <th scope="col">dtype</th>
              <th scope="col">Worst error</th>
              <th scope="col">ms</th>
            </tr>
          </thead>
          <tbody>
            {results.map((r, i) => (
              <tr key={i} className={r.pass ? 'pass' : 'fail'}>
                <td>{r.pass ? 'pass' : 'FAIL'}</td>
                <td>{r.family}</td>
                <td>{r.name}</td>
                <td>{r.dtype}</td>
                <td title={r.error ?? r.checks.map(describeCheck).join('\n')}>{r.error ? r.error.split('\n')[0] : worstCheck(r)}</td>
                <td>{r.ms.toFixed(0)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  );
}

function GeneratePanel() {
  const g = useAppStore((s) => s.gpu);
  return g.kind === 'ready' ? <Generate gpu={g.gpu} /> : null;
}

/** The GPU tools page (?tools): adapter details, the kernel self-test, text to image on the main thread. */
export function App() {
  const q = new URLSearchParams(location.search);
  return q.has('tools') || q.has('autorun') ? <Tools /> : <Studio />;
}

function Tools() {
  useEffect(() => {
    void initGpu();
  }, []);
  return (
    <main>
      <header>
        <h1>DreamBooth Studio: GPU tools</h1>
        <p>
          What this GPU offers, every kernel checked against golden values, and text to image. <a href="./">Back to the studio</a>
        </p>
      </header>
      <AdapterPanel />
      <SelfTestPanel />
      <GeneratePanel />
    </main>
  );
}
