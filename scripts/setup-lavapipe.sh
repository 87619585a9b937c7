#!/usr/bin/env bash
# Installs Mesa's lavapipe (software Vulkan) from bookworm-backports into .local/mesa, without
# touching the system: Dawn refuses Debian bookworm's own Mesa 22.3, and 25.x has shader-f16,
# subgroups and timestamp-query. Idempotent: does nothing when .local/mesa is complete.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.local/mesa"
stamp="$dest/.installed-v1"
[ -f "$stamp" ] && exit 0

# shellcheck source=scripts/apt-local.sh
source "$root/scripts/apt-local.sh"
echo "[setup-lavapipe] fetching Mesa lavapipe from bookworm-backports into .local/mesa"
pkgs=(mesa-vulkan-drivers/bookworm-backports libdrm2/bookworm-backports libdrm-amdgpu1/bookworm-backports
      libvulkan1 libllvm15 libwayland-client0 libx11-xcb1 libxcb-dri3-0 libxcb-present0 libxcb-randr0
      libxcb-shm0 libxcb-sync1 libxcb-xfixes0 libxshmfence1 libz3-4 libedit2 libffi8 libxml2 libicu72
      libbsd0 libmd0 libelf1 libexpat1 libzstd1)
apt_local_install "$dest" mesa "${pkgs[@]}"
lib="$dest/usr/lib/x86_64-linux-gnu"
# An ICD file with an absolute library path, so nothing depends on the loader's search path.
cat > "$dest/lvp_icd.json" <<ICD
{ "file_format_version": "1.0.0", "ICD": { "library_path": "$lib/libvulkan_lvp.so", "api_version": "1.4.305" } }
ICD
touch "$stamp"
echo "[setup-lavapipe] done"
