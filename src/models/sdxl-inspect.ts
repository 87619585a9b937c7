// `inspect` for an SDXL model (either layout): what it is and what the loader would refuse it for, from the
// safetensors headers and configs only (models/sdxl.ts's detection and its load-time shape checks), so
// inspect never calls an SDXL model fine that loadSdxl refuses. SD 1.x/2.x models go through inspect.ts.
import { ModelError } from './detect.ts';
import { validateComponent } from './load.ts';
import { SDXL_COMPONENTS, sdxlConfigs, type SdxlComponent, type SdxlSource } from './sdxl.ts';

export interface SdxlInspection {
  architecture: 'sdxl';
  predictionType: SdxlSource['prediction'];
  layout: SdxlSource['layout'];
  /** The UNet's cross-attention width: both text encoders' widths added (768 + 1280 for SDXL base). */
  contextDim: number;
  /** Text-encoder widths and encoder 2's projection (the pooled text_embeds width). */
  textEncoders: { width1: number; width2: number; projection: number };
  /** Blocks' transformer depths (SDXL base: [1, 2, 10]) and the time-id embedding width. */
  transformerLayersPerBlock: number[];
  addTimeEmbedDim: number;
  vaeScalingFactor: number;
  tensorCount: number;
  parameters: Record<SdxlComponent, number>;
  files: string[];
  /** Why the loader would refuse it, one line each; empty when it would load. */
  problems: string[];
}

const count = (shapes: Map<string, readonly number[]>) => [...shapes.values()].reduce((a, s) => a + s.reduce((x, y) => x * y, 1), 0);

export function inspectSdxl(src: SdxlSource, files: string[]): SdxlInspection {
  const problems: string[] = [];
  const num = (v: unknown) => (typeof v === 'number' ? v : NaN);
  let cfg: ReturnType<typeof sdxlConfigs> | null = null;
  try {
    cfg = sdxlConfigs(src);
  } catch (e) {
    if (!(e instanceof Error)) throw e; // ModelError, or ShapeError from a config the engine cannot read
    problems.push(e.message);
  }
  if (cfg)
    for (const c of SDXL_COMPONENTS)
      try {
        validateComponent(src.name, c, cfg.expected[c], src.shapes(c));
      } catch (e) {
        if (!(e instanceof ModelError)) throw e;
        problems.push(e.message);
      }
  const parameters = Object.fromEntries(SDXL_COMPONENTS.map((c) => [c, count(src.shapes(c))])) as Record<SdxlComponent, number>;
  const u = src.configs.unet;
  const depth = u.transformer_layers_per_block;
  return {
    architecture: 'sdxl',
    predictionType: src.prediction,
    layout: src.layout,
    contextDim: num(u.cross_attention_dim),
    textEncoders: {
      width1: num(src.configs.text_encoder.hidden_size),
      width2: num(src.configs.text_encoder_2.hidden_size),
      projection: num(src.configs.text_encoder_2.projection_dim),
    },
    transformerLayersPerBlock: Array.isArray(depth) ? (depth as number[]) : [num(depth)],
    addTimeEmbedDim: num(u.addition_time_embed_dim),
    vaeScalingFactor: num(src.configs.vae.scaling_factor),
    tensorCount: SDXL_COMPONENTS.reduce((a, c) => a + src.shapes(c).size, 0),
    parameters,
    files,
    problems,
  };
}
