"""Traces: what the policy did in each episode, at token level, keyed by the episode's correlation id.

Every generation that carries a correlation id (from `Generate` or the OpenAI-compatible endpoint) becomes
one turn of that id's trace: the prompt token ids after the chat template, the completion token ids, the
sampler's log-probs, the loss mask and the weight versions. The turn is recorded before the generation's
last byte is sent, so a Task App that has its answer can count on the turn being in the trace.

A trace is sealed by `finish` (the trainer, once the Task App returned the episode's result) or by the idle
timeout (an abandoned episode); sealing appends it to this worker incarnation's finished log, numbered
1, 2, 3, ... (`seq`), which `StreamTraces` serves from a cursor. The log keeps the newest `retain` traces; an
older cursor is refused rather than silently skipped. No torch here: the store is plain bookkeeping.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from google.protobuf import timestamp_pb2
from tandem.inference.v1 import generation_pb2, trace_pb2

from mesh.aio import wait_set
from mesh.errors import InvalidArgument, NotFound, OutOfRange, R

FINISH_REASONS = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


def _stamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def token_versions(count: int, reported: Sequence[int], first: int, last: int) -> list[int]:
    """One weight version per completion token, agreeing with the turn's first and last versions: what the
    engine reported per token (the torch engine tags each token with the weights of its step), else `first`
    throughout; kept non-decreasing and within [first, last], the first token `first` and the last `last`.
    vLLM reports per chunk the version it served when the chunk arrived and its own spans for the ends, which
    this reconciles; the torch engine's report already agrees and passes unchanged."""
    if count == 0:
        return []
    versions = list(reported) if len(reported) == count else [first] * count
    out, floor = [], first
    for version in versions:
        floor = min(max(floor, version), last)
        out.append(floor)
    out[0], out[-1] = first, last
    return out


@dataclass
class TurnHandle:
    correlation_id: str
    index: int


