"""A job's event stream that survives dropped connections.

`resume_events` keeps one cursor (the highest seq delivered, or a batch's or heartbeat's cursor when that is
higher) and, when a stream breaks with a transient status, opens a new one with `after_seq` set to it. The
events service numbers a job's events densely and delivers them in seq order, so the cursor is enough: an
event at or below it is a repeat (dropped here), and the next stream starts right after it (no gap).

It works on any stream of the events contract's shape (`events` / `heartbeat` / `end`): the gateway's
SubscribeEvents and the events service's own Subscribe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from tandem.events.v1 import event_pb2

from mesh.status import RpcError

# A stream that fails with one of these is reopened from the cursor; anything else is the caller's to see
# (NOT_FOUND, OUT_OF_RANGE for a compacted cursor, UNAUTHENTICATED, ...).
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,  # a connection reset mid-message surfaces as INTERNAL in grpc-core
        grpc.StatusCode.UNKNOWN,
    }
)
RATE_LIMITED = "RATE_LIMITED"
FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0


@dataclass
class Cursor:
    """Where a watch stands: resume a later watch with `after_seq=cursor.seq`."""

    seq: int = 0
    reconnects: int = 0
    terminal_state: int = 0  # tandem.scheduler.v1.Job.State of the StreamEnd, once received


OpenStream = Callable[[int], AsyncIterable[Any]]
OnReconnect = Callable[[RpcError | None, int], None]
LogPending = Callable[[], Awaitable[bool]]


async def resume_events(
    open_stream: OpenStream,
    cursor: Cursor,
    *,
    reconnect_for_s: float = 300.0,
    on_reconnect: OnReconnect | None = None,
    log_pending: LogPending | None = None,
) -> AsyncIterator[event_pb2.Event]:
    """Yield each event after `cursor.seq` exactly once, reopening the stream (`open_stream(after_seq)`)
    whenever it breaks with a transient status, for up to `reconnect_for_s` seconds without progress.
    Ends after the stream's `end` message (the job is terminal and its last event was delivered).

    A job's log exists from its first event, which its creator publishes just after storing it; NOT_FOUND
    before any event is retried like a dropped stream while `log_pending()` says the job itself exists."""
    backoff = FIRST_BACKOFF_S
    failing_since: float | None = None
    while True:
        error: RpcError | None = None
        try:
            async for reply in open_stream(cursor.seq):
                kind = reply.WhichOneof("kind")
                if kind == "events":
                    for event in reply.events.events:
                        if event.seq <= cursor.seq:
                            continue  # delivered before the connection dropped
                        cursor.seq = event.seq
                        yield event
                    cursor.seq = max(cursor.seq, reply.events.cursor)
                elif kind == "heartbeat":
                    cursor.seq = max(cursor.seq, reply.heartbeat.cursor)
                elif kind == "end":
                    cursor.terminal_state = reply.end.terminal_state
                    return
                failing_since, backoff = None, FIRST_BACKOFF_S
            # The server closed the stream without an end (it is draining, or a proxy timed the call out).
        except RpcError as failure:
            pending = (
                failure.code == grpc.StatusCode.NOT_FOUND
                and cursor.seq == 0
                and log_pending is not None
                and await log_pending()
            )
            if failure.code not in TRANSIENT and failure.reason != RATE_LIMITED and not pending:
                raise
            error = failure
        now = time.monotonic()
        failing_since = failing_since if failing_since is not None else now
        if now - failing_since > reconnect_for_s:
            if error is not None:
                raise error
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "the event stream keeps closing", reason="")
        cursor.reconnects += 1
        if on_reconnect is not None:
            on_reconnect(error, cursor.seq)
        delay = error.retry_after_s if error is not None and error.retry_after_s else backoff
        await asyncio.sleep(delay)
        backoff = min(backoff * 2, MAX_BACKOFF_S)
