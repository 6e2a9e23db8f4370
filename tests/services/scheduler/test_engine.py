"""The engine below the RPCs, driven pass by pass: a backend that cannot be reached leaves jobs waiting
with a message and never fails a task; jobs go on once it answers again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nacl.signing
import pytest
from tandem.scheduler.v1 import job_spec_pb2

from mesh.identity import TokenSigner
from mesh.store import open_database
from services.scheduler.backends.base import BackendUnavailable, Handle, LaunchSpec, NodeInventory, Observed
from services.scheduler.backends.local import LocalBackend
from services.scheduler.engine import Engine, EngineConfig, EventOutbox, job_event
from services.scheduler.lifecycle import JobState, TaskState
from services.scheduler.store import MIGRATIONS, JobRow, JobStore, TaskRow

pytestmark = pytest.mark.timeout(60)


class Flaky(LocalBackend):
    """The local backend behind a switch: while `down`, every call raises BackendUnavailable, as a Slurm
    backend does while slurmctld is unreachable."""

    down = False

    def _check(self) -> None:
        if self.down:
            raise BackendUnavailable("controller unreachable")

    async def inventory(self) -> list[NodeInventory]:
        self._check()
        return await super().inventory()

    async def launch(self, spec: LaunchSpec) -> Handle:
        self._check()
        return await super().launch(spec)

    async def find(self, key: str) -> Handle | None:
        self._check()
        return await super().find(key)

    async def poll(self, handle: Handle) -> Observed:
        self._check()
        return await super().poll(handle)

    async def cancel(self, handle: Handle, grace_s: float = 10.0) -> None:
        self._check()
        await super().cancel(handle, grace_s)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[Engine, Flaky]]:
    db = await open_database(f"sqlite:///{tmp_path / 'scheduler.db'}", "scheduler", MIGRATIONS)
    store = JobStore(db)
    backend = Flaky(tmp_path / "local", gpus=0, cpus=4, memory_gib=8)
    signer = TokenSigner(nacl.signing.SigningKey.generate())
    made = Engine(
        store, {"local": backend}, signer, EngineConfig(work_dir=tmp_path), EventOutbox(store, None, None)
    )
    yield made, backend
    await db.close()


async def submit(engine: Engine, name: str, run: str) -> None:
    spec = job_spec_pb2.JobSpec(
        tasks=[job_spec_pb2.TaskSpec(name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run=run)]
    )
    row = JobRow(name, "acme", spec.SerializeToString(), 0, "local", time.time(), waiting_since=time.time())
    record, _ = await engine.store.create(row, [TaskRow(name, "main", 0)], name, job_event(row, None)[2])
    await engine.submitted(record)


async def passes_until(engine: Engine, name: str, *states: JobState) -> Any:
    deadline = time.monotonic() + 30
    while True:
        await engine.run_pass()
        record = await engine.store.get(name)
        if record.job.state in states:
            return record
        assert time.monotonic() < deadline, record.job.state
        await asyncio.sleep(0.05)


async def test_an_unreachable_backend_delays_jobs_and_never_fails_them(
    engine: tuple[Engine, Flaky], tmp_path: Path
) -> None:
    scheduler, backend = engine
    backend.down = True
    await submit(scheduler, "orgs/acme/jobs/a", f"while [ ! -e {tmp_path / 'gate'} ]; do sleep 0.05; done")
    for _ in range(3):
        await scheduler.run_pass()
    waiting = await scheduler.store.get("orgs/acme/jobs/a")
    assert waiting.job.state is JobState.PENDING and "unavailable" in waiting.job.message
    backend.down = False
    running = await passes_until(scheduler, "orgs/acme/jobs/a", JobState.RUNNING)
    assert running.job.message == ""
    backend.down = True
    for _ in range(3):
        await scheduler.run_pass()
    still = await scheduler.store.get("orgs/acme/jobs/a")
    assert still.job.state is JobState.RUNNING and still.tasks[0].state is TaskState.RUNNING
    assert "unavailable" in still.job.message and still.tasks[0].failure is None
    backend.down = False
    await scheduler.run_pass()
    assert (await scheduler.store.get("orgs/acme/jobs/a")).job.message == ""
    (tmp_path / "gate").touch()
    done = await passes_until(scheduler, "orgs/acme/jobs/a", JobState.SUCCEEDED, JobState.FAILED)
    assert done.job.state is JobState.SUCCEEDED and done.job.restart_count == 0
    notes = [
        e
        for e in await scheduler.store.outbox(job="orgs/acme/jobs/a")
        if b"controller unreachable" in e.payload
    ]
    assert len(notes) == 2  # one warning in the job's log each time it stopped answering
