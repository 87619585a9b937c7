// The studio's Advanced form is generated from the settings schema: a field per entry the mode and the
// entry's show-when allow, with the entry's label and range (the rank caps at the schema's 1024, not a
// hand-written 256), and page-only controls placed after the field they belong to.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { createElement } from 'react';
import { renderToStaticMarkup } from 'react-dom/server';
import { SETTINGS, type RunSettings } from '../../src/pipeline/settings.ts';
import { AdvancedForm, fieldShown } from '../../src/ui/studio/AdvancedForm.tsx';
import { PAGE_DEFAULTS } from '../../src/ui/studio/presets.ts';

const html = (settings: RunSettings, after = {}) => renderToStaticMarkup(createElement(AdvancedForm, { settings, set: () => undefined, after }));
const input = (markup: string, name: string) => markup.match(new RegExp(`<(input|select)[^>]*name="${name}"[^>]*>`))?.[0] ?? null;

void describe('Advanced form (generated from the schema)', () => {
  void it("shows each entry's field with its label and the schema's range", () => {
    const m = html(PAGE_DEFAULTS);
    for (const spec of SETTINGS.filter((s) => fieldShown(s, PAGE_DEFAULTS))) {
      assert.ok(m.includes(`>${spec.label.replace(/&/g, '&amp;').replace(/"/g, '&quot;')}<`), `label of ${spec.key}`);
      assert.ok(input(m, spec.key), `field of ${spec.key}`);
    }
    assert.match(input(m, 'rank')!, /max="1024"/);
    assert.match(input(m, 'steps')!, /min="1" max="1000000"/);
    assert.equal(input(m, 'mode'), null, 'the mode is the preset, not an Advanced field');
  });

  void it('hides what the mode or a show-when rules out, and shows it once it applies', () => {
    const full = html({ ...PAGE_DEFAULTS, mode: 'full' });
    assert.equal(input(full, 'rank'), null);
    assert.ok(input(full, 'fusedUpdates'));
    assert.equal(input(html(PAGE_DEFAULTS), 'lrCycles'), null);
    assert.ok(input(html({ ...PAGE_DEFAULTS, lrScheduler: 'cosine_with_restarts' }), 'lrCycles'));
    assert.equal(input(html(PAGE_DEFAULTS), 'textEncoderLr'), null);
    assert.ok(input(html({ ...PAGE_DEFAULTS, trainTextEncoder: true }), 'textEncoderLr'));
  });

  void it("puts a page-only control right after its setting's field, only when that field shows", () => {
    const extra = { classSteps: createElement('span', { id: 'picker' }, 'Add class images') };
    assert.ok(!html({ ...PAGE_DEFAULTS, priorPreservation: false }, extra).includes('id="picker"'));
    const m = html({ ...PAGE_DEFAULTS, priorPreservation: true }, extra);
    assert.ok(m.indexOf('name="classSteps"') < m.indexOf('id="picker"') && m.includes('id="picker"'));
  });
});
