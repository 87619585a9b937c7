// The demo model the studio ships under public/demo-model/: a small model in the SD 1.x layout, pretrained
// from scratch by `npm run lab:pretrain` (lab/demo-model/pretrain.ts) on the procedural captioned scenes, as a diffusers
// folder (fp16 weights, configs, the CLIP tokenizer) with a manifest. The manifest names every file with its
// size and SHA-256, so a file the server lost, cut short or replaced is refused by name instead of loading
// as a broken model. lab/demo-model/scripts/ship-demo-model.ts writes it from a pretraining run.

/** The folder under public/ (served at the page's base URL). */
export const SHIPPED_DEMO_DIR = 'demo-model';
export const SHIPPED_DEMO_MANIFEST = 'manifest.json';
/** Its picture side when the manifest does not say (the `small` pretraining size). */
export const SHIPPED_DEMO_RESOLUTION = 64;

export interface ShippedDemoManifest {
  /** The name runs and exports carry (e.g. "demo-sd1-small"). */
  name: string;
  /** Picture side in px the model was pretrained at: the studio trains and samples the demo at it. */
  resolution: number;
  /** Pretraining stage and step the weights come from, and the run's settings (what README says it is). */
  stage: string;
  step: number;
  settings: Record<string, unknown>;
  files: { path: string; size: number; sha256: string }[];
}

export class ShippedDemoError extends Error {
  override name = 'ShippedDemoError';
}

/** Lower-case hex SHA-256 of `bytes` (WebCrypto: the page, its worker and Node all have it). */
export async function sha256Hex(bytes: Uint8Array): Promise<string> {
  const digest = await crypto.subtle.digest('SHA-256', bytes as Uint8Array<ArrayBuffer>);
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, '0')).join('');
}

/** Checks a manifest's shape, so a stray or hand-edited file is named rather than half-read. */
export function checkShippedManifest(m: unknown, where: string): ShippedDemoManifest {
  const bad = (what: string) => new ShippedDemoError(`${where}: ${what}; rebuild it with lab/demo-model/scripts/ship-demo-model.ts`);
  if (!m || typeof m !== 'object') throw bad('not a JSON object');
  const o = m as Partial<ShippedDemoManifest>;
  if (typeof o.name !== 'string' || !o.name) throw bad('no "name"');
  if (!Number.isInteger(o.resolution) || o.resolution! < 8) throw bad('"resolution" is not a whole number of px');
  if (!Array.isArray(o.files) || !o.files.length) throw bad('no "files"');
  for (const f of o.files)
    if (typeof f?.path !== 'string' || !Number.isInteger(f.size) || typeof f.sha256 !== 'string' || !/^[0-9a-f]{64}$/.test(f.sha256) || f.path.includes('..'))
      throw bad(`a file entry ${JSON.stringify(f)} lacks a path, size or SHA-256`);
  return o as ShippedDemoManifest;
}

/**
 * Fetches the shipped demo model from `baseUrl` (the page's base, e.g. "/" or "https://host/studio/"): the
 * manifest, then every file it names, each checked against its size and SHA-256. Returns the files by their
 * path in the diffusers folder. `onProgress` gets bytes so far out of the total.
 */
export async function fetchShippedDemo(
  baseUrl: string,
  o: { fetch?: typeof fetch; onProgress?: (loaded: number, total: number) => void } = {},
): Promise<{ manifest: ShippedDemoManifest; files: Map<string, Uint8Array> }> {
  const get = o.fetch ?? fetch;
  const url = (path: string) => `${baseUrl.replace(/\/?$/, '/')}${SHIPPED_DEMO_DIR}/${path}`;
  const fetchBytes = async (path: string): Promise<Uint8Array> => {
    let res: Response;
    try {
      res = await get(url(path));
    } catch (e) {
      throw new ShippedDemoError(
        `the demo model's ${path} could not be fetched (${(e as Error).message}): check the connection to this page's server and try again`,
      );
    }
    if (!res.ok)
      throw new ShippedDemoError(
        `the demo model's ${path} is missing from this page's server (HTTP ${res.status}): it ships in public/${SHIPPED_DEMO_DIR}/, so serve the studio with npm start or a full npm run build`,
      );
    return new Uint8Array(await res.arrayBuffer());
  };
  let parsed: unknown;
  const manifestBytes = await fetchBytes(SHIPPED_DEMO_MANIFEST);
  try {
    parsed = JSON.parse(new TextDecoder().decode(manifestBytes));
  } catch {
    throw new ShippedDemoError(
      `the demo model's ${SHIPPED_DEMO_MANIFEST} is not JSON: the server sent something else (is ${url(SHIPPED_DEMO_MANIFEST)} served?)`,
    );
  }
  const manifest = checkShippedManifest(parsed, `the demo model's ${SHIPPED_DEMO_MANIFEST}`);
  const total = manifest.files.reduce((a, f) => a + f.size, 0);
  let loaded = 0;
  const files = new Map<string, Uint8Array>();
  for (const f of manifest.files) {
    const bytes = await fetchBytes(f.path);
    if (bytes.length !== f.size)
      throw new ShippedDemoError(
        `the demo model's ${f.path} is ${bytes.length} bytes, not the ${f.size} its manifest says: the download was cut short or the file replaced; reload the page`,
      );
    if ((await sha256Hex(bytes)) !== f.sha256)
      throw new ShippedDemoError(
        `the demo model's ${f.path} does not match its manifest's SHA-256: the file on the server is damaged or was replaced; reload the page`,
      );
    files.set(f.path, bytes);
    loaded += bytes.length;
    o.onProgress?.(loaded, total);
  }
  return { manifest, files };
}
