#!/usr/bin/env bash
# Runs a command with WebGPU (Dawn) pointed at the project-local lavapipe, unless a real GPU
# driver is asked for (DBS_SYSTEM_VULKAN=1, e.g. on a machine with an NVIDIA GPU).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "${DBS_SYSTEM_VULKAN:-0}" != 1 ]; then
  bash "$root/scripts/setup-lavapipe.sh"
  export VK_ICD_FILENAMES="$root/.local/mesa/lvp_icd.json"
  export LD_LIBRARY_PATH="$root/.local/mesa/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$root/.local/xdg}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
exec "$@"
