#!/usr/bin/env bash
# The whole GPU half of the course on whatever NVIDIA GPU this machine has, in
# steps, into a report folder (`make gpu-check`; OUT=dir to choose it):
#   versions.txt, nvidia-smi.txt  the machine and the software
#   pytest.txt, pytest.xml        tests/test_gpu.py and tests/test_attention.py, compiled
#   kernels/, kernels.txt         scripts/kernel_ladder.py (every attention kernel checked
#                                 and timed, the decode/prefill figures, results.json)
#   decode/, decode.txt           scripts/decode_floor.py (the engine's decode step
#                                 against the physical floor, at the largest real shape
#                                 that fits the card)
#   nanovllm/, nanovllm.txt       python -m pagedkv_lab.bench nanovllm, per model
#   notebooks/NN_*.ipynb, .log    every chapter (00-11) executed with GPU sizes, each
#                                 cell's seconds in the log (scripts/run_notebook.py;
#                                 copies: the committed CPU outputs stay as they are)
#   bench/, bench.txt             python -m pagedkv_lab.bench all
#   steps.tsv                     one line per step: name, pass/FAIL, seconds, log
#   summary.txt                   every step recorded so far, the total, and the verdict:
#                                 "gpu-check: every step passed" only when every step of
#                                 the whole script has run and passed
#   targets.json                  the figures the GPU issues name (scripts/gpu_targets.py)
# Every step runs even when an earlier one failed; the exit code is 1 if any did.
#
# A machine that allows 10-minute commands runs it in parts into one folder; the
# parts add up (steps.tsv keeps each step's latest result), e.g.
#   STEPS="versions tests" ...;  STEPS=kernels ...;  STEPS="decode nanovllm" ...;
#   STEPS=notebooks CHAPTERS="00 01 02 03 04 05" ...;  CHAPTERS="06 07 08" ...;
#   CHAPTERS="09 10 11" ...;  STEPS=bench ...
# Environment: OUT (default gpu-report), PY (default .venv/bin/python, else
# python3: `PY=python3 bash scripts/gpu_check.sh` on a GPU machine whose python
# already has the package's requirements and no network), STEP_TIMEOUT (seconds
# per step, default 600), STEPS (default: all of "versions tests kernels decode
# nanovllm notebooks bench"), CHAPTERS (default: every chapter, 00-11).
set -u
ALL_STEPS="versions tests kernels decode nanovllm notebooks bench"
ALL_CHAPTERS="00 01 02 03 04 05 06 07 08 09 10 11"
NANOVLLM_MODELS="${NANOVLLM_MODELS:-Qwen2.5-0.5B Qwen3-0.6B}"
STEPS="${STEPS:-$ALL_STEPS}"
CHAPTERS="${CHAPTERS:-$ALL_CHAPTERS}"
wants() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

OUT="${OUT:-gpu-report}"
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
STEP_TIMEOUT="${STEP_TIMEOUT:-600}"
# Compiled kernels on a GPU: the interpreter must not be switched on by accident.
unset TRITON_INTERPRET

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
then
  cuda=$("$PY" -c "import torch; print('torch', torch.__version__)" 2>/dev/null \
    || echo "torch not importable")
  echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False; $cuda)." >&2
  echo "Run it on a machine with an NVIDIA GPU and a CUDA build of torch, e.g." >&2
  echo "Colab with a GPU runtime. On a CPU, 'make test' checks everything else." >&2
  exit 1
fi

mkdir -p "$OUT/notebooks" "$OUT/bench" "$OUT/nanovllm"
touch "$OUT/steps.tsv"
failed=0

# run_step NAME LOGFILE COMMAND...: run with a time limit, log, record the result
run_step() {
  local name="$1" log="$2"
  shift 2
  local t0 rc status
  t0=$(date +%s)
  echo "== $name" >&2
  if command -v timeout >/dev/null; then
    timeout "$STEP_TIMEOUT" "$@" >"$log" 2>&1
  else
    "$@" >"$log" 2>&1
  fi
  rc=$?
  case $rc in
    0) status=pass ;;
    124) status="FAIL (over ${STEP_TIMEOUT}s)" ;;
    *) status="FAIL (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || failed=1
  # the step's latest result replaces any earlier one (a part run again)
  awk -F '\t' -v n="$name" '$1 != n' "$OUT/steps.tsv" >"$OUT/steps.tsv.new"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" \
    "${log#"$OUT"/}" >>"$OUT/steps.tsv.new"
  mv "$OUT/steps.tsv.new" "$OUT/steps.tsv"
  tail -n 2 "$log" >&2
}

