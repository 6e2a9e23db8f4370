"""Async RL against synchronous on-policy RL on the demo task: the same job, seed and starting weights, run
once with `max_staleness = 0` (the baseline: every batch waits for the previous update) and once with
`max_staleness = 2` (the producer plays up to two batches ahead while the trainer trains).

Printed per run: wall-clock seconds and steps until the mean reward of 3 consecutive steps reaches the target
(0.8 by default), trainer tokens per second (tokens trained / wall-clock of the run), how many episodes were
used as they were, importance-corrected or dropped, and the reward at a few steps; then the speed-up of
async over sync (sync seconds / async seconds; the goal is >= 1.3x).

    .venv/bin/python benchmarks/async_vs_sync.py              # about 6-10 minutes on 2 cores
    .venv/bin/python benchmarks/async_vs_sync.py --max-steps 40 --target 0.5

Both runs start from one model built here (the demo's `model.build`); each run is a fresh mesh, Task App and
worker (`trainer.launch.local_environment`), so the second run does not inherit the first one's warm caches
beyond the OS's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem_jobs.config import Job, parse_job
from trainer.launch import local_environment
from trainer.models import ensure_model
from trainer.train import StepReport, Trainer

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 3  # steps in the moving mean that must reach the target


class Reached(Exception):
    """Raised from the step callback to end a run once the target is reached."""


@dataclass
class Run:
    max_staleness: int
    seconds: float = float("nan")
    steps: int = 0
    reached: bool = False
    tokens: float = 0.0
    wall_s: float = 0.0
    counts: dict[str, float] = field(default_factory=lambda: {"on_policy": 0, "corrected": 0, "dropped": 0})
    rewards: list[float] = field(default_factory=list)


async def one_run(
    document: dict[str, Any], model_dir: Path, folder: Path, staleness: int, target: float, max_steps: int
) -> Run:
    document = {**document, "model": {"dir": str(model_dir)}, "checkpoint_interval": 0}
    document["algorithm"] = {**document["algorithm"], "max_staleness": staleness, "steps": max_steps}
    job = Job(parse_job(document))
    run = Run(staleness)
    async with local_environment(job, folder / f"staleness-{staleness}") as env:
        trainer = Trainer(job, env)
        started = time.perf_counter()

        def on_step(report: StepReport) -> None:
            m = report.metrics
            run.rewards.append(m.get("reward/mean", 0.0))
            run.tokens += m.get("tokens", 0.0)
            for name in run.counts:
                run.counts[name] += m.get(f"staleness/{name}", 0.0)
            run.steps = report.step
            recent = run.rewards[-WINDOW:]
            if len(recent) == WINDOW and sum(recent) / WINDOW >= target:
                run.seconds = time.perf_counter() - started
                run.reached = True
                raise Reached

        with contextlib.suppress(Reached):
            await trainer.run(on_step=on_step)
        run.wall_s = time.perf_counter() - started
    return run


def show(run: Run, target: float) -> None:
    reached = f"{run.seconds:7.1f} s at step {run.steps}" if run.reached else f"not in {run.steps} steps"
    at = "  ".join(f"{s}:{run.rewards[s - 1]:.2f}" for s in (10, 20, 30, 40, 50) if s <= len(run.rewards))
    print(
        f"max_staleness={run.max_staleness}: reward {target} ({WINDOW}-step mean) {reached}; "
        f"trainer {run.tokens / max(run.wall_s, 1e-9):.0f} tokens/s; "
        f"episodes on-policy {run.counts['on_policy']:.0f}, "
        f"importance-corrected {run.counts['corrected']:.0f}, dropped {run.counts['dropped']:.0f}"
    )
    print(f"    reward at step {at}")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "jobs" / "demo.toml")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--async-staleness", type=int, default=2)
    args = parser.parse_args()
    document = tomllib.loads(args.config.read_text())
    with tempfile.TemporaryDirectory(prefix="async-model-") as folder:
        model = {**document["model"], "dir": str(Path(folder) / "model")}
        model_dir = await asyncio.to_thread(ensure_model, parse_job({**document, "model": model}).model)
        runs = []
        for staleness in (0, args.async_staleness):
            runs.append(
                await one_run(document, model_dir, Path(folder), staleness, args.target, args.max_steps)
            )
            show(runs[-1], args.target)
    sync, fast = runs
    if sync.reached and fast.reached:
        print(
            f"async/sync speed-up to reward {args.target}: {sync.seconds / fast.seconds:.2f}x (goal >= 1.3x)"
        )
    else:
        print(f"speed-up: not measured, a run did not reach {args.target} in {args.max_steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
