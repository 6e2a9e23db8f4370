"""A short online-RL job on a verifiers environment: the example single- and multi-turn envs written on
verifiers' API (examples/verifiers/) served by `tandem taskapp serve --verifiers` in .venv-verifiers, registered
with the embedded taskapp-proxy by `task_app.base_url` (the conformance kit passes), and the trainer steps on
their episodes, its policy the tiny model's inference worker. Skips without .venv-verifiers."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem.taskapp.v1 import taskapp_service_pb2 as tpb

from tests.support.verifiers_apps import MULTI_TURN, SINGLE_TURN, needs_verifiers, verifiers_app
from tests.trainer.test_train_loop import demo_job
from trainer.launch import local_environment
from trainer.models import build_tiny_model
from trainer.train import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), needs_verifiers]
KEY = "vf-train-key-0123456789abcdef"


@pytest.mark.parametrize(
    ("env", "app_id"), [(SINGLE_TURN, "vf-copy-letter"), (MULTI_TURN, "vf-guess-number")]
)
async def test_a_verifiers_env_registers_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: Path, app_id: str
) -> None:
    job = demo_job(build_tiny_model(tmp_path / "model"), steps=1)
    job.config.task_app.name = f"orgs/demo/taskApps/{app_id}"
    monkeypatch.setenv("ENVIRONMENT_API_KEY", KEY)  # the key of an app given by base_url, on this machine
    with verifiers_app(env, KEY) as url:
        job.config.task_app.base_url = url
        async with local_environment(job, tmp_path / "run") as run:
            app = (await run.proxy.GetTaskApp(tpb.GetTaskAppRequest(name=run.task_app))).task_app
            checks = {c.check: c for c in app.last_check_results}
            assert all(c.passed for c in checks.values()), checks
            assert checks["dialect"].detail == "tandem"
            (report,) = await Trainer(job, run).run()
    assert not report.skipped and report.metrics["tokens"] > 0
    assert report.metrics["episodes/failed"] == 0.0  # every episode of the step was played and scored
    assert 0.0 <= report.metrics["reward/mean"] <= 1.0
