#!/usr/bin/env bash
# The whole GPU check in one command (also `make gpu-check`): the gpu-marked tests, then the GPU benchmarks, then
# one summary table. Installs nothing: a missing dependency is named and the script exits 2. Without a CUDA GPU it
# says so and exits 0. A failing step is reported in the table and the others still run; the exit status is 1 when
# any step failed. PYTHONPATH is kept, with the repository put first.
#
#   scripts/gpu_check.sh            # PYTHON=python3.11 scripts/gpu_check.sh; GPU_CHECK_STEP_TIMEOUT=1800 (s)
#   GPU_CHECK_STEPS=stay-on,autocompare scripts/gpu_check.sh   # those steps alone (a lease shorter than the whole)
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh  # each step it would run, said, not run, on any machine (tests use it)
#   GPU_CHECK_PROFILE_DIR=$OUT/profiles       # where the profile step writes (default: the logs' folder, said)
#
# The steps' names are STEPS below, in the order they run. On a machine just started, give an autocompare step 120 s
# or more: it compiles its fused statistics first, and Python compiles every module it imports.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export DITORCH_QUIET=1
STEP_TIMEOUT=${GPU_CHECK_STEP_TIMEOUT:-1800}
STEPS="tests profiler launch launch-bf16 autocompare autocompare-per-call autocompare-bf16 autocompare-autocast monitor \
engine reductions stay-on profile"
SELECTED=${GPU_CHECK_STEPS:-}
for step in ${SELECTED//,/ }; do  # a misspelt step is named before anything runs, with or without a GPU
  case " $STEPS " in
    *" $step "*) ;;
    *) echo "gpu_check: GPU_CHECK_STEPS: unknown step '$step'; the steps are: ${STEPS// /, }"; exit 2 ;;
  esac
done

# One interpreter: the dependencies imported, not only looked up (a package that is present but broken counts as
# missing too), then the GPU asked for.
found=$("$PYTHON" - <<'EOF'
import importlib
missing = []
for name in ("torch", "numpy", "prettytable", "pytest", "transformers"):
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
if missing:
    print("missing", *missing)
else:
    import torch
    print(f"gpu torch {torch.__version__}, {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "none")
EOF
) || { echo "gpu_check: $PYTHON does not run"; exit 2; }
case "$found" in
  missing*)
    echo "gpu_check: missing dependency: ${found#missing } (install it; this script installs nothing)"
    exit 2 ;;
  none)
    if [ -z "${GPU_CHECK_DRY_RUN:-}" ]; then
      echo "gpu_check: no GPU: torch.cuda.is_available() is False on this machine; nothing to check (exit 0)"
      exit 0
    fi
    echo "gpu_check: no GPU here; a dry run: the steps are said, not run" ;;
  *)
    echo "gpu_check: ${found#gpu }" ;;
esac

logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
names=()
statuses=()
seconds=()
results=()

# run_step KEY NAME COMMAND...: unless GPU_CHECK_STEPS leaves KEY out, run it with the output shown and kept; record
# status, time and its result lines (the benchmarks' "summary:" lines, pytest's last line).
run_step() {
  local key=$1 name=$2
  shift 2
  if [ -n "$SELECTED" ] && [[ ",$SELECTED," != *",$key,"* ]]; then
    return
  fi
  if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
    echo "gpu_check: would run $key: $*"
    return
  fi
  local log="$logs/${#names[@]}.log" start=$SECONDS rc
  echo
  echo "=== gpu_check: $name: $*"
  if command -v timeout >/dev/null; then
    timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$log"
  else
    "$@" 2>&1 | tee "$log"
  fi
  rc=${PIPESTATUS[0]}
  names+=("$name")
  seconds+=($((SECONDS - start)))
  if [ "$rc" -eq 0 ]; then statuses+=("ok"); else statuses+=("FAILED (exit $rc)"); fi
  local found
  found=$(grep -E '^summary: ' "$log" | sed -e 's/^summary: //')
  [ -z "$found" ] && found=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1)
  results+=("$found")
}

run_step tests "pytest -m gpu" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider
run_step profiler "OpTimeMeasure vs torch.profiler" "$PYTHON" benchmarks/time_measure_vs_profiler.py
run_step launch "tools on the launch-bound step" "$PYTHON" benchmarks/overhead.py --device cuda --size launch-bound \
  --work-only
run_step launch-bf16 "same, bf16 autocast" "$PYTHON" benchmarks/overhead.py --device cuda --size launch-bound --work-only \
  --autocast bf16 --tools OpTimeMeasure,OpOverflowCheck
run_step autocompare "OpAutoCompare cost (device ref <= 20x step)" "$PYTHON" benchmarks/autocompare_cost.py --device cuda \
  --size real --rounds 3 --reference cpu,device
run_step autocompare-per-call "same, judged call by call (OP_AUTOCOMPARE_VERDICT_BATCH=1: what batched verdicts save, issue 33)" \
  env OP_AUTOCOMPARE_VERDICT_BATCH=1 "$PYTHON" benchmarks/autocompare_cost.py --device cuda --size real --rounds 3
run_step autocompare-bf16 "same, bf16 (0 failures, issue 34)" "$PYTHON" benchmarks/autocompare_cost.py --device cuda --size real \
  --rounds 1 --dtype bfloat16 --reference cpu,device
run_step autocompare-autocast "same, bf16 autocast" "$PYTHON" benchmarks/autocompare_cost.py --device cuda --size real --rounds 1 \
  --autocast bfloat16
run_step monitor "TrainingMonitor cost (target <= 1.05x)" "$PYTHON" benchmarks/training_monitor_cost.py --devices cuda --rounds 3
run_step engine "the engine alone, real size" "$PYTHON" benchmarks/engine_cost.py --device cuda --size real --rounds 3
run_step reductions "a call's device-side reduction, host µs" "$PYTHON" benchmarks/reduction_cost.py --device cuda
run_step stay-on "tools meant to stay on (<= 1.05x, 1.5x, 1.5x, 1.02x)" "$PYTHON" benchmarks/stay_on_cost.py --device cuda --rounds 3
run_step profile "where the stay-on tools' host time goes (cProfile, every thread's CPU time)" "$PYTHON" \
  benchmarks/stay_on_cost.py --device cuda --rounds 1 --steps 5 --profile "${GPU_CHECK_PROFILE_DIR:-$logs/profiles}"

failed=0
echo
echo "=== gpu_check summary (logs in $logs)"
printf '%-34s %-18s %6s  %s\n' "step" "status" "s" "result"
for i in "${!names[@]}"; do
  first=1
  while IFS= read -r line || [ -n "$line" ]; do
    if [ $first -eq 1 ]; then
      printf '%-34s %-18s %6s  %s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}" "$line"
      first=0
    else
      printf '%-34s %-18s %6s  %s\n' "" "" "" "$line"
    fi
  done <<<"${results[$i]}"
  [ "${statuses[$i]}" = "ok" ] || failed=1
done
exit $failed
