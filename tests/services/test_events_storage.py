"""The events store below the RPCs, on both stores: chunked storage, producer ranges, partial compaction,
and the data migration from one row per event (schema version 1) to chunks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from tandem.events.v1 import event_pb2

from mesh.store import Database, open_database
from services.events import store as schema
from services.events.log import Broker, EventLog

JOB = "orgs/acme/jobs/run-1"


def event(number: int, producer: str = "") -> event_pb2.Event:
    return event_pb2.Event(
        type="log", message=f"event {number}", producer_id=producer, producer_seq=number if producer else 0
    )


@pytest.fixture
async def log(store_url: str) -> AsyncIterator[EventLog]:
    db = await open_database(store_url, "events", schema.MIGRATIONS)
    events = EventLog(db, Broker())
    await events.start()
    try:
        yield events
    finally:
        await events.stop()
        await db.close()


def seqs(events: list[event_pb2.Event]) -> list[int]:
    return [e.seq for e in events]


async def test_reads_cross_chunk_boundaries_in_both_directions(log: EventLog) -> None:
    for start in range(1, 57, 7):  # 8 chunks of 7 events
        await log.publish(JOB, [event(n) for n in range(start, start + 7)], create=True)
    assert seqs(await log.read_stored(JOB, 0, 1000)) == list(range(1, 57))
    assert seqs(await log.read_stored(JOB, 5, 10)) == list(range(6, 16))
    assert seqs(await log.read_stored(JOB, 5, 100, before_seq=20)) == list(range(6, 20))
    assert seqs(await log.read_stored(JOB, 0, 4, descending=True)) == [56, 55, 54, 53]
    assert seqs(await log.read_stored(JOB, 10, 100, before_seq=16, descending=True)) == [15, 14, 13, 12, 11]
    assert seqs(await log.read_stored(JOB, 56, 10)) == []
    stored = await log.read_stored(JOB, 20, 1)
    assert (stored[0].job, stored[0].seq, stored[0].message) == (JOB, 21, "event 21")
    assert stored[0].receive_time.seconds > 0 and stored[0].time == stored[0].receive_time
    assert await log.retained_count(JOB) == 56


async def test_a_large_publish_is_split_into_bounded_chunks(log: EventLog) -> None:
    count = schema.CHUNK_EVENTS * 2 + 5
    await log.publish(JOB, [event(n) for n in range(count)], create=True)
    rows = await log.db.fetchall(
        "SELECT first_seq, last_seq FROM event_chunks WHERE job = ? ORDER BY last_seq", (JOB,)
    )
    assert [(r["first_seq"], r["last_seq"]) for r in rows] == [
        (1, schema.CHUNK_EVENTS),
        (schema.CHUNK_EVENTS + 1, 2 * schema.CHUNK_EVENTS),
        (2 * schema.CHUNK_EVENTS + 1, count),
    ]
    assert seqs(await log.read_stored(JOB, 0, count + 10)) == list(range(1, count + 1))


async def test_compaction_inside_a_chunk_keeps_exactly_the_newer_events(log: EventLog) -> None:
    await log.publish(JOB, [event(n) for n in range(1, 11)], create=True)
    await log.publish(JOB, [event(n) for n in range(11, 21)], create=True)
    removed, info = await log.compact(JOB, keep_last=14, max_age_s=None)
    assert (removed, info.first_retained_seq) == (6, 7)
    assert seqs(await log.read_stored(JOB, 0, 100)) == list(range(7, 21))
    assert await log.retained_count(JOB) == 14
    removed, _ = await log.compact(JOB, keep_last=14, max_age_s=None)
    assert removed == 0


async def test_producer_ranges_dedup_retries_in_and_across_commits(log: EventLog) -> None:
    first = await log.publish(JOB, [event(n, "trainer") for n in range(1, 6)], create=True)
    assert first.seqs == [1, 2, 3, 4, 5]
    # A retry overlapping the first publish, with new numbers after it; the same number twice in one call.
    again = await log.publish(JOB, [event(n, "trainer") for n in (4, 5, 6, 7, 7)], create=True)
    assert (again.seqs, again.duplicates) == ([4, 5, 6, 7, 7], 3)
    # Out of order, and a gap filled later: each number maps to the seq it got first.
    other = await log.publish(JOB, [event(n, "trainer") for n in (10, 9)], create=True)
    assert other.seqs == [8, 9]
    late = await log.publish(JOB, [event(n, "trainer") for n in (8, 9, 10)], create=True)
    assert (late.seqs, late.duplicates) == ([10, 9, 8], 2)
    assert seqs(await log.read_stored(JOB, 0, 100)) == list(range(1, 11))
    # A fresh writer (a restart) knows nothing in memory and asks storage.
    fresh = EventLog(log.db, Broker())
    await fresh.start()
    try:
        retry = await fresh.publish(JOB, [event(n, "trainer") for n in (1, 10, 11)], create=True)
    finally:
        await fresh.stop()
    assert (retry.seqs, retry.duplicates) == ([1, 8, 11], 2)


async def _version_one(url: str) -> Database:
    db = await open_database(url, "events", schema.MIGRATIONS[:1])
    now = time.time()
    rows, producers = [], []
    for seq in range(3, 1203):  # seqs 1 and 2 were compacted away
        stored = event(seq, "trainer")
        stored.job, stored.seq = JOB, seq
        stored.receive_time.FromNanoseconds(int(now * 1e9))
        rows.append((JOB, seq, "log", 2, now, stored.SerializeToString()))
        producers.append((JOB, "trainer", seq, seq))
    await db.execute(
        "INSERT INTO event_jobs (job, org, last_seq, first_retained_seq, create_time) VALUES (?, ?, ?, ?, ?)",
        (JOB, "acme", 1202, 3, now),
    )
    async with db.transaction() as tx:
        await tx.executemany(
            "INSERT INTO events (job, seq, type, level, receive_time, body) VALUES (?, ?, ?, ?, ?, ?)", rows
        )
        await tx.executemany(
            "INSERT INTO event_producers (job, producer_id, producer_seq, seq) VALUES (?, ?, ?, ?)", producers
        )
    return db


async def test_version_one_events_move_into_chunks(store_url: str) -> None:
    old = await _version_one(store_url)
    await old.close()
    db = await open_database(store_url, "events", schema.MIGRATIONS)
    log = EventLog(db, Broker())
    await log.start()
    try:
        assert seqs(await log.read_stored(JOB, 0, 5000)) == list(range(3, 1203))
        assert await log.retained_count(JOB) == 1200
        chunks = await db.fetchall(
            "SELECT last_seq - first_seq + 1 AS n FROM event_chunks WHERE job = ?", (JOB,)
        )
        assert max(r["n"] for r in chunks) <= schema.CHUNK_EVENTS
        retry = await log.publish(JOB, [event(n, "trainer") for n in (1202, 1203)], create=False)
        assert (retry.seqs, retry.duplicates) == ([1202, 1203], 1)
        tables = await db.fetchall(
            "SELECT version FROM tandem_migrations WHERE service = 'events' ORDER BY version"
        )
        assert [r["version"] for r in tables] == [1, 2]
    finally:
        await log.stop()
        await db.close()


def test_the_in_memory_window_serves_any_slice_it_covers() -> None:
    broker = Broker()
    stored = [event_pb2.Event(job=JOB, seq=n) for n in range(1, 101)]
    broker.committed(JOB, stored[:60])
    broker.committed(JOB, stored[60:])
    assert seqs(broker.recent(JOB, 95, 3) or []) == [96, 97, 98]
    assert seqs(broker.recent(JOB, 97, 50) or []) == [98, 99, 100]
    assert seqs(broker.recent(JOB, 10, 5) or []) == [11, 12, 13, 14, 15]
    assert seqs(broker.recent(JOB, 0, 1000) or []) == list(range(1, 101))
    assert broker.recent(JOB, 100, 10) == []  # nothing newer is committed
    broker.committed(JOB, [event_pb2.Event(job=JOB, seq=200)])  # not contiguous: the window restarts
    assert broker.recent(JOB, 150, 10) is None


async def test_the_same_batch_published_twice_at_once_is_stored_once(log: EventLog) -> None:
    batch = [event(n, "trainer") for n in range(1, 6)]
    copy = [event(n, "trainer") for n in range(1, 6)]
    mixed = [event(9, "a"), event(9, "b"), event(0)]  # two producers and a plain event: the per-event path
    results = await asyncio.gather(
        log.publish(JOB, batch, create=True),
        log.publish(JOB, copy, create=True),
        log.publish(JOB, mixed, create=True),
    )
    assert sorted(r.duplicates for r in results[:2]) == [0, 5]
    assert results[0].seqs == results[1].seqs
    assert sorted(results[0].seqs + results[2].seqs) == list(range(1, 9))
    stored = await log.read_stored(JOB, 0, 100)
    assert seqs(stored) == list(range(1, 9))
    assert sorted((e.producer_id, e.producer_seq) for e in stored) == sorted(
        [("trainer", n) for n in range(1, 6)] + [("a", 9), ("b", 9), ("", 0)]
    )
