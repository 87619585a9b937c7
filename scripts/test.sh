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
# Node files two at a time (DBS_TEST_JOBS): a file's own GPU work on lavapipe seldom fills both cores. The slow
# ones (scripts/slow-tests.txt) start first, longest first, so no long file runs alone at the end. The browser
# files (e2e/) then run one at a time: each has a whole Chromium with SwiftShader to itself, and some measure
# how fast the page answers.
mapfile -t slow < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' scripts/slow-tests.txt | grep -v '^$')
mapfile -t all < <(find tests lab -name '*.test.ts' 2>/dev/null | sort)
node_files=("${slow[@]}")
for f in "${all[@]}"; do
  [[ " ${slow[*]} " == *" $f "* ]] || node_files+=("$f")
done
mapfile -t e2e_files < <(find e2e -name '*.test.ts' 2>/dev/null | sort)
echo "[test] ${#node_files[@]} Node test files, ${#e2e_files[@]} browser test files"
# New GPU tensors are NaN-filled in the tests, so code that reads memory it never wrote fails.
export DBS_GPU_POISON=1
# TAP on stdout as the run goes; the failures alone go to a file printed last, so the end of a log names them.
failures=$(mktemp)
failures_e2e=$(mktemp)
trap 'rm -f "$failures" "$failures_e2e"' EXIT
status=0
run_tests() { # <concurrency> <failures file> <files...>
  local jobs=$1 out=$2
  shift 2
  bash scripts/gpu-env.sh node --import tsx --test --test-concurrency="$jobs" \
    --test-reporter=tap --test-reporter-destination=stdout \
    --test-reporter=./scripts/failed-tests-reporter.mjs --test-reporter-destination="$out" \
    "$@"
}
start=$SECONDS
run_tests "${DBS_TEST_JOBS:-2}" "$failures" "${node_files[@]}" || status=$?
echo "[test] Node files: $((SECONDS - start)) s"
start=$SECONDS
run_tests 1 "$failures_e2e" "${e2e_files[@]}" || status=$?
echo "[test] browser files: $((SECONDS - start)) s"
if [ -s "$failures" ] || [ -s "$failures_e2e" ]; then
  echo "[test] failed tests (exit $status):"
  cat "$failures" "$failures_e2e"
fi
exit "$status"
