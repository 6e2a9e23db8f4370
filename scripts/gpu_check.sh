#!/usr/bin/env bash
# Every GPU check in one run, for a machine with an NVIDIA GPU, ending in one summary table (check, status,
# seconds). Each check has its own time limit and together they stay under 10 minutes:
#
#   gpu tests        tests/gpu (marker gpu): the vLLM engine on CUDA generating with processed log-probs
#                    and recording the trace, and a CUDA IPC weight update proved by checksums against a
#                    fresh vLLM loaded from the same weights                                        (300 s)
#   ipc benchmark    benchmarks/weight_sync_gpu.py: a CUDA IPC update of a ~500M vLLM worker against one
#                    device copy of the same bytes                                                  (240 s)
#
# It needs the `gpu` extra (vLLM 0.33 and the torch it pins), in a venv of its own:
#
#     python -m venv .venv-gpu && .venv-gpu/bin/pip install -e '.[gpu,dev]'
#     PY=.venv-gpu/bin/python scripts/gpu_check.sh
#
# Where no GPU is present the tests skip and the script says so; it exits non-zero when a check fails.
# Not here yet (they need code that has not run on a GPU): NCCL weight transfer into two vLLM workers, and
# an 8B-shaped NCCL broadcast against the link's bandwidth; NCCL also wants one GPU per rank.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here; the gpu tests would only skip"
    exec "$PY" -m pytest -q -m gpu tests/gpu
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" - <<'PY'
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("vllm", "present" if importlib.util.find_spec("vllm") else "MISSING: pip install -e '.[gpu,dev]'")
PY
# With a GPU the gpu tests must run, not skip: without vLLM there is nothing to check.
"$PY" -c 'import vllm' 2>/dev/null || { echo "gpu_check: vLLM is missing in $PY"; exit 1; }

rows=()
status=0
check() {  # check NAME LIMIT_S COMMAND...: run it with a time limit, remember its outcome for the table
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS rc=0
    echo
    echo "=== $name (at most ${limit} s)"
    timeout "$limit" "$@" || rc=$?
    local took=$((SECONDS - began)) verdict=ok
    if ((rc == 124)); then verdict="TIMED OUT"; elif ((rc != 0)); then verdict="FAILED ($rc)"; fi
    ((rc == 0)) || status=1
    rows+=("$(printf '%-15s | %-11s | %5d s' "$name" "$verdict" "$took")")
}

check "gpu tests" 300 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider
check "ipc benchmark" 240 "$PY" benchmarks/weight_sync_gpu.py --params 500e6 --rounds 3

echo
echo "gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)):"
printf '%-15s | %-11s | %7s\n' check status time
printf -- '----------------+-------------+--------\n'
printf '%s\n' "${rows[@]}"
printf 'total %d s\n' "$SECONDS"
exit $status
