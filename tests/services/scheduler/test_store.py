"""The scheduler's tables on both stores: a job stored with its request id, the idempotent repeat, attempts
written before launch and updated after, what a restarted engine resumes, the event outbox."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from mesh.errors import AlreadyExists
from mesh.store import open_database
from services.scheduler.lifecycle import JobState, TaskState
from services.scheduler.store import MIGRATIONS, AttemptRow, JobRow, JobStore, TaskRow


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[JobStore]:
    db = await open_database(store_url, "scheduler", MIGRATIONS)
    try:
        yield JobStore(db)
    finally:
        await db.close()


def job(name: str, request_id: str = "") -> JobRow:
    return JobRow(name, "acme", b"spec", 0, "local", 1.0, request_id=request_id, waiting_since=1.0)


async def test_create_is_idempotent_per_request_id(store: JobStore) -> None:
    first, created = await store.create(
        job("orgs/acme/jobs/a", "r1"), [TaskRow("orgs/acme/jobs/a", "main", 0)], "f1", b"e"
    )
    assert created and first.job.state is JobState.PENDING and [t.task for t in first.tasks] == ["main"]
    again, created = await store.create(job("orgs/acme/jobs/b", "r1"), [], "f1", b"e")
    assert not created and again.job.name == "orgs/acme/jobs/a"
    with pytest.raises(AlreadyExists) as reused:
        await store.create(job("orgs/acme/jobs/c", "r1"), [], "other", b"e")
    assert reused.value.reason_name == "REQUEST_ID_REUSED"
    with pytest.raises(AlreadyExists) as taken:
        await store.create(job("orgs/acme/jobs/a"), [], "f2", b"e")
    assert taken.value.reason_name == "ALREADY_EXISTS"
    assert [e.job for e in await store.outbox()] == ["orgs/acme/jobs/a"]


async def test_attempts_and_resume(store: JobStore) -> None:
    record, _ = await store.create(
        job("orgs/acme/jobs/a"), [TaskRow("orgs/acme/jobs/a", "main", 0)], "f", b"e"
    )
    attempt = AttemptRow("orgs/acme/jobs/a", "main", 0, "key-0", "local", create_time=2.0)
    await store.save(attempts=[attempt])
    assert [a.handle for a in await store.live_attempts()] == [None]  # stored before launch
    attempt.handle = {"pid": 42}
    record.job.state = JobState.STARTING
    task = record.tasks[0]
    task.state, task.attempt = TaskState.STARTING, 0
    await store.save(record.job, [task], [attempt], [("orgs/acme/jobs/a", False, b"e2")])
    loaded = await store.get("orgs/acme/jobs/a")
    assert loaded.job.state is JobState.STARTING and loaded.tasks[0].attempt == 0
    current = loaded.current("main")
    assert current is not None and current.handle == {"pid": 42}
    assert [r.job.name for r in await store.active()] == ["orgs/acme/jobs/a"]
    attempt.ended, attempt.exit_code = True, 0
    record.job.state = JobState.SUCCEEDED
    await store.save(record.job, attempts=[attempt])
    assert await store.active() == [] and await store.live_attempts() == []
    events = await store.outbox()
    assert [e.payload for e in events] == [b"e", b"e2"]
    await store.sent([e.id for e in events])
    assert await store.outbox() == []


async def test_list_newest_first_with_state_filter(store: JobStore) -> None:
    for n in range(5):
        await store.create(job(f"orgs/acme/jobs/j{n}"), [], f"f{n}", b"e")
    page = await store.list_jobs("acme", [], 0, 2)
    assert [r.job.name for r in page] == ["orgs/acme/jobs/j4", "orgs/acme/jobs/j3"]
    rest = await store.list_jobs("acme", [JobState.PENDING], page[-1].job.seq, 10)
    assert [r.job.name for r in rest] == ["orgs/acme/jobs/j2", "orgs/acme/jobs/j1", "orgs/acme/jobs/j0"]
    assert await store.list_jobs("acme", [JobState.RUNNING], 0, 10) == []
    assert await store.list_jobs("globex", [], 0, 10) == []


async def test_a_page_of_jobs_reads_each_job_whole(store: JobStore) -> None:
    # A page reads every job's tasks and attempts together: each record must still get exactly its own.
    for n in range(4):
        name = f"orgs/acme/jobs/j{n}"
        tasks = [TaskRow(name, f"t{i}", i) for i in range(n % 3 + 1)]
        await store.create(job(name), tasks, f"f{n}", b"e")
        attempts = [
            AttemptRow(name, task.task, a, f"key-{n}-{task.task}-{a}", "local", create_time=float(a))
            for task in tasks
            for a in range(n % 2 + 1)
        ]
        await store.save(attempts=attempts)
    page = await store.list_jobs("acme", [], 0, 10)
    assert [r.job.name for r in page] == [f"orgs/acme/jobs/j{n}" for n in (3, 2, 1, 0)]
    assert page == [await store.get(r.job.name) for r in page]
    assert [[t.task for t in r.tasks] for r in page] == [["t0"], ["t0", "t1", "t2"], ["t0", "t1"], ["t0"]]
    assert [len(r.attempts["t0"]) for r in page] == [2, 1, 2, 1]
    assert sorted(r.job.name for r in await store.active()) == sorted(r.job.name for r in page)
