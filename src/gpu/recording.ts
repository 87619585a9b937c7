// A recording WebGPU: a `GPU` object whose adapter is described by an AdapterProfile (src/gpu/profile.ts) and whose
// device executes nothing and records every compute dispatch at submit. `Gpu.create(recordingGpu(profile, sink),
// {...})` then runs the engine's real code on it: every kernel choice is made by the code that makes it on the
// profiled adapter, every dispatch reaches `sink` as it would reach the hardware's queue, and no memory is backed
// (buffers are sizes only; reads map zeros). This is the census's instrument (bench/census.ts): what it records is
// what the engine issues, not a model of it. It never runs a shader, so nothing it returns is a computed value.
//
// What a record holds, all decoded from what the engine handed the device:
//   pipeline    the pipeline label device.ts gives it: `${shader}:${entry}:${defs}` (defs parsed back);
//   workgroups  dispatchWorkgroups' x, y, z;  workgroupSize from the module's @workgroup_size (consts resolved);
//   uniforms    the `struct Params` of the module, read from the bound slot of the uniform buffer as written
//               before the submit;
//   bindings    each bound storage range's name, access and element type (the module's declarations) and bytes.
import { adapterInfoOf, type AdapterProfile } from './profile.ts';

export interface RecordedBinding {
  name: string;
  access: 'read' | 'read_write';
  type: string;
  bytes: number;
  /** Label of the buffer (the allocator's tag or tensor label). */
  label: string;
}

export interface RecordedDispatch {
  shader: string;
  entry: string;
  defs: Record<string, string | number | boolean>;
  workgroups: [number, number, number];
  workgroupSize: [number, number, number];
  uniforms: Record<string, number>;
  bindings: RecordedBinding[];
}

interface ModuleFacts {
  label: string;
  workgroupSize: Map<string, [number, number, number]>;
  uniforms: { name: string; type: string }[];
  bindings: Map<number, { name: string; access: 'read' | 'read_write'; type: string }>;
}

/** Parses what the census needs out of a generated WGSL module. */
export function moduleFacts(code: string, label = ''): ModuleFacts {
  // Integer constants: the defs prelude (`const BM: u32 = 64u;`) and the shader's own (`const NT = TR * TC;`).
  const exprs = new Map<string, string>();
  for (const m of code.matchAll(/const\s+(\w+)\s*(?::\s*u32\s*)?=\s*([^;]+);/g)) exprs.set(m[1], m[2]);
  const value = (e: string, depth = 0): number => {
    if (depth > 16) throw new Error(`recording: constant '${e}' nests too deep in ${label}`);
    const text = e.replace(/\b(\d+)u\b/g, '$1').replace(/\b[A-Za-z_]\w*\b/g, (id) => {
      const x = exprs.get(id);
      if (x === undefined) throw new Error(`recording: cannot resolve workgroup size term '${id}' in ${label}`);
      return `(${value(x, depth + 1)})`;
    });
    if (!/^[\d\s+\-*/()]+$/.test(text)) throw new Error(`recording: workgroup size '${e}' is not integer arithmetic in ${label}`);
    return Math.floor(Number(new Function(`return (${text});`)()));
  };
  const workgroupSize = new Map<string, [number, number, number]>();
  for (const m of code.matchAll(/@workgroup_size\(([^)]*)\)\s*fn\s+(\w+)/g)) {
    const [x, y = '1', z = '1'] = m[1].split(',');
    workgroupSize.set(m[2], [value(x), value(y), value(z)]);
  }
  const params = /struct\s+Params\s*\{([^}]*)\}/.exec(code);
  const uniforms = params ? [...params[1].matchAll(/(\w+)\s*:\s*(u32|i32|f32)/g)].map((m) => ({ name: m[1], type: m[2] })) : [];
  const bindings = new Map<number, { name: string; access: 'read' | 'read_write'; type: string }>();
  for (const m of code.matchAll(/@binding\((\d+)\)\s*var<storage,\s*(read|read_write)>\s*(\w+)\s*:\s*array<(.+)>;/g))
    bindings.set(Number(m[1]), { name: m[3], access: m[2] as 'read' | 'read_write', type: m[4] });
  return { label, workgroupSize, uniforms, bindings };
}

