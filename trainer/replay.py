"""Replay one training step from its rollout dump: `python -m trainer.replay --dump DIR --step N`.

The way to look again at a bad step (a loss spike, a NaN, a grad norm out of line). With `[rollout_dump]
enabled = true` a job keeps every step's batch (trainer/dump.py); this loads the weights that step N trained
(the checkpoint of step N - 1 with its optimizer state and master weights, or the job's initial model for
step 1; the reference model when the job has a KL term), restores the thread count and RNG state the step
began with, and runs the trainer's own update on the dumped batch (`Ranks.alone`, `scatter` and
`train_shard` from trainer/train.py: the micro-batches, `grpo.policy_loss`, clipping), then prints the loss,
every statistic and the grad norm beside what the job recorded and says whether they are bit-identical.

    python -m trainer.replay --dump runs/demo/checkpoints/rollouts --step 7
    python -m trainer.replay --checkpoint runs/demo/checkpoints --step 7 --json

Exit status: 0 when every figure is bit-identical, 1 when one differs, 2 when the step cannot be replayed
(not dumped, no checkpoint before it, a damaged dump): the message says which steps can be.

Shortcuts: the replay runs on this process alone, on the CPU unless `--device` says otherwise. A job that
trained on one CPU rank replays bit for bit; one trained on several ranks, or on a GPU, replays the same
computation but not the same floating-point order, so its figures agree to rounding only.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoints, dump
from trainer.checkpoints import STATE_FILE
from trainer.dump import DumpError, Recorded
from trainer.ranks import Ranks
from trainer.scoring import load_policy, reference_for, trainable, trained_tokens
from trainer.train import train_shard

# The figures compared, in the order they are printed.
FIGURES = tuple(Recorded.__dataclass_fields__)


class NotReplayable(DumpError):
    """The weights a step trained are not kept; the message names the steps that can be replayed."""


@dataclass(frozen=True)
class Replayed:
    step: int
    weights: str  # where the weights before the step came from
    recorded: Recorded
    replayed: Recorded
    batch: dict[str, int | float]

    @property
    def differing(self) -> list[str]:
        return [n for n in FIGURES if not same(getattr(self.recorded, n), getattr(self.replayed, n))]

    @property
    def identical(self) -> bool:
        return not self.differing


def same(a: object, b: object) -> bool:
    """Bit-identical: floats compared by their 64-bit patterns (0.0 is not -0.0), except that a NaN matches
    any NaN: the dump's JSON keeps that a figure was NaN, not the NaN's sign and payload."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


def replayable(root: Path, checkpoint_root: Path) -> list[int]:
    """The dumped steps whose previous weights are kept: step 1, and each step right after a checkpoint."""
    kept = {c.step for c in checkpoints.list_all(checkpoint_root) if c.resumable}
    return [s for s in dump.steps(root) if s == 1 or s - 1 in kept]


def weights_before(step: dump.Step, root: Path, checkpoint: Path) -> Path | None:
    """The checkpoint folder of step N - 1: `checkpoint` itself when it is one, else the one under the folder
    of checkpoints `checkpoint`; None for step 1, which trained the job's initial model."""
    if step.step == 1:
        return None
    wanted = step.step - 1
    given = checkpoints.read(checkpoint)
    folder_of_all = checkpoint.parent if given is not None else checkpoint
    found = given if given is not None else checkpoints.read(checkpoints.folder(checkpoint, wanted))
    if found is not None and found.step == wanted and found.resumable:
        return found.path
    kept = sorted(c.step for c in checkpoints.list_all(folder_of_all) if c.resumable)
    interval = step.job.config.checkpoint_interval
    raise NotReplayable(
        f"step {step.step} trained the weights of step {wanted}, and {checkpoint} holds no checkpoint of "
        f"step {wanted} (checkpoints kept: {_listed(kept)}; the job keeps one "
        f"{f'every {interval} steps' if interval else 'at the end only'} and at the end). "
        f"Steps that can be replayed from this dump: {_listed(replayable(root, folder_of_all))}"
    )


