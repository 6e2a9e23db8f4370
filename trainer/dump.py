"""Rollout dumps: each step's training batch kept beside the checkpoints, so that the step can be recomputed
later (`python -m trainer.replay`, `tandem rl replay`). Off unless the job's `[rollout_dump] enabled` is true.

After each update the trainer calls `RolloutDump.record`, which writes two files into
`<output>/checkpoints/rollouts/`:

- `step-NNNNNN.safetensors`: the batch exactly as the update saw it, one row per trained turn (token ids,
  completion start, the sampler log-probs the loss used and the trace's own with any NaN left in, the loss
  mask, how the turn was sampled, its weight version and whether older weights sampled it, its advantage,
  which episode it came from), one row per episode (group, seed, reward, the trace's lowest weight version)
  and torch's RNG state when the update began. Lists of different lengths are concatenated, with offsets.
- `step-NNNNNN.json`: the step, the policy version it trained, the learning rate, the job's config (as the
  trainer read it), the number of ranks and CPU threads, what the step recorded (the loss, every
  `LossStats` figure, entropy, tokens, grad norm, whether it was finite) and the SHA-256 of the
  safetensors file, so that a replay notices a damaged dump.

Both are written beside and renamed into place, the JSON last: a step with a JSON file is complete. The
dumps together stay under `budget_mib`: after each write the oldest steps are removed until they fit (the
newest is always kept), and a `rollout_dump.pruned` event names the removed steps. A dump that cannot be
written (a full disk) is logged and training goes on without it. Nothing here computes a loss: replaying a
step runs the trainer's own `train_shard` (trainer/replay.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from google.protobuf import json_format
from safetensors.torch import load_file, save_file
from tandem.events.v1 import event_pb2, events_service_pb2
from tandem.trainer.v1 import config_pb2

from tandem_jobs.config import Job
from trainer.ranks import Update
from trainer.scoring import TrainSequence

log = logging.getLogger("tandem.trainer")
FOLDER = "rollouts"  # under the checkpoints folder
FORMAT = 1  # the dump's layout; a replay refuses a layout it does not know
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^step-([0-9]{6,})\.json$")


class DumpError(Exception):
    """A dump that is missing, incomplete or damaged; the message says which and what there is instead."""


def folder(checkpoints: Path) -> Path:
    return checkpoints / FOLDER


def tensors_file(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}.safetensors"


def metadata_file(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}.json"


def steps(root: Path) -> list[int]:
    """The steps with a complete dump under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = (_NAME.match(p.name) for p in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m is not None)


def size_of(root: Path, step: int) -> int:
    return sum(p.stat().st_size for p in (tensors_file(root, step), metadata_file(root, step)) if p.exists())


@dataclass(frozen=True)
class Recorded:
    """What an update gave, as the step recorded it: the figures a replay must reproduce bit for bit."""

    finite: bool
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    mismatch_abs: float
    mismatch_kl: float
    entropy: float
    tokens: int
    grad_norm: float | None

    @classmethod
    def of(cls, update: Update) -> Recorded:
        s = update.stats
        return cls(
            finite=update.finite,
            loss=s.loss,
            policy_loss=s.policy_loss,
            kl=s.kl,
            clip_fraction=s.clip_fraction,
            ratio_mean=s.ratio_mean,
            ratio_min=s.ratio_min,
            ratio_max=s.ratio_max,
            mismatch_abs=s.mismatch_abs,
            mismatch_kl=s.mismatch_kl,
            entropy=update.entropy,
            tokens=update.tokens,
            grad_norm=update.grad_norm,
        )


class Played(Protocol):
    """What the dump reads of one episode of a trained group (the trainer's `Episode`)."""

    seed: int
    reward: float | None
    trace: Any  # trace_pb2.Trace | None


@dataclass(frozen=True)
class Step:
    """One dumped step, read back."""

    step: int
    version: int
    lr: float
    job: Job
    ranks: int
    threads: int
    recorded: Recorded
    sequences: list[TrainSequence]
    advantages: list[float]
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]


