#!/usr/bin/env bash
# The GPU half of the course on whatever NVIDIA GPU this machine has, in one
# command that fits a time budget (`make gpu-check`; OUT=dir to choose the folder):
#
#   bash scripts/gpu_check.sh --budget 480             # the whole check, 8 minutes on an H100
#   bash scripts/gpu_check.sh --budget 480 --emulate t4  # and chapters 04b, 04c, 05, 10 as a T4 runs them
#   bash scripts/gpu_check.sh --plan                    # print the steps and their seconds, run nothing
#
# Steps run most informative first; each has an expected duration (an estimate
# for an H100, printed up front) and runs only if it fits what is left of the
# budget, with what is left as its time limit. A step that does not fit is
# reported as skipped and left for a later run: the parts add up across runs
# (steps.tsv keeps each step's latest result), e.g. STEPS="notebooks" CHAPTERS="10 11".
#
# Into the report folder:
#   versions.txt, nvidia-smi.txt  the machine and the software
#   nanovllm/MODEL.json/.txt      python -m pagedkv_lab.bench nanovllm (its default run, one
#                                 step in flight on a GPU, the step breakdown, and the
#                                 device's busy and idle time from torch.profiler)
#   nanovllm/MODEL-async.*        --compare-async: one step in flight against none in one
#                                 process, after an untimed pass, 3 alternating rounds
#   nanovllm/MODEL-greedy.*       --compare-greedy: greedy decoding against temperature 0.6
#                                 in one process, after an untimed pass, 3 alternating
#                                 rounds (the sampler's share)
#   nanovllm/profile-MODEL.txt    torch.profiler table of 20 decode steps at full batch
#   pytest.txt, pytest.xml        tests/test_gpu.py and tests/test_attention.py compiled,
#                                 the exhaustive gpu_sweep cases left out (step tests-sweep
#                                 runs them)
#   decode/, decode.txt           scripts/decode_floor.py (the engine's decode step against
#                                 the physical floor; tokens judged by pagedkv_lab.bench.compare)
#   kernels/, kernels.txt         scripts/kernel_ladder.py --sections prefill-kernel prefill
#   notebooks/NN_*.ipynb, .log    every chapter executed with GPU sizes (copies), each cell's
#                                 seconds in the log; notebooks-t4/: chapters 04b, 04c, 05, 10
#                                 with PAGEDKV_EMULATE=t4 (--emulate t4)
#   ladder/, ladder.txt           the whole kernel ladder and decode grid (optional)
#   bench/, bench.txt             python -m pagedkv_lab.bench all (optional)
#   steps.tsv                     name, pass/FAIL, seconds, log: one line per step run
#   summary.txt                   the plan, every step recorded so far, the total, the verdict:
#                                 "gpu-check: every step passed" only when every step of the
#                                 check has passed (all but the OPTIONAL ones below)
#   targets.json                  the figures the GPU issues name (scripts/gpu_targets.py)
#
# Environment: OUT (default gpu-report), PY (default .venv/bin/python, else python3),
# STEPS (names below; default: all), CHAPTERS (default 00-11), CHAPTER_TIMEOUT (seconds
# a chapter may take, default 60), STEP_TIMEOUT (the most any step may take, default 600).
set -u
BUDGET=""
EMULATE=""
PLAN_ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --plan) PLAN_ONLY=1; shift ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --budget=*) BUDGET="${1#*=}"; shift ;;
    --emulate) EMULATE="$2"; shift 2 ;;
    --emulate=*) EMULATE="${1#*=}"; shift ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (--budget SECONDS, --emulate CARD, --plan)" >&2
       exit 2 ;;
  esac
done
case "$BUDGET" in ''|*[!0-9]*) [ -z "$BUDGET" ] || { echo "--budget takes seconds" >&2; exit 2; } ;; esac

ALL_CHAPTERS="00 01 02 03 04 05 06 07 08 09 10 11"
CHAPTERS="${CHAPTERS:-$ALL_CHAPTERS}"
EMULATED_CHAPTERS="04b 04c 05 10"  # the chapters with 16-bit GPU paths (05: 05a and 05b)
STEPS="${STEPS:-versions nanovllm tests decode kernels notebooks emulate nanovllm-async nanovllm-greedy ladder bench tests-sweep}"
wants() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
OUT="${OUT:-gpu-report}"
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
STEP_TIMEOUT="${STEP_TIMEOUT:-600}"
CHAPTER_TIMEOUT="${CHAPTER_TIMEOUT:-60}"
unset TRITON_INTERPRET  # compiled kernels: the interpreter must not be on by accident
unset PAGEDKV_EMULATE   # only the emulated steps set it

