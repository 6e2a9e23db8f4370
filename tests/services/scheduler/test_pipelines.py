"""Serial groups and SkyPilot pipelines through the scheduler, on the local backend and real Slurm: each task
starts only once the one before it SUCCEEDED, and a failing task fails the job with the tasks after it
CANCELLED, never started."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from services.scheduler.spec import parse_yaml
from tests.services.scheduler.test_scheduler import ORG, TERMINAL, Clients, log_text, wait_for
from tests.services.scheduler.test_skypilot_env import local, slurm

pytestmark = pytest.mark.timeout(180)
__all__ = ["local", "slurm"]  # fixtures
TaskState = job_pb2.TaskStatus.State


def pipeline(trail: Path, fail_at: str = "") -> str:
    """A SkyPilot pipeline without a header: three documents, three tasks. Each checks that the trail holds
    exactly the tasks before it (so the one before has ended), then adds its own name after a pause that
    would let a task started too early see the trail unfinished."""

    def step(name: str, before: str) -> str:
        fail = "; exit 3" if name == fail_at else ""
        check = f'test "$(cat {trail} 2>/dev/null | tr "\\n" " ")" = "{before}"'
        return f"name: {name}\nrun: {check}; sleep 0.5; echo {name} >> {trail}; echo done {name}{fail}\n"

    return "---\n".join([step("prepare", ""), step("train", "prepare "), step("evaluate", "prepare train ")])


def written(trail: Path) -> list[str]:
    return trail.read_text().split() if trail.exists() else []


async def submit(clients: Clients, text: str, job_id: str, **spec: object) -> job_pb2.Job:
    group = parse_yaml(text)
    assert group.execution == job_spec_pb2.JobSpec.EXECUTION_SERIAL
    for key, value in spec.items():
        if isinstance(value, job_spec_pb2.RecoveryPolicy):
            group.recovery.CopyFrom(value)
        else:
            setattr(group, key, value)
    reply = await clients.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id=job_id, spec=group))
    return await wait_for(clients, reply.job.name, *TERMINAL, within_s=150)


async def check_in_order(clients: Clients, done: job_pb2.Job, trail: Path) -> None:
    logs = {t.task: await log_text(clients, done.name, t.task) for t in done.tasks}
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert written(trail) == ["prepare", "train", "evaluate"]
    assert [t.state for t in done.tasks] == [TaskState.STATE_SUCCEEDED] * 3


async def test_a_pipeline_runs_its_tasks_one_after_another(local: Clients, tmp_path: Path) -> None:
    trail = tmp_path / "trail"
    await check_in_order(local, await submit(local, pipeline(trail), "pipe"), trail)


async def test_a_failing_task_stops_the_rest_of_the_pipeline(local: Clients, tmp_path: Path) -> None:
    trail = tmp_path / "trail"
    done = await submit(local, pipeline(trail, fail_at="train"), "pipe-fails")
    assert done.state == job_pb2.Job.State.STATE_FAILED
    assert done.failure.task == "train" and "exited with code 3" in done.failure.message
    states = {t.task: t.state for t in done.tasks}
    assert states == {
        "prepare": TaskState.STATE_SUCCEEDED,
        "train": TaskState.STATE_FAILED,
        "evaluate": TaskState.STATE_CANCELLED,
    }
    assert written(trail) == ["prepare", "train"]  # evaluate never started
    assert "done evaluate" not in await log_text(local, done.name, "evaluate")


async def test_execution_serial_in_a_group_header(local: Clients, tmp_path: Path) -> None:
    trail = tmp_path / "trail"
    text = "name: steps\nexecution: serial\n---\n" + pipeline(trail)
    await check_in_order(local, await submit(local, text, "steps"), trail)


async def test_a_restarted_task_resumes_the_pipeline_where_it_failed(local: Clients, tmp_path: Path) -> None:
    """Recovery restarts the failed task only; what already succeeded is not run again."""
    trail = tmp_path / "trail"
    flaky = (
        f"name: prepare\nrun: echo prepare >> {trail}\n---\n"
        f'name: train\nrun: echo "train $TANDEM_RESTART_COUNT" >> {trail}; [ "$TANDEM_RESTART_COUNT" -ge 1 ]\n'
    )
    recovery = job_spec_pb2.RecoveryPolicy(max_restarts_on_errors=2)
    recovery.initial_backoff.FromMilliseconds(200)
    done = await submit(local, flaky, "flaky", recovery=recovery)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure.message
    assert written(trail) == ["prepare", "train", "0", "train", "1"]


@pytest.mark.slow
async def test_a_pipeline_on_slurm(slurm: Clients, tmp_path: Path) -> None:
    trail = tmp_path / "trail"
    done = await submit(slurm, pipeline(trail), "pipe-slurm", backend=job_spec_pb2.BACKEND_SLURM)
    await check_in_order(slurm, done, trail)
