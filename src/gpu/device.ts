// The GPU runtime: adapter + device with the adapter's maximum limits and the features we use,
// buffer allocation with accounting, a pipeline cache over specialised WGSL, batched dispatch,
// uploads and read-backs, and device-loss reporting. Host-agnostic: the host passes a GPU object
// (navigator.gpu in Chrome, the `webgpu` package's in Node) and a ShaderSource.

import { Allocator, sizeClass, type Tag } from './allocator.ts';
import { GpuDeviceLostError, GpuValidationError, NoWebGpuError, ShapeError } from './errors.ts';
import { fromF16Bits, toF16Bits } from '../util/half.ts';
import { kernel, kernelModule, orderBindings, packUniformsInto, uniformBytes, type BindingArgs, type KernelDecl, type UniformArgs } from './kernel.ts';
import { defsKey, type Defs, type ShaderSource } from './shaders.ts';
import { BYTES, numel, Tensor, type DType } from './tensor.ts';
import { checkTensorCores, tensorCoreDecision, type MatrixShape } from './tensorcore.ts';
import { gemmConfigProblem, type GemmConfig } from './gemm-config.ts';
import { adapterFacts, type AdapterFacts, type AdapterSummary } from './adapter.ts';
import { profileSummary, resolveTimestamps, startProfiling, type GpuProfile, type Profiling } from './timestamps.ts';
import type { CaptureSink } from './replay.ts';
import type { GpuOptions } from './options.ts';

export { defaultGemmConfig, GEMM_CONFIG_VALUES, gemmConfigProblem, type GemmConfig } from './gemm-config.ts';
export type { GpuProfile } from './timestamps.ts';

/** Limits we raise to the adapter's maximum when requesting the device. */
const RAISED_LIMITS = [
  'maxBufferSize',
  'maxStorageBufferBindingSize',
  'maxStorageBuffersPerShaderStage',
  'maxUniformBufferBindingSize',
  'maxComputeWorkgroupStorageSize',
  'maxComputeInvocationsPerWorkgroup',
  'maxComputeWorkgroupSizeX',
  'maxComputeWorkgroupSizeY',
  'maxComputeWorkgroupSizeZ',
  'maxComputeWorkgroupsPerDimension',
  'maxBindingsPerBindGroup',
] as const;

/** shaders/fill.wgsl: sets `words` 32-bit words of `out` to `value`. */
const FILL = kernel({
  shader: 'fill',
  entry: 'fill',
  uniforms: [
    { name: 'words', type: 'u32' },
    { name: 'value', type: 'u32' },
  ],
  bindings: [{ name: 'out', type: 'u32', access: 'read_write' }],
});

/** Alignment limits, where smaller is better: we take the adapter's. */
const ALIGNMENT_LIMITS = ['minStorageBufferOffsetAlignment', 'minUniformBufferOffsetAlignment'] as const;

/**
 * Requested where the adapter offers them. `chromium-experimental-subgroup-matrix` (cooperative matrices: tensor
 * cores on NVIDIA's Vulkan driver, simdgroup matrices on Metal) is offered only with Dawn's `allow_unsafe_apis`
 * toggle (node.ts; Chrome's --enable-unsafe-webgpu); lavapipe and SwiftShader do not offer it.
 */
const WANTED_FEATURES = ['shader-f16', 'subgroups', 'timestamp-query', 'chromium-experimental-subgroup-matrix'] as const;

export type { GpuOptions } from './options.ts';
export type { AdapterFacts, AdapterSummary } from './adapter.ts';

/** A buffer range bound to one shader binding. */
export interface BufferWindow {
  buffer: GPUBuffer;
  offset: number;
  size: number;
}

export type Bindable = Tensor | BufferWindow;

/** One call of a declared kernel (src/gpu/kernel.ts): uniforms and bindings by name. */
export interface KernelCall<D extends KernelDecl> {
  defs: Defs;
  uniforms: UniformArgs<D>;
  bindings: BindingArgs<D, Bindable>;
  workgroups: readonly [number, number?, number?];
}

export interface GpuStats {
  dispatches: number;
  buffersCreated: number;
  bindGroupsCreated: number;
  /** Bind groups held by the cache now (at most bindGroupCacheMax). */
  bindGroupsCached: number;
}

/** Uniform slots per flush before the ring must grow (or the recording be submitted early). */
const UNIFORM_RING_START = 64 * 1024;
/** Invocations (one word each) per workgroup of the fill kernel: its WG def and the grid's divisor. */
const FILL_WG = 256;
const UNIFORM_RING_MAX = 16 << 20;
export { bindGroupCacheMax } from './adapter.ts';

/** A compiled pipeline with its canonical key (shader, entry, sorted defs) and a short id for bind-group keys. */
interface PipelineEntry {
  readonly pipeline: GPUComputePipeline;
  readonly key: string;
  readonly id: number;
}

