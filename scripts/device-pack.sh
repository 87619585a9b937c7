#!/usr/bin/env bash
# Packs what a run on the lent GPU machine (the `device` tool: no Node.js, no registry there) needs into .dev/
# (git-ignored; name it in the run's `carry`):
#   node.xz                 this machine's Node binary, xz-compressed (the tree travels with a 64 MiB limit)
#   webgpu/                 the `webgpu` package with only its linux-x64 dawn.node (xz-compressed)
#   *.mjs                   esbuild bundles of the Node entry points (no tsx or node_modules needed there)
#   debs/                   the Vulkan loader (libvulkan1), per the device README
#   setup.sh                run first there: `source .dev/setup.sh` unpacks all that and puts node on PATH
# Usage: bash scripts/device-pack.sh    (then `run` with carry ['.dev'])
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dev=.dev
mkdir -p $dev/webgpu $dev/debs
[ -f $dev/node.xz ] || xz -T0 -9 -c "$(readlink -f "$(command -v node)")" >$dev/node.xz
cp node_modules/webgpu/index.js node_modules/webgpu/package.json $dev/webgpu/
[ -f $dev/webgpu/dawn.node.xz ] || xz -T0 -9 -c node_modules/webgpu/dist/linux-x64/dawn.node >$dev/webgpu/dawn.node.xz
if ! ls $dev/debs/libvulkan1_*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/amd64/partial
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  apt-get $o update -qq && (cd $dev/debs && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
fi
bundle() { npx esbuild "$1" --bundle --platform=node --format=esm --target=node20 --external:webgpu --log-level=warning \
  --banner:js="import { createRequire as __cr } from 'node:module'; const require = __cr(import.meta.url);" --outfile="$2"; }
bundle scripts/selftest-node.ts $dev/selftest-node.mjs
bundle bench/kernels-node.ts $dev/kernels-node.mjs
bundle bench/step.ts $dev/step.mjs
bundle src/cli/main.ts $dev/cli.mjs
bundle lab/demo-model/cli.ts $dev/lab-pretrain.mjs
for f in bench/devprobe.ts; do [ -f "$f" ] && bundle "$f" $dev/$(basename "$f" .ts).mjs; done
cat >$dev/setup.sh <<'SH'
# source .dev/setup.sh on the device machine, in the repository root
for f in .dev/debs/*.deb; do dpkg -x "$f" /; done; ldconfig
mkdir -p /tmp/nodebin && xz -dc .dev/node.xz >/tmp/nodebin/node && chmod +x /tmp/nodebin/node && export PATH=/tmp/nodebin:$PATH
mkdir -p node_modules/webgpu/dist/linux-x64 && cp .dev/webgpu/index.js .dev/webgpu/package.json node_modules/webgpu/
xz -dc .dev/webgpu/dawn.node.xz >node_modules/webgpu/dist/linux-x64/dawn.node
# bundles run from where their sources sit, so paths relative to import.meta.url hold
cp .dev/selftest-node.mjs scripts/; cp .dev/kernels-node.mjs .dev/step.mjs bench/; cp .dev/cli.mjs src/cli/; cp .dev/lab-pretrain.mjs lab/demo-model/
[ -f .dev/devprobe.mjs ] && cp .dev/devprobe.mjs bench/
export DBS_SHADERS_DIR=$PWD/shaders DBS_SYSTEM_VULKAN=1 PYTHON=$(command -v python3)
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
true
SH
du -sh $dev; du -sh $dev/*
