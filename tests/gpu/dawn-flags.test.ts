// The Node host's Dawn flags: our toggles (f16 on NVIDIA, unsafe APIs, unquantized timestamps) are always
// there, and DBS_DAWN_FLAGS adds to them without replacing them (the webgpu package keeps one value per flag
// name, so toggles of one kind must travel in one comma-separated flag).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { dawnFlags, nodeGpu } from '../../src/gpu/node.ts';

describe('dawnFlags', () => {
  it('enables f16 on NVIDIA and unsafe APIs, and disables timestamp quantization', () => {
    assert.deepEqual(dawnFlags(), ['enable-dawn-features=vulkan_enable_f16_on_nvidia,allow_unsafe_apis', 'disable-dawn-features=timestamp_quantization']);
  });

  it('merges extra toggles of either kind into the one flag, once each, and passes other flags through', () => {
    const flags = dawnFlags([
      'enable-dawn-features=dump_shaders,allow_unsafe_apis',
      'backend=vulkan',
      'disable-dawn-features=lazy_clear_resource_on_first_use',
    ]);
    assert.deepEqual(flags, [
      'enable-dawn-features=vulkan_enable_f16_on_nvidia,allow_unsafe_apis,dump_shaders',
      'disable-dawn-features=timestamp_quantization,lazy_clear_resource_on_first_use',
      'backend=vulkan',
    ]);
    assert.equal(flags.filter((f) => f.startsWith('enable-dawn-features=')).length, 1);
  });
});

describe('the Node device with these toggles', () => {
  it('still has shader-f16, subgroups and timestamp-query here (lavapipe), and f16 compute', async () => {
    const gpu = await nodeGpu();
    for (const f of ['shader-f16', 'subgroups', 'timestamp-query'])
      assert.ok(gpu.adapter.features.includes(f), `${f} missing: ${gpu.adapter.features.join(' ')}`);
    assert.equal(gpu.computeDType, 'f16');
    gpu.destroy();
  });
});
