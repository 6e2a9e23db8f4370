"""The learning proof, as a user runs it: `python -m trainer --config examples/jobs/demo.toml` from a folder
with no model builds the small random policy, trains it against the single-turn Task App through the real
mesh, and ends well above chance. The demo's chance level is 0.25 (four letters); it starts below that,
since a random policy rarely answers with a letter at all. `examples/jobs/demo-lora.toml` learns the same task
with a LoRA adapter on a frozen random base, each update sending the adapter alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.inference.process import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHANCE = 0.25


def run_demo(folder: Path, config: Path) -> list[float]:
    """`python -m trainer --config CONFIG` in `folder`; each step's mean training reward."""
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(config)],
        cwd=folder,  # the config's relative model and output folders land here
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [
        json.loads(line) for line in (folder / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()
    ]
    return [row["reward/mean"] for row in rows]


def test_the_demo_job_learns_from_random_initialisation(tmp_path: Path) -> None:
    rewards = run_demo(tmp_path, ROOT / "examples" / "jobs" / "demo.toml")
    assert (tmp_path / "runs" / "demo-model" / "config.json").is_file()  # built on first run
    output = tmp_path / "runs" / "latest"
    assert len(rewards) == 80
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < CHANCE, rewards[:5]
    assert last >= 2 * CHANCE, rewards
    assert (output / "checkpoints" / "reward.png").stat().st_size > 0
    assert (output / "checkpoints" / "step-000080" / "model.safetensors").is_file()


def test_the_lora_demo_learns_with_an_adapter_on_a_frozen_random_base(tmp_path: Path) -> None:
    """Its first 40 steps (seed 0, the file's, first passed 0.9 at step 23); checkpoints are adapter folders."""
    config = (ROOT / "examples" / "jobs" / "demo-lora.toml").read_text()
    assert "\nsteps = 80\n" in config and '\nmode = "lora"\n' in config
    (tmp_path / "lora.toml").write_text(config.replace("\nsteps = 80\n", "\nsteps = 40\n"))
    rewards = run_demo(tmp_path, tmp_path / "lora.toml")
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < CHANCE, rewards[:5]
    assert last >= 2 * CHANCE, rewards
    checkpoint = tmp_path / "runs" / "latest" / "checkpoints" / "step-000040"
    assert {p.name for p in checkpoint.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
