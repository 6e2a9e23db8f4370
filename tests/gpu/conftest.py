"""What the GPU tests share: their marks (skipped where no GPU, or no vLLM, is present) and the vLLM worker
settings for one small model on a shared GPU."""

from __future__ import annotations

import importlib.util

import pytest

GPU_VLLM_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="the gpu extra (vLLM) is not installed"
    ),
]
VLLM_ON_GPU = {
    "TANDEM_WORKER_ENGINE": "vllm",
    "TANDEM_WORKER_GPU_MEMORY_UTILIZATION": "0.3",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