# The plan: name, expected seconds on an H100 (estimates from the run of
# 2026-11-26 where a step ran then, else from its work; none is a measurement of
# this version), then the command. Most informative first.
MODELS="Qwen3-0.6B Qwen2.5-0.5B"
PLAN=()
plan() { PLAN+=("$1|$2|$3"); }
wants versions && plan "versions" 10 versions
if wants nanovllm; then
  plan "bench nanovllm Qwen3-0.6B" 30 "nanovllm Qwen3-0.6B --profile $OUT/nanovllm/profile-Qwen3-0.6B.txt"
  plan "bench nanovllm Qwen2.5-0.5B" 25 "nanovllm Qwen2.5-0.5B --profile $OUT/nanovllm/profile-Qwen2.5-0.5B.txt"
fi
wants tests && plan "pytest test_gpu + test_attention" 90 tests
wants decode && plan "decode floor" 50 decode
wants kernels && plan "kernel prefill" 25 kernels
chapter_seconds() {  # estimates for an H100, each at most CHAPTER_TIMEOUT
  # 04a-04d share the 25 s chapter 04 was estimated at before its split, 05a-05b
  # the 25 s of chapter 05
  case "$1" in 04a) echo 4 ;; 04b|04c) echo 8 ;; 04d) echo 5 ;; 05a) echo 10 ;; 05b) echo 15 ;;
    00|01|07) echo 10 ;; 02|03|08) echo 12 ;; 05|06|09) echo 25 ;; *) echo 40 ;; esac
}
if wants notebooks; then
  for n in $CHAPTERS; do
    for nb in notebooks/${n}*_*.ipynb; do  # 04 names 04a_..., 04b_...
      base=$(basename "$nb" .ipynb)
      [ -e "$nb" ] && plan "notebook $base" "$(chapter_seconds "${base%%_*}")" "notebook $nb"
    done
  done
fi
if [ -n "$EMULATE" ] && wants emulate; then
  for n in $EMULATED_CHAPTERS; do
    for nb in notebooks/${n}*_*.ipynb; do
      [ -e "$nb" ] && plan "notebook $(basename "$nb" .ipynb) as $EMULATE" 45 "emulate $nb"
    done
  done
fi
# Beyond the 8-minute check: run when the budget allows, or on their own.
# one process: the published run, an untimed pass, then 3 rounds of each mode (about 7 passes)
wants nanovllm-async && plan "bench nanovllm Qwen3-0.6B async vs sync" 180 "nanovllm Qwen3-0.6B --compare-async"
# the same for greedy decoding against the published temperature: the sampler's share
wants nanovllm-greedy && plan "bench nanovllm Qwen3-0.6B greedy vs sampled" 180 "nanovllm Qwen3-0.6B --compare-greedy"
wants ladder && plan "kernel ladder" 300 ladder
wants bench && plan "bench all" 400 bench
wants tests-sweep && plan "pytest gpu_sweep" 360 tests-sweep
# The steps "every step passed" requires: all but the optional ones.
OPTIONAL="bench nanovllm Qwen3-0.6B async vs sync|bench nanovllm Qwen3-0.6B greedy vs sampled|kernel ladder|bench all|pytest gpu_sweep"
BUDGETED=()
for entry in "${PLAN[@]}"; do
  name=${entry%%|*}
  case "|$OPTIONAL|" in *"|$name|"*) ;; *) BUDGETED+=("$name") ;; esac
done

mkdir -p "$OUT/notebooks" "$OUT/notebooks-t4" "$OUT/nanovllm" "$OUT/bench"
touch "$OUT/steps.tsv"
if [ -n "$EMULATE" ]; then  # fail now, not in the middle, if the card is unknown
  PAGEDKV_EMULATE="$EMULATE" "$PY" -c "from pagedkv_lab.device import emulated_card; emulated_card()" \
    || exit 2
