"""The live view of `tandem events watch`: one progress line for training steps, a line per state change,
checkpoint and warning.

On a terminal the progress line is redrawn in place (`[#####.....]  40/80  reward 0.812  loss +0.0012`);
elsewhere (a pipe, a CI log) each step is its own line. `--json` bypasses this view entirely: one JSON object
per event.
"""

from __future__ import annotations

import tomllib
from typing import TextIO

from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2
from tandem.scheduler.v1 import job_pb2

BAR_WIDTH = 30
QUIET_TYPES = frozenset({"train.step", "rollout.completed", "weights.updated", "log"})


def total_steps(job: job_pb2.Job) -> int:
    """`[algorithm] steps` of the job's online-RL config when it is inline TOML; 0 when unknown."""
    for task in job.spec.tasks:
        if task.HasField("online_rl") and task.online_rl.WhichOneof("trainer_config") == "config_toml":
            try:
                config = tomllib.loads(task.online_rl.config_toml)
            except (tomllib.TOMLDecodeError, RecursionError):
                return 0
            steps = config.get("algorithm", {}).get("steps", 0)
            return steps if isinstance(steps, int) else 0
    return 0


def job_state(value: int) -> str:
    return job_pb2.Job.State.Name(job_pb2.Job.State.ValueType(value)).removeprefix("STATE_") if value else "?"


def task_state(value: int) -> str:
    state = job_pb2.TaskStatus.State.ValueType(value)
    return job_pb2.TaskStatus.State.Name(state).removeprefix("STATE_") if value else "?"


def bar(step: int, total: int, width: int = BAR_WIDTH) -> str:
    if total <= 0:
        return f"step {step}"
    done = min(width, round(width * step / total))
    return f"[{'#' * done}{'.' * (width - done)}] {step:>{len(str(total))}}/{total}"


class ProgressView:
    """Turns a job's events into lines for a person. `tty` redraws the step line in place."""

    def __init__(self, out: TextIO, *, tty: bool, total: int = 0, verbose: bool = False) -> None:
        self._out = out
        self._tty = tty
        self.total = total
        self._verbose = verbose
        self._status = ""  # the step line currently drawn (tty only)
        self.last_step = 0
        self.last_metrics: dict[str, float] = {}

    def _line(self, text: str) -> None:
        if self._tty and self._status:
            self._out.write("\r\033[K")
        self._out.write(text + "\n")
        if self._tty and self._status:
            self._out.write(self._status)
        self._out.flush()

    def note(self, text: str) -> None:
        """A line of the CLI's own (reconnecting, resuming)."""
        self._line(text)

    def finish(self) -> None:
        if self._tty and self._status:
            self._out.write("\n")
            self._status = ""
            self._out.flush()

    def step_line(self, step: int, metrics: dict[str, float]) -> str:
        parts = [bar(step, self.total)]
        for label, key, fmt in (
            ("reward", "reward/mean", "{:.3f}"),
            ("loss", "loss", "{:+.4f}"),
            ("kl", "kl", "{:.4f}"),
        ):
            if key in metrics:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        if "step_s" in metrics:
            parts.append(f"{metrics['step_s']:.2f} s")
        return "  ".join(parts)

    def show(self, event: event_pb2.Event) -> None:
        core = event.WhichOneof("core")
        if core == "train_step":
            self.last_step = event.train_step.step
            self.last_metrics = dict(event.train_step.metrics)
            text = self.step_line(self.last_step, self.last_metrics)
            if self._tty:
                self._status = "\r\033[K" + text
                self._out.write(self._status)
                self._out.flush()
            else:
                self._line(text)
            return
        if core == "job_state_changed":
            change = event.job_state_changed
            text = f"job {job_state(change.state)}"
            if change.previous_state:
                text += f" (was {job_state(change.previous_state)})"
            if change.HasField("failure") and change.failure.message:
                text += f": {change.failure.message}"
            self._line(text)
            return
        if core == "task_state_changed":
            task = event.task_state_changed
            text = f"task {task.task} {task_state(task.state)}"
            if task.attempt:
                text += f" (attempt {task.attempt})"
            if task.HasField("failure") and task.failure.message:
                text += f": {task.failure.message}"
            self._line(text)
            return
        if core == "checkpoint_saved":
            saved = event.checkpoint_saved
            self._line(f"checkpoint {saved.checkpoint.rsplit('/', 1)[-1]} saved at step {saved.step}")
            return
        if event.level >= types_pb2.LEVEL_WARNING:
            label = "warning" if event.level == types_pb2.LEVEL_WARNING else "error"
            self._line(f"{label}: {event.message or event.type}")
            return
        if self._verbose or (event.type not in QUIET_TYPES and event.message):
            self._line(f"{event.type}: {event.message}" if event.message else event.type)
