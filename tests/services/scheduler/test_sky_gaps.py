"""SkyPilot files that SkyPilot's loader accepts and `load_yaml` used to refuse or misread: tasks without `run`,
storage mounts whose `name` is null, names outside Tandem's task-name shape, `workdir`'s ignore files and mounts
under `~/`. SkyPilot's own loader (in .venv-sky) is the oracle where it says what a file means; the tasks run
through CreateJob on the local backend and the real one-node Slurm cluster (tests/support/slurm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem.scheduler.v1 import job_pb2
from tandem.scheduler.v1 import job_spec_pb2 as js

from mesh.errors import InvalidArgument
from services.scheduler import spec as S
from tests.services.scheduler.test_scheduler import TERMINAL, log_text, wait_for
from tests.services.scheduler.test_skypilot import needs_skypilot
from tests.services.scheduler.test_skypilot_files import Acme, acme, submit, write_job
from tests.services.scheduler.test_skypilot_keys import refusals
from tests.services.scheduler.test_skypilot_keys import skypilot_reads as skypilot

__all__ = ["acme"]
pytestmark = pytest.mark.timeout(300)
State = job_pb2.Job.State


# -- tasks without run ---------------------------------------------------------------------------------------

WITHOUT_RUN = {
    "setup only": "name: prepare\nsetup: echo prepared > made-by-setup\n",
    "nothing": "name: nothing\n",
}

READ_RUN = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
print(json.dumps({"name": task.name, "setup": task.setup, "run": task.run}))
"""


@needs_skypilot
@pytest.mark.parametrize("text", WITHOUT_RUN.values(), ids=WITHOUT_RUN.keys())
def test_skypilot_takes_a_task_without_run_and_so_does_tandem(text: str, tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(text)
    sky = skypilot(READ_RUN, path)
    (task,) = S.load_yaml(path).tasks
    assert sky["run"] is None
    assert (task.name, task.setup or None, task.run) == (sky["name"], sky["setup"], "")
    assert task.kind == js.TaskSpec.KIND_COMMAND


def test_a_service_task_still_needs_run() -> None:
    found = refusals("tasks:\n  - name: web\n    service: {port: 8080}\n")
    assert found == {"tasks[0].run": "is required for service tasks"}


async def test_tasks_without_run_succeed(acme: Acme, tmp_path: Path) -> None:
    for label, text in WITHOUT_RUN.items():
        job = await submit(acme, S.load_yaml(write_job(tmp_path, text)))
        done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
        logs = await log_text(acme, job.name)
        assert done.state == State.STATE_SUCCEEDED, (label, done.failure.message, logs)


# -- a bucket's name: null -----------------------------------------------------------------------------------

VALIDATE_STORAGE = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
out = {}
for path, storage in task.storage_mounts.items():
    try:
        storage._validate_storage_spec(storage.name)
        out[path] = ["ok", storage.name]
    except Exception as exc:
        out[path] = ["refused", str(exc)]
print(json.dumps(out))
"""

NAMELESS = {
    "/from-source": "{name: null, source: 's3://datasets/gsm8k', mode: COPY}",
    "/empty-name": "{name: '', source: 's3://evals'}",
    "/nothing": "{name: null, mode: MOUNT}",
    "/copy-nothing": "{name: null, mode: COPY}",
    "/local": "{name: null, source: ./data}",
}


@needs_skypilot
def test_a_null_bucket_name_is_no_name_and_refusals_are_skypilots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    path = tmp_path / "task.yaml"
    mounts = "".join(f"  {where}: {value}\n" for where, value in NAMELESS.items())
    path.write_text(f"run: x\nfile_mounts:\n{mounts}")
    sky = skypilot(VALIDATE_STORAGE, path)
    monkeypatch.chdir(tmp_path)
    for where, value in NAMELESS.items():
        text = f"run: x\nfile_mounts:\n  {where}: {value}\n"
        verdict, said = sky[where]
        if verdict == "ok":
            (mount,) = S.load_yaml(write_job(tmp_path, text)).tasks[0].file_mounts
            assert mount.bucket.url.split("/")[2] == said and not mount.bucket.create, where
        else:
            with pytest.raises(InvalidArgument) as caught:
                S.load_yaml(write_job(tmp_path, text))
            (violation,) = caught.value.violations
            assert violation.field.startswith(f'file_mounts["{where}"]'), where
            assert violation.description == said, where