# 1. the machine and the software
if wants versions; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >>"$OUT/nvidia-smi.txt"
  run_step "versions" "$OUT/versions.txt" "$PY" -c '
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
fi

# 2. every GPU test, and the attention tests compiled for this GPU
if wants tests; then
  run_step "pytest test_gpu + test_attention" "$OUT/pytest.txt" \
    "$PY" -m pytest tests/test_gpu.py tests/test_attention.py -q -p no:cacheprovider \
    --junitxml="$OUT/pytest.xml"
fi

# 2b. every attention kernel checked and timed, the issue's targets last
if wants kernels; then
  run_step "kernel ladder" "$OUT/kernels.txt" \
    "$PY" scripts/kernel_ladder.py --out "$OUT/kernels"
fi

# 2c. the engine's decode step against the physical floor, and nano-vllm's benchmark
if wants decode; then
  run_step "decode floor" "$OUT/decode.txt" \
    "$PY" scripts/decode_floor.py --out "$OUT/decode"
fi
if wants nanovllm; then
  for model in $NANOVLLM_MODELS; do
    run_step "bench nanovllm $model" "$OUT/nanovllm/$model.txt" \
      "$PY" -m pagedkv_lab.bench nanovllm --model "$model" --json "$OUT/nanovllm/$model.json"
  done
  # the same run with one step in flight, to decide async_scheduling's default
  model=${NANOVLLM_MODELS%% *}
  run_step "bench nanovllm $model async" "$OUT/nanovllm/$model-async.txt" \
    "$PY" -m pagedkv_lab.bench nanovllm --model "$model" --async-scheduling --no-peers \
    --json "$OUT/nanovllm/$model-async.json"
fi

# 3. every chapter, executed with GPU sizes, into the report (not in place)
wants notebooks || CHAPTERS=""
for n in $CHAPTERS; do
  for nb in notebooks/${n}_*.ipynb; do
    if [ ! -e "$nb" ]; then
      printf '%-34s %-22s\n' "notebook $n" "skipped (not found)" >>"$OUT/summary.txt"
      continue
    fi
    base=$(basename "$nb" .ipynb)
    # cell by cell, each cell's seconds in the log as it ends (a chapter cut off
    # by the time limit still says where its time went)
    # PAGEDKV_TRACE: long benchmark cells log their progress there as they go
    PAGEDKV_TRACE="$OUT/notebooks/$base.trace" run_step "notebook $base" "$OUT/notebooks/$base.log" \
      "$PY" scripts/run_notebook.py "$nb" --out "$OUT/notebooks" \
      --cell-timeout "$STEP_TIMEOUT"
  done
done

# 4. the benchmark suite on this device
if wants bench; then
  run_step "bench all" "$OUT/bench.txt" "$PY" -m pagedkv_lab.bench all --out "$OUT/bench"
fi

# The whole script's expected steps, to tell "every step passed" from "so far".
expected="versions,pytest test_gpu + test_attention,kernel ladder,decode floor"
for model in $NANOVLLM_MODELS; do expected="$expected,bench nanovllm $model"; done
expected="$expected,bench nanovllm ${NANOVLLM_MODELS%% *} async"
for n in $ALL_CHAPTERS; do
  for nb in notebooks/${n}_*.ipynb; do
    [ -e "$nb" ] && expected="$expected,notebook $(basename "$nb" .ipynb)"
  done
done
expected="$expected,bench all"
"$PY" scripts/gpu_targets.py "$OUT" "$expected" >/dev/null \
  || echo "gpu_targets.py failed" >&2
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
folder = Path(sys.argv[1])
sys.path.insert(0, "scripts")
from gpu_targets import read_steps
steps = read_steps(folder)
check = json.loads((folder / "targets.json").read_text())["gpu_check"]
lines = [f"{s['name']:40} {s['status']:22} {s['seconds']:5d}s  {s['log']}" for s in steps]
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
