"""The scheduler's durable state: jobs, their tasks, every attempt of a task, request ids, and the outbox
of events still to publish.

Durability is the point of this module. A job (with its tasks, its request id and its first event) is
stored in one transaction before CreateJob answers; an attempt row is written before `backend.launch` is
called and its handle right after, so a scheduler restarted at any moment finds every attempt it may have
launched and asks the backend (`find`, `poll`) instead of launching twice or forgetting one. State changes
and the events that report them are written in the same transaction; a publisher drains the outbox, so an
unreachable events service delays events but never loses them or stops scheduling.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mesh.errors import AlreadyExists, NotFound, R
from mesh.store import Database, Executor, Fetch, IntegrityError, Migration, Program, Row, run_on
from services.scheduler.lifecycle import JOB_TERMINAL, FailureClass, JobState, TaskState

_TABLES = """
    CREATE TABLE sched_jobs (
        seq {serial} PRIMARY KEY, name TEXT NOT NULL UNIQUE, org TEXT NOT NULL, spec {blob} NOT NULL,
        state INTEGER NOT NULL, failure TEXT NOT NULL, priority INTEGER NOT NULL, backend TEXT NOT NULL,
        create_time DOUBLE PRECISION NOT NULL, start_time DOUBLE PRECISION, end_time DOUBLE PRECISION,
        request_id TEXT NOT NULL, creator TEXT NOT NULL, cancel_requested INTEGER NOT NULL,
        cancel_reason TEXT NOT NULL, restart_count INTEGER NOT NULL, budget_used INTEGER NOT NULL,
        next_restart_time DOUBLE PRECISION, waiting_since DOUBLE PRECISION NOT NULL, message TEXT NOT NULL);
    CREATE INDEX sched_jobs_org ON sched_jobs (org, seq);
    CREATE INDEX sched_jobs_state ON sched_jobs (state);
    CREATE TABLE sched_requests (
        org TEXT NOT NULL, request_id TEXT NOT NULL, fingerprint TEXT NOT NULL, job TEXT NOT NULL,
        PRIMARY KEY (org, request_id));
    CREATE TABLE sched_tasks (
        job TEXT NOT NULL, task TEXT NOT NULL, idx INTEGER NOT NULL, state INTEGER NOT NULL,
        restart_count INTEGER NOT NULL, attempt INTEGER NOT NULL, failure TEXT NOT NULL,
        start_time DOUBLE PRECISION, end_time DOUBLE PRECISION, endpoint TEXT NOT NULL,
        stop_at DOUBLE PRECISION, PRIMARY KEY (job, task));
    CREATE TABLE sched_attempts (
        job TEXT NOT NULL, task TEXT NOT NULL, attempt INTEGER NOT NULL, attempt_key TEXT NOT NULL,
        state INTEGER NOT NULL, backend TEXT NOT NULL, handle TEXT, nodes TEXT NOT NULL,
        exit_code INTEGER, failure TEXT NOT NULL, token_id TEXT NOT NULL,
        create_time DOUBLE PRECISION NOT NULL, start_time DOUBLE PRECISION, end_time DOUBLE PRECISION,
        ended INTEGER NOT NULL, PRIMARY KEY (job, task, attempt));
    CREATE INDEX sched_attempts_live ON sched_attempts (ended, job);
    CREATE TABLE sched_outbox (
        id {serial} PRIMARY KEY, job TEXT NOT NULL, closes INTEGER NOT NULL, payload {blob} NOT NULL)
"""

_OUTBOX_SQLITE = """
    DROP TABLE sched_outbox;
    CREATE TABLE sched_outbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, closes INTEGER NOT NULL, payload BLOB NOT NULL)
