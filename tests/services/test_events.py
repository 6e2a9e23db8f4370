"""The events service against a real in-process server, on both stores: dense ordered seqs, idempotent
producers, replay-then-tail subscriptions, filters, heartbeats, terminal streams, compaction, paging,
metrics, organization scoping and bad input."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2, field_mask_pb2
from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2, events_service_pb2_grpc, job_stream_pb2, metric_pb2
from tandem.events.v1 import events_service_pb2 as pb
from tandem.scheduler.v1 import job_pb2

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.status import RpcError
from services.events.log import RING_SIZE
from tests.support.mesh import Mesh, mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(60)
JOB = "orgs/acme/jobs/run-1"


@pytest.fixture
async def mesh(tmp_path: Path, store_url: str) -> AsyncIterator[Mesh]:
    async with running_mesh(mesh_settings(tmp_path, store_url=store_url), services=["events"]) as running:
        yield running


class Client:
    """An events stub with a chosen identity, closed with the test."""

    def __init__(self, mesh: Mesh, token: str) -> None:
        self.channel = open_channel(mesh.address("events"), mesh.settings, token=token)
        self.stub = events_service_pb2_grpc.EventServiceStub(self.channel)


@pytest.fixture
async def signer(mesh: Mesh) -> TokenSigner:
    return TokenSigner(load_signing_key("", mesh.settings.state_dir))


@pytest.fixture
async def scheduler(
    mesh: Mesh, signer: TokenSigner
) -> AsyncIterator[events_service_pb2_grpc.EventServiceStub]:
    client = Client(mesh, signer.issue("service", "scheduler"))
    yield client.stub
    await client.channel.close()


def ev(
    kind: str = "log", message: str = "", level: int = types_pb2.LEVEL_INFO, **producer: object
) -> event_pb2.Event:
    return event_pb2.Event(type=kind, message=message, level=level, **producer)  # type: ignore[arg-type]


async def publish(
    stub: events_service_pb2_grpc.EventServiceStub, *events: event_pb2.Event, job: str = JOB
) -> pb.PublishResponse:
    return await stub.Publish(pb.PublishRequest(job=job, events=list(events)))


async def collect(stream: AsyncIterator[pb.SubscribeResponse], count: int) -> list[event_pb2.Event]:
    seen: list[event_pb2.Event] = []
    async for reply in stream:
        seen.extend(reply.events.events)
        if len(seen) >= count:
            return seen
    return seen


async def test_publish_assigns_dense_sequence_numbers(
    scheduler: events_service_pb2_grpc.EventServiceStub,
) -> None:
    first = await publish(scheduler, ev(message="a"), ev(message="b"))
    second = await publish(scheduler, ev(message="c"))
    assert list(first.seqs) == [1, 2]
    assert list(second.seqs) == [3]
    assert second.last_seq == 3
    listed = await scheduler.ListEvents(pb.ListEventsRequest(job=JOB))
    assert [(e.seq, e.message, e.job) for e in listed.events] == [(1, "a", JOB), (2, "b", JOB), (3, "c", JOB)]
    assert all(e.HasField("receive_time") for e in listed.events)


async def test_concurrent_publishers_get_unique_gapless_seqs(
    scheduler: events_service_pb2_grpc.EventServiceStub,
) -> None:
    replies = await asyncio.gather(
        *(publish(scheduler, ev(message=str(i)), ev(message=str(i))) for i in range(50))
    )
    seqs = sorted(s for r in replies for s in r.seqs)
    assert seqs == list(range(1, 101))


async def test_a_listing_during_publishes_reports_a_last_seq_no_older_than_its_events(
    scheduler: events_service_pb2_grpc.EventServiceStub,
) -> None:
    await publish(scheduler, ev(message="first"))

    async def publish_more() -> None:
        for i in range(60):
            await publish(scheduler, ev(message=str(i)))

    writer = asyncio.create_task(publish_more())
    while not writer.done():
        listed = await scheduler.ListEvents(pb.ListEventsRequest(job=JOB, page_size=1000))
        assert listed.last_seq >= max(e.seq for e in listed.events)
        descending = await scheduler.ListEvents(pb.ListEventsRequest(job=JOB, descending=True, page_size=5))
        assert descending.last_seq >= descending.events[0].seq
    await writer


async def test_producer_retries_are_applied_once(scheduler: events_service_pb2_grpc.EventServiceStub) -> None:
    batch = [ev(message=f"m{i}", producer_id="trainer-0", producer_seq=i) for i in range(1, 4)]
    first = await publish(scheduler, *batch)
    retry = await publish(scheduler, *batch, ev(message="m4", producer_id="trainer-0", producer_seq=4))
    assert list(retry.seqs) == [*first.seqs, 4]
    assert retry.duplicate_count == 3
    listed = await scheduler.ListEvents(pb.ListEventsRequest(job=JOB))
    assert [e.message for e in listed.events] == ["m1", "m2", "m3", "m4"]


async def test_subscribe_replays_then_tails_without_gaps_or_repeats(
    scheduler: events_service_pb2_grpc.EventServiceStub,
) -> None:
    await publish(scheduler, *(ev(message=f"old{i}") for i in range(5)))
    stream = scheduler.Subscribe(pb.SubscribeRequest(job=JOB, after_seq=2))
    reader = asyncio.ensure_future(collect(stream, 3 + 20))
    for i in range(20):
        await publish(scheduler, ev(message=f"new{i}"))
    seen = await asyncio.wait_for(reader, 20)
    assert [e.seq for e in seen] == list(range(3, 26))
    stream.cancel()

    resumed = scheduler.Subscribe(pb.SubscribeRequest(job=JOB, after_seq=seen[10].seq))
    again = await asyncio.wait_for(collect(resumed, 12), 10)
    assert [e.seq for e in again] == list(range(seen[10].seq + 1, 26))
    resumed.cancel()


async def test_filters_and_heartbeats(scheduler: events_service_pb2_grpc.EventServiceStub) -> None:
    await publish(
        scheduler,
        ev("log", "debug", level=types_pb2.LEVEL_DEBUG),
        ev("train.step", "step"),
        ev("log", "warn", level=types_pb2.LEVEL_WARNING),
        ev("rollout.completed", "rollout"),
    )
    request = pb.SubscribeRequest(
        job=JOB,
        types=["train.*", "log"],
        min_level=types_pb2.LEVEL_INFO,
        heartbeat_interval=duration_pb2.Duration(nanos=100_000_000),
    )
    stream = scheduler.Subscribe(request)
    first = await stream.read()
    assert [e.message for e in first.events.events] == ["step", "warn"]
    assert first.events.cursor == 4
    beat = await asyncio.wait_for(stream.read(), 5)
    assert beat.WhichOneof("kind") == "heartbeat"
    assert (beat.heartbeat.cursor, beat.heartbeat.last_seq) == (4, 4)
    stream.cancel()


async def test_stream_ends_when_the_job_is_terminal(
    scheduler: events_service_pb2_grpc.EventServiceStub,
) -> None:
    await publish(scheduler, ev(message="working"))
    stream = scheduler.Subscribe(pb.SubscribeRequest(job=JOB, end_when_terminal=True))
    first = await stream.read()
    assert [e.message for e in first.events.events] == ["working"]
    closed = await scheduler.CloseJobStream(
        pb.CloseJobStreamRequest(
            job=JOB, state_changed=event_pb2.JobStateChanged(state=job_pb2.Job.STATE_SUCCEEDED)
        )
    )
    assert closed.event.seq == 2
    replies = [r async for r in stream]
    assert replies[-1].WhichOneof("kind") == "end"
    assert replies[-1].end.terminal_seq == 2
    assert replies[-1].end.terminal_state == job_pb2.Job.STATE_SUCCEEDED
    assert [e.type for r in replies for e in r.events.events] == ["job.state_changed"]
    with pytest.raises(RpcError) as info:
        await publish(scheduler, ev(message="late"))
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "JOB_STREAM_CLOSED")


async def test_cursor_errors_are_explicit(scheduler: events_service_pb2_grpc.EventServiceStub) -> None:
    await publish(scheduler, *(ev(message=str(i)) for i in range(10)))
    with pytest.raises(RpcError) as ahead:
        await scheduler.Subscribe(pb.SubscribeRequest(job=JOB, after_seq=11)).read()
    assert (ahead.value.code, ahead.value.reason) == (grpc.StatusCode.OUT_OF_RANGE, "CURSOR_AHEAD")
    compacted = await scheduler.CompactEvents(pb.CompactEventsRequest(job=JOB, keep_last=3))
    assert (compacted.removed_count, compacted.first_retained_seq, compacted.last_seq) == (7, 8, 10)
    with pytest.raises(RpcError) as behind:
        await scheduler.Subscribe(pb.SubscribeRequest(job=JOB, after_seq=2)).read()
    assert (behind.value.code, behind.value.reason) == (grpc.StatusCode.OUT_OF_RANGE, "CURSOR_COMPACTED")
    assert behind.value.metadata["first_retained_seq"] == "8"
    ok = scheduler.Subscribe(pb.SubscribeRequest(job=JOB, after_seq=7))
    assert [e.seq for e in (await ok.read()).events.events] == [8, 9, 10]
    ok.cancel()
    info = await scheduler.GetJobStreamInfo(pb.GetJobStreamInfoRequest(job=JOB))
    assert (info.info.first_retained_seq, info.info.last_seq, info.info.retained_event_count) == (8, 10, 3)


async def test_list_events_pages_with_filters(scheduler: events_service_pb2_grpc.EventServiceStub) -> None:
    await publish(scheduler, *(ev("train.step" if i % 2 else "log", str(i)) for i in range(25)))
    pages: list[list[int]] = []
    token = ""
    while True:
        reply = await scheduler.ListEvents(
            pb.ListEventsRequest(job=JOB, page_size=4, types=["train.step"], page_token=token)
        )
        pages.append([e.seq for e in reply.events])
        token = reply.next_page_token
        if not token:
            break
    assert [s for page in pages for s in page] == list(range(2, 26, 2))
    assert all(len(p) == 4 for p in pages[:-1])
    with pytest.raises(RpcError) as info:
        await scheduler.ListEvents(pb.ListEventsRequest(job=JOB, page_size=4, page_token=token or "bogus"))
    assert info.value.reason == "INVALID_PAGE_TOKEN"


async def test_metrics_from_train_steps_and_downsampling(
    scheduler: events_service_pb2_grpc.EventServiceStub,
) -> None:
    steps = [
        event_pb2.Event(
            type="train.step",
            train_step=event_pb2.TrainStep(step=s, metrics={"loss": 1.0 / s, "reward/mean": s / 100}),
        )
        for s in range(1, 101)
    ]
    await publish(scheduler, *steps)
    await scheduler.PublishMetrics(
        pb.PublishMetricsRequest(job=JOB, points=[metric_pb2.MetricPoint(name="kl", step=1, value=0.5)])
    )
    full = await scheduler.ListMetrics(pb.ListMetricsRequest(job=JOB))
    assert [s.name for s in full.series] == ["kl", "loss", "reward/mean"]
    reward = full.series[2]
    assert len(reward.points) == 100 and not reward.downsampled
    small = await scheduler.ListMetrics(pb.ListMetricsRequest(job=JOB, names=["reward/mean"], max_points=10))
    points = small.series[0].points
    assert small.series[0].downsampled and len(points) == 10
    assert (
        points[0].count == 10
        and points[0].min == pytest.approx(0.01)
        and points[0].max == pytest.approx(0.10)
    )
    assert points[0].value == pytest.approx(0.055)
    paged = await scheduler.ListMetrics(pb.ListMetricsRequest(job=JOB, page_size=2))
    rest = await scheduler.ListMetrics(
        pb.ListMetricsRequest(job=JOB, page_size=2, page_token=paged.next_page_token)
    )
    assert [s.name for s in paged.series] + [s.name for s in rest.series] == ["kl", "loss", "reward/mean"]
    assert rest.next_page_token == ""


async def test_org_subscription_sees_every_job_of_the_org(
    scheduler: events_service_pb2_grpc.EventServiceStub,
) -> None:
    await publish(scheduler, ev(message="a1"), job="orgs/acme/jobs/a")
    await publish(scheduler, ev(message="other"), job="orgs/globex/jobs/x")
    stream = scheduler.SubscribeOrg(pb.SubscribeOrgRequest(parent="orgs/acme"))
    first = await stream.read()
    assert [e.message for e in first.events.events] == ["a1"]
    await publish(scheduler, ev(message="b1"), job="orgs/acme/jobs/b")
    second = await asyncio.wait_for(stream.read(), 5)
    assert [(e.job, e.message) for e in second.events.events] == [("orgs/acme/jobs/b", "b1")]
    stream.cancel()


async def test_job_tokens_are_scoped(
    mesh: Mesh, signer: TokenSigner, scheduler: events_service_pb2_grpc.EventServiceStub
) -> None:
    await publish(scheduler, ev(message="x"))
    await publish(scheduler, ev(message="y"), job="orgs/globex/jobs/secret")
    own = Client(mesh, signer.issue("job", JOB, org="acme"))
    try:
        assert list((await publish(own.stub, ev(message="from job"))).seqs) == [2]
        # Any job but its own, of its org or another, existing or not, is refused alike.
        for job in ("orgs/acme/jobs/nope", "orgs/globex/jobs/secret", "orgs/globex/jobs/nope"):
            with pytest.raises(RpcError) as refused:
                await own.stub.ListEvents(pb.ListEventsRequest(job=job))
            assert (refused.value.code, refused.value.reason) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "OUTSIDE_JOB_SCOPE",
            )
        assert (await own.stub.ListEvents(pb.ListEventsRequest(job=JOB))).events
        with pytest.raises(RpcError) as sibling:
            await publish(own.stub, ev(message="x"), job="orgs/acme/jobs/other")
        assert sibling.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(RpcError) as close:
            await own.stub.CloseJobStream(
                pb.CloseJobStreamRequest(
                    job=JOB, state_changed=event_pb2.JobStateChanged(state=job_pb2.Job.STATE_FAILED)
                )
            )
        assert close.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await own.channel.close()


async def test_bad_input(
    mesh: Mesh, scheduler: events_service_pb2_grpc.EventServiceStub, signer: TokenSigner
) -> None:
    with pytest.raises(RpcError) as bad_field:
        await publish(scheduler, event_pb2.Event(type="log", trace_id="not-hex"))
    assert bad_field.value.reason == "INVALID_ARGUMENT"
    assert [v.field for v in bad_field.value.violations] == ["events[0].trace_id"]
    huge = event_pb2.Event(type="log")
    huge.payload.update({"blob": "y" * 70_000})
    with pytest.raises(RpcError) as payload:
        await publish(scheduler, huge)
    assert (payload.value.code, payload.value.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "PAYLOAD_TOO_LARGE",
    )
    terminal = event_pb2.Event(
        type="job.state_changed", job_state_changed=event_pb2.JobStateChanged(state=job_pb2.Job.STATE_FAILED)
    )
    with pytest.raises(RpcError) as sneaky:
        await publish(scheduler, terminal)
    assert sneaky.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RpcError) as unknown:
        await scheduler.Subscribe(pb.SubscribeRequest(job="orgs/acme/jobs/missing")).read()
    assert unknown.value.reason == "JOB_NOT_FOUND"
    # A string field that is not UTF-8: the raw bytes of PublishRequest{job: "orgs/acme/jobs/\xff"}.
    raw = b"\n\x10orgs/acme/jobs/\xff"
    token = signer.issue("service", "scheduler")
    async with grpc.aio.insecure_channel(mesh.address("events")) as channel:
        call = channel.unary_unary("/tandem.events.v1.EventService/Publish")
        with pytest.raises(grpc.aio.AioRpcError) as garbled:
            await call(raw, metadata=(("authorization", f"Bearer {token}"),), timeout=5)
    assert garbled.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RpcError) as nothing_written:  # every refused publish left no log behind
        await scheduler.GetJobStreamInfo(pb.GetJobStreamInfoRequest(job=JOB))
    assert nothing_written.value.reason == "JOB_NOT_FOUND"


async def test_events_survive_a_restart(tmp_path: Path, store_url: str) -> None:
    settings = mesh_settings(tmp_path, store_url=store_url)
    async with running_mesh(settings, services=["events"]) as first:
        signer = TokenSigner(load_signing_key("", settings.state_dir))
        client = Client(first, signer.issue("service", "scheduler"))
        await publish(client.stub, *(ev(message=str(i)) for i in range(7)))
        await client.channel.close()
    settings.ports.events = 0
    async with running_mesh(settings, services=["events"]) as second:
        client = Client(second, signer.issue("service", "scheduler"))
        listed = await client.stub.ListEvents(pb.ListEventsRequest(job=JOB))
        assert [e.seq for e in listed.events] == list(range(1, 8))
        assert list((await publish(client.stub, ev(message="after"))).seqs) == [8]
        await client.channel.close()


async def test_retention_policy_compacts_closed_logs(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_EVENTS_RETENTION_INTERVAL_S", "0.1")
    settings = mesh_settings(tmp_path, store_url=store_url)
    async with running_mesh(settings, services=["events"]) as mesh:
        client = Client(
            mesh, TokenSigner(load_signing_key("", settings.state_dir)).issue("service", "scheduler")
        )
        stub = client.stub
        name = "orgs/acme/retentionPolicy"
        default = await stub.GetRetentionPolicy(pb.GetRetentionPolicyRequest(name=name))
        assert default.retention_policy.max_events_per_job == 0
        assert not default.retention_policy.HasField("update_time")
        live = "orgs/acme/jobs/live"
        await publish(stub, *(ev(message=str(i)) for i in range(10)))
        await publish(stub, *(ev(message=str(i)) for i in range(10)), job=live)
        await stub.CloseJobStream(
            pb.CloseJobStreamRequest(
                job=JOB, state_changed=event_pb2.JobStateChanged(state=job_pb2.Job.STATE_SUCCEEDED)
            )
        )
        policy = job_stream_pb2.RetentionPolicy(name=name, max_events_per_job=3)
        mask = field_mask_pb2.FieldMask(paths=["max_events_per_job"])
        updated = await stub.UpdateRetentionPolicy(
            pb.UpdateRetentionPolicyRequest(retention_policy=policy, update_mask=mask)
        )
        assert updated.retention_policy.max_events_per_job == 3
        assert updated.retention_policy.HasField("update_time")
        for _ in range(100):
            info = (await stub.GetJobStreamInfo(pb.GetJobStreamInfoRequest(job=JOB))).info
            if info.first_retained_seq > 1:
                break
            await asyncio.sleep(0.05)
        assert (info.first_retained_seq, info.last_seq, info.retained_event_count) == (9, 11, 3)
        running = (await stub.GetJobStreamInfo(pb.GetJobStreamInfoRequest(job=live))).info
        assert running.first_retained_seq == 1  # live logs are kept unless compact_live_jobs is set
        with pytest.raises(RpcError) as bad_mask:
            await stub.UpdateRetentionPolicy(
                pb.UpdateRetentionPolicyRequest(
                    retention_policy=policy, update_mask=field_mask_pb2.FieldMask(paths=["name"])
                )
            )
        assert bad_mask.value.code == grpc.StatusCode.INVALID_ARGUMENT
        await client.channel.close()


async def test_replicas_on_postgres_fan_out_to_each_other(tmp_path: Path, postgres_url: str) -> None:
    """Two events replicas on one PostgreSQL database: a subscriber on B sees what is published on A."""
    settings_a = mesh_settings(tmp_path / "a", store_url=postgres_url, mesh_key="22" * 32)
    settings_b = mesh_settings(tmp_path / "b", store_url=postgres_url, mesh_key="22" * 32)
    token = TokenSigner(load_signing_key("22" * 32, tmp_path)).issue("service", "scheduler")
    async with (
        running_mesh(settings_a, services=["events"]) as a,
        running_mesh(settings_b, services=["events"]) as b,
    ):
        on_a, on_b = Client(a, token), Client(b, token)
        await publish(on_a.stub, ev(message="first"))
        stream = on_b.stub.Subscribe(pb.SubscribeRequest(job=JOB))
        assert [e.message for e in (await stream.read()).events.events] == ["first"]
        for i in range(20):
            await publish(on_a.stub if i % 2 else on_b.stub, ev(message=f"m{i}"))
        seen = await asyncio.wait_for(collect(stream, 20), 10)
        assert [e.seq for e in seen] == list(range(2, 22))
        stream.cancel()
        await on_a.channel.close()
        await on_b.channel.close()


async def test_a_stalled_subscriber_slows_nobody_and_still_gets_everything(
    scheduler: events_service_pb2_grpc.EventServiceStub,
) -> None:
    total = RING_SIZE + 1500  # more than the in-memory window: the stalled reader must fall back to storage
    await publish(scheduler, ev(message="start"))
    stalled = scheduler.Subscribe(pb.SubscribeRequest(job=JOB))
    assert [e.seq for e in (await stalled.read()).events.events] == [1]
    live = scheduler.Subscribe(pb.SubscribeRequest(job=JOB, after_seq=1))
    reader = asyncio.ensure_future(collect(live, total))
    for start in range(0, total, 500):
        await publish(scheduler, *(ev(message=str(i)) for i in range(start, min(start + 500, total))))
    assert [e.seq for e in await asyncio.wait_for(reader, 30)] == list(range(2, total + 2))
    late = await asyncio.wait_for(collect(stalled, total), 30)
    assert [e.seq for e in late] == list(range(2, total + 2))
    live.cancel()
    stalled.cancel()


async def test_a_retry_storm_is_applied_once(scheduler: events_service_pb2_grpc.EventServiceStub) -> None:
    batch = [ev(message=f"e{i}", producer_id="storm", producer_seq=i) for i in range(1, 21)]
    replies = await asyncio.gather(*(publish(scheduler, *batch) for _ in range(30)))
    assert {tuple(r.seqs) for r in replies} == {tuple(range(1, 21))}
    assert sorted(r.duplicate_count for r in replies) == [0] + [20] * 29
    info = (await scheduler.GetJobStreamInfo(pb.GetJobStreamInfoRequest(job=JOB))).info
    assert (info.last_seq, info.retained_event_count) == (20, 20)
