#!/usr/bin/env bash
# Installs whatever is missing on a fresh machine: npm packages (when node_modules is absent or older
# than package-lock.json), Mesa lavapipe into .local/mesa, shellcheck into .local/shellcheck (the tests check the
# generated job scripts with it), and (with --browser) Debian's chromium.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# node_modules is current when its stamp holds the hash of the lock file (of package.json when there is no lock).
stamp=node_modules/.deps-stamp
if [ -f package-lock.json ]; then lock=package-lock.json; else lock=package.json; fi
want=$(sha256sum "$lock" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if [ "$lock" = package-lock.json ]; then
    echo "[deps] npm ci"
    npm ci --no-audit --no-fund --loglevel=error
  else
    echo "[deps] npm install (no package-lock.json)"
    npm install --no-audit --no-fund --loglevel=error
    lock=package-lock.json
    want=$(sha256sum "$lock" | cut -d' ' -f1)
  fi
  echo "$want" > "$stamp"
fi
bash scripts/setup-lavapipe.sh
bash scripts/setup-shellcheck.sh
if [ "${1:-}" = --browser ] && [ ! -x /usr/bin/chromium ]; then
  echo "[deps] installing Debian's chromium"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
