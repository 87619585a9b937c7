#!/usr/bin/env bash
# Installs whatever is missing on a fresh machine: npm packages (when node_modules is absent or older
# than package-lock.json), Mesa lavapipe into .local/mesa, and (with --browser) Debian's chromium.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
stamp=node_modules/.deps-stamp
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[deps] npm ci"
  npm ci --no-audit --no-fund --loglevel=error
  echo "$want" > "$stamp"
fi
bash scripts/setup-lavapipe.sh
if [ "${1:-}" = --browser ] && [ ! -x /usr/bin/chromium ]; then
  echo "[deps] installing Debian's chromium"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
