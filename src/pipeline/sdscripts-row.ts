// Helpers for the settings schema's `sdScripts` rows (each setting's counterpart in the job bundle's kohya
// sd-scripts target, pipeline/bundle-sdscripts.ts): which script a run becomes, and a row for an option that
// is either given or off.
import type { BundleRow, RunSettings } from './settings.ts';

/** The sd-scripts script a run becomes: train_network.py (LoRA, networks.lora) or train_db.py (full). */
export function sdScriptOf(s: Pick<RunSettings, 'mode'>): 'train_network.py' | 'train_db.py' {
  return s.mode === 'lora' ? 'train_network.py' : 'train_db.py';
}

/** `option` when `on`, else the row "off". */
export const sdWhen = (on: boolean, option: string, note?: string): BundleRow => (on ? { option, ...(note ? { note } : {}) } : { option: null, note: 'off' });
