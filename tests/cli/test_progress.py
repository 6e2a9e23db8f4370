"""The live view of `tandem events watch`, fed real event messages: the step line with its bar, reward and
loss, redrawn in place on a terminal and one line per step elsewhere; state changes, checkpoints and warnings
as their own lines."""

from __future__ import annotations

import io

from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

from gateway.progress import ProgressView, bar, total_steps


def step(n: int, reward: float, loss: float) -> event_pb2.Event:
    event = event_pb2.Event(type="train.step")
    event.train_step.step = n
    event.train_step.metrics.update({"reward/mean": reward, "loss": loss})
    return event


def events() -> list[event_pb2.Event]:
    return [
        event_pb2.Event(
            type="job.state_changed",
            job_state_changed=event_pb2.JobStateChanged(
                state=job_pb2.Job.STATE_RUNNING, previous_state=job_pb2.Job.STATE_STARTING
            ),
        ),
        step(1, 0.25, 0.5),
        event_pb2.Event(type="rollout.completed"),
        event_pb2.Event(type="log", level=types_pb2.LEVEL_WARNING, message="3 rollouts timed out"),
        step(2, 0.75, -0.125),
        event_pb2.Event(
            type="checkpoint.saved",
            checkpoint_saved=event_pb2.CheckpointSaved(checkpoint="orgs/a/jobs/j/checkpoints/step-2", step=2),
        ),
    ]


def test_a_pipe_gets_one_line_per_step_and_change() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=False, total=4)
    for event in events():
        view.show(event)
    view.finish()
    assert out.getvalue().splitlines() == [
        "job RUNNING (was STARTING)",
        f"{bar(1, 4)}  reward 0.250  loss +0.5000",
        "warning: 3 rollouts timed out",
        f"{bar(2, 4)}  reward 0.750  loss -0.1250",
        "checkpoint step-2 saved at step 2",
    ]
    assert bar(2, 4, width=10) == "[#####.....] 2/4"


def test_a_terminal_redraws_the_step_line_under_other_lines() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=True, total=4)
    for event in events():
        view.show(event)
    view.finish()
    text = out.getvalue()
    assert text.count("\n") == 4  # three event lines, and the step line closed at the end
    assert text.endswith(f"\r\033[K{bar(2, 4)}  reward 0.750  loss -0.1250\n")
    assert "\r\033[Kwarning: 3 rollouts timed out\n" in text


def test_the_total_comes_from_the_jobs_config() -> None:
    task = job_spec_pb2.TaskSpec(
        name="trainer",
        kind=job_spec_pb2.TaskSpec.KIND_ONLINE_RL,
        online_rl=job_spec_pb2.OnlineRlOptions(config_toml="[algorithm]\nsteps = 80\n"),
    )
    assert total_steps(job_pb2.Job(spec=job_spec_pb2.JobSpec(tasks=[task]))) == 80
    assert total_steps(job_pb2.Job()) == 0
    assert bar(3, 0) == "step 3"