export class Gpu {
  readonly allocator: Allocator;
  readonly hasF16: boolean;
  readonly hasSubgroups: boolean;
  readonly hasTimestamps: boolean;
  /** The adapter profile (adapter.ts): every per-adapter fact the kernels branch on, built once here. */
  readonly facts: AdapterFacts;
  /**
   * The GEMM kernel choices in force (the adapter's defaults, or what setGemmConfig was given), frozen: every GEMM
   * dispatch reads it, so the getter hands out this one snapshot instead of a copy per call.
   */
  private gemm: Readonly<GemmConfig>;
  /** The subgroup-matrix shape f16 GEMMs run on (tensor cores), or null: they run the SIMT kernels. */
  readonly tensorCores: MatrixShape | null;
  /** Why tensor cores are or are not used here (for reports). */
  readonly tensorCoreNote: string;
  /** Largest byte range one storage binding may cover (the device limit, or a lower test override). */
  readonly maxBinding: number;
  readonly dryRun: boolean;
  /** A dry run that still encodes its dispatches (GpuOptions.recording). */
  private readonly encodesDryRun: boolean;
  private readonly pipelines = new Map<string, PipelineEntry>();
  /**
   * The same entries by kernel and by its defs in the order the call listed them: a call site lists its defs in one
   * order every time, so a warm dispatch finds its pipeline without sorting the defs (the canonical key is made once).
   */
  private readonly pipelinesByCall = new WeakMap<KernelDecl, Map<string, PipelineEntry>>();
  /** The device limits a dispatch checks, read once (each read of `device.limits` crosses into the native host). */
  private readonly maxWorkgroupsPerDim: number;
  private readonly maxStorageBinding: number;
  private readonly uniformAlign: number;
  /** One call's packed uniforms, checked before anything is recorded (grown for wider structs). */
  private uniformScratch = new DataView(new ArrayBuffer(256));
  /** The pipeline last set on the open compute pass (a repeated setPipeline is skipped). */
  private passPipeline: GPUComputePipeline | null = null;
  private encoder: GPUCommandEncoder | null = null;
  private pass: GPUComputePassEncoder | null = null;
  /**
   * Uniforms come from one ring buffer: each dispatch's bytes are packed into `uniformBytes` at an aligned
   * offset and bound there; flush() writes the packed bytes into `uniformRing` just before its submit. The
   * queue runs writes and submits in order, so one buffer serves every submit without waiting for the last.
   */
  private uniformRing: GPUBuffer | null = null;
  private uniformBytes = new Uint8Array(UNIFORM_RING_START);
  private uniformUsed = 0;
  /** Bind groups by pipeline and bound ranges: a training step binds the same buffers at the same offsets each time. */
  private readonly bindGroups = new Map<string, GPUBindGroup>();
  private readonly bufferIds = new WeakMap<GPUBuffer, number>();
  private nextBufferId = 1;
  /** Read-back staging buffers (MAP_READ) by size class, reused. */
  private readonly stagingPool = new Map<number, GPUBuffer[]>();
  private profiling: Profiling | null = null;
  private readonly poison: boolean;
  /** Buffers evicted from the pool while recorded commands still used them: destroyed once submitted. */
  private afterSubmit: GPUBuffer[] = [];
  /** Set while gpuTime() records: the next compute pass writes its begin/end timestamps here. */
  private passTimestamps: GPUComputePassTimestampWrites | null = null;
  private timedPasses = 0;
  private validationErrors: string[] = [];
  private lost: GpuDeviceLostError | null = null;
  private readonly lostListeners: ((e: GpuDeviceLostError) => void)[] = [];
  dispatchCount = 0;
  /** GPUBuffers created outside the allocator (uniforms, read-back staging, query resolves). */
  private otherBuffersCreated = 0;
  private bindGroupsCreated = 0;
  private readonly bindGroupCacheMax: number;
  /** Set while a step is captured for replay (src/gpu/replay.ts): sees every dispatch, refuses queue writes and reads. */
  captureSink: CaptureSink | null = null;
  /** Pool evictions so far: each may destroy buffers that captured bind groups bind, so a replay checks it is unchanged. */
  evictions = 0;

