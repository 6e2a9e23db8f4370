#!/usr/bin/env bash
# Every GPU check in one run, for a machine with an NVIDIA GPU (an H200 takes about 5 minutes):
# the `gpu`-marked tests (vLLM engine generation, a CUDA IPC weight update proved by checksums) and the GPU
# weight-sync benchmark. It needs the `gpu` extra (vLLM 0.33 and the torch it pins):
#
#     python -m venv .venv-gpu && .venv-gpu/bin/pip install -e '.[gpu,dev]'
#     PY=.venv-gpu/bin/python scripts/gpu_check.sh
#
# Where no GPU is present the tests skip and the script says so; it exits non-zero when a check fails.
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

status=0
timeout 420 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider || status=$?
timeout 240 "$PY" benchmarks/weight_sync_gpu.py --params 500e6 --rounds 3 || status=$?
exit $status
