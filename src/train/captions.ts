// Per-step caption processing, kohya sd-scripts' BaseDataset.process_caption for a DreamBooth subset:
//   dropout:  with probability `dropout` the caption is "" (the unconditional prompt), decided first;
//   shuffle:  otherwise the caption is split at ',' (each tag stripped, empty ones kept, as sd-scripts does),
//             the first `keepTokens` tags stay in place and the rest are shuffled (Python's random.shuffle:
//             Fisher-Yates from the last index down, j = floor(u * (i + 1))), then joined with ", ".
// The uniforms come from the run's Rng (drawn only when an option is on), so a resumed run draws the same
// captions an uninterrupted one would.

export interface CaptionOptions {
  /** Probability in [0, 1) that a step trains the photo with the empty caption. */
  dropout: number;
  /** Shuffle the comma-separated tags after the first `keepTokens`. */
  shuffle: boolean;
  keepTokens: number;
}

/** Whether any option changes a caption (else no uniforms are drawn and the cached embeddings are used). */
export const captionsProcessed = (o: CaptionOptions | undefined): o is CaptionOptions => !!o && (o.dropout > 0 || o.shuffle);

/** The caption a step trains with, drawing from `uniform` (in (0, 1)) as sd-scripts draws from Python's random. */
export function processCaption(caption: string, o: CaptionOptions, uniform: () => number): string {
  if (o.dropout > 0 && uniform() < o.dropout) return '';
  if (!o.shuffle) return caption;
  const tags = caption
    .trim()
    .split(',')
    .map((t) => t.trim());
  const fixed = o.keepTokens > 0 ? tags.slice(0, o.keepTokens) : [];
  const flex = o.keepTokens > 0 ? tags.slice(o.keepTokens) : tags;
  for (let i = flex.length - 1; i >= 1; i--) {
    const j = Math.min(i, Math.floor(uniform() * (i + 1)));
    [flex[i], flex[j]] = [flex[j], flex[i]];
  }
  return [...fixed, ...flex].join(', ');
}
