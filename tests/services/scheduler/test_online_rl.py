"""The done-when test: the online RL demo job (examples/jobs/demo.toml cut to 3 steps) runs through the
scheduler as an `online_rl` task on the local backend, SUCCEEDS and leaves a checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
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


async def test_the_demo_job_runs_through_the_scheduler(acme: Clients, tmp_path: Path) -> None:
    config = (ROOT / "examples" / "jobs" / "demo.toml").read_text()
    overrides = {
        "steps": "3",
        "prompts_per_step": "4",
        "group_size": "4",
        "checkpoint_interval": "3",
        "dir": f'"{tmp_path / "model"}"',
    }
    for key, value in overrides.items():
        config, count = re.subn(rf"^{key} = .*$", f"{key} = {value}", config, count=1, flags=re.MULTILINE)
        assert count == 1, f"demo.toml has no {key}"
    task = job_spec_pb2.TaskSpec(
        name="trainer",
        kind=job_spec_pb2.TaskSpec.KIND_ONLINE_RL,
        online_rl=job_spec_pb2.OnlineRlOptions(config_toml=config),
    )
    job = await create(acme, task, job_id="demo")
    done = await wait_for(acme, job.name, *TERMINAL, within_s=840)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, (
        done.failure.message,
        await log_text(acme, job.name),
    )
    checkpoints = (
        tmp_path / "scheduler" / "jobs" / "orgs-acme-jobs-demo" / "trainer" / "output" / "checkpoints"
    )
    outputs = [p for p in checkpoints.glob("step-*") if not p.name.endswith(".partial")]
    assert outputs, await log_text(acme, job.name)