class TraceStore:
    """Open traces by correlation id, and the log of sealed ones."""

    def __init__(self, incarnation: str, model: str, idle_timeout_s: float, retain: int) -> None:
        self.incarnation = incarnation
        self.model = model
        self.idle_timeout_s = idle_timeout_s
        self.retain = retain
        self._open: dict[str, trace_pb2.Trace] = {}
        self._last_activity: dict[str, float] = {}
        self._pending_turns: dict[str, int] = {}  # correlation id -> turns started and not ended
        self._sealed: OrderedDict[str, trace_pb2.Trace] = OrderedDict()  # by id, the newest `retain`
        self._log: deque[trace_pb2.Trace] = deque(maxlen=retain)  # sealed, by seq
        self._last_seq = 0
        self._grew = asyncio.Event()

    @property
    def last_seq(self) -> int:
        return self._last_seq

    # ---- turns --------------------------------------------------------------------------------

    def begin_turn(
        self,
        correlation_id: str,
        prompt_token_ids: Sequence[int],
        temperature: float,
        top_p: float,
        *,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
    ) -> TurnHandle:
        """Open a turn (and the trace, for a new id). A sealed trace takes no more turns."""
        if correlation_id in self._sealed:
            raise InvalidArgument(
                f"trace {correlation_id} is already sealed; its episode has ended",
                reason=R.ERROR_REASON_TRACE_FINISHED,
            )
        now = time.time()
        trace = self._open.get(correlation_id)
        if trace is None:
            trace = self._open[correlation_id] = trace_pb2.Trace(
                correlation_id=correlation_id, state=trace_pb2.Trace.STATE_OPEN, model=self.model
            )
            trace.create_time.CopyFrom(_stamp(now))
        turn = trace.turns.add(
            index=len(trace.turns), temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p
        )
        if seed is not None:
            turn.seed = seed
        turn.prompt_token_ids.extend(prompt_token_ids)
        turn.start_time.CopyFrom(_stamp(now))
        self._last_activity[correlation_id] = now
        self._pending_turns[correlation_id] = self._pending_turns.get(correlation_id, 0) + 1
        return TurnHandle(correlation_id, turn.index)

    def end_turn(
        self,
        handle: TurnHandle,
        completion_token_ids: Sequence[int],
        sampler_logprobs: Sequence[float],
        finish_reason: str,
        weight_version: int,
        last_weight_version: int,
        *,
        completion_weight_versions: Sequence[int] = (),
    ) -> None:
        """Record what the turn produced. Every sampled token is trained on (loss mask true).
        `completion_weight_versions` is the version of each token as the engine reported it; see
        `token_versions` for how it is made to agree with the first and last versions."""
        trace = self._open.get(handle.correlation_id) or self._sealed.get(handle.correlation_id)
        self._pending_turns[handle.correlation_id] = self._pending_turns.get(handle.correlation_id, 1) - 1
        if trace is None:
            return
        turn = trace.turns[handle.index]
        turn.completion_token_ids.extend(completion_token_ids)
        turn.sampler_logprobs.extend(sampler_logprobs)
        turn.loss_mask.extend([True] * len(completion_token_ids))
        turn.completion_weight_versions.extend(
            token_versions(
                len(completion_token_ids), completion_weight_versions, weight_version, last_weight_version
            )
        )
        turn.weight_version = weight_version
        turn.last_weight_version = last_weight_version
        turn.finish_reason = FINISH_REASONS[finish_reason]
        turn.end_time.CopyFrom(_stamp(time.time()))
        versions = [t.weight_version for t in trace.turns if t.HasField("end_time")]
        trace.min_weight_version = min(versions)
        trace.max_weight_version = max(t.last_weight_version for t in trace.turns if t.HasField("end_time"))
        self._last_activity[handle.correlation_id] = time.time()

    # ---- reading and sealing ------------------------------------------------------------------

    def get(self, correlation_id: str) -> trace_pb2.Trace:
        trace = self._open.get(correlation_id) or self._sealed.get(correlation_id)
        if trace is None:
            raise NotFound(
                f"no trace {correlation_id}: no generation carried this id, or it was evicted",
                reason=R.ERROR_REASON_TRACE_NOT_FOUND,
            )
        return trace

    def finish(self, correlation_id: str) -> trace_pb2.Trace:
        """Seal a trace (again: the sealed trace as it was)."""
        sealed = self._sealed.get(correlation_id)
        if sealed is not None:
            return sealed
        if correlation_id not in self._open:
            raise NotFound(
                f"no trace {correlation_id}: no generation carried this id, or it was evicted",
                reason=R.ERROR_REASON_TRACE_NOT_FOUND,
            )
        return self._seal(correlation_id, trace_pb2.Trace.STATE_FINISHED)

    def expire_idle(self, now: float | None = None) -> int:
        """Seal, as EXPIRED, open traces with no turn in flight and no activity for the idle timeout."""
        current = time.time() if now is None else now
        idle = [
            cid
            for cid, last in self._last_activity.items()
            if cid in self._open
            and current - last >= self.idle_timeout_s
            and not self._pending_turns.get(cid, 0)
        ]
        for cid in idle:
            self._seal(cid, trace_pb2.Trace.STATE_EXPIRED)
        return len(idle)

    def _seal(self, correlation_id: str, state: trace_pb2.Trace.State.ValueType) -> trace_pb2.Trace:
        trace = self._open.pop(correlation_id)
        self._last_activity.pop(correlation_id, None)
        self._pending_turns.pop(correlation_id, None)
        trace.state = state
        trace.finish_time.CopyFrom(_stamp(time.time()))
        self._last_seq += 1
        trace.seq = self._last_seq
        self._log.append(trace)
        self._sealed[correlation_id] = trace
        while len(self._sealed) > self.retain:
            self._sealed.popitem(last=False)
        self._grew.set()
        self._grew = asyncio.Event()
        return trace

    # ---- the finished log ---------------------------------------------------------------------

    def check_cursor(self, incarnation: str, after_seq: int) -> None:
        if incarnation and incarnation != self.incarnation:
            raise OutOfRange(
                f"the cursor belongs to worker incarnation {incarnation}; this is {self.incarnation} "
                "(the worker restarted and its traces are gone)",
                reason=R.ERROR_REASON_CURSOR_COMPACTED,
                metadata={"incarnation": self.incarnation},
            )
        if after_seq > self._last_seq:
            raise OutOfRange(
                f"the cursor {after_seq} is past the newest trace {self._last_seq}",
                reason=R.ERROR_REASON_CURSOR_AHEAD,
            )
        oldest = self._log[0].seq if self._log else self._last_seq + 1
        if after_seq + 1 < oldest:
            raise OutOfRange(
                f"traces after {after_seq} are no longer held; the oldest held is {oldest}",
                reason=R.ERROR_REASON_CURSOR_COMPACTED,
                metadata={"oldest_seq": str(oldest)},
            )

    def after(self, after_seq: int) -> list[trace_pb2.Trace]:
        if not self._log or after_seq >= self._last_seq:
            return []
        start = after_seq + 1 - self._log[0].seq
        return list(self._log)[max(start, 0) :]

    async def follow(self, after_seq: int, heartbeat_s: float) -> AsyncIterator[trace_pb2.Trace | None]:
        """Sealed traces after the cursor in seq order, then live ones; None after each idle heartbeat."""
        cursor = after_seq
        while True:
            waiter = self._grew
            batch = self.after(cursor)
            if batch and batch[0].seq != cursor + 1:
                raise OutOfRange(
                    f"traces after {cursor} were evicted while streaming; resume from a newer cursor",
                    reason=R.ERROR_REASON_CURSOR_COMPACTED,
                )
            for trace in batch:
                cursor = trace.seq
                yield trace
            if batch:
                continue
            if not await wait_set(waiter, heartbeat_s):
                yield None
