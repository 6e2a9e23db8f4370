#!/usr/bin/env bash
# Every GPU check in one run, for a machine with an NVIDIA GPU, ending in one summary table (check, status,
# seconds). Each check has its own time limit: 10.5 minutes at most in all on one GPU (the NCCL benchmark
# skips there), 13.5 with two or more:
#
#   gpu tests        tests/gpu (marker gpu): the vLLM engine on CUDA generating with processed log-probs
#                    and recording the trace; a CUDA IPC weight update proved by checksums against a
#                    fresh vLLM loaded from the same weights; a LoRA adapter update proved by checksums
#                    and by greedy output against a fresh vLLM on the adapter's folder; with three GPUs
#                    or more, NCCL weight transfer into two vLLM workers (versions 1 and 2, each proved
#                    by checksums)                                                                  (450 s)
#   ipc benchmark    benchmarks/weight_sync_gpu.py: a CUDA IPC update of a ~500M vLLM worker against one
#                    device copy of the same bytes                                                  (180 s)
#   nccl benchmark   benchmarks/weight_sync_nccl.py, with two GPUs or more: an 8B-shaped (Llama-3-8B,
#                    16 GB bfloat16) packed NCCL broadcast and load against one flat NCCL broadcast of
#                    the same bytes, the link's own bandwidth                                       (180 s)
#
# It needs the `gpu` extra (vLLM 0.33 and the torch it pins), in a venv of its own:
#
#     python -m venv .venv-gpu && .venv-gpu/bin/pip install -e '.[gpu,dev]'
#     PY=.venv-gpu/bin/python scripts/gpu_check.sh
#
# Where no GPU is present the tests skip and the script says so; it exits non-zero when a check fails.
# NCCL refuses two ranks of one group on the same device: on a one-GPU machine the NCCL test skips and the
# NCCL benchmark's row says "skipped" with the reason, so the table shows what was not measured.
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

skip() {  # skip NAME WHY: a row for a check this machine cannot run
    rows+=("$(printf '%-15s | %-11s | %5s   %s' "$1" "skipped" "-" "$2")")
}

gpus=$(nvidia-smi -L | wc -l)
check "gpu tests" 450 "$PY" -m pytest -q -rs -m gpu tests/gpu -p no:cacheprovider
check "ipc benchmark" 180 "$PY" benchmarks/weight_sync_gpu.py --params 500e6 --rounds 3
if ((gpus >= 2)); then
    check "nccl benchmark" 180 "$PY" benchmarks/weight_sync_nccl.py --shape llama-8b --rounds 3
else
    skip "nccl benchmark" "needs two GPUs, this machine has $gpus"
fi
if ((gpus < 3)); then
    skip "nccl tests" "two vLLM workers over NCCL need three GPUs, this machine has $gpus (skipped in gpu tests)"
fi

echo
echo "gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)):"
printf '%-15s | %-11s | %7s\n' check status time
printf -- '----------------+-------------+--------\n'
printf '%s\n' "${rows[@]}"
printf 'total %d s\n' "$SECONDS"
exit $status
