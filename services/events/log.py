"""The event log: dense per-job sequence numbers, durable before acknowledgement, idempotent producers,
live fan-out, explicit compaction, and metric series. Domain code: no grpc import.

Writes go through one writer task that commits every publish waiting at that moment in a single
transaction (group commit), so many small publishes cost one fsync. Each committed batch is handed to the
`Broker`, which wakes subscribers and keeps a bounded window of recent events in memory; a subscriber
whose cursor falls outside that window reads from storage instead, so a slow subscriber never holds up a
publisher or another subscriber. With PostgreSQL, every commit also sends a NOTIFY, and each replica's
listener wakes its own subscribers, so a subscriber on any replica sees every event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.events.v1 import event_pb2, job_stream_pb2, metric_pb2

from mesh.errors import FailedPrecondition, InvalidArgument, NotFound, R, Unavailable
from mesh.store import Database, Executor

log = logging.getLogger("tandem.events")

MAX_EVENT_BYTES = 64 * 1024
READ_BATCH = 512
RING_SIZE = 8192
NOTIFY_CHANNEL = "tandem_events"
TERMINAL_STATES = frozenset({5, 6, 7})  # tandem.scheduler.v1.Job.State SUCCEEDED, FAILED, CANCELLED


def org_of(job: str) -> str:
    return job.split("/")[1]


@dataclass
class JobInfo:
    job: str
    org: str
    last_seq: int
    first_retained_seq: int
    terminal: bool
    terminal_state: int
    create_time: float
    close_time: float | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> JobInfo:
        return cls(
            job=row["job"],
            org=row["org"],
            last_seq=int(row["last_seq"]),
            first_retained_seq=int(row["first_retained_seq"]),
            terminal=bool(row["terminal"]),
            terminal_state=int(row["terminal_state"]),
            create_time=float(row["create_time"]),
            close_time=row["close_time"],
        )


@dataclass
class PublishResult:
    seqs: list[int]
    duplicates: int
    last_seq: int


@dataclass
class _Pending:
    job: str
    events: list[event_pb2.Event]
    create: bool
    close_state: int
    future: asyncio.Future[PublishResult]


@dataclass
class _JobWindow:
    """Recent committed events of one job, contiguous by seq."""

    events: deque[event_pb2.Event] = field(default_factory=lambda: deque(maxlen=RING_SIZE))
    waiter: asyncio.Event = field(default_factory=asyncio.Event)


class Broker:
    """Wakes subscribers when a job's log grows and serves recent events from memory."""

    def __init__(self) -> None:
        self._jobs: dict[str, _JobWindow] = {}
        self._orgs: dict[str, asyncio.Event] = {}

    def _window(self, job: str) -> _JobWindow:
        window = self._jobs.get(job)
        if window is None:
            window = self._jobs[job] = _JobWindow()
        return window

    def waiter(self, job: str) -> asyncio.Event:
        """Take this before reading; it is set by the next commit to the job (no lost wake-ups)."""
        return self._window(job).waiter

    def org_waiter(self, org: str) -> asyncio.Event:
        if org not in self._orgs:
            self._orgs[org] = asyncio.Event()
        return self._orgs[org]

    def committed(self, job: str, events: Sequence[event_pb2.Event]) -> None:
        window = self._window(job)
        if events:
            ring = window.events
            if ring and ring[-1].seq + 1 != events[0].seq:
                ring.clear()  # not contiguous (compaction, another replica's writes): restart the window
            ring.extend(events)
        self.wake(job)

    def wake(self, job: str) -> None:
        window = self._window(job)
        window.waiter.set()
        window.waiter = asyncio.Event()
        org = org_of(job)
        if org in self._orgs:
            self._orgs[org].set()
            self._orgs[org] = asyncio.Event()

    def forget(self, job: str) -> None:
        """Drop the in-memory window (after compaction), so reads go to storage."""
        if job in self._jobs:
            self._jobs[job].events.clear()

    def recent(self, job: str, after_seq: int, limit: int) -> list[event_pb2.Event] | None:
        """Events after `after_seq` from memory, or None when the window does not cover that cursor."""
        window = self._jobs.get(job)
        if window is None or not window.events:
            return None
        first = window.events[0].seq
        last = window.events[-1].seq
        if after_seq + 1 < first or after_seq >= last:
            return None  # not covered, or nothing newer here (another replica may have newer: ask storage)
        start = after_seq + 1 - first
        return [window.events[i] for i in range(start, min(start + limit, len(window.events)))]


