#!/usr/bin/env bash
# npm start: installs what is missing, then serves the page (Vite dev server) on http://127.0.0.1:5173.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/ensure-deps.sh
exec npx vite --host 127.0.0.1 --port "${PORT:-5173}" "$@"
