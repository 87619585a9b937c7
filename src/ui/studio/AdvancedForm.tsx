// The studio's Advanced settings, generated from the settings schema (pipeline/settings.ts): one field per
// entry, in the schema's order, with its label, help, range, unit and step; an entry of one mode only shows
// in that mode, and one with `showWhen` only when it holds. A new option gets its field here by its entry.
import { Fragment, type ReactNode } from 'react';
import { SETTINGS, type RunSettings, type SettingKey, type SettingSpec } from '../../pipeline/settings.ts';
import { fmtBytes } from './state.ts';

/** Whether the page shows `spec`'s field for these settings. */
export function fieldShown(spec: SettingSpec, s: RunSettings): boolean {
  if (spec.hidden) return false;
  if (spec.onlyMode && spec.onlyMode !== s.mode) return false;
  return spec.showWhen ? spec.showWhen(s) : true;
}

/** One setting's input: a number, a checkbox, a text, a choice. */
function Field({ spec, s, set }: { spec: SettingSpec; s: RunSettings; set: (p: Partial<RunSettings>) => void }) {
  const key = spec.key;
  const value = s[key] as unknown;
  const put = (v: unknown) => set({ [key]: v } as Partial<RunSettings>);
  const title = spec.help + (spec.unit ? ` (${spec.unit})` : '');
  switch (spec.kind) {
    case 'bool':
      return (
        <label className="check" title={title}>
          <input type="checkbox" name={key} checked={value as boolean} onChange={(e) => put(e.target.checked)} />
          {spec.label}
        </label>
      );
    case 'string':
      return (
        <label title={title}>
          {spec.label}
          <input name={key} value={value as string} onChange={(e) => put(e.target.value)} />
        </label>
      );
    case 'enum':
      return (
        <label title={title}>
          {spec.label}
          <select name={key} value={value as string} onChange={(e) => put(e.target.value)}>
            {spec.values!.map((v) => (
              <option key={v} value={v}>
                {spec.valueLabels?.[v] ?? v}
              </option>
            ))}
          </select>
        </label>
      );
    case 'bytes':
      return (
        <label title={title}>
          {spec.label}
          <select name={key} value={value as number} onChange={(e) => put(Number(e.target.value))}>
            {[...new Set([...(spec.choices ?? []), value as number])]
              .sort((a, b) => a - b)
              .map((b) => (
                <option key={b} value={b}>
                  {fmtBytes(b)}
                </option>
              ))}
          </select>
        </label>
      );
    default: {
      const whole = spec.kind === 'int';
      return (
        <label title={title}>
          {spec.label}
          <input
            name={key}
            type="number"
            value={value as number}
            min={spec.min === Number.MIN_VALUE ? 0 : spec.min}
            max={spec.max}
            step={spec.step ?? (whole ? undefined : 'any')}
            onChange={(e) => e.target.value !== '' && put(whole ? Math.round(Number(e.target.value)) : Number(e.target.value))}
          />
        </label>
      );
    }
  }
}

/**
 * The Advanced form. `after` puts page-only controls (e.g. the class-image picker) right after a setting's
 * field, shown with it.
 */
export function AdvancedForm({
  settings,
  set,
  after = {},
}: {
  settings: RunSettings;
  set: (p: Partial<RunSettings>) => void;
  after?: Partial<Record<SettingKey, ReactNode>>;
}) {
  return (
    <form className="form" onSubmit={(e) => e.preventDefault()}>
      {SETTINGS.filter((spec) => fieldShown(spec, settings)).map((spec) => (
        <Fragment key={spec.key}>
          <Field spec={spec} s={settings} set={set} />
          {after[spec.key]}
        </Fragment>
      ))}
    </form>
  );
}
