// The training run's random numbers (noise, timesteps, offset noise, flips), from one 32-bit state that a
// checkpoint saves and a resume restores, so a resumed run draws exactly what an uninterrupted one would.
// mulberry32 for uniforms (the generator src/sample/schedulers.ts#randn uses), Box-Muller for normals.

export class Rng {
  private s: number;

  constructor(seed: number) {
    this.s = seed >>> 0;
  }

  /** Uniform in (0, 1): never 0, so log() in Box-Muller stays finite. */
  uniform(): number {
    this.s = (this.s + 0x6d2b79f5) >>> 0;
    let t = this.s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (((t ^ (t >>> 14)) >>> 0) + 0.5) / 4294967296;
  }

  /** Integer in [0, n). */
  int(n: number): number {
    return Math.min(n - 1, Math.floor(this.uniform() * n));
  }

  /** n standard normal values (each pair of uniforms gives a pair of normals). */
  normals(n: number): Float32Array {
    const out = new Float32Array(n);
    for (let i = 0; i < n; i += 2) {
      const r = Math.sqrt(-2 * Math.log(this.uniform()));
      const th = 2 * Math.PI * this.uniform();
      out[i] = r * Math.cos(th);
      if (i + 1 < n) out[i + 1] = r * Math.sin(th);
    }
    return out;
  }

  /** The whole state (a checkpoint stores it). */
  state(): number {
    return this.s;
  }

  restore(s: number): void {
    this.s = s >>> 0;
  }
}
