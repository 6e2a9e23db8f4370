"""The worker's trace store: turns by correlation id, sealing, idle expiry and the resumable finished log."""

from __future__ import annotations

import asyncio

import pytest
from tandem.inference.v1 import generation_pb2, trace_pb2

from mesh.errors import InvalidArgument, NotFound, OutOfRange
from trainer.inference.traces import TraceStore, token_versions


def store(retain: int = 100, idle_timeout_s: float = 60.0) -> TraceStore:
    return TraceStore("inc-1", "tiny", idle_timeout_s, retain)


def play(traces: TraceStore, cid: str, prompt: list[int], completion: list[int], version: int = 0) -> None:
    handle = traces.begin_turn(cid, prompt, 1.0, 1.0)
    traces.end_turn(handle, completion, [-0.5] * len(completion), "stop", version, version)


def test_every_turn_of_an_episode_joins_one_trace_in_order() -> None:
    traces = store()
    play(traces, "ep-1", [1, 2], [3, 4], version=2)
    play(traces, "ep-2", [9], [8])
    play(traces, "ep-1", [1, 2, 3, 4, 5], [6], version=3)
    trace = traces.get("ep-1")
    assert trace.state == trace_pb2.Trace.STATE_OPEN
    assert [list(t.prompt_token_ids) for t in trace.turns] == [[1, 2], [1, 2, 3, 4, 5]]
    assert [list(t.completion_token_ids) for t in trace.turns] == [[3, 4], [6]]
    assert [list(t.loss_mask) for t in trace.turns] == [[True, True], [True]]
    assert [t.index for t in trace.turns] == [0, 1]
    assert (trace.min_weight_version, trace.max_weight_version) == (2, 3)
    assert trace.turns[0].finish_reason == generation_pb2.FINISH_REASON_STOP
    assert len(traces.get("ep-2").turns) == 1


def test_each_completion_token_records_the_weight_version_that_sampled_it() -> None:
    traces = store()
    handle = traces.begin_turn("ep-1", [1, 2], 1.0, 1.0)
    traces.end_turn(handle, [3, 4, 5, 6], [-0.5] * 4, "stop", 4, 5, completion_weight_versions=[4, 4, 5, 5])
    handle = traces.begin_turn("ep-1", [1, 2, 3], 1.0, 1.0)
    traces.end_turn(handle, [7, 8], [-0.5] * 2, "length", 5, 5)  # nothing reported: the turn's version
    trace = traces.get("ep-1")
    assert [list(t.completion_weight_versions) for t in trace.turns] == [[4, 4, 5, 5], [5, 5]]
    assert (trace.min_weight_version, trace.max_weight_version) == (4, 5)  # the earliest bounds staleness


def test_reported_token_versions_are_made_to_agree_with_the_first_and_last() -> None:
    assert token_versions(0, [], 1, 1) == []
    assert token_versions(3, [2, 3, 3], 2, 3) == [2, 3, 3]  # the torch engine's report passes unchanged
    # vLLM tags a chunk with the version served when it arrived; its spans give the ends.
    assert token_versions(4, [3, 3, 3, 3], 2, 3) == [2, 3, 3, 3]
    assert token_versions(4, [2, 2, 2, 2], 2, 3) == [2, 2, 2, 3]
    assert token_versions(3, [5, 1, 9], 2, 3) == [2, 3, 3]  # clamped and never going back
    assert token_versions(2, [7], 2, 2) == [2, 2]  # a report of another length is not used


def test_a_turn_records_the_seed_it_was_sampled_with() -> None:
    traces = store()
    traces.begin_turn("ep-1", [1], 1.0, 1.0, seed=2**53 - 1)
    traces.begin_turn("ep-1", [1], 1.0, 1.0, seed=0)
    traces.begin_turn("ep-1", [1], 1.0, 1.0)
    turns = traces.get("ep-1").turns
    assert [t.seed for t in turns[:2]] == [2**53 - 1, 0]
    assert [t.HasField("seed") for t in turns] == [True, True, False]  # unset: the worker drew one


def test_sealing_numbers_traces_and_refuses_later_turns() -> None:
    traces = store()
    play(traces, "ep-1", [1], [2])
    play(traces, "ep-2", [1], [2])
    second = traces.finish("ep-2")
    first = traces.finish("ep-1")
    assert (second.seq, first.seq) == (1, 2)
    assert first.state == trace_pb2.Trace.STATE_FINISHED and first.HasField("finish_time")
    assert traces.finish("ep-1").seq == 2  # sealing again returns it as it was
    with pytest.raises(InvalidArgument) as info:
        traces.begin_turn("ep-1", [1], 1.0, 1.0)
    assert info.value.reason_name == "TRACE_FINISHED"
    with pytest.raises(NotFound) as missing:
        traces.finish("never-called")
    assert missing.value.reason_name == "TRACE_NOT_FOUND"


def test_idle_traces_expire_but_not_while_a_turn_is_in_flight() -> None:
    traces = store(idle_timeout_s=10.0)
    play(traces, "done", [1], [2])
    busy = traces.begin_turn("busy", [1], 1.0, 1.0)
    later = traces.get("done").turns[0].end_time.ToNanoseconds() / 1e9 + 11
    assert traces.expire_idle(now=later) == 1
    assert traces.get("done").state == trace_pb2.Trace.STATE_EXPIRED
    assert traces.get("busy").state == trace_pb2.Trace.STATE_OPEN
    traces.end_turn(busy, [5], [-1.0], "length", 0, 0)
    assert traces.expire_idle(now=later + 100) == 1


def test_cursors_from_another_incarnation_or_too_old_are_refused() -> None:
    traces = store(retain=2)
    for n in range(4):
        play(traces, f"ep-{n}", [1], [2])
        traces.finish(f"ep-{n}")
    assert [t.seq for t in traces.after(2)] == [3, 4]
    traces.check_cursor("inc-1", 2)
    for incarnation, seq, reason in [
        ("inc-0", 2, "CURSOR_COMPACTED"),
        ("inc-1", 1, "CURSOR_COMPACTED"),
        ("inc-1", 5, "CURSOR_AHEAD"),
    ]:
        with pytest.raises(OutOfRange) as info:
            traces.check_cursor(incarnation, seq)
        assert info.value.reason_name == reason


async def test_follow_replays_then_tails_with_heartbeats() -> None:
    traces = store()
    play(traces, "ep-1", [1], [2])
    traces.finish("ep-1")
    seen: list[int | None] = []
    idle = asyncio.Event()

    async def consume() -> None:
        async for trace in traces.follow(0, heartbeat_s=0.05):
            seen.append(trace.seq if trace else None)
            if trace is None:
                idle.set()
            if len([s for s in seen if s]) == 2:
                return

    task = asyncio.create_task(consume())
    await asyncio.wait_for(idle.wait(), 5)
    play(traces, "ep-2", [1], [2])
    traces.finish("ep-2")
    await asyncio.wait_for(task, 5)
    assert [s for s in seen if s] == [1, 2]
