"""A short online-RL job on the Task App written to the hosted contract (examples/taskapps/hosted_copy_letter.py,
standard library only, its own process): the embedded proxy registers it after the conformance kit finds it
speaks the hosted dialect, normalises its `trajectories[].steps[]` answers, and the trainer steps on them;
its checkpoint is listed with the trigger that saved it."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import json_format
from tandem.taskapp.v1 import taskapp_service_pb2 as tpb
from tandem.trainer.v1 import checkpoint_pb2

from gateway.checkpoints import CheckpointIndex
from tests.trainer.test_train_loop import demo_job
from trainer.launch import local_environment
from trainer.models import build_tiny_model
from trainer.train import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def test_a_hosted_contract_app_registers_and_trains(tmp_path: Path) -> None:
    job = demo_job(build_tiny_model(tmp_path / "model"), steps=1)
    job.config.task_app.name = "orgs/demo/taskApps/hosted-copy-letter"
    async with local_environment(job, tmp_path / "run") as env:
        app = (await env.proxy.GetTaskApp(tpb.GetTaskAppRequest(name=env.task_app))).task_app
        checks = {c.check: c for c in app.last_check_results}
        assert all(c.passed for c in checks.values()), checks
        assert checks["dialect"].detail.startswith("hosted: "), checks["dialect"]
        assert "rollouts as trajectories[].steps[]" in checks["dialect"].detail
        # The stored description is in Tandem's shape: string splits became objects, task_metadata the instance.
        info = json_format.MessageToDict(app.task_info)
        assert info["dataset"]["splits"] == [{"name": "train"}] and info["rubric"] == {}
        assert info["instance"]["target"] in "ABCD"
        (report,) = await Trainer(job, env).run()
        # Its checkpoint says why it was saved, in the event and as the gateway's index lists it.
        index = CheckpointIndex(env.events.ListEvents, env.events.ListMetrics)
        (listed,) = await index.all(env.job)
    assert not report.skipped and report.metrics["tokens"] > 0
    assert 0.0 <= report.metrics["reward/mean"] <= 1.0
    assert listed.name == f"{env.job}/checkpoints/step-1"
    assert listed.trigger == checkpoint_pb2.Checkpoint.TRIGGER_FINAL and listed.resumable