"""

MIGRATIONS = [
    Migration.portable(1, "jobs, tasks, attempts, request ids, event outbox", _TABLES),
    # Outbox ids are the events' producer sequence: SQLite must never reuse the id of a sent (deleted)
    # row, or the events service would take a new event for a duplicate. PostgreSQL sequences never do.
    Migration(2, "outbox ids never reused", dialect_sql={"sqlite": _OUTBOX_SQLITE, "postgres": ""}),
]


@dataclass
class FailureInfo:
    failure_class: FailureClass
    message: str
    exit_code: int | None = None
    task: str = ""
    time: float = 0.0

    def to_json(self) -> str:
        data = asdict(self)
        data["failure_class"] = int(self.failure_class)
        return json.dumps(data)

    @staticmethod
    def from_json(text: str) -> FailureInfo | None:
        if not text:
            return None
        data = json.loads(text)
        data["failure_class"] = FailureClass(int(data["failure_class"]))
        return FailureInfo(**data)


def _failure_text(failure: FailureInfo | None) -> str:
    return failure.to_json() if failure else ""


@dataclass
class AttemptRow:
    job: str
    task: str
    attempt: int
    key: str
    backend: str
    state: TaskState = TaskState.STARTING
    handle: dict[str, Any] | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)  # rank, node, address, gpu_indices
    exit_code: int | None = None
    failure: FailureInfo | None = None
    token_id: str = ""
    create_time: float = 0.0
    start_time: float | None = None
    end_time: float | None = None
    ended: bool = False


@dataclass
class TaskRow:
    job: str
    task: str
    idx: int
    state: TaskState = TaskState.PENDING
    restart_count: int = 0
    attempt: int = -1  # the current attempt's number; -1 before the first launch
    failure: FailureInfo | None = None
    start_time: float | None = None
    end_time: float | None = None
    endpoint: str = ""
    stop_at: float | None = None  # auxiliaries: when to stop them after the primaries ended


@dataclass
class JobRow:
    name: str
    org: str
    spec: bytes
    priority: int
    backend: str
    create_time: float
    state: JobState = JobState.PENDING
    failure: FailureInfo | None = None
    start_time: float | None = None
    end_time: float | None = None
    request_id: str = ""
    creator: str = ""
    cancel_requested: bool = False
    cancel_reason: str = ""
    restart_count: int = 0
    budget_used: int = 0
    next_restart_time: float | None = None
    waiting_since: float = 0.0
    message: str = ""  # a note such as "backend unavailable: ..." while it lasts
    seq: int = 0


@dataclass
class JobRecord:
    """A job with its tasks (spec order) and attempts (by task, in attempt order)."""

    job: JobRow
    tasks: list[TaskRow]
    attempts: dict[str, list[AttemptRow]] = field(default_factory=dict)

    def task(self, name: str) -> TaskRow:
        return next(t for t in self.tasks if t.task == name)

    def current(self, task: str) -> AttemptRow | None:
        attempts = self.attempts.get(task, [])
        return attempts[-1] if attempts else None


@dataclass(frozen=True)
class OutboxEvent:
    id: int
    job: str
    closes: bool
    payload: bytes


_JOB_COLUMNS = (
    "name, org, spec, state, failure, priority, backend, create_time, start_time, end_time, request_id, "
    "creator, cancel_requested, cancel_reason, restart_count, budget_used, next_restart_time, "
    "waiting_since, message"
)


def _job_params(j: JobRow) -> tuple[Any, ...]:
    return (
        j.name,
        j.org,
        j.spec,
        int(j.state),
        _failure_text(j.failure),
        j.priority,
        j.backend,
        j.create_time,
        j.start_time,
        j.end_time,
        j.request_id,
        j.creator,
        int(j.cancel_requested),
        j.cancel_reason,
        j.restart_count,
        j.budget_used,
        j.next_restart_time,
        j.waiting_since,
        j.message,
    )


# Rows to enums by lookup: calling an Enum class costs microseconds, and a page of jobs makes hundreds.
_JOB_STATES = {int(state): state for state in JobState}
_TASK_STATES = {int(state): state for state in TaskState}


def _job_from(row: dict[str, Any]) -> JobRow:
    return JobRow(
        name=row["name"],
        org=row["org"],
        spec=bytes(row["spec"]),
        priority=int(row["priority"]),
        backend=row["backend"],
        create_time=float(row["create_time"]),
        state=_JOB_STATES[int(row["state"])],
        failure=FailureInfo.from_json(row["failure"]),
        start_time=row["start_time"],
        end_time=row["end_time"],
        request_id=row["request_id"],
        creator=row["creator"],
        cancel_requested=bool(row["cancel_requested"]),
        cancel_reason=row["cancel_reason"],
        restart_count=int(row["restart_count"]),
        budget_used=int(row["budget_used"]),
        next_restart_time=row["next_restart_time"],
        waiting_since=float(row["waiting_since"]),
        message=row["message"],
        seq=int(row["seq"]),
    )


LOAD_CHUNK = 500  # job names per IN (...) list, well under any store's limit on parameters


def _records(rows: Sequence[Row]) -> Program[list[JobRecord]]:
    """The records of these job rows, in their order, with their tasks and attempts read in two statements
    per `LOAD_CHUNK` jobs rather than two per job."""
    records = {str(row["name"]): JobRecord(_job_from(row), []) for row in rows}
    names = list(records)
    for start in range(0, len(names), LOAD_CHUNK):
        chunk = names[start : start + LOAD_CHUNK]
        marks = ", ".join("?" * len(chunk))
        tasks: list[Row] = yield Fetch(
            f"SELECT * FROM sched_tasks WHERE job IN ({marks}) ORDER BY job, idx",  # noqa: S608 - placeholders
            chunk,
        )
        attempts: list[Row] = yield Fetch(
            f"SELECT * FROM sched_attempts WHERE job IN ({marks}) ORDER BY job, task, attempt",  # noqa: S608 - placeholders
            chunk,
        )
        for t in tasks:
            records[t["job"]].tasks.append(_task_from(t))
        for a in attempts:
            records[a["job"]].attempts.setdefault(a["task"], []).append(_attempt_from(a))
    return list(records.values())


def _jobs_where(condition: str, params: Sequence[Any]) -> Program[list[JobRecord]]:
    """The jobs `condition` (a WHERE clause and what follows it) selects, whole. Run by `Database.read`, a
    page of ListJobs is one hand-off to SQLite's reader thread and one snapshot, not three reads per job."""
    rows: list[Row] = yield Fetch(
        f"SELECT seq, {_JOB_COLUMNS} FROM sched_jobs WHERE {condition}",  # noqa: S608 - constant columns, our clauses
        params,
    )
    return (yield from _records(rows))


