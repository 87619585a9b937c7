#!/usr/bin/env bash
# npm test: installs what is missing, typechecks, lints (ESLint), checks formatting (Prettier), builds the page, then
# runs every test: the Node suite on Dawn + lavapipe (f16 and f32), then the browser tests in headless Chromium.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/ensure-deps.sh --browser
# The four checks are independent: two at a time, each one's output printed whole when it ends.
checks=$(mktemp -d)
check() { # <name> <command...>: runs in the background, output to $checks/<name>
  local name=$1
  shift
  ( "$@" >"$checks/$name" 2>&1 && echo ok >>"$checks/$name.rc" || echo "failed ($?)" >>"$checks/$name.rc" ) &
}
report() { # <name>: prints a finished check's output, returns its status
  echo "[test] $1: $(cat "$checks/$1.rc")"
  cat "$checks/$1"
  [ "$(cat "$checks/$1.rc")" = ok ]
}
check_status=0
check typecheck npx tsc -p .
check lint npx eslint .
wait
report typecheck || check_status=1
report lint || check_status=1
check format npx prettier --check .
[ -f index.html ] && check build npx vite build --logLevel warn
wait
report format || check_status=1
if [ -f index.html ]; then report build || check_status=1; fi
rm -rf "$checks"
[ "$check_status" = 0 ] || exit 1
# Every test file, two at a time (DBS_TEST_JOBS) with the browser files (e2e/) one at a time beside the Node files
# (scripts/run-tests.mjs says why). The slow list (scripts/slow-tests.txt) starts first, in its order.
mapfile -t slow < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' scripts/slow-tests.txt | grep -v '^$')
mapfile -t all < <(find tests lab e2e -name '*.test.ts' 2>/dev/null | sort)
files=("${slow[@]}")
for f in "${all[@]}"; do
  [[ " ${slow[*]} " == *" $f "* ]] || files+=("$f")
done
echo "[test] ${#files[@]} test files"
# New GPU tensors are NaN-filled in the tests, so code that reads memory it never wrote fails.
export DBS_GPU_POISON=1
# TAP on stdout, each file whole as it ends; the failures alone go to a file printed last, so the end of a log
# names them.
failures=$(mktemp)
trap 'rm -f "$failures"' EXIT
status=0
start=$SECONDS
bash scripts/gpu-env.sh node scripts/run-tests.mjs --jobs "${DBS_TEST_JOBS:-2}" --failures "$failures" -- "${files[@]}" || status=$?
echo "[test] tests: $((SECONDS - start)) s"
if [ -s "$failures" ]; then
  echo "[test] failed tests (exit $status):"
  cat "$failures"
fi
exit "$status"
