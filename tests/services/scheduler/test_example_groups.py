"""The seed example group, examples/jobs/rl-with-eval-watcher.yaml, through the scheduler on the local
backend: the online RL trainer (primary, the demo cut to 3 steps) and the CPU-only eval-watcher (auxiliary)
share the checkpoint volume; the watcher reports the trainer's checkpoint, the job SUCCEEDS when the trainer
does, and the watcher is then stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import duration_pb2
from tandem.scheduler.v1 import job_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from services.scheduler.spec import load_yaml
from tests.services.scheduler.test_online_rl import ROOT, short_demo
from tests.services.scheduler.test_scheduler import (
    ORG,
    TERMINAL,
    Clients,
    acme,
    log_text,
    mesh,
    signer,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
__all__ = ["acme", "mesh", "signer"]  # fixtures


async def test_the_trainer_and_eval_watcher_group_runs_and_shares_its_checkpoints(
    acme: Clients, tmp_path: Path
) -> None:
    spec = load_yaml(ROOT / "examples" / "jobs" / "rl-with-eval-watcher.yaml")
    trainer, watcher = spec.tasks
    trainer.online_rl.config_toml = short_demo(tmp_path / "model")
    watcher.envs["WATCH_INTERVAL"] = "1"
    watcher.termination_delay.CopyFrom(duration_pb2.Duration(seconds=5))
    reply = await acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id="rl-watch", spec=spec))
    done = await wait_for(acme, reply.job.name, *TERMINAL, within_s=840)
    logs = await log_text(acme, reply.job.name, "eval-watcher")
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, (done.failure.message, logs)
    states = {t.task: t.state for t in done.tasks}
    assert states["trainer"] == job_pb2.TaskStatus.State.STATE_SUCCEEDED
    assert states["eval-watcher"] == job_pb2.TaskStatus.State.STATE_STOPPED
    assert '"step": 3' in logs, logs  # the watcher saw the trainer's final checkpoint on the shared volume