def _job_named(name: str) -> Program[JobRecord | None]:
    records = yield from _jobs_where("name = ?", (name,))
    return records[0] if records else None


def _task_from(row: dict[str, Any]) -> TaskRow:
    return TaskRow(
        job=row["job"],
        task=row["task"],
        idx=int(row["idx"]),
        state=_TASK_STATES[int(row["state"])],
        restart_count=int(row["restart_count"]),
        attempt=int(row["attempt"]),
        failure=FailureInfo.from_json(row["failure"]),
        start_time=row["start_time"],
        end_time=row["end_time"],
        endpoint=row["endpoint"],
        stop_at=row["stop_at"],
    )


def _attempt_from(row: dict[str, Any]) -> AttemptRow:
    return AttemptRow(
        job=row["job"],
        task=row["task"],
        attempt=int(row["attempt"]),
        key=row["attempt_key"],
        backend=row["backend"],
        state=_TASK_STATES[int(row["state"])],
        handle=json.loads(row["handle"]) if row["handle"] else None,
        nodes=json.loads(row["nodes"]),
        exit_code=row["exit_code"],
        failure=FailureInfo.from_json(row["failure"]),
        token_id=row["token_id"],
        create_time=float(row["create_time"]),
        start_time=row["start_time"],
        end_time=row["end_time"],
        ended=bool(row["ended"]),
    )