  private constructor(
    readonly device: GPUDevice,
    readonly adapter: AdapterSummary,
    private readonly shaders: ShaderSource,
    opts: GpuOptions,
    tensorCores: { shape: MatrixShape | null; note: string } = { shape: null, note: 'not checked' },
  ) {
    this.facts = adapterFacts(adapter, opts, tensorCores);
    this.tensorCores = this.facts.tensorCores;
    this.tensorCoreNote = this.facts.tensorCoreNote;
    this.hasF16 = this.facts.f16;
    this.hasSubgroups = this.facts.subgroups;
    this.hasTimestamps = this.facts.timestamps;
    this.maxBinding = this.facts.maxBinding;
    this.dryRun = opts.dryRun ?? false;
    this.encodesDryRun = this.dryRun && (opts.recording ?? false);
    this.poison = (opts.poison ?? false) && !this.dryRun;
    this.bindGroupCacheMax = this.facts.bindGroupCacheMax;
    this.gemm = Object.freeze({ ...this.facts.gemmDefaults });
    this.allocator = new Allocator(device, device.limits.maxBufferSize, this.dryRun, this.encodesDryRun);
    this.maxWorkgroupsPerDim = device.limits.maxComputeWorkgroupsPerDimension;
    this.maxStorageBinding = device.limits.maxStorageBufferBindingSize;
    this.uniformAlign = device.limits.minUniformBufferOffsetAlignment;
    this.allocator.onEvict = () => {
      this.bindGroups.clear();
      this.evictions++;
    };
    this.allocator.destroyEvicted = (b) => (this.encoder ? this.afterSubmit.push(b) : b.destroy());
    void device.lost.then((info) => {
      this.lost = new GpuDeviceLostError(info.reason ?? 'unknown', info.message || 'no message');
      for (const l of this.lostListeners) l(this.lost);
    });
    device.addEventListener('uncapturederror', (ev) => {
      this.validationErrors.push((ev as GPUUncapturedErrorEvent).error.message);
    });
  }

  static async create(gpu: GPU | undefined | null, opts: GpuOptions): Promise<Gpu> {
    if (!gpu) throw new NoWebGpuError('WebGPU is not available: this browser or host exposes no navigator.gpu.');
    const adapter = await gpu.requestAdapter({ powerPreference: opts.powerPreference ?? 'high-performance' });
    if (!adapter) throw new NoWebGpuError('WebGPU is available but no GPU adapter was found (is hardware acceleration off?).');
    const requiredLimits: Record<string, number> = {};
    for (const name of [...RAISED_LIMITS, ...ALIGNMENT_LIMITS]) {
      const v = (adapter.limits as unknown as Record<string, number>)[name];
      if (typeof v === 'number') requiredLimits[name] = v;
    }
    if (opts.storageAlignment)
      requiredLimits.minStorageBufferOffsetAlignment = Math.max(requiredLimits.minStorageBufferOffsetAlignment ?? 0, opts.storageAlignment);
    const requiredFeatures = WANTED_FEATURES.filter((f) => adapter.features.has(f)) as GPUFeatureName[];
    const device = await adapter.requestDevice({ requiredLimits, requiredFeatures });
    const info = adapter.info ?? ({} as GPUAdapterInfo);
    const limits: Record<string, number> = {};
    for (const k in device.limits) {
      const v = (device.limits as unknown as Record<string, number>)[k];
      if (typeof v === 'number') limits[k] = v;
    }
    const summary: AdapterSummary = {
      vendor: info.vendor ?? '',
      architecture: info.architecture ?? '',
      device: info.device ?? '',
      description: info.description ?? '',
      features: [...device.features].map(String).sort(),
      limits,
      subgroupMinSize: device.features.has('subgroups') ? Number(info.subgroupMinSize ?? 0) || 0 : 0,
    };
    return new Gpu(device, summary, opts.shaders, opts, await tensorCoresFor(adapter, device, opts));
  }

  /** The GEMM kernel choices in force (a frozen snapshot: setGemmConfig replaces it, never changes it). */
  get gemmConfig(): Readonly<GemmConfig> {
    return this.gemm;
  }

  /** Switches the GEMM kernel choices (src/ops/tune.ts, a resumed run's recorded config); refuses invalid ones. */
  setGemmConfig(c: GemmConfig): void {
    const problem = gemmConfigProblem(c);
    if (problem) throw new Error(`invalid GEMM config ${JSON.stringify(c)}: ${problem}`);
    // SwiftShader refuses the direct core (ops/tiles.ts directRefusal): its config says what runs, whatever it is given.
    const direct = ((c as Partial<GemmConfig>).direct ?? this.gemm.direct) && this.facts.directGemm; // absent from configs recorded before it
    this.gemm = Object.freeze({ registerBlock: c.registerBlock, fillWorkgroups: c.fillWorkgroups, splitK: c.splitK, bk: c.bk, prefetch: c.prefetch, direct });
  }

  /** Workgroups a dispatch needs before big tiles pay (GemmConfig.fillWorkgroups). */
  get fillWorkgroups(): number {
    return this.gemm.fillWorkgroups;
  }

  /** Whether GEMMs pick split-K on their own (GemmConfig.splitK; GpuOptions.splitK sets the default). */
  get autoSplitK(): boolean {
    return this.gemm.splitK;
  }

  /** The storage dtype for activations and weights: f16 where the device has it, else f32. */
  get computeDType(): DType {
    return this.hasF16 ? 'f16' : 'f32';
  }

  onLost(listener: (e: GpuDeviceLostError) => void): void {
    this.lostListeners.push(listener);
    if (this.lost) listener(this.lost);
  }

  // ---- tensors -------------------------------------------------------------------------------