fi
# Each chapter's time predicted before the run (python -m pagedkv_lab.bench.plan):
# its forward passes and kernel-benchmark rows counted on this CPU at its GPU
# sizes, priced at the committed H100 run's costs; printed beside the estimate.
PREDICTED=$("$PY" -m pagedkv_lab.bench.plan --tsv 2>/dev/null || true)
predicted() {  # predicted seconds of notebook $1 (a stem), or "-"
  awk -F '\t' -v c="$1" '$1 == c { print $2; found = 1 } END { if (!found) print "-" }' \
    <<<"$PREDICTED"
}
{
  echo "gpu-check plan (expected seconds on an H100, estimates; beside a chapter, the"
  echo "prediction of python -m pagedkv_lab.bench.plan: its forward passes and kernel"
  echo "benchmark rows counted on a CPU at its GPU sizes, priced at the committed H100"
  echo "run; model loading, compiles and graph captures outside benchmarks not seen):"
  total=0
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name seconds _ <<<"$entry"
    case "$name" in
      "notebook "*" as "*) printf '  %-44s %5s s\n' "$name" "$seconds" ;;
      "notebook "*)
        p=$(predicted "${name#notebook }")
        over=""; [ "$p" != "-" ] && [ "$p" -gt "$CHAPTER_TIMEOUT" ] && over=" (over the ${CHAPTER_TIMEOUT} s limit)"
        printf '  %-44s %5s s   predicted %4s s%s\n' "$name" "$seconds" "$p" "$over" ;;
      *) printf '  %-44s %5s s\n' "$name" "$seconds" ;;
    esac
    total=$((total + seconds))
  done
  required=0
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name seconds _ <<<"$entry"
    case "|$OPTIONAL|" in *"|$name|"*) ;; *) required=$((required + seconds)) ;; esac
  done
  echo "  in all about $total s, of which $required s for the check itself (the rest optional:"
  echo "  ${OPTIONAL//|/, })${BUDGET:+; budget $BUDGET s: steps that do not fit are skipped}"
} >"$OUT/plan.txt"
cat "$OUT/plan.txt" >&2
[ -n "$PLAN_ONLY" ] && exit 0
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  cuda=$("$PY" -c "import torch; print('torch', torch.__version__)" 2>/dev/null \
    || echo "torch not importable")
  echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False; $cuda)." >&2
  echo "Run it on a machine with an NVIDIA GPU and a CUDA build of torch, e.g." >&2
  echo "Colab with a GPU runtime. On a CPU, 'make test' checks everything else." >&2
  exit 1
fi


start=$(date +%s)
failed=0
skipped=()
# run_step NAME LOGFILE LIMIT COMMAND...: run with a time limit, log, record the result
run_step() {
  local name="$1" log="$2" limit="$3"
  shift 3
  local t0 rc status
  t0=$(date +%s)
  echo "== $name (limit ${limit}s)" >&2
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=pass ;;
    124) status="FAIL (over ${limit}s)" ;;
    *) status="FAIL (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || failed=1
  awk -F '\t' -v n="$name" '$1 != n' "$OUT/steps.tsv" >"$OUT/steps.tsv.new"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" \
    "${log#"$OUT"/}" >>"$OUT/steps.tsv.new"
  mv "$OUT/steps.tsv.new" "$OUT/steps.tsv"
  tail -n 3 "$log" >&2
}

VERSIONS='
import torch
from pagedkv_lab.device import default_dtype, device_report, gpu_spec
from pagedkv_lab.models import largest_real_shape
device = torch.device("cuda")
report = device_report(device)
report["cuda (torch build)"] = str(torch.version.cuda)
report["compute capability"] = "sm_%d%d" % gpu_spec(device).capability
report["library dtype"] = str(default_dtype(device))
report["largest real shape"] = largest_real_shape(device)
for key, value in report.items():
    print(f"{key:>20}: {value}")
'

