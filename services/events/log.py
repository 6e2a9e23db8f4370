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
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import timestamp_pb2
from tandem.events.v1 import event_pb2, job_stream_pb2, metric_pb2
from tandem.scheduler.v1 import job_pb2

from mesh.aio import cancel_and_wait
from mesh.errors import FailedPrecondition, InvalidArgument, NotFound, R, Unavailable
from mesh.store import Database, Execute, ExecuteMany, Fetch, Program, Row
from services.events.store import (
    CHUNK_EVENTS,
    INSERT_CHUNK,
    ChunkRow,
    chunk_row,
    chunk_rows,
    decode_chunk,
)

log = logging.getLogger("tandem.events")

MAX_EVENT_BYTES = 64 * 1024
READ_BATCH = 512
CHUNKS_PER_READ = 8
RING_SIZE = 8192
NOTIFY_CHANNEL = "tandem_events"
SERIALIZED_CACHE_SIZE = 256  # serialized Subscribe responses shared by subscribers at one cursor
GATHER_TURNS = 8  # event-loop turns the writer waits while its queue still grows
PRODUCER_CACHE_JOBS = 4096  # jobs whose producers' highest producer_seq the writer remembers
TERMINAL_STATES = frozenset(
    {job_pb2.Job.STATE_SUCCEEDED, job_pb2.Job.STATE_FAILED, job_pb2.Job.STATE_CANCELLED}
)


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
    block: tuple[str, int] | None = None  # (producer, first number): one producer, consecutive numbers


@dataclass
class _Applied:
    """What one commit group did, in memory until the transaction commits."""

    outcomes: list[PublishResult | Exception] = field(default_factory=list)
    appended: dict[str, list[event_pb2.Event]] = field(default_factory=dict)
    jobs: dict[str, tuple[int, int]] = field(default_factory=dict)  # job -> (last seq, terminal state)
    producer_max: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> producer -> highest


