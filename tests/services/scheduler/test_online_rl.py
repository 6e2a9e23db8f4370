"""The done-when test: the online RL demo job (examples/jobs/demo.toml cut to 3 steps) runs through the
scheduler as an `online_rl` task on the local backend, SUCCEEDS, leaves a checkpoint and reports to the job's
stream. tests/gateway/test_scheduled_trainer.py runs it against a Task App registered in the mesh."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tandem.events.v1 import events_service_pb2
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

from tests.services.scheduler.test_scheduler import (
    TERMINAL,
    Clients,
    acme,
    create,
    log_text,
    mesh,
    signer,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[3]
__all__ = ["acme", "mesh", "signer"]  # fixtures


def short_demo(model_dir: Path) -> str:
    """examples/jobs/demo.toml cut to 3 small steps, its model built in `model_dir`."""
    config = (ROOT / "examples" / "jobs" / "demo.toml").read_text()
    overrides = {
        "steps": "3",
        "prompts_per_step": "4",
        "group_size": "4",
        "checkpoint_interval": "3",
        "dir": f'"{model_dir}"',
    }
    for key, value in overrides.items():
        config, count = re.subn(rf"^{key} = .*$", f"{key} = {value}", config, count=1, flags=re.MULTILINE)
        assert count == 1, f"demo.toml has no {key}"
    return config


def demo_task(model_dir: Path) -> job_spec_pb2.TaskSpec:
    """The one online_rl task both backends run (local here, Slurm in test_slurm_jobs.py)."""
    return job_spec_pb2.TaskSpec(
        name="trainer",
        kind=job_spec_pb2.TaskSpec.KIND_ONLINE_RL,
        online_rl=job_spec_pb2.OnlineRlOptions(config_toml=short_demo(model_dir)),
    )


def trainer_checkpoints(tmp_path: Path, job: str) -> list[Path]:
    folder = tmp_path / "scheduler" / "jobs" / job.replace("/", "-") / "trainer" / "output" / "checkpoints"
    return [p for p in folder.glob("step-*") if not p.name.endswith(".partial")]


async def test_the_demo_job_runs_through_the_scheduler(acme: Clients, tmp_path: Path) -> None:
    job = await create(acme, demo_task(tmp_path / "model"), job_id="demo")
    done = await wait_for(acme, job.name, *TERMINAL, within_s=840)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, (
        done.failure.message,
        await log_text(acme, job.name),
    )
    assert trainer_checkpoints(tmp_path, job.name), await log_text(acme, job.name)
    # The config's example app is not registered in this mesh (it names orgs/demo), so the trainer plays it
    # on loopback, but its events are the job's: they are in the job's own stream.
    listed = await acme.events.ListEvents(events_service_pb2.ListEventsRequest(job=job.name, page_size=1000))
    types = [e.type for e in listed.events]
    assert types.count("train.step") == 3 and "checkpoint.saved" in types, types