class EventLog:
    """Publishing, reading, closing and compacting job logs on one database."""

    def __init__(
        self, db: Database, broker: Broker, max_group: int = 256, retention_interval_s: float = 60.0
    ) -> None:
        self.db = db
        self.broker = broker
        self._retention_interval_s = retention_interval_s
        self._retention: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._max_group = max_group
        self._writer: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="events-writer")
        self._retention = asyncio.create_task(
            self._retention_loop(self._retention_interval_s), name="events-retention"
        )
        if self.db.dialect == "postgres":
            self._listener = asyncio.create_task(self._listen_loop(), name="events-listener")

    async def stop(self) -> None:
        for task in (self._writer, self._listener, self._retention):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ---- writes -------------------------------------------------------------------------------

    async def publish(
        self, job: str, events: Sequence[event_pb2.Event], *, create: bool, close_state: int = 0
    ) -> PublishResult:
        """Append events; durable when this returns. `create` lets a trusted caller open a new log."""
        for index, event in enumerate(events):
            if event.ByteSize() > MAX_EVENT_BYTES:
                raise InvalidArgument(
                    f"events[{index}] is {event.ByteSize()} bytes; the limit is {MAX_EVENT_BYTES}",
                    reason=R.ERROR_REASON_PAYLOAD_TOO_LARGE,
                    metadata={"limit_bytes": str(MAX_EVENT_BYTES)},
                )
        future: asyncio.Future[PublishResult] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(job, list(events), create, close_state, future))
        return await future

    async def _write_loop(self) -> None:
        while True:
            group = [await self._queue.get()]
            while len(group) < self._max_group and not self._queue.empty():
                group.append(self._queue.get_nowait())
            await self._commit(group)

    async def _commit(self, group: list[_Pending]) -> None:  # noqa: PLR0912 - one transaction, top to bottom
        outcomes: list[PublishResult | Exception] = []
        appended: dict[str, list[event_pb2.Event]] = {}
        try:
            async with self.db.transaction() as tx:
                for pending in group:
                    try:
                        result, new = await self._apply(tx, pending)
                    except (NotFound, FailedPrecondition) as refused:
                        outcomes.append(refused)
                        continue
                    outcomes.append(result)
                    if new:
                        appended.setdefault(pending.job, []).extend(new)
                if self.db.dialect == "postgres":
                    for job, new in appended.items():
                        await tx.execute("SELECT pg_notify(?, ?)", (NOTIFY_CHANNEL, f"{job} {new[-1].seq}"))
        except Exception:
            log.exception("event commit failed; nothing in this group was acknowledged")
            for pending in group:
                if not pending.future.done():
                    pending.future.set_exception(Unavailable("the event store could not commit; retry"))
            return
        for job, new in appended.items():
            self.broker.committed(job, new)
        for pending, outcome in zip(group, outcomes, strict=True):
            if pending.future.done():
                continue
            if isinstance(outcome, Exception):
                pending.future.set_exception(outcome)
            else:
                pending.future.set_result(outcome)

    async def _apply(self, tx: Executor, pending: _Pending) -> tuple[PublishResult, list[event_pb2.Event]]:
        lock = " FOR UPDATE" if tx.dialect == "postgres" else ""
        row = await tx.fetchone(f"SELECT * FROM event_jobs WHERE job = ?{lock}", (pending.job,))  # noqa: S608
        now = time.time()
        if row is None:
            if not pending.create:
                raise NotFound(f"{pending.job} has no event log", reason=R.ERROR_REASON_JOB_NOT_FOUND)
            await tx.execute(
                "INSERT INTO event_jobs (job, org, last_seq, first_retained_seq, create_time)"
                " VALUES (?, ?, 0, 1, ?)",
                (pending.job, org_of(pending.job), now),
            )
            info = JobInfo(pending.job, org_of(pending.job), 0, 1, False, 0, now, None)
        else:
            info = JobInfo.from_row(row)
        if info.terminal:
            raise FailedPrecondition(
                f"{pending.job} is closed; nothing more can be published",
                reason=R.ERROR_REASON_JOB_STREAM_CLOSED,
            )
        known = await self._known_producer_seqs(tx, pending)
        seqs: list[int] = []
        new: list[event_pb2.Event] = []
        duplicates = 0
        next_seq = info.last_seq
        for event in pending.events:
            key = (event.producer_id, event.producer_seq)
            if event.producer_id and key in known:
                seqs.append(known[key])
                duplicates += 1
                continue
            next_seq += 1
            stored = event_pb2.Event()
            stored.CopyFrom(event)
            stored.job = pending.job
            stored.seq = next_seq
            stored.receive_time.FromNanoseconds(time.time_ns())
            if not stored.HasField("time"):
                stored.time.CopyFrom(stored.receive_time)
            new.append(stored)
            seqs.append(next_seq)
            if event.producer_id:
                known[key] = next_seq
        if new:
            await tx.executemany(
                "INSERT INTO events (job, seq, type, level, receive_time, body) VALUES (?, ?, ?, ?, ?, ?)",
                [(e.job, e.seq, e.type, int(e.level), now, e.SerializeToString()) for e in new],
            )
            producer_rows = [(e.job, e.producer_id, e.producer_seq, e.seq) for e in new if e.producer_id]
            if producer_rows:
                await tx.executemany(
                    "INSERT INTO event_producers (job, producer_id, producer_seq, seq) VALUES (?, ?, ?, ?)",
                    producer_rows,
                )
            await self._record_step_metrics(tx, new, now)
        close = pending.close_state
        await tx.execute(
            "UPDATE event_jobs SET last_seq = ?, terminal = ?, terminal_state = ?, close_time = ?"
            " WHERE job = ?",
            (next_seq, 1 if close else 0, close, now if close else None, pending.job),
        )
        return PublishResult(seqs, duplicates, next_seq), new

    async def _known_producer_seqs(self, tx: Executor, pending: _Pending) -> dict[tuple[str, int], int]:
        ranges: dict[str, list[int]] = {}
        for event in pending.events:
            if event.producer_id:
                ranges.setdefault(event.producer_id, []).append(event.producer_seq)
        known: dict[tuple[str, int], int] = {}
        for producer, numbers in ranges.items():
            rows = await tx.fetchall(
                "SELECT producer_seq, seq FROM event_producers"
                " WHERE job = ? AND producer_id = ? AND producer_seq BETWEEN ? AND ?",
                (pending.job, producer, min(numbers), max(numbers)),
            )
            known.update({(producer, int(r["producer_seq"])): int(r["seq"]) for r in rows})
        return known

    async def _record_step_metrics(self, tx: Executor, events: list[event_pb2.Event], now: float) -> None:
        rows = [
            (e.job, name, e.train_step.step, value, now)
            for e in events
            if e.WhichOneof("core") == "train_step"
            for name, value in e.train_step.metrics.items()
        ]
        if rows:
            await tx.executemany(UPSERT_METRIC, rows)

    # ---- reads --------------------------------------------------------------------------------

    async def info(self, job: str) -> JobInfo:
        row = await self.db.fetchone("SELECT * FROM event_jobs WHERE job = ?", (job,))
        if row is None:
            raise NotFound(f"{job} has no event log", reason=R.ERROR_REASON_JOB_NOT_FOUND)
        return JobInfo.from_row(row)

    async def jobs_of(self, org: str) -> list[JobInfo]:
        rows = await self.db.fetchall("SELECT * FROM event_jobs WHERE org = ? ORDER BY job", (org,))
        return [JobInfo.from_row(r) for r in rows]

    async def read(self, job: str, after_seq: int, limit: int = READ_BATCH) -> list[event_pb2.Event]:
        """Events with seq > after_seq in order: from memory when the window covers it, else storage."""
        recent = self.broker.recent(job, after_seq, limit)
        if recent is not None:
            return recent
        return await self.read_stored(job, after_seq, limit)

    async def read_stored(
        self, job: str, after_seq: int, limit: int, before_seq: int = 0, descending: bool = False
    ) -> list[event_pb2.Event]:
        upper = before_seq if before_seq else 2**62
        order = "DESC" if descending else "ASC"
        rows = await self.db.fetchall(
            f"SELECT body FROM events WHERE job = ? AND seq > ? AND seq < ? ORDER BY seq {order} LIMIT ?",  # noqa: S608
            (job, after_seq, upper, limit),
        )
        return [event_pb2.Event.FromString(bytes(r["body"])) for r in rows]

    # ---- retention ----------------------------------------------------------------------------

    async def compact(self, job: str, keep_last: int, max_age_s: float | None) -> tuple[int, JobInfo]:
        """Remove the oldest events beyond `keep_last` and those older than `max_age_s`; the newest stays."""
        async with self.db.transaction() as tx:
            lock = " FOR UPDATE" if tx.dialect == "postgres" else ""
            row = await tx.fetchone(f"SELECT * FROM event_jobs WHERE job = ?{lock}", (job,))  # noqa: S608
            if row is None:
                raise NotFound(f"{job} has no event log", reason=R.ERROR_REASON_JOB_NOT_FOUND)
            info = JobInfo.from_row(row)
            cut = info.first_retained_seq  # new first retained seq
            if keep_last:
                cut = max(cut, info.last_seq - keep_last + 1)
            if max_age_s is not None:
                young = await tx.fetchone(
                    "SELECT MIN(seq) AS seq FROM events WHERE job = ? AND receive_time >= ?",
                    (job, time.time() - max_age_s),
                )
                oldest_young = young["seq"] if young and young["seq"] is not None else info.last_seq
                cut = max(cut, int(oldest_young))
            cut = min(cut, max(info.last_seq, 1))
            removed = await tx.execute("DELETE FROM events WHERE job = ? AND seq < ?", (job, cut))
            await tx.execute("DELETE FROM event_producers WHERE job = ? AND seq < ?", (job, cut))
            await tx.execute("UPDATE event_jobs SET first_retained_seq = ? WHERE job = ?", (cut, job))
            info.first_retained_seq = cut
        if removed:
            self.broker.forget(job)
        return removed, info

    async def policy(self, org: str) -> job_stream_pb2.RetentionPolicy:
        row = await self.db.fetchone("SELECT body FROM retention_policies WHERE org = ?", (org,))
        if row is None:
            return job_stream_pb2.RetentionPolicy(name=f"orgs/{org}/retentionPolicy")
        return job_stream_pb2.RetentionPolicy.FromString(bytes(row["body"]))

    async def set_policy(self, org: str, policy: job_stream_pb2.RetentionPolicy) -> None:
        await self.db.execute(
            "INSERT INTO retention_policies (org, body) VALUES (?, ?)"
            " ON CONFLICT (org) DO UPDATE SET body = excluded.body",
            (org, policy.SerializeToString()),
        )

    async def apply_retention(self) -> int:
        """One pass of every organization's policy over its logs; returns how many events it removed."""
        removed = 0
        for row in await self.db.fetchall("SELECT org, body FROM retention_policies"):
            policy = job_stream_pb2.RetentionPolicy.FromString(bytes(row["body"]))
            max_age = policy.max_age.ToNanoseconds() / 1e9 if policy.max_age.ToNanoseconds() > 0 else None
            if not policy.max_events_per_job and max_age is None:
                continue
            for info in await self.jobs_of(row["org"]):
                if info.terminal or policy.compact_live_jobs:
                    count, _ = await self.compact(info.job, policy.max_events_per_job, max_age)
                    removed += count
        return removed

    async def _retention_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                removed = await self.apply_retention()
                if removed:
                    log.info("retention pass", extra={"removed_events": removed})
            except Exception:
                log.exception("retention pass failed; retrying at the next interval")

    async def _listen_loop(self) -> None:
        """PostgreSQL only: wake local subscribers for commits made by any replica."""
        import psycopg  # noqa: PLC0415

        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.db.url, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    async for note in conn.notifies():
                        job, _, _ = note.payload.partition(" ")
                        self.broker.wake(job)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("event listener lost its connection; reconnecting", exc_info=True)
                await asyncio.sleep(1.0)


