#!/usr/bin/env bash
# npm run test:unit: the fast tier. Every Node test file (tests/**/*.test.ts and lab/**/*.test.ts) except the slow
# ones (scripts/slow-tests.txt), on Dawn + lavapipe with new GPU tensors NaN-filled; no browser, no e2e/, no typecheck or lint.
# Meant to take at most 8 minutes on the 2-core CI machine; `npm test` still runs everything (docs/testing.md).
# Arguments go to node --test (e.g. --test-name-pattern norm).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# The slow list (scripts/slow-tests.txt, each with its reason) is left out here.
mapfile -t SLOW < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' scripts/slow-tests.txt | grep -v -e '^$' -e '^e2e/')

for f in "${SLOW[@]}"; do
  if [ ! -f "$f" ]; then
    echo "scripts/slow-tests.txt lists $f, which does not exist; update the list" >&2
    exit 1
  fi
done

bash scripts/ensure-deps.sh
mapfile -t all < <(find tests lab -name '*.test.ts' 2>/dev/null | sort)
files=()
for f in "${all[@]}"; do
  slow=0
  for s in "${SLOW[@]}"; do [ "$f" = "$s" ] && slow=1; done
  [ "$slow" = 1 ] || files+=("$f")
done
echo "[test:unit] ${#files[@]} test files (${#SLOW[@]} slow ones left out)"
# New GPU tensors are NaN-filled, so code that reads memory it never wrote fails (as in npm test).
export DBS_GPU_POISON=1
# The same runner as npm test (scripts/run-tests.mjs: two files at a time, each file's own environment, the time per
# file and the failures at the end); this script's arguments go to each file's node.
options=()
for a in "$@"; do options+=(--node-option "$a"); done
failures=$(mktemp)
trap 'rm -f "$failures"' EXIT
start=$SECONDS
status=0
bash scripts/gpu-env.sh node scripts/run-tests.mjs --jobs "${DBS_TEST_JOBS:-2}" --failures "$failures" "${options[@]}" -- "${files[@]}" || status=$?
echo "[test:unit] $((SECONDS - start)) s, exit $status"
if [ -s "$failures" ]; then
  echo "[test:unit] failed tests:"
  cat "$failures"
fi
exit "$status"
