// The GPU runtime: adapter + device with the adapter's maximum limits and the features we use,
// buffer allocation with accounting, a pipeline cache over specialised WGSL, batched dispatch,
// uploads and read-backs, and device-loss reporting. Host-agnostic: the host passes a GPU object
// (navigator.gpu in Chrome, the `webgpu` package's in Node) and a ShaderSource.

import { Allocator, type Tag } from './allocator.ts';
import { GpuDeviceLostError, GpuValidationError, NoWebGpuError, ShapeError } from './errors.ts';
import { fromF16Bits, toF16Bits } from '../util/half.ts';
import { defsKey, specialise, type Defs, type ShaderSource } from './shaders.ts';
import { BYTES, numel, Tensor, type DType } from './tensor.ts';

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

/** Alignment limits, where smaller is better: we take the adapter's. */
const ALIGNMENT_LIMITS = ['minStorageBufferOffsetAlignment', 'minUniformBufferOffsetAlignment'] as const;

const WANTED_FEATURES = ['shader-f16', 'subgroups', 'timestamp-query'] as const;

export interface GpuOptions {
  shaders: ShaderSource;
  powerPreference?: GPUPowerPreference;
  /** Force the f32 path even where shader-f16 exists. */
  disableF16?: boolean;
  /** Pretend the largest storage binding is this many bytes (tests exercise the chunked paths with it). */
  bindingLimit?: number;
  /**
   * Memory planning: allocations are accounted but not backed, dispatches, writes and reads do nothing
   * (reads return zeros), so the real code measures its own peak bytes for any model size in moments.
   */
  dryRun?: boolean;
}

export interface AdapterSummary {
  vendor: string;
  architecture: string;
  device: string;
  description: string;
  features: string[];
  limits: Record<string, number>;
}

/** A buffer range bound to one shader binding. */
export interface BufferWindow {
  buffer: GPUBuffer;
  offset: number;
  size: number;
}

export type Bindable = Tensor | BufferWindow;

export interface DispatchSpec {
  shader: string;
  entry: string;
  defs: Defs;
  /** Scalar parameters, bound at @binding(0) as a uniform struct of 4-byte fields. */
  uniforms?: Uniforms;
  /** Storage bindings: element i is bound at @binding(i + 1); null leaves that binding out. */
  bindings: (Bindable | null)[];
  workgroups: readonly [number, number?, number?];
}

/** Builds the bytes of a uniform struct whose fields are all u32 / i32 / f32. */
export class Uniforms {
  private readonly values: { kind: 'u' | 'i' | 'f'; v: number }[] = [];
  u32(...v: number[]): this {
    for (const x of v) {
      if (!Number.isInteger(x) || x < 0 || x > 0xffffffff) throw new Error(`uniform u32 out of range: ${x}`);
      this.values.push({ kind: 'u', v: x });
    }
    return this;
  }
  i32(...v: number[]): this {
    for (const x of v) this.values.push({ kind: 'i', v: x });
    return this;
  }
  f32(...v: number[]): this {
    for (const x of v) this.values.push({ kind: 'f', v: x });
    return this;
  }
  bytes(): ArrayBuffer {
    const buf = new ArrayBuffer(Math.max(16, Math.ceil((this.values.length * 4) / 16) * 16));
    const dv = new DataView(buf);
    this.values.forEach(({ kind, v }, i) => {
      if (kind === 'u') dv.setUint32(i * 4, v, true);
      else if (kind === 'i') dv.setInt32(i * 4, v, true);
      else dv.setFloat32(i * 4, v, true);
    });
    return buf;
  }
}

export interface GpuStats {
  dispatches: number;
  buffersCreated: number;
  bindGroupsCreated: number;
}

export class Gpu {
  readonly allocator: Allocator;
  readonly hasF16: boolean;
  readonly hasSubgroups: boolean;
  readonly hasTimestamps: boolean;
  /** Largest byte range one storage binding may cover (the device limit, or a lower test override). */
  readonly maxBinding: number;
  readonly dryRun: boolean;
  private readonly pipelines = new Map<string, GPUComputePipeline>();
  private encoder: GPUCommandEncoder | null = null;
  private pass: GPUComputePassEncoder | null = null;
  private pendingUniforms: GPUBuffer[] = [];
  /** Buffers freed while recorded commands still used them: destroyed once submitted. */
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

