#!/usr/bin/env bash
# One command that checks the CUDA path on whatever GPU this machine has and
# writes a report folder (`make gpu-check`; OUT=dir to choose it):
#   versions.txt, nvidia-smi.txt  the machine and the software
#   pytest.txt, pytest.xml        tests/test_gpu.py and tests/test_attention.py
#   kernels/, kernels.txt         scripts/kernel_ladder.py (summary.txt: the targets)
#   notebooks/NN_*.ipynb, .log    chapters 04-11 executed with GPU sizes, each
#                                 cell's seconds in the log (scripts/run_notebook.py;
#                                 copies: the committed CPU outputs stay as they are)
#   bench/, bench.txt             python -m pagedkv_lab.bench all
#   summary.txt                   pass/fail and seconds per step
# Every step runs even when an earlier one failed; the exit code is 1 if any did.
# Environment: OUT (default gpu-report), PY (default .venv/bin/python, else
# python3: `PY=python3 bash scripts/gpu_check.sh` on a GPU machine whose python
# already has the package's requirements and no network), STEP_TIMEOUT (seconds
# per step, default 600), STEPS (default "tests kernels notebooks bench"; the versions
# always run) and CHAPTERS (default "04 05 06 07 08 09 10 11"), to split a run
# over several commands, e.g. STEPS=notebooks CHAPTERS="10 11".
set -u
STEPS="${STEPS:-tests kernels notebooks bench}"
CHAPTERS="${CHAPTERS:-04 05 06 07 08 09 10 11}"
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

mkdir -p "$OUT/notebooks" "$OUT/bench"
: > "$OUT/summary.txt"
failed=0
start_all=$(date +%s)

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
  printf '%-34s %-22s %5ss  %s\n' "$name" "$status" "$(($(date +%s) - t0))" \
    "${log#"$OUT"/}" >>"$OUT/summary.txt"
  tail -n 2 "$log" >&2
}

# 1. the machine and the software
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >>"$OUT/nvidia-smi.txt"
run_step "versions" "$OUT/versions.txt" "$PY" -c '
import torch
from pagedkv_lab.device import device_report
report = device_report(torch.device("cuda"))
report["cuda (torch build)"] = str(torch.version.cuda)
report["compute capability"] = "sm_%d%d" % torch.cuda.get_device_capability()
report["bf16 supported"] = str(torch.cuda.is_bf16_supported())
for key, value in report.items():
    print(f"{key:>20}: {value}")
'

# 2. every GPU test, and the attention tests compiled for this GPU
if wants tests; then
  run_step "pytest test_gpu + test_attention" "$OUT/pytest.txt" \
    "$PY" -m pytest tests/test_gpu.py tests/test_attention.py -q -p no:cacheprovider \
    --junitxml="$OUT/pytest.xml"
fi

# 2b. every attention kernel checked and timed, the targets last
if wants kernels; then
  run_step "kernel ladder" "$OUT/kernels.txt" \
    "$PY" scripts/kernel_ladder.py --out "$OUT/kernels"
fi

# 3. chapters 04-11, executed with GPU sizes, into the report (not in place)
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
    run_step "notebook $base" "$OUT/notebooks/$base.log" \
      "$PY" scripts/run_notebook.py "$nb" --out "$OUT/notebooks" \
      --cell-timeout "$STEP_TIMEOUT"
  done
done

# 4. the benchmark suite on this device
if wants bench; then
  run_step "bench all" "$OUT/bench.txt" "$PY" -m pagedkv_lab.bench all --out "$OUT/bench"
fi

total=$(($(date +%s) - start_all))
{
  echo
  echo "total ${total}s; report in $OUT/"
  if [ "$failed" -eq 0 ]; then echo "gpu-check: every step passed"; else
    echo "gpu-check: FAILED (see the logs named above)"; fi
} >>"$OUT/summary.txt"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo
echo "gpu-check summary, ${gpu:-GPU}:"
cat "$OUT/summary.txt"
exit "$failed"
