"""A job whose inference worker is SIGKILLed mid-job fails with an error naming the worker, and trains no
step on the batch the dead worker could not play: the weights stay those of the last completed step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from trainer.launch import local_environment
from trainer.models import build_tiny_model
from trainer.train import StepReport, Trainer, WorkerLost

from .test_train_loop import demo_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


async def test_a_killed_worker_fails_the_job_by_name_without_further_updates(
    model_dir: Path, tmp_path: Path
) -> None:
    job = demo_job(model_dir, steps=6, max_staleness=0)
    output = tmp_path / "run"
    async with local_environment(job, output) as env:
        trainer = Trainer(job, env)
        pid = json.loads((output / "worker-0" / "ready.json").read_text())["pid"]

        def kill_after_first(report: StepReport) -> None:
            if report.step == 1:
                os.kill(pid, signal.SIGKILL)

        with pytest.raises(WorkerLost, match="inference worker 0"):
            await trainer.run(on_step=kill_after_first)
        assert [r.step for r in trainer.history] == [1]
        assert trainer.version <= 1  # nothing was trained after the worker died
