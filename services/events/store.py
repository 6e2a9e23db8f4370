"""Schema and queries of the events service. Events are stored as serialized `tandem.events.v1.Event`
bodies keyed by (job, seq); the columns beside the body exist for filtering and retention."""

from __future__ import annotations

from mesh.store import Migration

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
    )
]