for entry in "${PLAN[@]}"; do
  IFS='|' read -r name expected what <<<"$entry"
  limit=$STEP_TIMEOUT
  if [ -n "$BUDGET" ]; then
    left=$((BUDGET - ($(date +%s) - start)))
    if [ "$left" -lt "$expected" ]; then
      skipped+=("$name")
      echo "== $name: skipped (expected ${expected}s, ${left}s of the budget left)" >&2
      continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  set -- $what
  kind=$1
  shift
  case "$kind" in
    versions)
      nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >>"$OUT/nvidia-smi.txt"
      run_step "$name" "$OUT/versions.txt" "$limit" "$PY" -c "$VERSIONS" ;;
    nanovllm)
      model=$1; shift
      tag=$model
      case " $* " in
        *" --compare-async "*) tag="$model-async" ;;
        *" --compare-greedy "*) tag="$model-greedy" ;;
      esac
      run_step "$name" "$OUT/nanovllm/$tag.txt" "$limit" \
        "$PY" -m pagedkv_lab.bench nanovllm --model "$model" --no-peers "$@" \
        --json "$OUT/nanovllm/$tag.json" ;;
    tests)
      run_step "$name" "$OUT/pytest.txt" "$limit" \
        "$PY" -m pytest tests/test_gpu.py tests/test_attention.py -q -p no:cacheprovider \
        -m "not gpu_sweep" --junitxml="$OUT/pytest.xml" ;;
    tests-sweep)
      run_step "$name" "$OUT/pytest-sweep.txt" "$limit" \
        "$PY" -m pytest tests/test_gpu.py tests/test_attention.py -q -p no:cacheprovider \
        -m gpu_sweep ;;
    decode)
      run_step "$name" "$OUT/decode.txt" "$limit" \
        "$PY" scripts/decode_floor.py --out "$OUT/decode" --systems pagedkv hf ;;
    kernels)
      run_step "$name" "$OUT/kernels.txt" "$limit" \
        "$PY" scripts/kernel_ladder.py --sections prefill-kernel prefill --out "$OUT/kernels" ;;
    ladder)
      run_step "$name" "$OUT/ladder.txt" "$limit" \
        "$PY" scripts/kernel_ladder.py --sections checks decode ladder --out "$OUT/ladder" ;;
    notebook|emulate)
      nb=$1
      base=$(basename "$nb" .ipynb)
      folder="$OUT/notebooks"; [ "$kind" = emulate ] && folder="$OUT/notebooks-t4"
      [ "$limit" -gt "$CHAPTER_TIMEOUT" ] && limit=$CHAPTER_TIMEOUT
      # cell by cell, each cell's seconds in the log as it ends; PAGEDKV_TRACE:
      # long benchmark cells log their progress there as they go
      if [ "$kind" = emulate ]; then
        PAGEDKV_EMULATE="$EMULATE" PAGEDKV_TRACE="$folder/$base.trace" run_step "$name" \
          "$folder/$base.log" "$limit" "$PY" scripts/run_notebook.py "$nb" --out "$folder" \
          --cell-timeout "$limit"
      else
        PAGEDKV_TRACE="$folder/$base.trace" run_step "$name" "$folder/$base.log" "$limit" \
          "$PY" scripts/run_notebook.py "$nb" --out "$folder" --cell-timeout "$limit"
      fi ;;
    bench) run_step "$name" "$OUT/bench.txt" "$limit" "$PY" -m pagedkv_lab.bench all --out "$OUT/bench" ;;
  esac
done

expected=$(IFS=,; echo "${BUDGETED[*]}")
"$PY" scripts/gpu_targets.py "$OUT" "$expected" >/dev/null || echo "gpu_targets.py failed" >&2
"$PY" - "$OUT" "$(IFS=,; echo "${skipped[*]:-}")" <<'PYEOF'
import json, sys
from pathlib import Path
folder, skipped = Path(sys.argv[1]), [s for s in sys.argv[2].split(",") if s]
sys.path.insert(0, "scripts")
from gpu_targets import read_steps
steps = read_steps(folder)
check = json.loads((folder / "targets.json").read_text())["gpu_check"]
lines = [(folder / "plan.txt").read_text().rstrip(), ""]
lines += [f"{s['name']:44} {s['status']:22} {s['seconds']:5d}s  {s['log']}" for s in steps]
if skipped:
    lines.append("skipped for the budget this run: " + ", ".join(skipped))
lines.append(f"\ntotal {check['seconds']} s over {len(steps)} steps; report in {folder}/")
if check["all_passed"]:
    lines.append("gpu-check: every step passed")
elif check["failed"]:
    lines.append("gpu-check: FAILED: " + ", ".join(check["failed"]))
else:
    lines.append("gpu-check: incomplete, not yet run: " + ", ".join(check["not_run"]))
(folder / "summary.txt").write_text("\n".join(lines) + "\n")
PYEOF
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo
echo "gpu-check summary, ${gpu:-GPU}:"
cat "$OUT/summary.txt"
exit "$failed"