  /**
   * A tensor whose contents are undefined (a pooled buffer keeps what its last user wrote): for outputs a kernel
   * writes in full. Use zeros() for accumulators. Under `poison` its words are NaN.
   */
  tensor(shape: readonly number[], dtype: DType, tag: Tag, label = 'tensor'): Tensor {
    const t = this.allocTensor(shape, dtype, tag, label);
    if (this.poison) this.fill(t, 0xffffffff);
    return t;
  }

  async tensorChecked(shape: readonly number[], dtype: DType, tag: Tag, label = 'tensor'): Promise<Tensor> {
    this.checkAlive();
    this.checkDType(dtype, label);
    const t = new Tensor(await this.allocator.allocChecked(numel(shape) * BYTES[dtype], tag, label), shape, dtype);
    if (this.poison) this.fill(t, 0xffffffff);
    return t;
  }

  private allocTensor(shape: readonly number[], dtype: DType, tag: Tag, label: string): Tensor {
    this.checkAlive();
    this.checkDType(dtype, label);
    return new Tensor(this.allocator.alloc(numel(shape) * BYTES[dtype], tag, label), shape, dtype);
  }

  /** Sets every 32-bit word of the tensor's buffer range to `word` (one dispatch per storage binding's worth). */
  /** Fills t with a 32-bit word (fill.wgsl, FILL_WG words per workgroup). */
  private fill(t: Tensor, word: number): void {
    const words = Math.ceil(t.byteSize / 4);
    // Windows of the device's real binding limit (a test's lower `bindingLimit` is for the kernels under test).
    const align = this.device.limits.minStorageBufferOffsetAlignment / 4;
    const per = Math.floor(this.device.limits.maxStorageBufferBindingSize / 4 / align) * align;
    for (let start = 0; start < words; start += per) {
      const count = Math.min(per, words - start);
      this.run(FILL, {
        defs: { WG: FILL_WG },
        uniforms: { words: count, value: word },
        bindings: { out: this.subWindow(t, start, count, 4) },
        workgroups: this.grid(Math.ceil(count / FILL_WG)),
      });
    }
  }

  /** Uploads f32 values as a tensor of `dtype` (rounding to f16 where asked). */
  upload(data: ArrayLike<number>, shape: readonly number[], dtype: DType, tag: Tag = 'scratch', label = 'upload'): Tensor {
    if (data.length !== numel(shape)) throw new ShapeError('upload', `${data.length} values for shape [${shape.join(',')}]`);
    const t = this.allocTensor(shape, dtype, tag, label); // write() sets every element
    this.write(t, data);
    return t;
  }

  write(t: Tensor, data: ArrayLike<number>): void {
    if (data.length !== t.numel) throw new ShapeError('write', `${data.length} values for ${t}`);
    if (this.dryRun) return;
    this.captureSink?.refuse(`a queue write into ${t.alloc.label}`);
    const bytes = t.dtype === 'f16' ? toF16Bits(data) : data instanceof Float32Array ? data : Float32Array.from(data);
    // writeBuffer needs a multiple of 4 bytes: pad an odd-length f16 array.
    const padded = bytes.byteLength % 4 === 0 ? bytes : padTo4(bytes as Uint16Array);
    this.flush();
    this.device.queue.writeBuffer(t.buffer, t.byteOffset, padded.buffer, padded.byteOffset, padded.byteLength);
  }

  /**
   * Writes raw bytes (e.g. u32 ids in 4-byte slots) at the start of a tensor. Like write(), it submits what is
   * recorded first: a queue write runs before any command not yet submitted, and a pooled buffer may still be read
   * by recorded commands of its previous user.
   */
  writeRaw(t: Tensor, data: ArrayBufferView): void {
    if (data.byteLength > t.alloc.bytes - t.byteOffset) throw new ShapeError('writeRaw', `${data.byteLength} bytes for ${t}`);
    if (this.dryRun) return;
    this.captureSink?.refuse(`a queue write into ${t.alloc.label}`);
    this.flush();
    this.device.queue.writeBuffer(t.buffer, t.byteOffset, data.buffer, data.byteOffset, data.byteLength);
  }

  zeros(shape: readonly number[], dtype: DType, tag: Tag = 'scratch', label = 'zeros'): Tensor {
    const t = this.allocTensor(shape, dtype, tag, label);
    if (t.alloc.reused) this.fill(t, 0); // WebGPU zero-initialises new buffers; a pooled one holds stale data
    return t;
  }

  /** Reads a tensor back as f32 values. */
  async read(t: Tensor): Promise<Float32Array> {
    if (this.dryRun) return new Float32Array(t.numel);
    const raw = await this.readBytes(t.buffer, t.byteOffset, t.byteSize);
    return t.dtype === 'f16' ? fromF16Bits(new Uint16Array(raw, 0, t.numel)) : new Float32Array(raw, 0, t.numel);
  }

