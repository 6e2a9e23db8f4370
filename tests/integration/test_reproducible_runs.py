"""A seed makes a run reproducible: the demo's online RL job (`examples/jobs/demo.toml`, on the torch engine,
shortened to 10 steps) run twice with one seed gives the same reward and loss at every step (and every
other figure of the step but its timings: grad norm, entropy, sampler/trainer mismatch, ...) and the same
final weights, bit for bit; run with another seed it differs. The runs share the model folder the first one
builds (its `[model.build]` seed fixes the initialisation); everything else each run starts afresh: mesh,
Task App, worker, trainer, and a correlation id prefix of its own."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.inference.process import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
STEPS = 10
# Wall-clock figures, the only ones allowed to differ.
TIMINGS = {
    "step_s",
    "tokens_per_s",
    "weight_sync_s",
    "time/rollouts_s",
    "time/generation_idle_s",
    "time/trainer_idle_s",
}


def job_file(folder: Path, seed: int) -> Path:
    text = (ROOT / "examples" / "jobs" / "demo.toml").read_text()
    for old, new in (("\nseed = 0\n", f"\nseed = {seed}\n"), ("\nsteps = 80\n", f"\nsteps = {STEPS}\n")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = folder / f"demo-seed-{seed}.toml"
    path.write_text(text)
    return path


def run(folder: Path, seed: int, name: str) -> tuple[list[dict[str, float]], str]:
    """Each step's figures but its timings, and the SHA-256 of the final checkpoint's weights."""
    output = folder / "runs" / name
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(job_file(folder, seed)), "--output", str(output)],
        cwd=folder,  # the config's relative model folder lands here, shared by the runs
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    weights = output / "checkpoints" / f"step-{STEPS:06d}" / "model.safetensors"
    assert all({"reward/mean", "loss", "grad_norm"} <= set(row) for row in rows)  # every step trained
    figures = [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]
    return figures, hashlib.sha256(weights.read_bytes()).hexdigest()


def test_one_seed_gives_the_same_run_and_another_seed_another(tmp_path: Path) -> None:
    first, first_weights = run(tmp_path, 0, "first")
    again, again_weights = run(tmp_path, 0, "again")
    assert [(r["reward/mean"], r["loss"]) for r in again] == [(r["reward/mean"], r["loss"]) for r in first]
    assert again == first  # and every other figure, exactly
    assert again_weights == first_weights
    other, other_weights = run(tmp_path, 1, "other")
    # Other sampling seeds (and another seed order): other episodes, and another loss, from the first step on.
    assert (other[0]["reward/mean"], other[0]["loss"]) != (first[0]["reward/mean"], first[0]["loss"])
    assert other_weights != first_weights