  private constructor(
    readonly device: GPUDevice,
    readonly adapter: AdapterSummary,
    private readonly shaders: ShaderSource,
    opts: GpuOptions,
  ) {
    this.hasF16 = device.features.has('shader-f16') && !opts.disableF16;
    this.hasSubgroups = device.features.has('subgroups');
    this.hasTimestamps = device.features.has('timestamp-query');
    this.maxBinding = Math.min(opts.bindingLimit ?? Infinity, device.limits.maxStorageBufferBindingSize);
    this.dryRun = opts.dryRun ?? false;
    this.allocator = new Allocator(device, device.limits.maxBufferSize, this.dryRun);
    device.lost.then((info) => {
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
    };
    return new Gpu(device, summary, opts.shaders, opts);
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

  tensor(shape: readonly number[], dtype: DType, tag: Tag, label = 'tensor'): Tensor {
    this.checkAlive();
    this.checkDType(dtype, label);
    return new Tensor(this.allocator.alloc(numel(shape) * BYTES[dtype], tag, label), shape, dtype);
  }

  async tensorChecked(shape: readonly number[], dtype: DType, tag: Tag, label = 'tensor'): Promise<Tensor> {
    this.checkAlive();
    this.checkDType(dtype, label);
    return new Tensor(await this.allocator.allocChecked(numel(shape) * BYTES[dtype], tag, label), shape, dtype);
  }

  /** Uploads f32 values as a tensor of `dtype` (rounding to f16 where asked). */
  upload(data: ArrayLike<number>, shape: readonly number[], dtype: DType, tag: Tag = 'scratch', label = 'upload'): Tensor {
    if (data.length !== numel(shape)) throw new ShapeError('upload', `${data.length} values for shape [${shape.join(',')}]`);
    const t = this.tensor(shape, dtype, tag, label);
    this.write(t, data);
    return t;
  }

  write(t: Tensor, data: ArrayLike<number>): void {
    if (data.length !== t.numel) throw new ShapeError('write', `${data.length} values for ${t}`);
    if (this.dryRun) return;
    const bytes = t.dtype === 'f16' ? toF16Bits(data) : data instanceof Float32Array ? data : Float32Array.from(data);
    // writeBuffer needs a multiple of 4 bytes: pad an odd-length f16 array.
    const padded = bytes.byteLength % 4 === 0 ? bytes : padTo4(bytes as Uint16Array);
    this.flush();
    this.device.queue.writeBuffer(t.buffer, t.byteOffset, padded.buffer, padded.byteOffset, padded.byteLength);
  }

  zeros(shape: readonly number[], dtype: DType, tag: Tag = 'scratch', label = 'zeros'): Tensor {
    return this.tensor(shape, dtype, tag, label); // WebGPU zero-initialises new buffers
  }

  /** Reads a tensor back as f32 values. */
  async read(t: Tensor): Promise<Float32Array> {
    if (this.dryRun) return new Float32Array(t.numel);
    const raw = await this.readBytes(t.buffer, t.byteOffset, t.byteSize);
    return t.dtype === 'f16' ? fromF16Bits(new Uint16Array(raw, 0, t.numel)) : new Float32Array(raw, 0, t.numel);
  }

  async readBytes(buffer: GPUBuffer, offset: number, size: number): Promise<ArrayBuffer> {
    this.checkAlive();
    const padded = Math.ceil(size / 4) * 4;
    const staging = this.device.createBuffer({ size: padded, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST, label: 'readback' });
    this.otherBuffersCreated++;
    this.endPass();
    this.getEncoder().copyBufferToBuffer(buffer, offset, staging, 0, padded);
    await this.sync();
    await staging.mapAsync(GPUMapMode.READ);
    const out = staging.getMappedRange().slice(0, size);
    staging.unmap();
    staging.destroy();
    return out;
  }

  /** Frees tensors; safe while commands using them are still recorded (destroyed after submit). */
  free(...ts: (Tensor | null | undefined)[]): void {
    const defer = this.encoder ? (b: GPUBuffer) => this.afterSubmit.push(b) : undefined;
    for (const t of ts) if (t && t.owner) this.allocator.free(t.alloc, defer);
  }

  // ---- dispatch ------------------------------------------------------------------------------

  pipeline(shader: string, entry: string, defs: Defs): GPUComputePipeline {
    const key = `${shader}:${entry}:${defsKey(defs)}`;
    let p = this.pipelines.get(key);
    if (!p) {
      const code = specialise(this.shaders.get(shader), defs);
      const module = this.device.createShaderModule({ code, label: key });
      p = this.device.createComputePipeline({ layout: 'auto', compute: { module, entryPoint: entry }, label: key });
      this.pipelines.set(key, p);
    }
    return p;
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
    };
  }

  get pipelineCount(): number {
    return this.pipelines.size;
  }

  dispatch(spec: DispatchSpec): void {
    this.checkAlive();
    if (this.dryRun) return;
    const pipeline = this.pipeline(spec.shader, spec.entry, spec.defs);
    const entries: GPUBindGroupEntry[] = [];
    if (spec.uniforms) {
      const bytes = spec.uniforms.bytes();
      const ub = this.device.createBuffer({ size: bytes.byteLength, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST, mappedAtCreation: true });
      this.otherBuffersCreated++;
      new Uint8Array(ub.getMappedRange()).set(new Uint8Array(bytes));
      ub.unmap();
      this.pendingUniforms.push(ub);
      entries.push({ binding: 0, resource: { buffer: ub } });
    }
    spec.bindings.forEach((b, i) => {
      if (!b) return;
      const w = b instanceof Tensor ? this.window(b) : b;
      if (w.size > this.device.limits.maxStorageBufferBindingSize)
        throw new ShapeError(`${spec.shader}.${spec.entry}`, `binding ${i + 1} spans ${w.size} bytes, over the device's storage binding limit`);
      entries.push({ binding: i + 1, resource: { buffer: w.buffer, offset: w.offset, size: w.size } });
    });
    const bindGroup = this.device.createBindGroup({ layout: pipeline.getBindGroupLayout(0), entries });
    this.bindGroupsCreated++;
    const [x, y = 1, z = 1] = spec.workgroups;
    const maxWg = this.device.limits.maxComputeWorkgroupsPerDimension;
    if (x > maxWg || y > maxWg || z > maxWg)
      throw new ShapeError(`${spec.shader}.${spec.entry}`, `dispatch ${x}x${y}x${z} exceeds ${maxWg} workgroups per dimension`);
    if (x === 0 || y === 0 || z === 0) return;
    const pass = this.getPass();
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, bindGroup);
    pass.dispatchWorkgroups(x, y, z);
    this.dispatchCount++;
  }

  /** Splits `n` workgroups over x and y so neither exceeds the per-dimension limit. */
  grid(n: number): [number, number] {
    const maxWg = this.device.limits.maxComputeWorkgroupsPerDimension;
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

  /** Submits everything recorded so far. */
  flush(): void {
    this.endPass();
    if (!this.encoder) return;
    const cmd = this.encoder.finish();
    this.encoder = null;
    this.device.queue.submit([cmd]);
    for (const b of this.afterSubmit.splice(0)) b.destroy();
    const uniforms = this.pendingUniforms;
    this.pendingUniforms = [];
    if (uniforms.length) this.device.queue.onSubmittedWorkDone().then(() => uniforms.forEach((u) => u.destroy()));
  }

  /** Submits and waits for the GPU; throws validation, out-of-memory or device-loss errors seen meanwhile. */
  async sync(): Promise<void> {
    this.flush();
    await this.device.queue.onSubmittedWorkDone();
    this.checkAlive();
    const oom = await this.allocator.takeOomErrors();
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