  async readBytes(buffer: GPUBuffer, offset: number, size: number): Promise<ArrayBuffer> {
    this.checkAlive();
    this.captureSink?.refuse('a read-back');
    const padded = Math.ceil(size / 4) * 4;
    const staging = this.takeStaging(padded);
    this.endPass();
    this.getEncoder().copyBufferToBuffer(buffer, offset, staging, 0, padded);
    try {
      await this.sync();
      await staging.mapAsync(GPUMapMode.READ, 0, padded);
      const out = staging.getMappedRange(0, padded).slice(0, size);
      staging.unmap();
      this.stagingPool.get(staging.size)!.push(staging);
      return out;
    } catch (e) {
      staging.destroy();
      throw e;
    }
  }

  /** A MAP_READ staging buffer of at least `bytes` from the pool, or a new one of its size class. */
  private takeStaging(bytes: number): GPUBuffer {
    const cls = sizeClass(bytes);
    const stack = this.stagingPool.get(cls) ?? [];
    this.stagingPool.set(cls, stack);
    const pooled = stack.pop();
    if (pooled) return pooled;
    this.otherBuffersCreated++;
    return this.device.createBuffer({ size: cls, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST, label: 'readback' });
  }

  /**
   * Frees tensors: their buffers go back to the pool, where the next allocation of their size class takes them
   * (safe while commands using them are recorded or running: later commands run after them).
   */
  free(...ts: (Tensor | null | undefined)[]): void {
    for (const t of ts) if (t && t.owner) this.allocator.free(t.alloc);
  }

  /** Destroys the pool's idle buffers (memory back to the device; the next step recreates what it needs). */
  trimPool(): void {
    this.allocator.trimPool(0);
    for (const stack of this.stagingPool.values()) for (const b of stack.splice(0)) b.destroy();
  }

  // ---- dispatch ------------------------------------------------------------------------------

  /** The compute pipeline of a declared kernel under these defs (compiled once, then cached). */
  pipeline(k: KernelDecl, defs: Defs): GPUComputePipeline {
    return this.pipelineEntry(k, defs).pipeline;
  }

  private pipelineEntry(k: KernelDecl, defs: Defs): PipelineEntry {
    let byCall = this.pipelinesByCall.get(k);
    if (!byCall) this.pipelinesByCall.set(k, (byCall = new Map()));
    let callKey = '';
    for (const name in defs) callKey += `${name}=${defs[name]},`;
    const known = byCall.get(callKey);
    if (known) return known;
    const { shader, entry } = k;
    const key = `${shader}:${entry}:${defsKey(defs)}`;
    let e = this.pipelines.get(key);
    if (!e) {
      const code = kernelModule(this.shaders.get(shader), k, defs);
      const module = this.device.createShaderModule({ code, label: key });
      const pipeline = this.device.createComputePipeline({ layout: 'auto', compute: { module, entryPoint: entry }, label: key });
      e = { pipeline, key, id: this.pipelines.size + 1 };
      this.pipelines.set(key, e);
    }
    byCall.set(callKey, e);
    return e;
  }

  /**
   * Running totals since the Gpu was made, for benchmarks (diff two readings around a step): dispatches
   * recorded, GPUBuffers created (allocator tensors, uniforms, read-back staging) and bind groups created.
   * Counting only; nothing reads them to decide anything.
   */
  get stats(): GpuStats {
    return {
      dispatches: this.dispatchCount,
      buffersCreated: this.allocator.buffersCreated + this.otherBuffersCreated,
      bindGroupsCreated: this.bindGroupsCreated,
      bindGroupsCached: this.bindGroups.size,
    };
  }

  get pipelineCount(): number {
    return this.pipelines.size;
  }

  /**
   * Records one dispatch of a declared kernel (src/gpu/kernel.ts): its uniforms packed into the ring at
   * @binding(0), its storage windows bound by name at @binding(i + 1).
   */
  run<D extends KernelDecl>(k: D, call: KernelCall<D>): void {
    this.checkAlive();
    if (this.dryRun && !this.encodesDryRun) return;
    const [x, y = 1, z = 1] = call.workgroups;
    const maxWg = this.maxWorkgroupsPerDim;
    if (x > maxWg || y > maxWg || z > maxWg)
      throw new ShapeError(`${k.shader}.${k.entry}`, `dispatch ${x}x${y}x${z} exceeds ${maxWg} workgroups per dimension`);
    // Every check comes before anything is recorded or reserved: a refused call changes nothing.
    let uniformSize = 0;
    if (k.uniforms.length > 0) {
      if (uniformBytes(k) > this.uniformScratch.byteLength) this.uniformScratch = new DataView(new ArrayBuffer(uniformBytes(k)));
      uniformSize = packUniformsInto(k, call.uniforms, this.uniformScratch, 0);
    }
    const bindings = orderBindings<Bindable>(k, call.defs, call.bindings as Record<string, Bindable | undefined>);
    const windows: (BufferWindow | null)[] = bindings.map((b, i) => {
      if (!b) return null;
      const w = b instanceof Tensor ? this.window(b) : b;
      if (w.size > this.maxStorageBinding)
        throw new ShapeError(`${k.shader}.${k.entry}`, `binding '${k.bindings[i].name}' spans ${w.size} bytes, over the device's storage binding limit`);
      return w;
    });
    if (x === 0 || y === 0 || z === 0) return;
    const entry = this.pipelineEntry(k, call.defs);
    const uniforms = uniformSize > 0 ? this.uniformSlot(uniformSize) : null;
    const bindGroup = this.bindGroupFor(entry, uniforms, windows);
    if (this.captureSink) {
      if (this.profiling || this.passTimestamps) this.captureSink.refuse('a profiled or timed dispatch');
      const u = uniformSize > 0 ? new Uint8Array(this.uniformScratch.buffer.slice(0, uniformSize)) : null;
      this.captureSink.dispatch({ label: entry.key, pipeline: entry.pipeline, group: bindGroup, uniforms: u, windows, workgroups: [x, y, z] }, bindings);
    }
    const pass = this.profiling ? this.profiledPass(`${k.shader}.${k.entry}`) : this.getPass();
    if (this.passPipeline !== entry.pipeline) {
      pass.setPipeline(entry.pipeline);
      this.passPipeline = entry.pipeline;
    }
    pass.setBindGroup(0, bindGroup);
    pass.dispatchWorkgroups(x, y, z);
    this.dispatchCount++;
    if (this.profiling) this.endPass();
  }

