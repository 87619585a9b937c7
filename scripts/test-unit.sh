#!/usr/bin/env bash
# npm run test:unit: the fast tier. Every Node test file (tests/**/*.test.ts and lab/**/*.test.ts) except the slow
# ones listed below, on Dawn + lavapipe with new GPU tensors NaN-filled; no browser, no e2e/, no typecheck or lint.
# Meant to take at most 8 minutes on the 2-core CI machine; `npm test` still runs everything (docs/testing.md).
# Arguments go to node --test (e.g. --test-name-pattern norm).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# The slow list: files that need minutes because they train end to end, measure quality, pretrain, or start many
# command-line processes. A new test file is in the unit tier unless it is added here with its reason.
SLOW=(
  tests/reliability/corpus.test.ts        # every bad-input case through a fresh command-line process
  tests/reliability/signals.test.ts       # runs killed and interrupted mid-training, then resumed
  tests/studio/session.test.ts            # the studio session trains the demo model (about 5.5 min alone)
  tests/train/cli-train.test.ts           # cli train end to end, SIGKILL and --resume
  tests/train/compact-quality.test.ts     # 200 full fine-tune steps in each optimizer mode
  tests/train/compact-modes.test.ts       # bit-identical resume in every optimizer mode (about 2 min)
  tests/train/fused.test.ts               # fused against unfused steps, bit for bit (1-3 min)
  lab/demo-model/tests/pretrain.test.ts   # pretraining runs killed mid-stage and resumed
  lab/demo-model/tests/cli-pretrain.test.ts
  lab/demo-model/tests/quality.test.ts    # DreamBooth quality runs on the 16 px fixture
  lab/demo-model/tests/quality-demo.test.ts
  lab/demo-model/tests/shipped-demo-draws.test.ts # samples grids from both demo models
)

for f in "${SLOW[@]}"; do
  if [ ! -f "$f" ]; then
    echo "scripts/test-unit.sh: $f is on the slow list but does not exist; update the list" >&2
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
start=$SECONDS
status=0
bash scripts/gpu-env.sh node --import tsx --test --test-concurrency=1 "$@" "${files[@]}" || status=$?
echo "[test:unit] $((SECONDS - start)) s, exit $status"
exit "$status"