class _ProducerCache:
    """The writer's record of the highest producer_seq committed per (job, producer), so a new producer
    sequence needs no lookup. Valid for a job only while its last seq is the one this writer committed: a
    job row that moved otherwise (another replica on PostgreSQL) drops the job's entries."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[int, dict[str, int]]] = {}

    def check(self, job: str, last_seq: int) -> None:
        entry = self._jobs.get(job)
        if entry is not None and entry[0] != last_seq:
            del self._jobs[job]

    def highest(self, job: str, producer: str) -> int | None:
        entry = self._jobs.get(job)
        return None if entry is None else entry[1].get(producer)

    def learn(self, job: str, producer: str, highest: int) -> None:
        entry = self._jobs.get(job)
        if entry is None:
            entry = self._jobs[job] = (-1, {})  # last seq set by the commit; -1 never matches a row
        entry[1][producer] = highest

    def fresh(self, job: str, producer: str) -> None:
        """A log created in this group has no producers yet."""
        self.learn(job, producer, 0)

    def commit(self, job: str, last_seq: int, producers: dict[str, int] | None) -> None:
        entry = self._jobs.get(job)
        table = entry[1] if entry is not None else {}
        for producer, highest in (producers or {}).items():
            if highest > table.get(producer, 0):
                table[producer] = highest
        self._jobs[job] = (last_seq, table)
        if len(self._jobs) > PRODUCER_CACHE_JOBS:
            self._jobs.pop(next(iter(self._jobs)))

    def clear(self) -> None:
        self._jobs.clear()


@dataclass
class _ProducerRun:
    """One producer's numbers on one job within a commit group: what was committed before (the stored
    ranges that overlap this group's numbers) and the ranges this group adds. A range maps producer_seqs
    first..last onto seqs first_seq..first_seq + (last - first), so a producer sending in order costs one
    stored row per publish, not one per event."""

    high: int  # the highest producer_seq committed before this group, then the highest seen in it
    stored: list[tuple[int, int, int]] = field(default_factory=list)  # (first, last, first_seq)
    ranges: list[list[int]] = field(default_factory=list)  # [first, last, first_seq], this group's

    def find(self, number: int) -> int:
        """The seq `number` was given, or 0 when it has none yet."""
        for first, last, seq in itertools.chain(self.ranges, self.stored):
            if first <= number <= last:
                return seq + number - first
        return 0

    def add_block(self, number: int, count: int, seq: int) -> None:
        """Numbers number..number + count - 1 took seqs seq..seq + count - 1."""
        self.add(number, seq)
        tail = self.ranges[-1]
        tail[1] = number + count - 1
        self.high = max(self.high, tail[1])

    def add(self, number: int, seq: int) -> None:
        ranges = self.ranges
        if ranges:
            tail = ranges[-1]
            if tail[1] + 1 == number and tail[2] + tail[1] - tail[0] + 1 == seq:
                tail[1] = number
                self.high = max(self.high, number)
                return
        ranges.append([number, number, seq])
        self.high = max(self.high, number)


@dataclass
class _JobWindow:
    """Recent committed events of one job, contiguous by seq, and what this process knows of its log."""

    events: deque[event_pb2.Event] = field(default_factory=lambda: deque(maxlen=RING_SIZE))
    waiter: asyncio.Event = field(default_factory=asyncio.Event)
    last_seq: int | None = None  # the newest committed seq known here; None: ask storage
    terminal_state: int = 0  # nonzero once the log is known to be closed


class Broker:
    """Wakes subscribers when a job's log grows, serves recent events from memory, and knows each job's
    newest committed seq and terminal state (from local commits, NOTIFY payloads and storage reads), so a
    caught-up subscriber waits without asking storage."""

    def __init__(self) -> None:
        self._jobs: dict[str, _JobWindow] = {}
        self._orgs: dict[str, asyncio.Event] = {}
        self._serialized: OrderedDict[tuple[Any, ...], bytes | None] = OrderedDict()

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

    def committed(
        self, job: str, events: Sequence[event_pb2.Event], last_seq: int = 0, terminal_state: int = 0
    ) -> None:
        """A commit to `job` (local: with its events; another replica's: `last_seq` only), then wake."""
        window = self._window(job)
        if events:
            ring = window.events
            if ring and ring[-1].seq + 1 != events[0].seq:
                ring.clear()  # not contiguous (compaction, another replica's writes): restart the window
            ring.extend(events)
            last_seq = max(last_seq, events[-1].seq)
        self.observe(job, last_seq, terminal_state)
        self.wake(job)

    def observe(self, job: str, last_seq: int, terminal_state: int = 0) -> None:
        """Record what storage or a peer said of the log; never moves the known last seq backwards."""
        window = self._window(job)
        if window.last_seq is None or last_seq > window.last_seq:
            window.last_seq = last_seq
        if terminal_state:
            window.terminal_state = terminal_state

    def known(self, job: str) -> tuple[int, int] | None:
        """(newest committed seq, terminal state) as known here, or None when this process knows nothing."""
        window = self._jobs.get(job)
        if window is None or window.last_seq is None:
            return None
        return window.last_seq, window.terminal_state

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
        """Events after `after_seq` from memory; [] when nothing newer is known to be committed; None when
        the window does not cover that cursor (read storage)."""
        window = self._jobs.get(job)
        if window is None:
            return None
        if window.last_seq is not None and after_seq >= window.last_seq:
            return []
        ring = window.events
        if not ring:
            return None
        first = ring[0].seq
        last = ring[-1].seq
        if after_seq + 1 < first or after_seq >= last:
            return None  # not covered, or newer events only another replica wrote: ask storage
        start = after_seq + 1 - first
        stop = min(start + limit, len(ring))
        if start == 0 and stop == len(ring):
            return list(ring)
        if start < len(ring) - stop:
            return list(itertools.islice(ring, start, stop))
        # Caught-up readers ask for the newest few: walk from the right end, not over the whole window.
        newest_first = list(itertools.islice(reversed(ring), len(ring) - stop, len(ring) - start))
        newest_first.reverse()
        return newest_first

    def serialized(self, key: tuple[Any, ...]) -> tuple[bool, bytes | None]:
        """A response serialized for an earlier subscriber at the same cursor with the same filter."""
        cache = self._serialized
        if key in cache:
            cache.move_to_end(key)
            return True, cache[key]
        return False, None

    def remember(self, key: tuple[Any, ...], data: bytes | None) -> None:
        cache = self._serialized
        cache[key] = data
        if len(cache) > SERIALIZED_CACHE_SIZE:
            cache.popitem(last=False)


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
        self._producers = _ProducerCache()

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
                await cancel_and_wait(task)

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
            # Publishes whose bytes already arrived are parsed and queued by callbacks that are ready now:
            # let them run (a few loop turns, no timer) so they share this commit instead of the next fsync.
            for _ in range(GATHER_TURNS):
                waiting = self._queue.qsize()
                await asyncio.sleep(0)
                if self._queue.qsize() == waiting:
                    break
            while len(group) < self._max_group and not self._queue.empty():
                group.append(self._queue.get_nowait())
            await self._commit(group)

    async def _commit(self, group: list[_Pending]) -> None:
        try:
            applied = await self.db.run(self._commit_program(group))
        except Exception:
            log.exception("event commit failed; nothing in this group was acknowledged")
            self._producers.clear()  # what the failed group learned was never committed
            for pending in group:
                if not pending.future.done():
                    pending.future.set_exception(Unavailable("the event store could not commit; retry"))
            return
        for job, (last_seq, close_state) in applied.jobs.items():
            self._producers.commit(job, last_seq, applied.producer_max.get(job))
            self.broker.committed(job, applied.appended.get(job, ()), last_seq, close_state)
        for pending, outcome in zip(group, applied.outcomes, strict=True):
            if pending.future.done():
                continue
            if isinstance(outcome, Exception):
                pending.future.set_exception(outcome)
            else:
                pending.future.set_result(outcome)

    def _commit_program(self, group: list[_Pending]) -> Program[_Applied]:  # noqa: PLR0912, PLR0915
        """One commit group as a transaction program: seqs for the whole group from one read of its job
        rows, producer lookups only where a producer_seq could be a retry, one batched write per table and,
        on PostgreSQL, a NOTIFY per job. On SQLite all of it runs on the store's thread in one hand-off."""
        postgres = self.db.dialect == "postgres"
        now_ns = time.time_ns()  # one receive time for the whole group
        now = now_ns / 1e9
        stamp = timestamp_pb2.Timestamp()
        stamp.FromNanoseconds(now_ns)
        names = sorted({p.job for p in group})
        lock = " FOR UPDATE" if postgres else ""
        marks = ", ".join("?" for _ in names)
        rows: list[Row] = yield Fetch(
            f"SELECT * FROM event_jobs WHERE job IN ({marks}) ORDER BY job{lock}",  # noqa: S608
            names,
        )
        infos: dict[str, JobInfo] = {r["job"]: JobInfo.from_row(r) for r in rows}
        for name, existing in infos.items():
            self._producers.check(name, existing.last_seq)
        # Producer sequences that may be retries: at or below the highest one committed (unknown: ask).
        # A publish from one producer with consecutive numbers (the usual shape) is recognised here at C
        # speed, and its events later take their seqs as a block.
        spans: dict[tuple[str, str], tuple[int, int]] = {}
        for pending in group:
            if (pending.job not in infos and not pending.create) or not pending.events:
                continue
            ids = [e.producer_id for e in pending.events]
            if ids.count(ids[0]) == len(ids):
                if not ids[0]:
                    continue
                numbers = [e.producer_seq for e in pending.events]
                low, high = min(numbers), max(numbers)
                if high - low + 1 == len(numbers) and numbers == list(range(low, high + 1)):
                    pending.block = (ids[0], low)
                key = (pending.job, ids[0])
                span = spans.get(key)
                spans[key] = (low, high) if span is None else (min(span[0], low), max(span[1], high))
                continue
            for event in pending.events:
                if event.producer_id:
                    key = (pending.job, event.producer_id)
                    number = event.producer_seq
                    span = spans.get(key)
                    spans[key] = (
                        (number, number) if span is None else (min(span[0], number), max(span[1], number))
                    )
        runs: dict[tuple[str, str], _ProducerRun] = {}
        for (job, producer), (low, high) in spans.items():
            if job not in infos:
                self._producers.fresh(job, producer)
                runs[job, producer] = _ProducerRun(0)
                continue
            highest = self._producers.highest(job, producer)
            if highest is None:
                top: list[Row] = yield Fetch(
                    "SELECT MAX(last_producer_seq) AS m FROM event_producer_ranges"
                    " WHERE job = ? AND producer_id = ?",
                    (job, producer),
                )
                highest = int(top[0]["m"]) if top and top[0]["m"] is not None else 0
                self._producers.learn(job, producer, highest)
            run = runs[job, producer] = _ProducerRun(highest)
            if low <= highest:
                found: list[Row] = yield Fetch(
                    "SELECT first_producer_seq, last_producer_seq, first_seq FROM event_producer_ranges"
                    " WHERE job = ? AND producer_id = ? AND last_producer_seq >= ? AND first_producer_seq <= ?",
                    (job, producer, low, min(high, highest)),
                )
                run.stored = [
                    (int(r["first_producer_seq"]), int(r["last_producer_seq"]), int(r["first_seq"]))
                    for r in found
                ]

        applied = _Applied()
        chunks: list[ChunkRow] = []
        created: list[tuple[str, str, float]] = []
        metric_rows: list[tuple[str, str, int, float, float]] = []
        for pending in group:
            job = pending.job
            info = infos.get(job)
            if info is None:
                if not pending.create:
                    applied.outcomes.append(
                        NotFound(f"{job} has no event log", reason=R.ERROR_REASON_JOB_NOT_FOUND)
                    )
                    continue
                info = infos[job] = JobInfo(job, org_of(job), 0, 1, False, 0, now, None)
                created.append((job, info.org, now))
            if info.terminal:
                applied.outcomes.append(
                    FailedPrecondition(
                        f"{job} is closed; nothing more can be published",
                        reason=R.ERROR_REASON_JOB_STREAM_CLOSED,
                    )
                )
                continue
            seqs: list[int] = []
            duplicates = 0
            next_seq = info.last_seq
            new = applied.appended.setdefault(job, [])
            fresh: list[event_pb2.Event] = []  # the events this publish adds, in order
            if pending.block is not None and pending.block[1] > runs[job, pending.block[0]].high:
                # One producer, consecutive numbers, all new: no retry is possible, seqs follow as a block.
                fresh = pending.events
                runs[job, pending.block[0]].add_block(pending.block[1], len(fresh), next_seq + 1)
                seqs = list(range(next_seq + 1, next_seq + 1 + len(fresh)))
                next_seq += len(fresh)
            else:
                producer, run = "", _ProducerRun(0)
                for event in pending.events:
                    if event.producer_id:
                        if event.producer_id != producer:
                            producer = event.producer_id
                            run = runs[job, producer]
                        number = event.producer_seq
                        if number <= run.high:  # committed before, or earlier in this group: maybe a retry
                            seen = run.find(number)
                            if seen:
                                seqs.append(seen)
                                duplicates += 1
                                continue
                        run.add(number, next_seq + 1)
                    next_seq += 1
                    fresh.append(event)
                    seqs.append(next_seq)
            # The request is this call's own: its events are stamped in place and kept, not copied.
            for seq, event in enumerate(fresh, start=info.last_seq + 1):
                event.job = job
                event.seq = seq
                event.receive_time.CopyFrom(stamp)
                if not event.HasField("time"):
                    event.time.CopyFrom(stamp)
                if event.HasField("train_step"):
                    step = event.train_step.step
                    metric_rows.extend(
                        (job, name, step, value, now) for name, value in event.train_step.metrics.items()
                    )
            new.extend(fresh)
            if fresh:
                chunks.extend(chunk_rows(job, fresh, now))
            info.last_seq = next_seq
            if pending.close_state:
                info.terminal = True
                info.terminal_state = pending.close_state
                info.close_time = now
            applied.jobs[job] = (next_seq, info.terminal_state)
            applied.outcomes.append(PublishResult(seqs, duplicates, next_seq))
        producer_rows: list[tuple[str, str, int, int, int]] = []
        for (job, producer), run in runs.items():
            if run.ranges:
                applied.producer_max.setdefault(job, {})[producer] = run.high
                producer_rows.extend((job, producer, first, last, seq) for first, last, seq in run.ranges)
        if created:
            yield ExecuteMany(
                "INSERT INTO event_jobs (job, org, last_seq, first_retained_seq, create_time)"
                " VALUES (?, ?, 0, 1, ?)",
                created,
            )
        if chunks:
            yield ExecuteMany(INSERT_CHUNK, chunks)
        if producer_rows:
            yield ExecuteMany(
                "INSERT INTO event_producer_ranges"
                " (job, producer_id, first_producer_seq, last_producer_seq, first_seq) VALUES (?, ?, ?, ?, ?)",
                producer_rows,
            )
        if metric_rows:
            yield ExecuteMany(UPSERT_METRIC, metric_rows)
        if applied.jobs:
            yield ExecuteMany(
                "UPDATE event_jobs SET last_seq = ?, terminal = ?, terminal_state = ?, close_time = ?"
                " WHERE job = ?",
                [
                    (info.last_seq, 1 if info.terminal else 0, info.terminal_state, info.close_time, job)
                    for job in applied.jobs
                    for info in (infos[job],)
                ],
            )
        if postgres:
            for job, (last_seq, close_state) in applied.jobs.items():
                payload = f"{job} {last_seq}" + (f" {close_state}" if close_state else "")
                yield Execute("SELECT pg_notify(?, ?)", (NOTIFY_CHANNEL, payload))
        return applied

    # ---- reads --------------------------------------------------------------------------------

    async def info(self, job: str) -> JobInfo:
        row = await self.db.fetchone("SELECT * FROM event_jobs WHERE job = ?", (job,))
        if row is None:
            raise NotFound(f"{job} has no event log", reason=R.ERROR_REASON_JOB_NOT_FOUND)
        info = JobInfo.from_row(row)
        self.broker.observe(job, info.last_seq, info.terminal_state if info.terminal else 0)
        return info

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
        """Up to `limit` stored events with after_seq < seq < before_seq (0: no upper bound), in seq order or,
        when `descending`, from the newest down; read a few chunks at a time."""
        upper = before_seq if before_seq else 2**62
        found: list[event_pb2.Event] = []
        while len(found) < limit:
            if descending:
                rows = await self.db.fetchall(
                    "SELECT body FROM event_chunks WHERE job = ? AND last_seq > ? AND last_seq < ?"
                    " AND first_seq < ? ORDER BY last_seq DESC LIMIT ?",
                    (job, after_seq, upper + CHUNK_EVENTS, upper, CHUNKS_PER_READ),
                )
            else:
                rows = await self.db.fetchall(
                    "SELECT body FROM event_chunks WHERE job = ? AND last_seq > ? AND first_seq < ?"
                    " ORDER BY last_seq LIMIT ?",
                    (job, after_seq, upper, CHUNKS_PER_READ),
                )
            for row in rows:
                events = decode_chunk(bytes(row["body"]))
                if descending:
                    events.reverse()
                found.extend(e for e in events if after_seq < e.seq < upper)
            if len(rows) < CHUNKS_PER_READ or not found:
                break
            if descending:
                upper = found[-1].seq
            else:
                after_seq = found[-1].seq
        return found[:limit]

    async def retained_count(self, job: str) -> int:
        row = await self.db.fetchone(
            "SELECT COALESCE(SUM(last_seq - first_seq + 1), 0) AS n FROM event_chunks WHERE job = ?", (job,)
        )
        return int(row["n"]) if row else 0

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
                    "SELECT MIN(first_seq) AS seq FROM event_chunks WHERE job = ? AND receive_time >= ?",
                    (job, time.time() - max_age_s),
                )
                oldest_young = young["seq"] if young and young["seq"] is not None else info.last_seq
                cut = max(cut, int(oldest_young))
            cut = min(cut, max(info.last_seq, 1))
            whole = await tx.fetchone(
                "SELECT COALESCE(SUM(last_seq - first_seq + 1), 0) AS n FROM event_chunks"
                " WHERE job = ? AND last_seq < ?",
                (job, cut),
            )
            removed = int(whole["n"]) if whole else 0
            await tx.execute("DELETE FROM event_chunks WHERE job = ? AND last_seq < ?", (job, cut))
            # A chunk across the cut keeps only its events from the cut on.
            for row in await tx.fetchall(
                "SELECT first_seq, last_seq, body FROM event_chunks WHERE job = ? AND first_seq < ?",
                (job, cut),
            ):
                kept = [e for e in decode_chunk(bytes(row["body"])) if e.seq >= cut]
                _, first, _, _, body = chunk_row(job, kept, 0.0)
                removed += first - int(row["first_seq"])
                await tx.execute(
                    "UPDATE event_chunks SET first_seq = ?, body = ? WHERE job = ? AND last_seq = ?",
                    (first, body, job, int(row["last_seq"])),
                )
            await tx.execute(
                "DELETE FROM event_producer_ranges"
                " WHERE job = ? AND first_seq + (last_producer_seq - first_producer_seq) < ?",
                (job, cut),
            )
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
                        # "{job} {last_seq}", and " {terminal_state}" when the commit closed the log
                        job, *rest = note.payload.split(" ")
                        try:
                            last_seq = int(rest[0]) if rest else 0
                            state = int(rest[1]) if len(rest) > 1 else 0
                        except ValueError:
                            last_seq, state = 0, 0
                        self.broker.committed(job, (), last_seq, state)
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
