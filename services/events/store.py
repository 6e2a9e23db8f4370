"""Schema of the events service.

Events are stored in chunks: one row holds consecutive events of one job, first_seq..last_seq, as a
serialized `tandem.events.v1.EventBatch` whose events carry every field the service sets (job, seq,
receive_time, time). A publish's new events make one chunk, so ingest costs a row per publish rather than a
row per event, and a read decodes a row per publish. A producer range maps one producer's numbers
first_producer_seq..last_producer_seq onto seqs first_seq, first_seq + 1, ..., so a producer that sends in
order costs one dedup row per publish too.
"""

from __future__ import annotations

from tandem.events.v1 import event_pb2, events_service_pb2

from mesh.store import Execute, ExecuteMany, Fetch, Migration, Program, Row

CHUNK_EVENTS = 1024  # the most events one chunk row holds
ChunkRow = tuple[str, int, int, float, bytes]  # job, first_seq, last_seq, receive_time, body
INSERT_CHUNK = (
    "INSERT INTO event_chunks (job, first_seq, last_seq, receive_time, body) VALUES (?, ?, ?, ?, ?)"
)

_CHUNKS_AND_RANGES = """
CREATE TABLE event_chunks (
    job TEXT NOT NULL, first_seq {bigint} NOT NULL, last_seq {bigint} NOT NULL,
    receive_time DOUBLE PRECISION NOT NULL, body {blob} NOT NULL, PRIMARY KEY (job, last_seq));
CREATE TABLE event_producer_ranges (
    job TEXT NOT NULL, producer_id TEXT NOT NULL, first_producer_seq {bigint} NOT NULL,
    last_producer_seq {bigint} NOT NULL, first_seq {bigint} NOT NULL,
    PRIMARY KEY (job, producer_id, last_producer_seq));
INSERT INTO event_producer_ranges (job, producer_id, first_producer_seq, last_producer_seq, first_seq)
    SELECT job, producer_id, producer_seq, producer_seq, seq FROM event_producers;
DROP TABLE event_producers
"""


def chunk_rows(job: str, events: list[event_pb2.Event], receive_time: float) -> list[ChunkRow]:
    """Rows of `event_chunks` for consecutive events of one job, at most CHUNK_EVENTS to a row. The writer
    passes one publish's new events at a time, so a chunk's size is bounded by the request size limit."""
    return [
        chunk_row(job, events[start : start + CHUNK_EVENTS], receive_time)
        for start in range(0, len(events), CHUNK_EVENTS)
    ]


def chunk_row(job: str, events: list[event_pb2.Event], receive_time: float) -> ChunkRow:
    body = events_service_pb2.EventBatch(events=events).SerializeToString()
    return (job, events[0].seq, events[-1].seq, receive_time, body)


def decode_chunk(body: bytes) -> list[event_pb2.Event]:
    return list(events_service_pb2.EventBatch.FromString(body).events)


def _events_into_chunks() -> Program[None]:
    """Version 1 kept one row per event: move them into chunks, job by job, in bounded reads."""
    jobs: list[Row] = yield Fetch("SELECT DISTINCT job FROM events ORDER BY job")
    for job_row in jobs:
        job, after = job_row["job"], 0
        while True:
            rows: list[Row] = yield Fetch(
                "SELECT seq, receive_time, body FROM events WHERE job = ? AND seq > ? ORDER BY seq LIMIT ?",
                (job, after, CHUNK_EVENTS),
            )
            if not rows:
                break
            run: list[event_pb2.Event] = []
            chunks: list[ChunkRow] = []
            for row in rows:
                if run and run[-1].seq + 1 != int(row["seq"]):
                    chunks.append(chunk_row(job, run, float(row["receive_time"])))
                    run = []
                run.append(event_pb2.Event.FromString(bytes(row["body"])))
            chunks.append(chunk_row(job, run, float(rows[-1]["receive_time"])))
            yield ExecuteMany(INSERT_CHUNK, chunks)
            after = int(rows[-1]["seq"])
    yield Execute("DROP TABLE events")


MIGRATIONS = [
    Migration.portable(
        1,
        "event logs, events, producer dedup, metrics, retention",
        """
        CREATE TABLE event_jobs (
            job TEXT PRIMARY KEY, org TEXT NOT NULL, last_seq {bigint} NOT NULL,
            first_retained_seq {bigint} NOT NULL, terminal INTEGER NOT NULL DEFAULT 0,
            terminal_state INTEGER NOT NULL DEFAULT 0, create_time DOUBLE PRECISION NOT NULL,
            close_time DOUBLE PRECISION);
        CREATE INDEX event_jobs_org ON event_jobs (org);
        CREATE TABLE events (
            job TEXT NOT NULL, seq {bigint} NOT NULL, type TEXT NOT NULL, level INTEGER NOT NULL,
            receive_time DOUBLE PRECISION NOT NULL, body {blob} NOT NULL, PRIMARY KEY (job, seq));
        CREATE TABLE event_producers (
            job TEXT NOT NULL, producer_id TEXT NOT NULL, producer_seq {bigint} NOT NULL,
            seq {bigint} NOT NULL, PRIMARY KEY (job, producer_id, producer_seq));
        CREATE TABLE metric_points (
            job TEXT NOT NULL, name TEXT NOT NULL, step {bigint} NOT NULL,
            value DOUBLE PRECISION NOT NULL, time DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (job, name, step));
        CREATE TABLE retention_policies (org TEXT PRIMARY KEY, body {blob} NOT NULL)
        """,
    ),
    Migration(
        2,
        "events stored in chunks (a row per job per commit), producer dedup as ranges",
        dialect_sql={
            "sqlite": _CHUNKS_AND_RANGES.format(bigint="INTEGER", blob="BLOB"),
            "postgres": _CHUNKS_AND_RANGES.format(bigint="BIGINT", blob="BYTEA"),
        },
        program=lambda dialect: _events_into_chunks(),
    ),
]