def _flat(lists: Sequence[Sequence[Any]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = [0]
    for item in lists:
        offsets.append(offsets[-1] + len(item))
    values = torch.tensor([v for item in lists for v in item], dtype=dtype)
    return values, torch.tensor(offsets, dtype=torch.long)


def _rows(values: torch.Tensor, offsets: torch.Tensor) -> list[list[Any]]:
    bounds = offsets.tolist()
    items = values.tolist()
    return [items[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


def batch_tensors(
    groups: Sequence[Sequence[Played]],
    sequences: Sequence[TrainSequence],
    advantages: Sequence[float],
    rng_state: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The safetensors content of one step. `sequences` are the trainer's, in its order: every turn with
    completion tokens of every episode of `groups`, group after group."""
    turns = [(e, t) for g in groups for e in g for t in e.trace.turns if t.completion_token_ids]
    if len(turns) != len(sequences) or len(sequences) != len(advantages):
        raise ValueError(
            f"{len(turns)} trained turns, {len(sequences)} sequences, {len(advantages)} advantages"
        )
    episodes = [e for g in groups for e in g]
    index = {id(e): i for i, e in enumerate(episodes)}
    token_ids, token_offsets = _flat([s[0] for s in sequences], torch.long)
    logprobs, logprob_offsets = _flat([s[2] for s in sequences], torch.float64)
    raw, raw_offsets = _flat([list(t.sampler_logprobs) for _, t in turns], torch.float64)
    mask, mask_offsets = _flat([s[3] for s in sequences], torch.bool)
    return {
        "token_ids": token_ids,
        "token_offsets": token_offsets,
        "prompt_lengths": torch.tensor([s[1] for s in sequences], dtype=torch.long),
        "sampler_logprobs": logprobs,
        "sampler_logprob_offsets": logprob_offsets,
        "trace_logprobs": raw,  # the worker's, NaN and infinities included
        "trace_logprob_offsets": raw_offsets,
        "loss_mask": mask,
        "loss_mask_offsets": mask_offsets,
        "sampling": torch.tensor(
            [list(s[4]) for s in sequences], dtype=torch.float64
        ),  # temp, top_k, p, min_p
        "lagging": torch.tensor([s[5] for s in sequences], dtype=torch.bool),
        "advantages": torch.tensor(list(advantages), dtype=torch.float64),
        "weight_versions": torch.tensor([t.weight_version for _, t in turns], dtype=torch.long),
        "sequence_episodes": torch.tensor([index[id(e)] for e, _ in turns], dtype=torch.long),
        "episode_groups": torch.tensor([n for n, g in enumerate(groups) for _ in g], dtype=torch.long),
        "episode_seeds": torch.tensor([e.seed for e in episodes], dtype=torch.long),
        "episode_rewards": torch.tensor([e.reward for e in episodes], dtype=torch.float64),
        "episode_versions": torch.tensor([e.trace.min_weight_version for e in episodes], dtype=torch.long),
        "torch_rng": rng_state.clone(),
    }


def sequences_of(tensors: dict[str, torch.Tensor]) -> tuple[list[TrainSequence], list[float]]:
    """The trainer's sequences and advantages back from a dump's tensors, value for value."""
    ids = _rows(tensors["token_ids"], tensors["token_offsets"])
    logprobs = _rows(tensors["sampler_logprobs"], tensors["sampler_logprob_offsets"])
    masks = _rows(tensors["loss_mask"], tensors["loss_mask_offsets"])
    starts = tensors["prompt_lengths"].tolist()
    lagging = tensors["lagging"].tolist()
    sampled = tensors["sampling"].tolist()
    sequences: list[TrainSequence] = [
        (ids[i], starts[i], logprobs[i], masks[i], (t, int(k), p, m), bool(lagging[i]))
        for i, (t, k, p, m) in enumerate(sampled)
    ]
    return sequences, [float(a) for a in tensors["advantages"].tolist()]


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_durably(path: Path, write: Any) -> None:
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        write(partial)
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write(
    root: Path,
    step: int,
    *,
    version: int,
    lr: float,
    job: Job,
    ranks: int,
    tensors: dict[str, torch.Tensor],
    recorded: Recorded,
) -> int:
    """Write one step's dump (the safetensors file, then the JSON that completes it); returns its bytes."""
    root.mkdir(parents=True, exist_ok=True)
    data = tensors_file(root, step)
    _write_durably(data, lambda p: save_file(tensors, str(p), metadata={"format": str(FORMAT)}))
    document = {
        "format": FORMAT,
        "step": step,
        "policy_version": version,
        "learning_rate": lr,
        "trainer_ranks": ranks,
        "torch_threads": torch.get_num_threads(),
        "sequences": int(tensors["prompt_lengths"].numel()),
        "episodes": int(tensors["episode_seeds"].numel()),
        "recorded": asdict(recorded),  # json writes NaN and Infinity, and reads them back
        "tensors_sha256": _digest(data),
        "model_dir": str(Path(job.config.model.dir).resolve()),  # the initial and reference weights
        "config": json_format.MessageToDict(job.config, preserving_proto_field_name=True),
    }
    _write_durably(metadata_file(root, step), lambda p: p.write_text(json.dumps(document, indent=1)))
    return size_of(root, step)


def prune(root: Path, budget_bytes: int) -> list[tuple[int, int]]:
    """Remove the oldest dumps until the rest fit in `budget_bytes`, never the newest; returns the removed
    (step, bytes)."""
    kept = steps(root)
    sizes = {s: size_of(root, s) for s in kept}
    total = sum(sizes.values())
    removed = []
    while len(kept) > 1 and total > budget_bytes:
        oldest = kept.pop(0)
        metadata_file(root, oldest).unlink(missing_ok=True)  # first: the step stops counting as complete
        tensors_file(root, oldest).unlink(missing_ok=True)
        total -= sizes[oldest]
        removed.append((oldest, sizes[oldest]))
    return removed


def read(root: Path, step: int) -> Step:
    """Step `step`'s dump, checked against its digest; DumpError says what is wrong and which steps there are."""
    meta = metadata_file(root, step)
    if not meta.is_file():
        there = steps(root)
        listed = _ranges(there) if there else "none"
        raise DumpError(f"step {step} is not in the rollout dump at {root} (steps dumped: {listed})")
    try:
        document = json.loads(meta.read_text())
        if document.get("format") != FORMAT:
            raise DumpError(f"{meta} is dump format {document.get('format')!r}; this trainer reads {FORMAT}")
        data = tensors_file(root, step)
        if not data.is_file():
            raise DumpError(f"{data} is missing: the dump of step {step} is incomplete")
        if _digest(data) != document["tensors_sha256"]:
            raise DumpError(f"{data} does not match the SHA-256 its JSON recorded: the dump is damaged")
        tensors = load_file(str(data))
        sequences, advantages = sequences_of(tensors)
        job = Job(json_format.ParseDict(document["config"], config_pb2.TrainerConfig()))
        recorded = Recorded(**document["recorded"])
        return Step(
            step=int(document["step"]),
            version=int(document["policy_version"]),
            lr=float(document["learning_rate"]),
            job=job,
            ranks=int(document["trainer_ranks"]),
            threads=int(document["torch_threads"]),
            recorded=recorded,
            sequences=sequences,
            advantages=advantages,
            tensors=tensors,
            metadata=document,
        )
    except DumpError:
        raise
    except Exception as exc:  # a truncated JSON, a missing key, a file safetensors cannot parse
        raise DumpError(
            f"the dump of step {step} at {root} cannot be read: {type(exc).__name__}: {exc}"
        ) from exc


def _ranges(values: Sequence[int]) -> str:
    """1, 2, 3, 5, 7, 8 -> '1-3, 5, 7-8'."""
    parts: list[str] = []
    start = previous = values[0]
    for value in [*values[1:], None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if value is not None:
            start = previous = value
    return ", ".join(parts)


class RolloutDump:
    """The job's dump folder and budget; `record` is the one call the training loop makes."""

    def __init__(self, root: Path, budget_bytes: int, events: Any | None = None, job_name: str = "") -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.events = events  # EventServiceStub
        self.job_name = job_name

    @classmethod
    def of(cls, job: Job, checkpoints: Path, events: Any | None, job_name: str) -> RolloutDump | None:
        """The job's dump when its config turns it on, else None."""
        if not job.config.rollout_dump.enabled:
            return None
        return cls(folder(checkpoints), int(job.rollout_dump_budget_mib * 1024 * 1024), events, job_name)

    async def record(
        self,
        step: int,
        *,
        version: int,
        lr: float,
        job: Job,
        ranks: int,
        groups: Sequence[Sequence[Played]],
        sequences: Sequence[TrainSequence],
        advantages: Sequence[float],
        rng_state: torch.Tensor,
        update: Update,
    ) -> None:
        """Keep step `step`'s batch and outcome, then prune to the budget; a failure is logged, never raised."""
        try:
            tensors = batch_tensors(groups, sequences, advantages, rng_state)
            await asyncio.to_thread(
                write,
                self.root,
                step,
                version=version,
                lr=lr,
                job=job,
                ranks=ranks,
                tensors=tensors,
                recorded=Recorded.of(update),
            )
            removed = await asyncio.to_thread(prune, self.root, self.budget_bytes)
        except Exception:
            log.warning("could not dump the rollouts of step %d; training goes on", step, exc_info=True)
            return
        if removed:
            await self._announce(step, removed)

    async def _announce(self, step: int, removed: list[tuple[int, int]]) -> None:
        pruned = [s for s, _ in removed]
        freed = sum(b for _, b in removed)
        log.info("rollout dump over its budget: removed steps %s (%d bytes)", _ranges(pruned), freed)
        if self.events is None:
            return
        event = event_pb2.Event(
            type="rollout_dump.pruned",
            message=f"rollout dump over its {self.budget_bytes} bytes: removed steps {_ranges(pruned)}",
        )
        event.payload.update(
            {
                "step": step,
                "pruned_steps": pruned,
                "freed_bytes": freed,
                "budget_bytes": self.budget_bytes,
                "oldest_kept": steps(self.root)[0],
            }
        )
        try:
            await self.events.Publish(
                events_service_pb2.PublishRequest(job=self.job_name, events=[event]), timeout=30
            )
        except Exception:
            log.warning("could not publish the rollout dump's pruning at step %d", step, exc_info=True)