/** `shader:entry:a=1,b=f16,...` (device.ts's pipeline key) back into its parts. */
export function parsePipelineLabel(label: string): { shader: string; entry: string; defs: RecordedDispatch['defs'] } {
  const [shader, entry, ...rest] = label.split(':');
  const defs: RecordedDispatch['defs'] = {};
  for (const kv of rest.join(':').split(',').filter(Boolean)) {
    const eq = kv.indexOf('=');
    const v = kv.slice(eq + 1);
    defs[kv.slice(0, eq)] = v === 'true' ? true : v === 'false' ? false : /^\d+$/.test(v) ? Number(v) : v;
  }
  return { shader, entry, defs };
}

class RecBuffer {
  /** Contents kept only for uniform buffers (the census decodes them); other buffers are sizes only. */
  data: Uint8Array | null;
  mapState = 'unmapped';
  constructor(
    readonly size: number,
    readonly usage: number,
    readonly label: string,
  ) {
    this.data = usage & 0x40 /* UNIFORM */ ? new Uint8Array(size) : null;
  }
  async mapAsync(): Promise<void> {
    this.mapState = 'mapped';
  }
  getMappedRange(offset = 0, size?: number): ArrayBuffer {
    return new ArrayBuffer(size ?? this.size - offset);
  }
  unmap(): void {
    this.mapState = 'unmapped';
  }
  destroy(): void {}
}

interface Entry {
  binding: number;
  resource: { buffer: RecBuffer; offset?: number; size?: number };
}
interface RecPipeline {
  facts: ModuleFacts;
  entry: string;
  getBindGroupLayout(i: number): object;
}
interface RecBindGroup {
  entries: Entry[];
}
interface PendingDispatch {
  pipeline: RecPipeline;
  group: RecBindGroup;
  workgroups: [number, number, number];
}

class RecPass {
  private pipeline: RecPipeline | null = null;
  private group: RecBindGroup | null = null;
  constructor(private readonly out: PendingDispatch[]) {}
  setPipeline(p: RecPipeline): void {
    this.pipeline = p;
  }
  setBindGroup(_i: number, g: RecBindGroup): void {
    this.group = g;
  }
  dispatchWorkgroups(x: number, y = 1, z = 1): void {
    if (!this.pipeline || !this.group) throw new Error('recording: dispatch without a pipeline and bind group');
    this.out.push({ pipeline: this.pipeline, group: this.group, workgroups: [x, y, z] });
  }
  end(): void {}
}

class RecEncoder {
  readonly dispatches: PendingDispatch[] = [];
  beginComputePass(): RecPass {
    return new RecPass(this.dispatches);
  }
  copyBufferToBuffer(): void {}
  resolveQuerySet(): void {}
  clearBuffer(): void {}
  finish(): { dispatches: PendingDispatch[] } {
    return { dispatches: this.dispatches };
  }
}

/** The decoded record of one dispatch, its uniforms read from the uniform buffer's current contents. */
function decode(d: PendingDispatch): RecordedDispatch {
  const { shader, entry, defs } = parsePipelineLabel(d.pipeline.facts.label);
  const uniforms: Record<string, number> = {};
  const bindings: RecordedBinding[] = [];
  for (const e of d.group.entries) {
    const r = e.resource;
    const size = r.size ?? r.buffer.size - (r.offset ?? 0);
    if (e.binding === 0 && r.buffer.data) {
      const view = new DataView(r.buffer.data.buffer, r.offset ?? 0, size);
      d.pipeline.facts.uniforms.forEach((u, i) => {
        uniforms[u.name] = u.type === 'f32' ? view.getFloat32(4 * i, true) : u.type === 'i32' ? view.getInt32(4 * i, true) : view.getUint32(4 * i, true);
      });
      continue;
    }
    const decl = d.pipeline.facts.bindings.get(e.binding);
    if (!decl) throw new Error(`recording: ${d.pipeline.facts.label} binds @binding(${e.binding}), which its module does not declare`);
    bindings.push({ ...decl, bytes: size, label: r.buffer.label });
  }
  const workgroupSize = d.pipeline.facts.workgroupSize.get(d.pipeline.entry);
  if (!workgroupSize) throw new Error(`recording: no @workgroup_size for entry ${d.pipeline.entry} in ${d.pipeline.facts.label}`);
  return { shader, entry, defs, workgroups: d.workgroups, workgroupSize, uniforms, bindings };
}

