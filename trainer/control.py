"""The trainer's side of its control surface (`tandem.trainer.v1.TrainerService`).

`Control` is shared by the loop and the servicer, on one event loop, so it needs no locks. The loop tells it
where it is (`training`, `stepped`, `checkpointing`, `checkpointed`, `failed`, `ended`); callers ask it for
a checkpoint (`save`) or a stop (`stop`), and the loop reads both at each step boundary (`save_wanted`,
`stop_requested`). Nothing here imports torch or grpc; refusals are `mesh.errors` with stable reasons.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Mapping

from mesh.errors import AlreadyExists, FailedPrecondition, R, Unavailable
from trainer.checkpoints import CheckpointInfo


class State(enum.Enum):
    """`TrainerStatus.State`."""

    STARTING = "starting"
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


# The step metrics the loop reports per step, summed into the job's staleness counts.
STALENESS_METRICS = ("staleness/on_policy", "staleness/corrected", "staleness/dropped")


def _conflict(message: str) -> FailedPrecondition:
    return FailedPrecondition(message, reason=R.ERROR_REASON_JOB_STATE_CONFLICT)


def _settle(future: asyncio.Future[CheckpointInfo]) -> None:
    """Nobody may be waiting any more (the caller's deadline passed): mark the outcome as seen."""
    if not future.cancelled():
        future.exception()


class Control:
    def __init__(self) -> None:
        self.state = State.STARTING
        self.error = ""
        self.step = 0
        self.total_steps = 0
        self.weight_version = 0
        self.metrics: dict[str, float] = {}
        self.staleness = dict.fromkeys(STALENESS_METRICS, 0)
        self.last_checkpoint: CheckpointInfo | None = None
        self.start_time = time.time()
        self.update_time = 0.0
        self.stop_requested = False
        self.skip_final_checkpoint = False
        self._waiting: list[asyncio.Future[CheckpointInfo]] = []
        self._saves: dict[str, asyncio.Future[CheckpointInfo]] = {}  # request id -> its checkpoint
        self._stops: dict[str, bool] = {}  # request id -> skip_checkpoint

    # ---- what the loop tells ------------------------------------------------------------------

    def training(self, step: int, weight_version: int, total_steps: int) -> None:
        """The model is loaded and the workers are connected: steps begin."""
        self.step, self.weight_version, self.total_steps = step, weight_version, total_steps
        if self.state is State.STARTING:
            self.state = State.TRAINING

    def stepped(self, step: int, weight_version: int, metrics: Mapping[str, float]) -> None:
        self.step, self.weight_version = step, weight_version
        self.metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        for name in STALENESS_METRICS:
            self.staleness[name] += int(metrics.get(name, 0))
        self.update_time = time.time()

    def checkpointing(self) -> None:
        if self.state is State.TRAINING:
            self.state = State.CHECKPOINTING

    def checkpointed(self, checkpoint: CheckpointInfo) -> None:
        """A checkpoint is durable: every save waiting for the next boundary gets it."""
        self.last_checkpoint = checkpoint
        self._back_to_training()
        waiting, self._waiting = self._waiting, []
        for future in waiting:
            future.set_result(checkpoint)

    def checkpoint_failed(self, step: int, error: BaseException) -> None:
        """The write failed; the previous checkpoint stands. Waiting saves fail and may be retried."""
        self._back_to_training()
        self._refuse_waiting(
            Unavailable(
                f"the checkpoint at step {step} could not be written ({error}); the previous checkpoint is "
                "intact and training goes on"
            )
        )

    def failed(self, error: BaseException) -> None:
        self.state = State.FAILED
        self.error = f"{type(error).__name__}: {error}"

    def ended(self) -> None:
        """The loop is over (all steps, a stop, or a failure); the process exits shortly."""
        if self.state is not State.FAILED:
            self.state = State.STOPPED
        self._refuse_waiting(_conflict(f"the trainer is {self.state.value}; no checkpoint was saved"))

    def _back_to_training(self) -> None:
        if self.state is State.CHECKPOINTING:
            self.state = State.TRAINING

    def _refuse_waiting(self, error: Exception) -> None:
        waiting, self._waiting = self._waiting, []
        for future in waiting:
            future.set_exception(error)
        # A retry with the same request id tries again instead of repeating the failure.
        self._saves = {rid: f for rid, f in self._saves.items() if not (f.done() and f.exception())}

    # ---- what callers ask ---------------------------------------------------------------------

    @property
    def save_wanted(self) -> bool:
        return bool(self._waiting)

    async def save(self, request_id: str = "") -> CheckpointInfo:
        """A checkpoint of the last completed step, written at the next step boundary unless it exists.
        The same request id returns the same checkpoint."""
        future = self._saves.get(request_id) if request_id else None
        if future is None:
            if self.state not in (State.TRAINING, State.CHECKPOINTING):
                raise _conflict(
                    f"the trainer is {self.state.value}; it saves checkpoints only while training"
                )
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(_settle)
            latest = self.last_checkpoint
            if self.state is State.TRAINING and latest is not None and latest.step == self.step:
                future.set_result(latest)
            else:
                self._waiting.append(future)
            if request_id:
                self._saves[request_id] = future
        # A caller that gives up does not withdraw the request: the loop still saves, and a retry with the
        # same request id picks up that checkpoint.
        return await asyncio.shield(future)

    def stop(self, *, skip_checkpoint: bool = False, request_id: str = "") -> None:
        """Ask the loop to end after the current step; a stopping or stopped trainer stays as it is."""
        if self.state is State.FAILED:
            raise _conflict(f"the trainer failed: {self.error}")
        if request_id:
            earlier = self._stops.setdefault(request_id, skip_checkpoint)
            if earlier != skip_checkpoint:
                raise AlreadyExists(
                    f"request id {request_id} was used for a stop with skip_checkpoint={earlier}",
                    reason=R.ERROR_REASON_REQUEST_ID_REUSED,
                )
        if self.stop_requested or self.state is State.STOPPED:
            return
        self.stop_requested = True
        self.skip_final_checkpoint = skip_checkpoint
        self.state = State.STOPPING
