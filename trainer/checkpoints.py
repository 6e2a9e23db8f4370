"""Checkpoint folders on the job's storage and the metadata beside the weights.

A checkpoint is a folder `<output>/checkpoints/step-NNNNNN` (zero-padded so names sort by step) holding
Hugging Face files, the state to resume (`STATE_FILE`) and `tandem.json`: step, weight version, why it was
saved, the step's metrics and when it became durable. Its resource id is `step-{step}` without padding, as
`tandem.trainer.v1.Checkpoint` names it. The trainer writes a checkpoint into `step-NNNNNN.partial`, syncs
every file and renames it into place, so a folder without that suffix is complete. Nothing here imports
torch or grpc: the control surface lists and reads checkpoints through this module alone.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tandem.trainer.v1 import checkpoint_pb2

METADATA_FILE = "tandem.json"
STATE_FILE = "trainer_state.pt"
PARTIAL_SUFFIX = ".partial"
_ID = re.compile(r"^step-(0|[1-9][0-9]*)$")


class Trigger(enum.Enum):
    """Why a checkpoint was saved (`Checkpoint.Trigger`)."""

    INTERVAL = "interval"  # checkpoint_interval was reached
    REQUESTED = "requested"  # SaveCheckpoint
    FINAL = "final"  # the last step, or StopTraining


# Each trigger as the contract's `Checkpoint.Trigger`, for the TrainerService and `checkpoint.saved` events.
TRIGGERS = {
    Trigger.INTERVAL: checkpoint_pb2.Checkpoint.TRIGGER_INTERVAL,
    Trigger.REQUESTED: checkpoint_pb2.Checkpoint.TRIGGER_ON_DEMAND,
    Trigger.FINAL: checkpoint_pb2.Checkpoint.TRIGGER_FINAL,
}


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    weight_version: int
    trigger: Trigger | None  # None: written before checkpoints said why
    path: Path
    create_time: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    size_bytes: int = 0
    resumable: bool = False

    @property
    def id(self) -> str:
        return checkpoint_id(self.step)


def checkpoint_id(step: int) -> str:
    return f"step-{step}"


def step_of(checkpoint: str) -> int | None:
    """The step a checkpoint id names, None when it is not a canonical `step-{step}`."""
    match = _ID.match(checkpoint)
    return int(match.group(1)) if match else None


def folder(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def write_metadata(
    path: Path, *, job: str, step: int, weight_version: int, trigger: Trigger, metrics: Mapping[str, float]
) -> None:
    document = {
        "job": job,
        "step": step,
        "weight_version": weight_version,
        "trigger": trigger.value,
        "metrics": {k: v for k, v in metrics.items() if math.isfinite(v)},  # JSON has no NaN
        "create_time": time.time(),
    }
    (path / METADATA_FILE).write_text(json.dumps(document, indent=1, sort_keys=True))


def model_dtype(path: Path) -> str:
    """The dtype a Hugging Face model directory stores its weights in, as its config.json names it
    (`dtype`, or the older `torch_dtype`); float32 when it names none."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    named = config.get("dtype") or config.get("torch_dtype")
    return named if isinstance(named, str) and named else "float32"


def make_durable(path: Path) -> None:
    """fsync every file of a checkpoint folder and the folder itself, before it is renamed into place."""
    for item in path.iterdir():
        if item.is_file():
            _fsync(item, os.O_RDONLY)
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def sync_folder(path: Path) -> None:
    """fsync a folder, so a rename inside it survives a crash."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path) -> CheckpointInfo | None:
    """The checkpoint in a complete folder; None for a partial folder or one without readable metadata."""
    if path.name.endswith(PARTIAL_SUFFIX):
        return None
    try:
        document = json.loads((path / METADATA_FILE).read_text())
        files = [item.stat() for item in path.iterdir() if item.is_file()]
        step = int(document["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        trigger: Trigger | None = Trigger(document.get("trigger"))
    except ValueError:
        trigger = None
    return CheckpointInfo(
        step=step,
        weight_version=int(document.get("weight_version", step)),
        trigger=trigger,
        path=path,
        create_time=float(document.get("create_time", max((f.st_mtime for f in files), default=0.0))),
        metrics={str(k): float(v) for k, v in dict(document.get("metrics", {})).items()},
        size_bytes=sum(f.st_size for f in files),
        resumable=(path / STATE_FILE).is_file(),
    )


def find(root: Path, checkpoint: str) -> CheckpointInfo | None:
    step = step_of(checkpoint)
    return None if step is None else read(folder(root, step))


def list_all(root: Path) -> list[CheckpointInfo]:
    """Every complete checkpoint under `root`, newest step first."""
    found = [read(path) for path in root.glob("step-*")] if root.is_dir() else []
    return sorted((c for c in found if c is not None), key=lambda c: c.step, reverse=True)
