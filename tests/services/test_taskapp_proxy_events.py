"""The proxy's `rollout.completed` events: batched, idempotent on retry, sent on stop, against a fake
events service (the mesh test `test_each_rollout_is_an_event_of_the_job` covers the real one)."""

from __future__ import annotations

import asyncio

import grpc
from tandem.events.v1 import event_pb2, events_service_pb2
from tandem.taskapp.v1 import rollout_pb2

from mesh.status import RpcError
from services.taskapp_proxy.servicer import BATCH_LINGER_S, MAX_BATCH, RolloutEvents

JOB = "orgs/acme/jobs/j1"
OTHER_JOB = "orgs/acme/jobs/j2"
APP = "orgs/acme/taskApps/app"


class FakeEvents:
    """Stores events once per (job, producer_id, producer_seq), as the events service does; fails the
    first `failures` calls with `code`."""

    def __init__(self, failures: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.calls: list[events_service_pb2.PublishRequest] = []
        self.stored: dict[tuple[str, str, int], event_pb2.Event] = {}
        self._failures = failures
        self._code = code

    async def Publish(self, request: events_service_pb2.PublishRequest) -> events_service_pb2.PublishResponse:
        self.calls.append(request)
        if self._failures:
            self._failures -= 1
            raise RpcError(self._code, "refused", reason="TEST")
        for event in request.events:
            self.stored.setdefault((request.job, event.producer_id, event.producer_seq), event)
        return events_service_pb2.PublishResponse()

    def ids(self, job: str) -> list[str]:
        return [e.rollout_completed.rollout_id for (j, _, _), e in sorted(self.stored.items()) if j == job]


def result(correlation: str) -> rollout_pb2.RolloutResult:
    return rollout_pb2.RolloutResult(
        trace_correlation_id=correlation, metrics=rollout_pb2.RolloutMetrics(outcome_reward=1.0)
    )


async def settle(events: FakeEvents, calls: int) -> None:
    for _ in range(100):
        if len(events.calls) >= calls:
            return
        await asyncio.sleep(BATCH_LINGER_S / 5)


async def test_rollouts_close_together_share_one_publish_per_job() -> None:
    fake = FakeEvents()
    events = RolloutEvents(fake)
    events.start()
    for i in range(20):
        events.record(JOB if i % 2 else OTHER_JOB, APP, result(f"r{i}"))
    await settle(fake, 2)
    await events.stop()
    assert sorted(c.job for c in fake.calls) == [JOB, OTHER_JOB]
    assert fake.ids(JOB) == [f"r{i}" for i in range(1, 20, 2)]
    sent = [e for c in fake.calls if c.job == JOB for e in c.events]
    assert [e.producer_seq for e in sent] == list(range(1, 11))  # per job, from 1
    assert len({e.producer_id for c in fake.calls for e in c.events}) == 1
    assert all(e.type == "rollout.completed" and e.rollout_completed.task_app == APP for e in sent)


async def test_an_unavailable_events_service_gets_the_same_events_again() -> None:
    fake = FakeEvents(failures=2)
    events = RolloutEvents(fake)
    events.start()
    events.record(JOB, APP, result("a"))
    events.record(JOB, APP, result("b"))
    await settle(fake, 3)
    events.record(JOB, APP, result("c"))
    await settle(fake, 4)
    await events.stop()
    assert [list(c.events) for c in fake.calls[:3]] == [list(fake.calls[0].events)] * 3  # resent unchanged
    assert fake.ids(JOB) == ["a", "b", "c"]


async def test_a_refused_batch_is_dropped_and_later_events_still_go() -> None:
    fake = FakeEvents(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    events = RolloutEvents(fake)
    events.start()
    events.record(JOB, APP, result("refused"))
    await settle(fake, 1)
    events.record(JOB, APP, result("later"))
    await settle(fake, 2)
    await events.stop()
    assert len(fake.calls) == 2
    assert fake.ids(JOB) == ["later"]


async def test_stop_sends_what_is_still_queued() -> None:
    fake = FakeEvents()
    events = RolloutEvents(fake)
    events.start()
    await asyncio.sleep(0)
    for i in range(3):
        events.record(JOB, APP, result(f"r{i}"))
    await events.stop()  # within the linger: nothing was sent yet
    assert fake.ids(JOB) == ["r0", "r1", "r2"]


async def test_stop_sends_a_backlog_in_calls_the_contract_allows() -> None:
    fake = FakeEvents()
    events = RolloutEvents(fake)  # never started: everything is still queued at stop
    for i in range(1200):
        events.record(JOB, APP, result(f"r{i}"))
    await events.stop()
    assert [len(c.events) for c in fake.calls] == [MAX_BATCH, MAX_BATCH, 1200 - 2 * MAX_BATCH]
    assert fake.ids(JOB) == [f"r{i}" for i in range(1200)]
