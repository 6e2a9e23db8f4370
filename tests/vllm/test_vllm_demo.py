"""The demo job with vLLM sampling, shortened: `python -m trainer --config examples/jobs/demo-vllm.toml` in
vLLM's environment builds the small policy, starts a vLLM inference worker, plays the single-turn Task App
through the mesh and trains, weights going into vLLM through its weight-transfer API after every step. The
step's sampler/trainer mismatch is logged, and with vLLM serving the trainer's dtype it stays at rounding
level: the log-probs vLLM samples with are those of the policy being trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import VLLM_CPU
from trainer.inference.process import ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 4


def run_job(folder: Path, config: str) -> subprocess.CompletedProcess[str]:
    """`python -m trainer` on the job file `config` in `folder`, its output in `folder/out`; it must succeed."""
    (folder / "job.toml").write_text(config)
    env = {"VLLM_CPU_KVCACHE_SPACE": VLLM_CPU["VLLM_CPU_KVCACHE_SPACE"]}  # vLLM logs at INFO: checked after
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", "job.toml", "--output", "out"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_the_demo_job_trains_with_vllm_sampling(tmp_path: Path) -> None:
    config = (ROOT / "examples" / "jobs" / "demo-vllm.toml").read_text()
    assert "\nsteps = 80\n" in config
    done = run_job(tmp_path, config.replace("\nsteps = 80\n", f"\nsteps = {STEPS}\n"))
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == STEPS and all("mismatch |r-1|" in line for line in steps)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    for row in rows:
        assert 0 <= row["mismatch/ratio_abs"] < 1e-3, row
        assert 0 <= row["mismatch/kl"] < 1e-6, row
    worker_log = (tmp_path / "out" / "worker-0" / "worker.log").read_text()
    assert "V1 LLM engine" in worker_log  # vLLM served the episodes, not the torch engine
    assert (tmp_path / "out" / "checkpoints" / f"step-{STEPS:06d}" / "model.safetensors").is_file()


def test_the_demo_job_in_lora_mode_trains_an_adapter_that_vllm_serves(tmp_path: Path) -> None:
    """`[weights] mode = "lora"` with vLLM: the launcher starts the worker with LoRA serving, each update
    sends the adapter alone and vLLM loads it as a new adapter version, and vLLM samples with the log-probs
    of the policy being trained (base + adapter); checkpoints are adapter folders."""
    config = (ROOT / "examples" / "jobs" / "demo-vllm.toml").read_text()
    config = config.replace("\nsteps = 80\n", "\nsteps = 2\n")
    config += '\n[weights]\nmode = "lora"\n\n[weights.lora]\nrank = 8\n'
    run_job(tmp_path, config)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    base_bytes = (tmp_path / "runs" / "demo-model" / "model.safetensors").stat().st_size
    for row in rows:
        assert 0 <= row["mismatch/ratio_abs"] < 1e-3, row
        assert 0 < row["weight_sync/bytes"] < 0.2 * base_bytes, row
    worker_log = (tmp_path / "out" / "worker-0" / "worker.log").read_text()
    assert "V1 LLM engine" in worker_log
    checkpoint = tmp_path / "out" / "checkpoints" / "step-000002"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in checkpoint.iterdir()}
