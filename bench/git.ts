// The commit a benchmark measured, recorded in its results (Node side only).
import { execFileSync } from 'node:child_process';

/**
 * HEAD's short hash, with '+dirty' when the kernels (shaders/, src/ops/, src/gpu/) differ from it: the
 * numbers are then of uncommitted kernel code. Changes to bench/ itself do not count.
 */
export function gitCommit(): string {
  try {
    const head = execFileSync('git', ['rev-parse', '--short', 'HEAD'], { encoding: 'utf8' }).trim();
    const dirty = execFileSync('git', ['status', '--porcelain', '--', 'shaders', 'src/ops', 'src/gpu'], { encoding: 'utf8' }).trim() !== '';
    return dirty ? `${head}+dirty` : head;
  } catch {
    return 'unknown';
  }
}
