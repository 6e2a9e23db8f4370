"""Learning reliability: the demo job over several seeds, each with its own initialisation, sampling seeds and
prompt order, and what each seed learned on held-out seeds of the task that are never trained on.

Printed per seed: the first step whose training reward (the step's mean over its 256 episodes) is >= the
target (0.9 by default), the final step's training reward, and the held-out reward (one episode per held-out
seed, played with the job's sampling settings) before training, every `--eval-every` steps and after the last
step. The baseline is the same policy before training, measured in the same run: each seed's held-out reward
after / before. The summary says how many seeds reached the target within the job's step budget (goal: >= 9
of 10) and how held-out reward follows training reward (their correlation over every evaluation of every
seed, and how many seeds ended higher on held-out seeds than they began).

    .venv/bin/python benchmarks/learning.py                  # 10 seeds x 80 steps: about an hour on 2 cores
    .venv/bin/python benchmarks/learning.py --seeds 3 --steps 30 --json runs/learning.json
    .venv/bin/python benchmarks/learning.py --json runs/learning.json --resume   # after an interruption

Runs are deterministic (the demo sets `max_batch = 1`: trainer/README.md, "Reproducible runs"), so the
figures do not depend on how loaded the machine is; running the script under `nice` changes only its length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tandem_jobs.config import Job, parse_job
from trainer.launch import local_environment
from trainer.train import StepReport, Trainer

ROOT = Path(__file__).resolve().parents[1]
# Far above the demo's training seeds (0-9999): the task's targets come from a hash of the seed, so these are
# instances the policy never saw. One episode each per evaluation.
HELD_OUT_START = 1_000_000


@dataclass
class SeedRun:
    seed: int
    steps: int = 0
    first_at_target: int | None = None  # the first step whose training reward reached the target
    final_reward: float = math.nan  # the last step's training reward
    rewards: list[float] = field(default_factory=list)
    held_out: dict[int, float] = field(default_factory=dict)  # step -> held-out reward; 0 is before training
    wall_s: float = 0.0

    @property
    def held_out_before(self) -> float:
        return self.held_out.get(0, math.nan)

    @property
    def held_out_after(self) -> float:
        return self.held_out[max(self.held_out)] if self.held_out else math.nan


def job_document(
    base: dict[str, Any], seed: int, folder: Path, steps: int, held_out: int, eval_every: int
) -> dict[str, Any]:
    document = json.loads(json.dumps(base))  # a deep copy
    document["seed"] = seed
    document["checkpoint_interval"] = 0
    document.pop("rollout_dump", None)  # nothing here replays a step
    build = {**document["model"].get("build", {}), "seed": seed}  # this seed's own initialisation
    document["model"] = {**document["model"], "dir": str(folder / "model"), "build": build}
    document["algorithm"] = {**document["algorithm"], "steps": steps}
    document["data"] = {
        **document["data"],
        "eval": {"seeds": [{"start": HELD_OUT_START, "end": HELD_OUT_START + held_out}]},
    }
    document["eval_interval"] = eval_every
    return document


async def one_seed(document: dict[str, Any], folder: Path, target: float) -> SeedRun:
    job = Job(parse_job(document))
    run = SeedRun(job.config.seed)
    started = time.perf_counter()
    async with local_environment(job, folder / "run") as env:
        trainer = Trainer(job, env)
        run.held_out[0] = (await trainer.evaluate())["eval/reward_mean"]

        def on_step(report: StepReport) -> None:
            reward = report.metrics.get("reward/mean", 0.0)
            run.rewards.append(reward)
            run.steps = report.step
            if run.first_at_target is None and reward >= target:
                run.first_at_target = report.step
            if "eval/reward_mean" in report.metrics:
                run.held_out[report.step] = report.metrics["eval/reward_mean"]

        await trainer.run(on_step=on_step)
    run.final_reward = run.rewards[-1] if run.rewards else math.nan
    run.wall_s = time.perf_counter() - started
    return run


def show(run: SeedRun, target: float) -> None:
    first = f"step {run.first_at_target:3d}" if run.first_at_target else f"not in {run.steps}"
    curve = " ".join(f"{step}:{reward:.2f}" for step, reward in sorted(run.held_out.items()))
    ratio = f"{run.held_out_after / run.held_out_before:.2f}x" if run.held_out_before > 0 else "from 0"
    print(
        f"seed {run.seed:2d}: first step >= {target}: {first}; final training reward {run.final_reward:.3f}; "
        f"held-out {run.held_out_before:.3f} -> {run.held_out_after:.3f} ({ratio}); "
        f"{run.wall_s:.0f} s",
        flush=True,
    )
    print(f"    held-out reward by step: {curve}", flush=True)


def correlation(pairs: list[tuple[float, float]]) -> float:
    """Pearson's r of (training reward, held-out reward) pairs; NaN when either side does not vary."""
    if len(pairs) < 2:
        return math.nan
    xs, ys = zip(*pairs, strict=True)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def summary(runs: list[SeedRun], target: float, steps: int) -> None:
    reached = [r for r in runs if r.first_at_target is not None]
    firsts = sorted(r.first_at_target for r in reached if r.first_at_target is not None)
    median = firsts[len(firsts) // 2] if firsts else None
    print(
        f"reached training reward {target} within {steps} steps: {len(reached)} of {len(runs)} seeds "
        f"(goal >= {math.ceil(0.9 * len(runs))} of {len(runs)}); first step: median {median}, "
        f"range {firsts[0] if firsts else '-'}-{firsts[-1] if firsts else '-'}"
    )
    finals = [r.final_reward for r in runs]
    print(f"final training reward: min {min(finals):.3f}, mean {sum(finals) / len(finals):.3f}")
    # Each evaluation after step s beside the training reward of step s; before training, the chance level
    # the first step's batch measured (it was played by the same untrained weights).
    pairs = [
        (r.rewards[step - 1] if step else r.rewards[0], reward)
        for r in runs
        if r.rewards
        for step, reward in r.held_out.items()
    ]
    rose = sum(1 for r in runs if r.held_out_after > r.held_out_before)
    before = sum(r.held_out_before for r in runs) / len(runs)
    after = sum(r.held_out_after for r in runs) / len(runs)
    ratio = f"{after / before:.2f}x" if before > 0 else "up from 0 in"
    print(
        f"held-out reward: mean {before:.3f} before training -> {after:.3f} after ({ratio} the untrained "
        f"baseline); higher after than before on {rose} of {len(runs)} seeds; correlation with the training "
        f"reward over {len(pairs)} evaluations: r = {correlation(pairs):.3f}"
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "jobs" / "demo.toml")
    parser.add_argument("--seeds", type=int, default=10, help="job seeds 0..N-1 (default 10)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="steps per run; 0: the job file's (default)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--held-out", type=int, default=64, help="held-out seeds per evaluation")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between held-out evaluations")
    parser.add_argument("--json", type=Path, help="also write every run's figures here, after each seed")
    parser.add_argument(
        "--resume", action="store_true", help="keep the seeds --json already holds and run the others"
    )
    args = parser.parse_args()
    base = tomllib.loads(args.config.read_text())
    steps = args.steps or int(base["algorithm"]["steps"])
    print(
        f"{args.config.name}: {steps} steps, seeds {args.first_seed}-{args.first_seed + args.seeds - 1}, "
        f"{args.held_out} held-out seeds from {HELD_OUT_START}, evaluated every {args.eval_every} steps",
        flush=True,
    )
    runs: list[SeedRun] = []
    if args.resume and args.json and args.json.exists():  # seeds an earlier, interrupted run finished
        for kept in json.loads(args.json.read_text()):
            kept["held_out"] = {int(step): reward for step, reward in kept["held_out"].items()}
            runs.append(SeedRun(**kept))
            show(runs[-1], args.target)
    done = {r.seed for r in runs}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        if seed in done:
            continue
        with tempfile.TemporaryDirectory(prefix=f"learning-{seed}-") as folder:
            document = job_document(base, seed, Path(folder), steps, args.held_out, args.eval_every)
            runs.append(await one_seed(document, Path(folder), args.target))
        show(runs[-1], args.target)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    summary(runs, args.target, steps)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
