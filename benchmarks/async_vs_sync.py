"""Async RL against synchronous on-policy RL on the demo task, with generation and training on cores of their
own, as on a GPU node where inference workers and the trainer hold separate devices.

The same job, seed and starting weights run in up to three modes:
- `sync` (the baseline): `max_staleness = 0`, every batch waits for the previous update;
- `async`: `max_staleness = 2`, the producer plays up to two batches ahead while the trainer trains; workers
  pause (KEEP) for each weight update;
- `async-inflight`: the same with `[weights] in_flight = true`: workers keep generating during the transfer
  and swap the weights in between two generation steps.
Every mode trains with `staleness_correction = DECOUPLED` (`--correction clip` for the clipped objective).

With `--affinity` (the default where the machine has at least two CPUs) the generation side (the mesh with
its taskapp-proxy, the Task App and the inference workers) is pinned to the first half of the CPUs and this
process, the trainer, to the other half, in every mode alike.

Printed per mode: wall-clock seconds and steps until the mean reward of 3 consecutive steps reaches the target
(0.5 by default: the 4 x 256 policy below reaches about 0.56 in 50 steps on-policy), trainer tokens per
second, the seconds each side spent idle waiting for the other (the trainer for a batch, the generation side
for the staleness bound), how many episodes were used as they were, importance-corrected or dropped, and the
reward at a few steps; then each async mode's speed-up over sync (sync seconds / async seconds; the goal is
>= 1.3x) and its speed-up per step, beside the bound the sync run's own timings set on that: a step cannot
take less than the longer of its two sides, so sync (rollouts + training) / max(rollouts, training).

    .venv/bin/python benchmarks/async_vs_sync.py              # about 8 minutes on 2 cores
    .venv/bin/python benchmarks/async_vs_sync.py --layers 0 --hidden-size 0 --target 0.8 --modes sync,async

Every run starts from one model built here (the demo's `model.build`, 4 layers of width 256 unless `--layers`
and `--hidden-size` say otherwise: the size at which a training step takes about as long as playing its
episodes, so that there is something to overlap); each is a fresh mesh, Task App and
worker (`trainer.launch.local_environment`), so no run inherits another's warm caches beyond the OS's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _children import descendants, pin

from tandem_jobs.config import Job, parse_job
from trainer.launch import local_environment
from trainer.models import ensure_model
from trainer.train import StepReport, Trainer

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 3  # steps in the moving mean that must reach the target
MODES = {  # name -> (max_staleness, in-flight weight updates)
    "sync": (0, False),
    "async": (2, False),
    "async-inflight": (2, True),
}


class Reached(Exception):
    """Raised from the step callback to end a run once the target is reached."""


@dataclass
class Run:
    mode: str
    seconds: float = float("nan")
    steps: int = 0
    reached: bool = False
    tokens: float = 0.0
    wall_s: float = 0.0
    rollouts_s: float = 0.0  # playing the batches, summed over steps
    train_s: float = 0.0  # the steps' updates and weight syncs, summed
    sync_s: float = 0.0  # the weight syncs alone
    trainer_idle_s: float = 0.0
    generation_idle_s: float = 0.0
    counts: dict[str, float] = field(default_factory=lambda: {"on_policy": 0, "corrected": 0, "dropped": 0})
    rewards: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    generation: set[int]
    trainer: set[int]

    def apply(self) -> None:
        """The trainer (this process) on its CPUs; everything it started (mesh, Task App, workers) on the
        generation CPUs."""
        for child in descendants(os.getpid()):
            pin(child, self.generation)
        pin(os.getpid(), self.trainer)
        torch.set_num_threads(len(self.trainer))


def placement(enabled: bool) -> Placement | None:
    cpus = sorted(os.sched_getaffinity(0))
    if not enabled or len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return Placement(set(cpus[:half]), set(cpus[half:]))


async def one_run(
    document: dict[str, Any],
    model_dir: Path,
    folder: Path,
    mode: str,
    target: float,
    max_steps: int,
    where: Placement | None,
    correction: str,
) -> Run:
    staleness, in_flight = MODES[mode]
    document = {**document, "model": {"dir": str(model_dir)}, "checkpoint_interval": 0}
    document.pop("rollout_dump", None)
    document["algorithm"] = {
        **document["algorithm"],
        "max_staleness": staleness,
        "steps": max_steps,
        "staleness_correction": f"STALENESS_CORRECTION_{correction.upper()}",
    }
    if in_flight:
        document["weights"] = {**document.get("weights", {}), "in_flight": True}
    job = Job(parse_job(document))
    run = Run(mode)
    everything = set(os.sched_getaffinity(0))
    try:
        async with local_environment(job, folder / mode) as env:
            if where is not None:
                where.apply()
            trainer = Trainer(job, env)
            started = time.perf_counter()

            def on_step(report: StepReport) -> None:
                m = report.metrics
                run.rewards.append(m.get("reward/mean", 0.0))
                run.tokens += m.get("tokens", 0.0)
                run.rollouts_s += m.get("time/rollouts_s", 0.0)
                run.train_s += m.get("step_s", 0.0)
                run.sync_s += m.get("weight_sync_s", 0.0)
                run.trainer_idle_s += m.get("time/trainer_idle_s", 0.0)
                run.generation_idle_s += m.get("time/generation_idle_s", 0.0)
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
    finally:
        pin(os.getpid(), everything)
        torch.set_num_threads(len(everything))
    return run


def show(run: Run, target: float) -> None:
    reached = f"{run.seconds:7.1f} s at step {run.steps}" if run.reached else f"not in {run.steps} steps"
    at = "  ".join(f"{s}:{run.rewards[s - 1]:.2f}" for s in (10, 20, 30, 40, 50) if s <= len(run.rewards))
    print(
        f"{run.mode:>14}: reward {target} ({WINDOW}-step mean) {reached}; "
        f"trainer {run.tokens / max(run.wall_s, 1e-9):.0f} tokens/s; "
        f"rollouts {run.rollouts_s:.1f} s, training {run.train_s - run.sync_s:.1f} s + weight sync "
        f"{run.sync_s:.1f} s; idle: trainer "
        f"{run.trainer_idle_s:.1f} s, generation {run.generation_idle_s:.1f} s; "
        f"episodes on-policy {run.counts['on_policy']:.0f}, "
        f"importance-corrected {run.counts['corrected']:.0f}, dropped {run.counts['dropped']:.0f}",
        flush=True,
    )
    print(f"{'':>14}  reward at step {at}", flush=True)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "jobs" / "demo.toml")
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument(
        "--correction",
        choices=("clip", "decoupled"),
        default="decoupled",
        help="[algorithm] staleness_correction in every mode (default decoupled)",
    )
    # The demo's policy (2 x 128) trains a step in a sixth of the time its episodes take to play on one core
    # each, which bounds any overlap at about 1.15x; 4 x 256 makes the two sides about equal, as a GPU node's
    # split between inference and training GPUs is chosen to.
    parser.add_argument("--layers", type=int, default=4, help="policy layers (0: the job file's)")
    parser.add_argument("--hidden-size", type=int, default=256, help="policy width (0: the job file's)")
    affinity = parser.add_mutually_exclusive_group()
    affinity.add_argument("--affinity", dest="affinity", action="store_true", default=True)
    affinity.add_argument(
        "--no-affinity", dest="affinity", action="store_false", help="let every process use every CPU"
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "sync" not in modes or any(m not in MODES for m in modes):
        parser.error(f"--modes must include sync (the baseline) and name only {', '.join(MODES)}")
    where = placement(args.affinity)
    threads = str(len(where.trainer)) if where else ""
    if where and os.environ.get("OMP_NUM_THREADS") != threads:
        # OpenMP sizes each thread's team from this variable: without it the trainer's update, which runs
        # on a worker thread, forks a team as large as the machine onto its share of the CPUs, and the
        # team's spinning barriers made a pinned update about 9x slower. Read at start-up only, so the
        # script starts again with it (the generation side gets as many CPUs, and inherits it).
        os.environ["OMP_NUM_THREADS"] = threads
        os.execv(sys.executable, [sys.executable, *sys.argv])  # noqa: S606 - this script again, the variable set
    print(
        f"generation on CPUs {sorted(where.generation)}, trainer on CPUs {sorted(where.trainer)}"
        if where
        else "no CPU affinity: every process shares every CPU",
        flush=True,
    )
    document = tomllib.loads(args.config.read_text())
    build = dict(document["model"].get("build", {}))
    if args.layers:
        build["layers"] = args.layers
    if args.hidden_size:
        build["hidden_size"] = args.hidden_size
    print(f"policy: {build.get('layers', 2)} layers, hidden size {build.get('hidden_size', 128)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="async-model-") as folder:
        model = {**document["model"], "build": build, "dir": str(Path(folder) / "model")}
        model_dir = await asyncio.to_thread(ensure_model, parse_job({**document, "model": model}).model)
        runs: dict[str, Run] = {}
        for mode in ["sync", *(m for m in modes if m != "sync")]:
            runs[mode] = await one_run(
                document, model_dir, Path(folder), mode, args.target, args.max_steps, where, args.correction
            )
            show(runs[mode], args.target)
    sync = runs["sync"]
    bound = (sync.rollouts_s + sync.train_s) / max(sync.rollouts_s, sync.train_s, 1e-9)
    for mode, run in runs.items():
        if mode == "sync":
            continue
        if sync.reached and run.reached:
            per_step = (sync.seconds / sync.steps) / (run.seconds / run.steps)
            print(
                f"{mode}/sync speed-up to reward {args.target}: {sync.seconds / run.seconds:.2f}x "
                f"(goal >= 1.3x), {per_step:.2f}x per step ({sync.steps} steps against {run.steps}; the "
                f"sync run's timings bound the per-step gain at {bound:.2f}x)"
            )
        else:
            print(
                f"{mode}: speed-up not measured, a run did not reach {args.target} in {args.max_steps} steps"
            )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
