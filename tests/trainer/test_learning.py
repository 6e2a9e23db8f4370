"""The learning proof, as a user runs it: `python -m trainer --config examples/jobs/demo.toml` from a folder
with no model builds the small random policy, trains it against the single-turn Task App through the real
mesh, and ends well above chance. The demo's chance level is 0.25 (four letters); it starts below that,
since a random policy rarely answers with a letter at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.inference.process import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHANCE = 0.25


def test_the_demo_job_learns_from_random_initialisation(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(ROOT / "examples" / "jobs" / "demo.toml")],
        cwd=tmp_path,  # the config's relative model and output folders land here
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "runs" / "demo-model" / "config.json").is_file()  # built on first run
    output = tmp_path / "runs" / "latest"
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward/mean"] for row in rows]
    assert len(rewards) == 80
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < CHANCE, rewards[:5]
    assert last >= 2 * CHANCE, rewards
    assert (output / "checkpoints" / "reward.png").stat().st_size > 0
    assert (output / "checkpoints" / "step-000080" / "model.safetensors").is_file()
