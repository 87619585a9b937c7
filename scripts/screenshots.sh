#!/usr/bin/env bash
# npm run screenshots: refreshes the screenshots the README shows (e2e/screenshots/*.png) by running the
# e2e tests that take them with SCREENSHOTS_DIR=e2e/screenshots. (`npm test` runs the same tests but saves
# its screenshots to the git-ignored test-results/screenshots/, so it leaves the working tree clean.)
# Give test files to refresh only theirs: npm run screenshots -- e2e/studio.test.ts
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/ensure-deps.sh --browser
echo "[screenshots] vite build"
npx vite build --logLevel warn
if [ $# -gt 0 ]; then
  files=("$@")
else
  # Every e2e test that saves a screenshot (through browser.ts's screenshotPath).
  mapfile -t files < <(grep -l 'screenshotPath(' e2e/*.test.ts | sort)
fi
echo "[screenshots] ${files[*]} -> e2e/screenshots/"
export SCREENSHOTS_DIR=e2e/screenshots
exec node --import tsx --test --test-concurrency=1 "${files[@]}"
