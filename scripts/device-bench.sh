#!/usr/bin/env bash
# The prepared GPU run of issue 44 (item 4), for a lent NVIDIA GPU through the `device` tool, in at most 9 minutes,
# each stage time-boxed (timeouts sum to 505 s, each plus 5 s to kill) so one that hangs cannot eat the others:
#   1 step-128-simt   the SD 1.5 LoRA step at 128 px (SIMT kernels) with the PyTorch f32 and AMP peers      90 s
#   2 step-512-simt   the 512 px batch-2 step with the PyTorch f32 and AMP peers                           150 s
#   3 kernels-simt    kernel rates, f16 and f32, SIMT kernels, PyTorch beside them                          60 s
#   4 kernels-tc      kernel rates, f16, tensor cores (the default; the SIMT stages set DBS_TENSOR_CORES=0)  45 s
#   5 step-128-tc     the 128 px step with tensor cores                                                      60 s
#   6 selftest-tc     the tensor-core self-test (every case; matmul/conv f16 through tensor cores)           60 s
#   7 table           measured vs MODELLED (bench/census-compare.ts: the census's figures and the model
#                     recalibrated on stage 1's profile; no GPU work)                                        40 s
# Results go to bench/results/device/ (JSON per stage, logs/*.log), the table to bench/results/device/table.json.
# The GEMM tuner is off (DBS_GPU_TUNE=off): the census models the default kernel choices, so the run measures them.
# Dawn toggles (src/gpu/node.ts, always passed by the Node host): vulkan_enable_f16_on_nvidia (shader-f16 on NVIDIA),
# allow_unsafe_apis (subgroup matrices), timestamp_quantization disabled.
#
# Usage, on this machine first:   bash scripts/device-bench.sh --pack      (device-pack.sh plus the table's bundle)
#        then on the GPU machine: source .dev/setup.sh && bash scripts/device-bench.sh    (run with carry ['.dev'])
#        here, to check every stage starts (lavapipe, tiny shapes, seconds each):  bash scripts/device-bench.sh --smoke
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

mode=device
case "${1:-}" in
  --pack) mode=pack ;;
  --smoke) mode=smoke ;;
  '') ;;
  *) echo "device-bench.sh: unknown argument '$1' (use --pack, --smoke or nothing)" >&2; exit 2 ;;
esac

if [ "$mode" = pack ]; then
  bash scripts/device-pack.sh
  npx esbuild bench/census-compare.ts --bundle --platform=node --format=esm --target=node20 --external:webgpu --log-level=warning \
    --banner:js="import { createRequire as __cr } from 'node:module'; const require = __cr(import.meta.url);" --outfile=.dev/census-compare.mjs
  exit 0
fi

out=bench/results/device
[ "$mode" = smoke ] && out=$(mktemp -d /tmp/device-bench-smoke.XXXX)
mkdir -p "$out/logs"
export DBS_GPU_TUNE=off

# Entry points: the .dev bundles on the device machine (no tsx there), tsx on lavapipe for --smoke.
if [ "$mode" = device ]; then
  cp .dev/census-compare.mjs bench/ 2>/dev/null || echo "note: .dev/census-compare.mjs missing (run --pack): the table stage will fail"
  STEP=(node bench/step.mjs) KERNELS=(node bench/kernels-node.mjs) SELFTEST=(node scripts/selftest-node.mjs) COMPARE=(node bench/census-compare.mjs)
  TORCH=(--torch-device cuda)
else
  STEP=(bash scripts/gpu-env.sh npx tsx bench/step.ts) KERNELS=(bash scripts/gpu-env.sh npx tsx bench/kernels-node.ts)
  SELFTEST=(bash scripts/gpu-env.sh npx tsx scripts/selftest-node.ts) COMPARE=(npx tsx bench/census-compare.ts)
  TORCH=()
fi

status=0
# stage NAME SECONDS COMMAND...: runs it under `timeout`, its output in logs/NAME.log, and records how it ended.
# With STARTS=PATTERN (smoke) a stage that timed out still passes when its log shows PATTERN: it started.
stage() {
  local name=$1 secs=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=5 "$secs" "$@" >"$out/logs/$name.log" 2>&1
  local rc=$?
  local note=''
  [ $rc = 124 ] && note=', TIMED OUT'
  if [ $rc = 124 ] && [ -n "${STARTS:-}" ] && grep -q "$STARTS" "$out/logs/$name.log"; then
    note=", stopped at the limit after starting ('$STARTS' seen)"
    rc=0
  fi
  echo "stage $name: exit $rc after $((SECONDS - t0)) s (limit $secs s)$note" | tee -a "$out/logs/stages.log"
  [ $rc = 0 ] || status=1
  tail -n 4 "$out/logs/$name.log"
}

if [ "$mode" = smoke ]; then
  # On lavapipe each stage only has to start and do its first unit of work: the tiny UNet's step (no SD 1.5 there:
  # lavapipe takes minutes per SD 1.5 step), one small kernel case, the self-test's first cases, and the table from
  # the committed H200 profile.
  stage step-128-simt 300 env DBS_TENSOR_CORES=0 "${STEP[@]}" --cases tiny-lora --quick --budget-gib 4 --out "$out/step-128-simt.json"
  stage kernels-simt 300 env DBS_TENSOR_CORES=0 "${KERNELS[@]}" --quick --only mm320 --reps 1 --dtypes f32 --out "$out/kernels-simt.json"
  STARTS='^ok ' stage selftest-tc 90 env DBS_TENSOR_CORES=1 "${SELFTEST[@]}"
  stage table 200 "${COMPARE[@]}" --step bench/results/step-nvidia-h200.json --label 2756811-profile --out "$out/table.json"
  echo "smoke results in $out"
  exit $status
fi

B=(--budget-gib 24)
stage step-128-simt 90 env DBS_TENSOR_CORES=0 "${STEP[@]}" --cases sd15-lora --sd15-px 128 "${B[@]}" "${TORCH[@]}" --out "$out/step-128-simt.json"
stage step-512-simt 150 env DBS_TENSOR_CORES=0 "${STEP[@]}" --cases sd15-lora --sd15-px 512 "${B[@]}" "${TORCH[@]}" --out "$out/step-512-simt.json"
stage kernels-simt 60 env DBS_TENSOR_CORES=0 "${KERNELS[@]}" --reps 5 "${TORCH[@]}" --out "$out/kernels-simt.json"
stage kernels-tc 45 env DBS_TENSOR_CORES=1 "${KERNELS[@]}" --reps 5 --dtypes f16 --out "$out/kernels-tc.json"
stage step-128-tc 60 env DBS_TENSOR_CORES=1 "${STEP[@]}" --cases sd15-lora --sd15-px 128 "${B[@]}" --out "$out/step-128-tc.json"
stage selftest-tc 60 env DBS_TENSOR_CORES=1 "${SELFTEST[@]}"
stage table 40 "${COMPARE[@]}" --step "$out/step-128-simt.json" --label "$(git rev-parse --short HEAD 2>/dev/null || echo device)" --out "$out/table.json"
exit $status