UPSERT_METRIC = (
    "INSERT INTO metric_points (job, name, step, value, time) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (job, name, step) DO UPDATE SET value = excluded.value, time = excluded.time"
)


async def write_metrics(db: Database, job: str, points: Sequence[metric_pb2.MetricPoint]) -> int:
    now = time.time()
    rows = [
        (job, p.name, p.step, p.value, p.time.ToNanoseconds() / 1e9 if p.HasField("time") else now)
        for p in points
    ]
    async with db.transaction() as tx:
        await tx.executemany(UPSERT_METRIC, rows)
    return len(rows)


def downsample(
    points: list[tuple[int, float, float]], max_points: int
) -> tuple[list[metric_pb2.MetricSeries.Point], bool]:
    """(step, value, time) points in step order -> at most `max_points` buckets of equal step width,
    each reporting mean, min, max and count, at the bucket's last step."""
    out: list[metric_pb2.MetricSeries.Point] = []
    if not max_points or len(points) <= max_points:
        for step, value, when in points:
            point = metric_pb2.MetricSeries.Point(step=step, value=value, min=value, max=value, count=1)
            point.time.FromNanoseconds(int(when * 1e9))
            out.append(point)
        return out, False
    first, last = points[0][0], points[-1][0]
    width = max(1, -(-(last - first + 1) // max_points))
    bucket: list[tuple[int, float, float]] = []
    for item in points:
        if bucket and (item[0] - first) // width != (bucket[0][0] - first) // width:
            out.append(_bucket(bucket))
            bucket = []
        bucket.append(item)
    if bucket:
        out.append(_bucket(bucket))
    return out, True


def _bucket(items: list[tuple[int, float, float]]) -> metric_pb2.MetricSeries.Point:
    values = [v for _, v, _ in items]
    point = metric_pb2.MetricSeries.Point(
        step=items[-1][0],
        value=sum(values) / len(values),
        min=min(values),
        max=max(values),
        count=len(values),
    )
    point.time.FromNanoseconds(int(items[-1][2] * 1e9))
    return point