  /** Counts GPUBuffers and bind groups made for the Gpu outside its own paths (a replay's baked uniforms: replay.ts). */
  noteCreated(buffers: number, bindGroups: number): void {
    this.otherBuffersCreated += buffers;
    this.bindGroupsCreated += bindGroups;
  }

  /** Whether a replay may encode now: not a dry run, no profile or timed pass, no capture running. */
  get canReplay(): boolean {
    return !this.dryRun && !this.profiling && !this.passTimestamps && !this.captureSink;
  }

  /** Bytes of the uniform ring taken since the last submit (a capture notes where a segment left it: replay.ts). */
  get uniformFill(): number {
    return this.uniformUsed;
  }

  /** Leaves the ring's slots up to `fill` unused: the live dispatches after a replayed segment get the slots they got live. */
  skipUniforms(fill: number): void {
    if (fill > this.uniformUsed && fill <= this.uniformBytes.length) this.uniformUsed = fill;
  }

  /** The open compute pass, for a replay (replay.ts) of `count` dispatches; the next run sets its pipeline again. */
  replayPass(count: number): GPUComputePassEncoder {
    this.checkAlive();
    if (!this.canReplay) throw new Error('replayPass: a replay cannot run in a dry run, a profile, a timed pass or a capture');
    this.dispatchCount += count;
    const pass = this.getPass();
    this.passPipeline = null;
    return pass;
  }

  /** Copies the packed uniforms (uniformScratch) into the ring and returns the binding of their slot. */
  private uniformSlot(size: number): GPUBufferBinding {
    const align = this.uniformAlign;
    let offset = Math.ceil(this.uniformUsed / align) * align;
    if (offset + size > this.uniformBytes.length) {
      // Full: submit what is recorded (its uniforms are written then) and grow the ring for next time, so a
      // warm step fits one ring and creates no buffer.
      this.flush();
      offset = 0;
      if (this.uniformBytes.length < UNIFORM_RING_MAX) {
        this.uniformBytes = new Uint8Array(this.uniformBytes.length * 2);
        this.uniformRing?.destroy(); // submitted work that used it still runs (destroy waits for the queue)
        this.uniformRing = null;
      }
    }
    if (!this.uniformRing) {
      this.uniformRing = this.device.createBuffer({
        size: this.uniformBytes.length,
        usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
        label: 'uniforms',
      });
      this.otherBuffersCreated++;
    }
    this.uniformBytes.set(new Uint8Array(this.uniformScratch.buffer, 0, size), offset);
    this.uniformUsed = offset + size;
    return { buffer: this.uniformRing, offset, size };
  }

  /**
   * The bind group of a pipeline over these ranges, made once and reused while the same buffer ranges recur (a warm
   * training step binds the same pooled buffers at the same offsets, its uniforms at the same ring offsets). A key
   * names each buffer by an id given once per GPUBuffer object: a destroyed buffer's id is never given to another, so
   * a cached group can only match the live buffers it was made with (evictions also empty the cache: Allocator.onEvict).
   */
  private bindGroupFor(p: PipelineEntry, uniforms: GPUBufferBinding | null, windows: readonly (BufferWindow | null)[]): GPUBindGroup {
    let key = `${p.id}`;
    if (uniforms) key += `|0:${this.bufferId(uniforms.buffer)}:${uniforms.offset}:${uniforms.size}`;
    for (let i = 0; i < windows.length; i++) {
      const w = windows[i];
      if (w) key += `|${i + 1}:${this.bufferId(w.buffer)}:${w.offset}:${w.size}`;
    }
    let group = this.bindGroups.get(key);
    if (!group) {
      const entries: GPUBindGroupEntry[] = [];
      if (uniforms) entries.push({ binding: 0, resource: uniforms });
      windows.forEach((w, i) => {
        if (w) entries.push({ binding: i + 1, resource: { buffer: w.buffer, offset: w.offset, size: w.size } });
      });
      // A Map iterates in insertion order: its first key is the oldest entry.
      if (this.bindGroups.size >= this.bindGroupCacheMax) this.bindGroups.delete(this.bindGroups.keys().next().value!);
      group = this.device.createBindGroup({ layout: p.pipeline.getBindGroupLayout(0), entries });
      this.bindGroups.set(key, group);
      this.bindGroupsCreated++;
    }
    return group;
  }

