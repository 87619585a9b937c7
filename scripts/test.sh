#!/usr/bin/env bash
# npm test: installs what is missing, typechecks, lints (ESLint), checks formatting (Prettier), builds the page, then
# runs every test (Node suite on Dawn + lavapipe for f16 and f32, and the browser tests in headless Chromium) in one
# node:test run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/ensure-deps.sh --browser
echo "[test] typecheck"
npx tsc -p .
echo "[test] lint"
npx eslint .
echo "[test] format"
npx prettier --check .
if [ -f index.html ]; then
  echo "[test] vite build"
  npx vite build --logLevel warn
fi
mapfile -t files < <(find tests lab e2e -name '*.test.ts' 2>/dev/null | sort)
echo "[test] ${#files[@]} test files"
# New GPU tensors are NaN-filled in the tests, so code that reads memory it never wrote fails.
export DBS_GPU_POISON=1
# TAP on stdout as the run goes; the failures alone go to a file printed last, so the end of a log names them.
failures=$(mktemp)
trap 'rm -f "$failures"' EXIT
status=0
bash scripts/gpu-env.sh node --import tsx --test --test-concurrency=1 \
  --test-reporter=tap --test-reporter-destination=stdout \
  --test-reporter=./scripts/failed-tests-reporter.mjs --test-reporter-destination="$failures" \
  "${files[@]}" || status=$?
if [ -s "$failures" ]; then
  echo "[test] failed tests (exit $status):"
  cat "$failures"
fi
exit "$status"