class JobStore:
    """Reads and writes of the scheduler's tables; every multi-row change is one transaction."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # ---- jobs -------------------------------------------------------------------------------------

    async def create(
        self, job: JobRow, tasks: Sequence[TaskRow], fingerprint: str, first_event: bytes
    ) -> tuple[JobRecord, bool]:
        """Store a new job with its tasks, request id and first event. Returns (record, created): a repeat
        of a stored request id with the same fingerprint returns the first job and False; with another
        fingerprint it fails ALREADY_EXISTS / REQUEST_ID_REUSED; a taken name fails ALREADY_EXISTS."""
        try:
            async with self.db.transaction() as tx:
                if job.request_id:
                    earlier = await _earlier_request(tx, job, fingerprint)
                    if earlier is not None:
                        found = await self._load(tx, earlier)
                        assert found is not None
                        return found, False
                    await tx.execute(
                        "INSERT INTO sched_requests (org, request_id, fingerprint, job) VALUES (?, ?, ?, ?)",
                        (job.org, job.request_id, fingerprint, job.name),
                    )
                await tx.execute(
                    f"INSERT INTO sched_jobs ({_JOB_COLUMNS}) VALUES ({', '.join('?' * 19)})",  # noqa: S608 - constant columns
                    _job_params(job),
                )
                for task in tasks:
                    await self._put_task(tx, task, insert=True)
                await tx.execute(
                    "INSERT INTO sched_outbox (job, closes, payload) VALUES (?, 0, ?)",
                    (job.name, first_event),
                )
                record = await self._load(tx, job.name)
                assert record is not None
                return record, True
        except IntegrityError:
            # A concurrent call with the same request id or job id won the race: answer as it would.
            if job.request_id:
                earlier = await _earlier_request(self.db, job, fingerprint)
                if earlier is not None:
                    return await self.get(earlier), False
            raise AlreadyExists(f"{job.name} already exists", reason=R.ERROR_REASON_ALREADY_EXISTS) from None

    async def find_request(self, org: str, request_id: str) -> str | None:
        """The job a stored CreateJob request id created, if any."""
        row = await self.db.fetchone(
            "SELECT job FROM sched_requests WHERE org = ? AND request_id = ?", (org, request_id)
        )
        return str(row["job"]) if row else None

    async def get(self, name: str) -> JobRecord:
        record = await self.find(name)
        if record is None:
            raise NotFound(f"{name} not found", reason=R.ERROR_REASON_JOB_NOT_FOUND)
        return record

    async def find(self, name: str) -> JobRecord | None:
        return await self.db.read(_job_named(name))

    async def _load(self, tx: Executor, name: str) -> JobRecord | None:
        return await run_on(tx, _job_named(name))

    async def list_jobs(
        self, org: str, states: Sequence[JobState], before_seq: int, limit: int
    ) -> list[JobRecord]:
        """One page of an organization's jobs, newest first, below `before_seq` (0: from the newest)."""
        condition = "org = ?"
        params: list[Any] = [org]
        if before_seq:
            condition += " AND seq < ?"
            params.append(before_seq)
        if states:
            condition += f" AND state IN ({', '.join('?' * len(states))})"
            params.extend(int(s) for s in states)
        params.append(limit)
        return await self.db.read(_jobs_where(condition + " ORDER BY seq DESC LIMIT ?", params))

    async def active(self) -> list[JobRecord]:
        """Every job not in a terminal state, oldest first: what a starting engine resumes."""
        terminal = ", ".join(str(int(s)) for s in JOB_TERMINAL)
        return await self.db.read(_jobs_where(f"state NOT IN ({terminal}) ORDER BY seq", ()))

    async def live_attempts(self) -> list[AttemptRow]:
        """Attempts not known to have ended, of any job: a restarted engine reattaches each."""
        rows = await self.db.fetchall(
            "SELECT * FROM sched_attempts WHERE ended = 0 ORDER BY job, task, attempt"
        )
        return [_attempt_from(r) for r in rows]

    # ---- changes ----------------------------------------------------------------------------------

    async def save(
        self,
        job: JobRow | None = None,
        tasks: Sequence[TaskRow] = (),
        attempts: Sequence[AttemptRow] = (),
        events: Sequence[tuple[str, bool, bytes]] = (),
    ) -> None:
        """Write changed rows and the events reporting them in one transaction."""
        async with self.db.transaction() as tx:
            if job is not None:
                assignments = ", ".join(f"{c.strip()} = ?" for c in _JOB_COLUMNS.split(",")[1:])
                await tx.execute(
                    f"UPDATE sched_jobs SET {assignments} WHERE name = ?",  # noqa: S608 - constant columns
                    (*_job_params(job)[1:], job.name),
                )
            for task in tasks:
                await self._put_task(tx, task, insert=False)
            for attempt in attempts:
                await self._put_attempt(tx, attempt)
            for job_name, closes, payload in events:
                await tx.execute(
                    "INSERT INTO sched_outbox (job, closes, payload) VALUES (?, ?, ?)",
                    (job_name, int(closes), payload),
                )

    async def _put_task(self, tx: Executor, t: TaskRow, insert: bool) -> None:
        values = (
            int(t.state),
            t.restart_count,
            t.attempt,
            _failure_text(t.failure),
            t.start_time,
            t.end_time,
            t.endpoint,
            t.stop_at,
        )
        if insert:
            await tx.execute(
                "INSERT INTO sched_tasks (job, task, idx, state, restart_count, attempt, failure, start_time,"
                " end_time, endpoint, stop_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (t.job, t.task, t.idx, *values),
            )
        else:
            await tx.execute(
                "UPDATE sched_tasks SET state = ?, restart_count = ?, attempt = ?, failure = ?, start_time = ?,"
                " end_time = ?, endpoint = ?, stop_at = ? WHERE job = ? AND task = ?",
                (*values, t.job, t.task),
            )

    async def _put_attempt(self, tx: Executor, a: AttemptRow) -> None:
        await tx.execute(
            "INSERT INTO sched_attempts (job, task, attempt, attempt_key, state, backend, handle, nodes,"
            " exit_code, failure, token_id, create_time, start_time, end_time, ended)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (job, task, attempt) DO UPDATE SET state = excluded.state,"
            " handle = excluded.handle, nodes = excluded.nodes, exit_code = excluded.exit_code,"
            " failure = excluded.failure, token_id = excluded.token_id, start_time = excluded.start_time,"
            " end_time = excluded.end_time, ended = excluded.ended",
            (
                a.job,
                a.task,
                a.attempt,
                a.key,
                int(a.state),
                a.backend,
                json.dumps(a.handle) if a.handle is not None else None,
                json.dumps(a.nodes),
                a.exit_code,
                _failure_text(a.failure),
                a.token_id,
                a.create_time,
                a.start_time,
                a.end_time,
                int(a.ended),
            ),
        )

    # ---- the event outbox -------------------------------------------------------------------------

    async def outbox(self, limit: int = 500, job: str = "") -> list[OutboxEvent]:
        sql = "SELECT id, job, closes, payload FROM sched_outbox"
        params: list[Any] = []
        if job:
            sql += " WHERE job = ?"
            params.append(job)
        sql += " ORDER BY id LIMIT ?"
        params.append(limit)
        rows = await self.db.fetchall(sql, params)
        return [OutboxEvent(int(r["id"]), r["job"], bool(r["closes"]), bytes(r["payload"])) for r in rows]

    async def sent(self, ids: Sequence[int]) -> None:
        if ids:
            await self.db.execute(
                f"DELETE FROM sched_outbox WHERE id IN ({', '.join('?' * len(ids))})",  # noqa: S608 - placeholders
                tuple(ids),
            )


async def _earlier_request(tx: Executor, job: JobRow, fingerprint: str) -> str | None:
    """The job an earlier CreateJob with this request id made; REQUEST_ID_REUSED if its body differed."""
    earlier = await tx.fetchone(
        "SELECT fingerprint, job FROM sched_requests WHERE org = ? AND request_id = ?",
        (job.org, job.request_id),
    )
    if earlier is None:
        return None
    if earlier["fingerprint"] != fingerprint:
        raise AlreadyExists(
            "request_id was used for another CreateJob request", reason=R.ERROR_REASON_REQUEST_ID_REUSED
        )
    return str(earlier["job"])
