// Named tensors readable one at a time: names and shapes up front, each tensor's values read only when a
// consumer asks (from the GPU, a chunk store, a file), so a consumer that writes tensor by tensor never holds
// more than the one it is writing. The trainer hands its trained state out this way and the exporters read it.

export interface TensorProvider {
  names(): string[];
  shape(name: string): number[];
  read(name: string): Promise<Float32Array>;
}

export function sameShape(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}