def _listed(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def replay(root: Path, step_number: int, checkpoint: Path | None = None, device: str = "cpu") -> Replayed:
    """Recompute step `step_number` of the dump at `root` (DumpError when it cannot be)."""
    checkpoint = checkpoint or root.parent
    step = dump.read(root, step_number)
    job, where = step.job, torch.device(device)
    folder = weights_before(step, root, checkpoint)
    model_dir = Path(step.metadata.get("model_dir") or job.config.model.dir)
    policy = load_policy(folder or model_dir, where, job)
    optimizer = torch.optim.AdamW(
        trainable(policy), lr=job.learning_rate(0), weight_decay=job.config.optimizer.weight_decay
    )
    if folder is not None:  # as Trainer.resume loads it
        state = torch.load(folder / STATE_FILE, weights_only=False)
        if "master_weights" in state:
            policy.load_state_dict(state["master_weights"], strict=job.weights_mode != "lora")
        optimizer.load_state_dict(state["optimizer"])
    reference = reference_for(policy, model_dir, where, job) if job.config.algorithm.kl_coef > 0 else None
    torch.set_num_threads(step.threads)
    torch.set_rng_state(step.tensors["torch_rng"])
    ranks = Ranks.alone(where)
    tokens = [trained_tokens(s) for s in step.sequences]
    shard = ranks.scatter(step.sequences, step.advantages, tokens, lr=step.lr, aggregation=job.aggregation)
    update = train_shard(ranks, policy, reference, optimizer, shard, job, where)
    return Replayed(
        step=step.step,
        weights=str(folder or model_dir),
        recorded=step.recorded,
        replayed=Recorded.of(update),
        batch=_batch(step),
    )


def _batch(step: dump.Step) -> dict[str, int | float]:
    """What the batch held, for a person looking at a bad step."""
    t = step.tensors
    return {
        "sequences": int(t["prompt_lengths"].numel()),
        "episodes": int(t["episode_seeds"].numel()),
        "groups": int(t["episode_groups"].max()) + 1,
        "reward_mean": float(t["episode_rewards"].mean()),
        "advantage_min": float(t["advantages"].min()),
        "advantage_max": float(t["advantages"].max()),
        "trained_tokens": sum(trained_tokens(s) for s in step.sequences),
        "lagging_sequences": int(t["lagging"].sum()),
        "non_finite_trace_logprobs": int((~torch.isfinite(t["trace_logprobs"])).sum()),
        "policy_version": step.version,
        "learning_rate": step.lr,
    }


def _text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def report(result: Replayed, out: Any = sys.stdout) -> None:
    print(f"step {result.step}, replayed from {result.weights}", file=out)
    print("batch: " + ", ".join(f"{k} {_text(v)}" for k, v in result.batch.items()), file=out)
    rows = [("figure", "recorded", "replayed", "")]
    for name in FIGURES:
        a, b = getattr(result.recorded, name), getattr(result.replayed, name)
        verdict = "same" if same(a, b) else "DIFFERS"
        if verdict != "same" and isinstance(a, float) and isinstance(b, float) and math.isfinite(a - b):
            verdict += f" by {b - a:+.3e}"
        rows.append((name, _text(a), _text(b), verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, [*widths, 0], strict=True)).rstrip(), file=out)
    if result.identical:
        print(f"step {result.step}: bit-identical to what the job recorded", file=out)
    else:
        print(f"step {result.step}: differs in {', '.join(result.differing)}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.replay",
        description="Recompute one step of a job from its rollout dump and the checkpoint before it, and "
        "compare the loss, statistics and grad norm with what the job recorded.",
        epilog="example: python -m trainer.replay --dump runs/demo/checkpoints/rollouts --step 7",
    )
    parser.add_argument(
        "--dump",
        type=Path,
        help="the dump folder, <output>/checkpoints/rollouts (default: CHECKPOINT/rollouts)",
    )
    parser.add_argument("--step", type=int, required=True, help="the step to replay (1 is the first)")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="the checkpoint of step N - 1, or the folder of checkpoints (default: the dump's parent)",
    )
    parser.add_argument("--device", default="cpu", help="where to compute (default cpu: bit-exact)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    args = parser.parse_args(argv)
    if args.dump is None and args.checkpoint is None:
        parser.error("give --dump, --checkpoint or both")
    if args.dump is not None:
        root = args.dump
    else:  # the folder of checkpoints holds the dump; so does the folder above one checkpoint
        given = checkpoints.read(args.checkpoint)
        root = dump.folder(args.checkpoint.parent if given is not None else args.checkpoint)
    try:
        result = replay(root, args.step, args.checkpoint, args.device)
    except DumpError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        document = {
            "step": result.step,
            "weights": result.weights,
            "identical": result.identical,
            "differing": result.differing,
            "recorded": asdict(result.recorded),
            "replayed": asdict(result.replayed),
            "batch": result.batch,
        }
        print(json.dumps(document, indent=2))
    else:
        report(result)
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