  private bufferId(b: GPUBuffer): number {
    let id = this.bufferIds.get(b);
    if (id === undefined) {
      id = this.nextBufferId++;
      this.bufferIds.set(b, id);
    }
    return id;
  }

  // ---- profiling -----------------------------------------------------------------------------

  /**
   * Starts timing every dispatch on the GPU: each gets its own compute pass with a timestamp pair, and the
   * times add up by op family (the shader file) and kernel until stopProfile(). For benchmarks: the extra
   * passes and read-backs cost time and create buffers, so do not time or count a profiled step. Needs the
   * timestamp-query feature; in Node, Dawn's timestamp quantization is off (src/gpu/node.ts).
   */
  startProfile(): void {
    if (!this.hasTimestamps) throw new Error('profiling needs the timestamp-query feature, which this adapter lacks');
    if (this.profiling) throw new Error('a profile is already running');
    this.flush();
    this.profiling = startProfiling(this.device);
  }

  /** Ends the profile: waits for its timestamps and returns the milliseconds by family and by kernel. */
  async stopProfile(): Promise<GpuProfile> {
    const prof = this.profiling;
    if (!prof) throw new Error('no profile is running');
    await this.sync();
    this.profiling = null;
    await Promise.all(prof.pending);
    prof.querySet.destroy();
    return profileSummary(prof);
  }

  /** A new compute pass whose begin and end timestamps go to the next query pair. */
  private profiledPass(kernel: string): GPUComputePassEncoder {
    const prof = this.profiling!;
    if (prof.kernels.length === prof.capacity) this.flush();
    this.endPass();
    const pair = prof.kernels.length;
    prof.kernels.push(kernel);
    this.passPipeline = null;
    this.pass = this.getEncoder().beginComputePass({
      timestampWrites: { querySet: prof.querySet, beginningOfPassWriteIndex: 2 * pair, endOfPassWriteIndex: 2 * pair + 1 },
    });
    return this.pass;
  }

  /** Before a submit: resolve this recording's timestamps into a read-back that adds them to the totals. */
  private resolveProfile(encoder: GPUCommandEncoder): (() => void) | null {
    const prof = this.profiling;
    if (!prof || prof.kernels.length === 0) return null;
    this.otherBuffersCreated += 2;
    return resolveTimestamps(this.device, encoder, prof);
  }

  /** Splits `n` workgroups over x and y so neither exceeds the per-dimension limit. */
  grid(n: number): [number, number] {
    const maxWg = this.maxWorkgroupsPerDim;
    if (n <= maxWg) return [n, 1];
    const y = Math.ceil(n / maxWg);
    return [Math.ceil(n / y), y];
  }

  /** The whole tensor as one binding (its size rounded up to 4 bytes). */
  window(t: Tensor): BufferWindow {
    return { buffer: t.buffer, offset: t.byteOffset, size: Math.ceil(t.byteSize / 4) * 4 };
  }

  /**
   * Splits `count` items of `bytesPerItem` into ranges that each fit one storage binding with an
   * aligned start, for kernels that walk huge tensors piecewise. `count` = rows, elements, ...
   */
  chunks(count: number, bytesPerItem: number, narrowestBytes = bytesPerItem): { start: number; count: number }[] {
    const align = this.device.limits.minStorageBufferOffsetAlignment;
    let per = Math.floor(this.maxBinding / bytesPerItem);
    // Chunk starts must land on aligned byte offsets in every tensor walked in step (the widest
    // and the narrowest item sizes).
    const a = align / gcd(align, bytesPerItem);
    const b = align / gcd(align, narrowestBytes);
    const itemsPerAlign = (a * b) / gcd(a, b);
    per = Math.floor(per / itemsPerAlign) * itemsPerAlign;
    if (per <= 0) throw new ShapeError('chunks', `one item of ${bytesPerItem} bytes does not fit a storage binding of ${this.maxBinding}`);
    const out: { start: number; count: number }[] = [];
    for (let s = 0; s < count; s += per) out.push({ start: s, count: Math.min(per, count - s) });
    return out;
  }