function recordingDevice(profile: AdapterProfile, sink: (d: RecordedDispatch) => void) {
  const features = new Set(profile.features);
  return {
    features,
    limits: { ...profile.limits },
    lost: new Promise<never>(() => {}),
    label: `recording ${profile.name}`,
    addEventListener(): void {},
    pushErrorScope(): void {},
    popErrorScope: async () => null,
    destroy(): void {},
    createBuffer: (d: { size: number; usage: number; label?: string }) => new RecBuffer(d.size, d.usage, d.label ?? ''),
    createShaderModule: (d: { code: string; label?: string }) => ({ facts: moduleFacts(d.code, d.label ?? '') }),
    createComputePipeline: (d: { compute: { module: { facts: ModuleFacts }; entryPoint: string }; label?: string }): RecPipeline => ({
      facts: { ...d.compute.module.facts, label: d.label ?? d.compute.module.facts.label },
      entry: d.compute.entryPoint,
      getBindGroupLayout: () => ({}),
    }),
    createBindGroup: (d: { entries: Entry[] }): RecBindGroup => ({ entries: d.entries }),
    createCommandEncoder: () => new RecEncoder(),
    createQuerySet: () => ({ destroy(): void {} }),
    queue: {
      writeBuffer(b: RecBuffer, offset: number, src: ArrayBuffer | ArrayBufferView, srcOffset = 0, size?: number): void {
        if (!b.data) return;
        const bytes = ArrayBuffer.isView(src) ? new Uint8Array(src.buffer, src.byteOffset, src.byteLength) : new Uint8Array(src);
        // ArrayBuffer sources count srcOffset/size in bytes (typed arrays would count elements; device.ts passes bytes)
        b.data.set(bytes.subarray(srcOffset, size === undefined ? undefined : srcOffset + size), offset);
      },
      submit(cmds: { dispatches: PendingDispatch[] }[]): void {
        for (const c of cmds) for (const d of c.dispatches) sink(decode(d));
      },
      onSubmittedWorkDone: async () => undefined,
    },
  };
}

/**
 * A `GPU` (navigator.gpu's interface, the parts Gpu.create uses) whose one adapter is `profile` and whose device
 * records dispatches into `sink` instead of running them.
 */
export function recordingGpu(profile: AdapterProfile, sink: (d: RecordedDispatch) => void): GPU {
  // The WebGPU spec's flag constants, for hosts that have no WebGPU of their own (Node without the `webgpu` package).
  const g = globalThis as Record<string, unknown>;
  g.GPUBufferUsage ??= {
    MAP_READ: 1,
    MAP_WRITE: 2,
    COPY_SRC: 4,
    COPY_DST: 8,
    INDEX: 16,
    VERTEX: 32,
    UNIFORM: 64,
    STORAGE: 128,
    INDIRECT: 256,
    QUERY_RESOLVE: 512,
  };
  g.GPUMapMode ??= { READ: 1, WRITE: 2 };
  const features = new Set(profile.features);
  const adapter = {
    features,
    limits: { ...profile.limits },
    info: adapterInfoOf(profile),
    isFallbackAdapter: false,
    requestDevice: async () => recordingDevice(profile, sink),
  };
  return { requestAdapter: async () => adapter, getPreferredCanvasFormat: () => 'rgba8unorm' } as unknown as GPU;
}
