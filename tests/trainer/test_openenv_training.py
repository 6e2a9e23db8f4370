"""A short online-RL job on an OpenEnv environment: the example guess-the-number env written on openenv-core's
server API (examples/openenv/guess_env.py) runs as its env server in .venv-openenv, Tandem's adapter serves it
as a Task App (examples/openenv/guess_adapter.py), registered with the embedded taskapp-proxy by
`task_app.base_url` (the conformance kit passes), and the trainer steps on its multi-turn episodes, its policy
the tiny model's inference worker. Skips without .venv-openenv."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem.taskapp.v1 import taskapp_service_pb2 as tpb

from tandem_taskapp import create_app
from tandem_taskapp.openenv_env import openenv_task_app
from tandem_taskapp.serve import load_openenv_adapter
from tandem_taskapp.testing import serve_in_thread
from tests.support.openenv_apps import GUESS_ADAPTER, needs_openenv, openenv_server
from tests.trainer.test_train_loop import demo_job
from trainer.launch import local_environment
from trainer.models import build_tiny_model
from trainer.train import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), needs_openenv]
KEY = "oe-train-key-0123456789abcdef"


async def test_an_openenv_env_registers_and_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = demo_job(build_tiny_model(tmp_path / "model"), steps=1)
    job.config.task_app.name = "orgs/demo/taskApps/oe-guess-number"
    monkeypatch.setenv("ENVIRONMENT_API_KEY", KEY)  # the key of an app given by base_url, on this machine
    with openenv_server() as env_url:
        app = openenv_task_app(env_url, load_openenv_adapter(str(GUESS_ADAPTER)))
        with serve_in_thread(create_app(app, KEY)) as url:
            job.config.task_app.base_url = url
            async with local_environment(job, tmp_path / "run") as run:
                registered = (await run.proxy.GetTaskApp(tpb.GetTaskAppRequest(name=run.task_app))).task_app
                checks = {c.check: c for c in registered.last_check_results}
                assert all(c.passed for c in checks.values()), checks
                assert checks["dialect"].detail == "tandem"
                (report,) = await Trainer(job, run).run()
    assert not report.skipped and report.metrics["tokens"] > 0
    assert report.metrics["episodes/failed"] == 0.0  # every episode of the step was played and scored
    assert 0.0 <= report.metrics["reward/mean"] <= 1.0