  /** Binding over items [start, start+count) of a tensor whose items are `bytesPerItem` each. */
  subWindow(t: Tensor, start: number, count: number, bytesPerItem: number): BufferWindow {
    return { buffer: t.buffer, offset: t.byteOffset + start * bytesPerItem, size: Math.ceil((count * bytesPerItem) / 4) * 4 };
  }

  /** True when the tensor fits one binding under the current limit. */
  fitsBinding(t: Tensor): boolean {
    return t.byteSize <= this.maxBinding;
  }

  /**
   * GPU time in milliseconds of the dispatches `record` issues, from timestamp queries around the one
   * compute pass they are recorded into (no submit or completion latency). `record` must only
   * dispatch (no reads or writes, which would split the pass). Needs the timestamp-query feature.
   */
  async gpuTime(record: () => void): Promise<number> {
    if (!this.hasTimestamps) throw new Error('gpuTime needs the timestamp-query feature');
    this.flush();
    const querySet = this.device.createQuerySet({ type: 'timestamp', count: 2 });
    this.passTimestamps = { querySet, beginningOfPassWriteIndex: 0, endOfPassWriteIndex: 1 };
    this.timedPasses = 0;
    try {
      record();
    } finally {
      this.endPass();
      this.passTimestamps = null;
    }
    if (this.timedPasses !== 1) throw new Error(`gpuTime: the recorded work spanned ${this.timedPasses} compute passes, expected 1`);
    const resolved = this.device.createBuffer({ size: 16, usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC });
    this.otherBuffersCreated++;
    this.getEncoder().resolveQuerySet(querySet, 0, 2, resolved, 0);
    const [t0, t1] = new BigUint64Array(await this.readBytes(resolved, 0, 16));
    resolved.destroy();
    querySet.destroy();
    return Number(t1 - t0) / 1e6;
  }

  /** Submits everything recorded so far (after writing its uniforms into the ring). */
  flush(): void {
    this.endPass();
    if (!this.encoder) return;
    const afterProfile = this.resolveProfile(this.encoder);
    const cmd = this.encoder.finish();
    this.encoder = null;
    if (this.uniformUsed > 0) {
      const used = Math.ceil(this.uniformUsed / 4) * 4;
      this.device.queue.writeBuffer(this.uniformRing!, 0, this.uniformBytes.buffer, 0, used);
      this.uniformUsed = 0;
    }
    this.device.queue.submit([cmd]);
    afterProfile?.();
    for (const b of this.afterSubmit.splice(0)) b.destroy();
  }

  /** Submits and waits for the GPU; throws validation, out-of-memory or device-loss errors seen meanwhile. */
  async sync(): Promise<void> {
    this.flush();
    await this.device.queue.onSubmittedWorkDone();
    this.checkAlive();
    const oom = await this.allocator.takeOomErrors(); // empties the pool when there are any: a retry finds the memory
    if (oom.length) throw oom[0];
    if (this.validationErrors.length) {
      const msgs = this.validationErrors.splice(0);
      throw new GpuValidationError(`WebGPU validation failed: ${msgs.join(' | ')}`);
    }
  }

  destroy(): void {
    this.flush();
    this.device.destroy();
  }

  private getEncoder(): GPUCommandEncoder {
    if (!this.encoder) this.encoder = this.device.createCommandEncoder();
    return this.encoder;
  }

  private getPass(): GPUComputePassEncoder {
    if (!this.pass) {
      this.passPipeline = null;
      this.pass = this.getEncoder().beginComputePass(this.passTimestamps ? { timestampWrites: this.passTimestamps } : undefined);
      if (this.passTimestamps) this.timedPasses++;
    }
    return this.pass;
  }

  private endPass(): void {
    if (this.pass) {
      this.pass.end();
      this.pass = null;
    }
  }

  private checkAlive(): void {
    if (this.lost) throw this.lost;
  }

  private checkDType(dtype: DType, label: string): void {
    if (dtype === 'f16' && !this.hasF16) throw new ShapeError(label, 'f16 tensors need the shader-f16 feature, which this device lacks (use f32)');
  }
}

function padTo4(bits: Uint16Array): Uint16Array {
  const out = new Uint16Array(bits.length + 1);
  out.set(bits);
  return out;
}

function gcd(a: number, b: number): number {
  while (b) [a, b] = [b, a % b];
  return a;
}

/** Whether f16 GEMMs use tensor cores on this device: the options, the adapter's offer, then the start-up check. */
function tensorCoresFor(adapter: GPUAdapter, device: GPUDevice, opts: GpuOptions): Promise<{ shape: MatrixShape | null; note: string }> {
  return tensorCoreDecision({
    asked: opts.tensorCores,
    optOut: opts.tensorCoreOptOut ?? 'GpuOptions.tensorCores = false',
    disableF16: opts.disableF16 ?? false,
    dryRun: opts.dryRun ?? false,
    features: new Set([...device.features].map(String)),
    info: (adapter.info ?? {}) as unknown as Record<string, unknown>,
    check: (shape) => checkTensorCores(device, shape),
  });
}
