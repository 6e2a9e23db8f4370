"""Copies the vault's audit log to the events service, so audit records can be watched live.

The vault's own table stays the authoritative, durable record (written in the transaction of each change).
This forwarder tails it by time and publishes each record to `orgs/{org}/jobs/vault-audit`, and an injection
for a job also to that job's log, with producer id `vault` and the audit id as producer sequence, so a
resend after a crash or an unreachable events service is applied once. Rows are forwarded once they are a
second old, and every pass re-reads the last ten seconds, so a PostgreSQL transaction that committed late
is still forwarded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf import struct_pb2
from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2, events_service_pb2
from tandem.vault.v1 import audit_pb2

from mesh.aio import cancel_and_wait
from mesh.store import Database

log = logging.getLogger("tandem.vault.audit")
AUDIT_JOB = "vault-audit"
SETTLE_S = 1.0
RESCAN_S = 10.0
Publish = Callable[[events_service_pb2.PublishRequest], Awaitable[Any]]


def audit_event(row: dict[str, Any]) -> event_pb2.Event:
    action = audit_pb2.AuditEvent.Action.Name(int(row["action"])).removeprefix("ACTION_").lower()  # type: ignore[arg-type]
    outcome = audit_pb2.AuditEvent.Outcome.Name(int(row["outcome"])).removeprefix("OUTCOME_").lower()  # type: ignore[arg-type]
    payload = struct_pb2.Struct()
    payload.update(
        {
            "action": action,
            "outcome": outcome,
            "actor": row["actor_id"],
            "secret": row["secret"],
            "version": int(row["version"]),
            "fingerprint": row["fingerprint"],
            "key_id": row["key_id"],
            "audit_id": int(row["id"]),
        }
    )
    denied = int(row["outcome"]) != audit_pb2.AuditEvent.OUTCOME_ALLOWED
    event = event_pb2.Event(
        type=f"secret.{action}",
        level=types_pb2.LEVEL_WARNING if denied else types_pb2.LEVEL_INFO,
        message=f"{action} {row['secret'] or row['key_id']}: {outcome}",
        payload=payload,
        producer_id="vault",
        producer_seq=int(row["id"]),
    )
    event.time.FromNanoseconds(int(float(row["time"]) * 1e9))
    return event


class AuditForwarder:
    def __init__(self, db: Database, publish: Publish, interval_s: float = 0.5) -> None:
        self._db = db
        self._publish = publish
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None
        self._sent: dict[int, float] = {}  # audit id -> time, for the re-scanned window only

    async def start(self) -> None:
        await self._db.execute(
            "INSERT INTO vault_forward_cursor (name, last_id) VALUES ('events', 0) ON CONFLICT (name) DO NOTHING"
        )
        self._task = asyncio.create_task(self._loop(), name="vault-audit-forwarder")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def forward_once(self, settle_s: float = SETTLE_S) -> int:
        """Publish the records of the window after the cursor, then move the cursor to the newest record
        sent less `RESCAN_S`. Re-sending a record is harmless (events dedupe by audit id); re-scanning is
        what catches a PostgreSQL transaction that took an id early and committed late."""
        cursor = await self._db.fetchone("SELECT last_id FROM vault_forward_cursor WHERE name = 'events'")
        since = int(cursor["last_id"]) / 1e6 if cursor else 0.0
        rows = await self._db.fetchall(
            "SELECT * FROM vault_audit WHERE time > ? AND time < ? ORDER BY time, id LIMIT 2000",
            (since, time.time() - settle_s),
        )
        fresh = [row for row in rows if int(row["id"]) not in self._sent]
        if not rows:
            return 0
        by_job: dict[str, list[event_pb2.Event]] = {}
        for row in fresh:
            event = audit_event(row)
            by_job.setdefault(f"orgs/{row['org']}/jobs/{AUDIT_JOB}", []).append(event)
            if int(row["actor_kind"]) == audit_pb2.AuditEvent.Actor.KIND_JOB and "#" in row["actor_id"]:
                by_job.setdefault(row["actor_id"].split("#", 1)[0], []).append(event)
        for job, events in by_job.items():
            for start in range(0, len(events), 1000):
                await self._publish(
                    events_service_pb2.PublishRequest(job=job, events=events[start : start + 1000])
                )
        self._sent.update({int(row["id"]): float(row["time"]) for row in fresh})
        newest = float(rows[-1]["time"])
        next_since = max(since, newest - RESCAN_S) if len(rows) < 2000 else newest
        self._sent = {k: t for k, t in self._sent.items() if t > next_since}
        await self._db.execute(
            "UPDATE vault_forward_cursor SET last_id = ? WHERE name = 'events'", (int(next_since * 1e6),)
        )
        return len(fresh)

    async def _loop(self) -> None:
        while True:
            try:
                while await self.forward_once():
                    pass
            except asyncio.CancelledError:
                raise
            except Exception as error:  # events down: the records wait in the vault's table
                log.warning("audit forwarding paused: %s", type(error).__name__)
            await asyncio.sleep(self._interval)
