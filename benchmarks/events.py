"""Events service benchmark: durable ingest, live fan-out and publish-to-deliver latency, each beside a
no-storage baseline measured in the same run.

Run from the repository root:

    .venv/bin/python benchmarks/events.py                  # SQLite in a temporary folder, ~70 s
    .venv/bin/python benchmarks/events.py --quick          # smoke run, < 30 s
    .venv/bin/python benchmarks/events.py --store postgresql://user:pass@host/db

Two servers run as child processes, so neither shares an event loop with the client (this process):

* tandem events: `python -m services.events`, the deployment shape (interceptors, auth, validation,
  tracing, request logging, group-committed durable store; SQLite with synchronous=FULL by default).
* baseline: `python benchmarks/events.py --serve-baseline PORT`, a plain `grpc.aio` server with the same
  EventService Publish and Subscribe, that assigns seqs and echoes each published batch, as one response
  message shared by all, to every subscriber's queue in memory: no storage, no auth, no interceptors.

Both are driven by the same client code, which sends events shaped like a trainer's (type `log`, one in ten
`train.step` with two metrics, a ~60 character message, a small Struct payload, an idempotent producer id).
What is measured, each on a fresh job and after a short warm-up that is not counted:

1. ingest: 8 publishers, one job each, sending 100-event batches back to back; events acknowledged per
   second (for tandem: durable before the acknowledgement).
2. fan-out: 50 live subscribers on one job, one publisher sending 100-event batches as fast as they are
   acknowledged; events received by all subscribers together per second.
3. latency: 50 live subscribers on one job, one publisher at a fixed offered load of 2,000 events/s (20
   events every 10 ms on a monotonic schedule, open loop); each event carries its send time, and the
   latency of a delivery is its receive time minus its send time (one clock: publisher and subscribers live
   in this process). p50 and p99 over every delivery of every event sent in the measured window; a delivery
   still missing a few seconds after the last publish counts as slower than all others.

The client is one Python process, so on a small machine it can be the bottleneck itself; that is why the
baseline uses the very same client and the ratio between the two columns is the figure that matters.
Under the table it prints what reading the table needs: the publisher's acknowledged rate during fan-out; the p50 of
events sent in the first and in the last quarter of the latency window (when it grows, the offered load was
not sustained, a backlog built up, and p50/p99 then depend on the window's length more than on anything
else); and the cores the client and the server kept busy in each measurement, which tells which side
limited a figure (one Python process cannot use much more than one core).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import signal
import sys
import tempfile
import time
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import nacl.signing
from _children import Child, child_process, cpu_seconds, free_port, serve_until_signal
from google.protobuf import duration_pb2, timestamp_pb2
from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2, events_service_pb2, events_service_pb2_grpc

from mesh.identity import TokenSigner

pb = events_service_pb2
SCRIPT = Path(__file__).resolve()
ORG = "bench"
RING_SIZE = 8192  # the baseline keeps as many recent events for replay as tandem's in-memory window
SUBSCRIBER_CHANNELS = 5  # 50 subscribers over 5 connections, publishers on a connection of their own
START_TIMEOUT_S = 60.0
PRIME_TIMEOUT_S = 20.0
SUBSCRIBE_RETRIES = 20
DRAIN_TIMEOUT_S = 5.0
Metadata = tuple[tuple[str, str], ...]
Stub = events_service_pb2_grpc.EventServiceStub
T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    warmup_s: float
    ingest_s: float
    fanout_s: float
    latency_s: float
    publishers: int = 8
    batch: int = 100
    subscribers: int = 50
    offered_rate: int = 2_000
    tick_s: float = 0.010

    @property
    def tick_events(self) -> int:
        return round(self.offered_rate * self.tick_s)


FULL = Plan(warmup_s=1.0, ingest_s=8.0, fanout_s=8.0, latency_s=10.0)
QUICK = Plan(warmup_s=0.3, ingest_s=1.5, fanout_s=1.5, latency_s=2.0)


# ---- events -------------------------------------------------------------------------------------------


def realistic_event(index: int, producer: str) -> event_pb2.Event:
    """A trainer-shaped event: a log line, or (one in ten) a train step with two metrics."""
    event = event_pb2.Event(
        type="log",
        level=types_pb2.LEVEL_INFO,
        message=f"rank {index % 8} finished rollout batch {index:>6}: 4096 tokens in 331 ms",
        producer_id=producer,
        producer_seq=index,
    )
    event.payload.update({"rank": index % 8, "phase": "rollout", "tokens": 4096})
    if index % 10 == 0:
        event.type = "train.step"
        event.train_step.step = index
        event.train_step.metrics["loss"] = 2.0 / math.log(index + 2)
        event.train_step.metrics["lr"] = 3e-4
    return event


class BatchSource:
    """One producer's batches: a request built once, renumbered in place for every send (cheap on the
    client, so the client spends its time on the transport and not on building messages)."""

    def __init__(self, job: str, producer: str, size: int) -> None:
        self.request = pb.PublishRequest(
            job=job, events=[realistic_event(i + 1, producer) for i in range(size)]
        )
        self._next = 1

    def next(self) -> pb.PublishRequest:
        for event in self.request.events:
            event.producer_seq = self._next
            if event.type == "train.step":
                event.train_step.step = self._next
            self._next += 1
        return self.request


def timed_batch(job: str, producer: str, first: int, count: int, sent_us: float) -> pb.PublishRequest:
    events = [realistic_event(first + i, producer) for i in range(count)]
    for event in events:
        event.payload["sent_us"] = sent_us
    return pb.PublishRequest(job=job, events=events)


# ---- the baseline server ------------------------------------------------------------------------------


@dataclass
class _MemoryJob:
    last_seq: int = 0
    recent: deque[event_pb2.Event] = field(default_factory=lambda: deque(maxlen=RING_SIZE))
    queues: set[asyncio.Queue[pb.SubscribeResponse]] = field(default_factory=set)


class BaselineServicer(events_service_pb2_grpc.EventServiceServicer):
    """Publish and Subscribe of EventService over memory only: a published batch gets its seqs and is
    echoed, as one response message, to every live subscriber's queue; a recent window serves replay."""

    def __init__(self) -> None:
        self._jobs: dict[str, _MemoryJob] = {}

    def _job(self, name: str) -> _MemoryJob:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = _MemoryJob()
        return job

    async def Publish(
        self, request: pb.PublishRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PublishResponse:
        job = self._job(request.job)
        now = timestamp_pb2.Timestamp()
        now.GetCurrentTime()
        events = list(request.events)
        for event in events:
            job.last_seq += 1
            event.job = request.job
            event.seq = job.last_seq
            event.receive_time.CopyFrom(now)
        job.recent.extend(events)
        if events and job.queues:
            echo = pb.SubscribeResponse(events=pb.EventBatch(events=events, cursor=job.last_seq))
            for queue in job.queues:
                queue.put_nowait(echo)
        return pb.PublishResponse(seqs=[e.seq for e in events], last_seq=job.last_seq)

    async def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SubscribeResponse]:
        job = self._job(request.job)
        queue: asyncio.Queue[pb.SubscribeResponse] = asyncio.Queue()
        job.queues.add(queue)  # before the replay, so nothing falls between the two
        try:
            cursor = request.after_seq
            replay = [e for e in job.recent if e.seq > cursor]
            if replay:
                cursor = replay[-1].seq
                yield pb.SubscribeResponse(events=pb.EventBatch(events=replay, cursor=cursor))
            while True:
                reply = await queue.get()
                if not queue.empty():  # coalesce what arrived meanwhile, as tandem's reader does
                    merged = pb.SubscribeResponse()
                    merged.MergeFrom(reply)
                    while not queue.empty():
                        merged.MergeFrom(queue.get_nowait())
                    reply = merged
                if reply.events.events[0].seq <= cursor:  # partly replayed already
                    fresh = [e for e in reply.events.events if e.seq > cursor]
                    if not fresh:
                        continue
                    reply = pb.SubscribeResponse(events=pb.EventBatch(events=fresh, cursor=fresh[-1].seq))
                cursor = reply.events.cursor
                yield reply
        finally:
            job.queues.discard(queue)


async def serve_baseline(port: int) -> None:
    server = grpc.aio.server()
    events_service_pb2_grpc.add_EventServiceServicer_to_server(BaselineServicer(), server)  # type: ignore[abstract]
    await serve_until_signal(server, port)


# ---- child processes ----------------------------------------------------------------------------------


def events_env(state_dir: Path, port: int, seed_hex: str, store_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        TANDEM_STATE_DIR=str(state_dir),
        TANDEM_PORTS__EVENTS=str(port),
        TANDEM_MESH_KEY=seed_hex,
        TANDEM_DRAIN_GRACE_S="1",
    )
    if store_url:
        env["TANDEM_STORE_URL"] = store_url
    return env


# ---- client side --------------------------------------------------------------------------------------


class Target:
    """One server as the client sees it: a publisher stub and subscriber stubs on their own connections."""

    def __init__(self, name: str, child: Child, metadata: Metadata) -> None:
        self.name = name
        self.child = child
        self.metadata = metadata
        options = [("grpc.use_local_subchannel_pool", 1)]
        address = f"127.0.0.1:{child.port}"
        self.channels = [grpc.aio.insecure_channel(address, options) for _ in range(1 + SUBSCRIBER_CHANNELS)]
        self.publisher = Stub(self.channels[0])
        self.subscriber_stubs = [Stub(c) for c in self.channels[1:]]
        self.stale_not_found = 0  # Subscribe answered NOT_FOUND for a job whose creation was acknowledged

    async def publish(
        self, request: pb.PublishRequest, *, wait: bool = False, deadline_s: float = 30.0
    ) -> int:
        reply: pb.PublishResponse = await self.publisher.Publish(
            request, metadata=self.metadata, timeout=deadline_s, wait_for_ready=wait
        )
        return reply.last_seq

    async def wait_ready(self, run: str) -> None:
        """Until a publish succeeds (both servers create a job on its first event from a service)."""
        request = pb.PublishRequest(job=f"orgs/{ORG}/jobs/{run}-ready", events=[realistic_event(1, "")])
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.child.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.child.proc.returncode}):\n{self.child.tail()}")
            try:
                await self.publish(request, wait=True, deadline_s=1.0)
                return
            except grpc.aio.AioRpcError as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not answer: {error}\n{self.child.tail()}") from None

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


class Subscribers:
    """N live subscriptions on one job, each calling `on_batch(events, receive_time)` per message.

    A subscription answered NOT_FOUND before its first event is retried a few times, and counted on the
    target: the job's first Publish was acknowledged before any Subscribe started, so such an answer is a
    stale read by the server, reported under the table rather than allowed to end the run.
    """

    def __init__(
        self, target: Target, job: str, after_seq: int, count: int, on_batch: Callable[[Any, float], None]
    ) -> None:
        self._target = target
        self._on_batch = on_batch
        self._request = pb.SubscribeRequest(
            job=job, after_seq=after_seq, heartbeat_interval=duration_pb2.Duration(seconds=30)
        )
        self._calls: list[Any] = [None] * count
        self._count = count
        self.primed = 0
        self.ready = asyncio.Event()
        self._tasks = [asyncio.create_task(self._consume(index)) for index in range(count)]

    async def _consume(self, index: int) -> None:
        stub = self._target.subscriber_stubs[index % len(self._target.subscriber_stubs)]
        primed = False
        retries = 0
        while True:
            call = self._calls[index] = stub.Subscribe(self._request, metadata=self._target.metadata)
            try:
                async for reply in call:
                    if reply.WhichOneof("kind") != "events":
                        continue
                    now = time.perf_counter()
                    if not primed:
                        primed = True
                        self.primed += 1
                        if self.primed == self._count:
                            self.ready.set()
                    self._on_batch(reply.events.events, now)
                return
            except grpc.aio.AioRpcError as error:
                if primed or error.code() != grpc.StatusCode.NOT_FOUND or retries == SUBSCRIBE_RETRIES:
                    raise
                retries += 1
                self._target.stale_not_found += 1
                await asyncio.sleep(0.05)

    def failure(self) -> BaseException | None:
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    async def close(self) -> None:
        for call in self._calls:
            if call is not None:
                call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def sleep_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def subscribed(
    target: Target, job: str, plan: Plan, on_batch: Callable[[Any, float], None]
) -> Subscribers:
    """Open the log with a priming event, subscribe from before it, wait until every subscriber has it."""
    await target.publish(pb.PublishRequest(job=job, events=[realistic_event(1, "")]))
    subs = Subscribers(target, job, 0, plan.subscribers, on_batch)
    try:
        await asyncio.wait_for(subs.ready.wait(), PRIME_TIMEOUT_S)
    except TimeoutError:
        failed = subs.failure()
        await subs.close()
        raise RuntimeError(
            f"{target.name}: {subs.primed}/{plan.subscribers} subscribers got the priming event: {failed!r}"
        ) from None
    return subs


async def measure_ingest(target: Target, plan: Plan, run: str) -> float:
    """Events/s acknowledged to `plan.publishers` back-to-back publishers, one job each."""
    start = time.perf_counter()
    window = (start + plan.warmup_s, start + plan.warmup_s + plan.ingest_s)
    acked = 0

    async def publisher(index: int) -> None:
        nonlocal acked
        source = BatchSource(f"orgs/{ORG}/jobs/{run}-ingest-{index}", f"bench/ingest/{index}", plan.batch)
        while time.perf_counter() < window[1]:
            await target.publish(source.next())
            if window[0] <= time.perf_counter() < window[1]:
                acked += plan.batch

    await asyncio.gather(*(publisher(i) for i in range(plan.publishers)))
    return acked / plan.ingest_s


@dataclass
class FanoutResult:
    deliveries_per_s: float
    published_per_s: float
    lag_events: int


async def measure_fanout(target: Target, plan: Plan, run: str) -> FanoutResult:
    """Event deliveries/s to `plan.subscribers` subscribers of one job fed by one back-to-back publisher."""
    job = f"orgs/{ORG}/jobs/{run}-fanout"
    window = (math.inf, math.inf)
    delivered = 0
    total = 0

    def on_batch(events: Any, now: float) -> None:
        nonlocal delivered, total
        total += len(events)
        if window[0] <= now < window[1]:
            delivered += len(events)

    subs = await subscribed(target, job, plan, on_batch)
    try:
        start = time.perf_counter()
        window = (start + plan.warmup_s, start + plan.warmup_s + plan.fanout_s)
        source = BatchSource(job, "bench/fanout", plan.batch)
        published = 0
        last_seq = 0
        while time.perf_counter() < window[1]:
            last_seq = await target.publish(source.next())
            if window[0] <= time.perf_counter() < window[1]:
                published += plan.batch
        if (failed := subs.failure()) is not None:
            raise RuntimeError(f"{target.name}: a subscriber failed: {failed!r}")
        lag = last_seq * plan.subscribers - total
        return FanoutResult(delivered / plan.fanout_s, published / plan.fanout_s, lag)
    finally:
        await subs.close()


@dataclass
class LatencyResult:
    p50_ms: float
    p99_ms: float
    offered_per_s: float
    delivered_fraction: float
    first_quarter_p50_ms: float
    last_quarter_p50_ms: float

    @property
    def backlog_grew(self) -> bool:
        """Events sent late in the window waited much longer than early ones: the load was not sustained."""
        return self.last_quarter_p50_ms > 2 * self.first_quarter_p50_ms + 20


def percentile(ordered: Sequence[float], fraction: float) -> float:
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


async def measure_latency(target: Target, plan: Plan, run: str) -> LatencyResult:
    """Publish-to-deliver latency at a fixed offered load (open loop) with `plan.subscribers` subscribers."""
    job = f"orgs/{ORG}/jobs/{run}-latency"
    origin = time.perf_counter()
    window_us = (math.inf, math.inf, math.inf, math.inf)  # start, end of first quarter, start of last, end
    latencies_us: list[float] = []
    early_us: list[float] = []
    late_us: list[float] = []
    expected = sys.maxsize  # known once the publisher is done
    drained = asyncio.Event()

    per_tick = plan.tick_events

    def record(sent_us: float, now_us: float, count: int) -> None:
        low, first_quarter, last_quarter, high = window_us
        if low <= sent_us < high:
            latency = [now_us - sent_us] * count
            latencies_us.extend(latency)
            if sent_us < first_quarter:
                early_us.extend(latency)
            elif sent_us >= last_quarter:
                late_us.extend(latency)

    def on_batch(events: Any, now: float) -> None:
        # The events of one publish share a send time and sit together, so the subscriber reads the send
        # time once per run of them (telling runs apart by producer_seq) and not once per event: this
        # client serves 50 subscribers and must stay cheaper than the servers it measures.
        now_us = (now - origin) * 1e6
        run, sent_us, count = -1, 0.0, 0
        for event in events:
            tick = event.producer_seq // per_tick
            if tick != run:
                if count:
                    record(sent_us, now_us, count)
                run, sent_us, count = tick, event.payload.fields["sent_us"].number_value, 0
            count += 1
        if count:
            record(sent_us, now_us, count)
        if len(latencies_us) >= expected:
            drained.set()

    subs = await subscribed(target, job, plan, on_batch)
    inflight: set[asyncio.Task[int]] = set()
    try:
        start = time.perf_counter()
        end = start + plan.warmup_s + plan.latency_s
        low, high = (start - origin + plan.warmup_s) * 1e6, (end - origin) * 1e6
        window_us = (low, low + (high - low) / 4, high - (high - low) / 4, high)
        sent_in_window = 0
        seq = plan.tick_events  # batch k holds producer seqs [k * tick_events, (k + 1) * tick_events)
        tick = 0
        while (moment := start + tick * plan.tick_s) < end:
            await sleep_until(moment)
            sent_us = (time.perf_counter() - origin) * 1e6
            request = timed_batch(job, "bench/latency", seq, plan.tick_events, sent_us)
            task = asyncio.create_task(target.publish(request))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            if low <= sent_us < high:
                sent_in_window += plan.tick_events
            seq += plan.tick_events
            tick += 1
        await asyncio.gather(*inflight)
        expected = sent_in_window * plan.subscribers
        if len(latencies_us) < expected:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drained.wait(), DRAIN_TIMEOUT_S)
        if (failed := subs.failure()) is not None:
            raise RuntimeError(f"{target.name}: a subscriber failed: {failed!r}")
        delivered = len(latencies_us)
        ordered = sorted(latencies_us) + [math.inf] * max(0, expected - delivered)  # lost: slower than any
        return LatencyResult(
            p50_ms=percentile(ordered, 0.50) / 1000,
            p99_ms=percentile(ordered, 0.99) / 1000,
            offered_per_s=sent_in_window / plan.latency_s,
            delivered_fraction=delivered / expected if expected else math.nan,
            first_quarter_p50_ms=percentile(sorted(early_us), 0.50) / 1000,
            last_quarter_p50_ms=percentile(sorted(late_us), 0.50) / 1000,
        )
    finally:
        for task in inflight:
            task.cancel()
        await subs.close()


@dataclass
class CpuUse:
    """Cores kept busy during one measurement, by the client (this process) and by the server."""

    client: float
    server: float

    def __str__(self) -> str:
        return f"{self.client:.2f}/{self.server:.2f}"


async def metered(target: Target, measurement: Awaitable[T]) -> tuple[T, CpuUse]:
    pid = target.child.proc.pid
    wall, client, server = time.perf_counter(), cpu_seconds(), cpu_seconds(pid)
    result = await measurement
    elapsed = time.perf_counter() - wall
    return result, CpuUse((cpu_seconds() - client) / elapsed, (cpu_seconds(pid) - server) / elapsed)


# ---- the run ------------------------------------------------------------------------------------------


@dataclass
class Results:
    ingest: dict[str, float] = field(default_factory=dict)
    fanout: dict[str, FanoutResult] = field(default_factory=dict)
    latency: dict[str, LatencyResult] = field(default_factory=dict)
    cpu: dict[tuple[str, str], CpuUse] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    async def record(
        self, scenario: str, target: Target, measurement: Awaitable[T], into: dict[str, T]
    ) -> None:
        """Run one measurement on one server; a failure is reported and leaves the cell empty."""
        print(f"{scenario:<8} {target.name} ...", flush=True)
        try:
            into[target.name], self.cpu[scenario, target.name] = await metered(target, measurement)
        except (RuntimeError, TimeoutError, grpc.aio.AioRpcError) as error:
            message = f"{scenario} on {target.name} failed: {error}"
            print(f"  {message}", flush=True)
            self.failures.append(message)


def both(values: dict[str, T], get: Callable[[T], float]) -> tuple[float, float]:
    """(tandem, baseline) figures of one metric, NaN where the measurement failed."""
    return (
        get(values["tandem"]) if "tandem" in values else math.nan,
        get(values["baseline"]) if "baseline" in values else math.nan,
    )


def number(value: float, digits: int = 0) -> str:
    return "error" if math.isnan(value) else f"{value:,.{digits}f}"


def ratio(ours: float, theirs: float) -> str:
    return "-" if math.isnan(ours) or math.isnan(theirs) or not theirs else f"{ours / theirs:.2f}x"


def verdict(value: float, met: bool) -> str:
    return "n/a" if math.isnan(value) else "met" if met else "MISSED"


def report(results: Results, plan: Plan, store: str, elapsed_s: float, targets: Sequence[Target]) -> str:
    ingest = both(results.ingest, lambda r: r)
    fanout = both(results.fanout, lambda r: r.deliveries_per_s)
    p50 = both(results.latency, lambda r: r.p50_ms)
    p99 = both(results.latency, lambda r: r.p99_ms)
    fan_ratio = fanout[0] / fanout[1] if fanout[1] else math.nan
    subs, rate = plan.subscribers, plan.offered_rate
    rows = [
        ("metric", "tandem events", "baseline (no storage)", "ratio", "goal"),
        (
            f"ingest, {plan.publishers} publishers x {plan.batch} (events/s)",
            number(ingest[0]),
            number(ingest[1]),
            ratio(*ingest),
            f">= 20,000/s: {verdict(ingest[0], ingest[0] >= 20_000)}",
        ),
        (
            f"fan-out to {subs} subscribers (deliveries/s)",
            number(fanout[0]),
            number(fanout[1]),
            ratio(*fanout),
            f">= 0.5x baseline: {verdict(fan_ratio, fan_ratio >= 0.5)}",
        ),
        (
            f"latency p50 @ {rate:,} ev/s, {subs} subs (ms)",
            number(p50[0], 1),
            number(p50[1], 1),
            ratio(*p50),
            "-",
        ),
        (
            f"latency p99 @ {rate:,} ev/s, {subs} subs (ms)",
            number(p99[0], 1),
            number(p99[1], 1),
            ratio(*p99),
            f"<= 50 ms: {verdict(p99[0], p99[0] <= 50)}",
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    published = both(results.fanout, lambda r: r.published_per_s)
    owed = both(results.fanout, lambda r: r.lag_events)
    offered = both(results.latency, lambda r: r.offered_per_s)
    delivered = both(results.latency, lambda r: 100 * r.delivered_fraction)
    trend = [
        f"{name} {number(r.first_quarter_p50_ms, 1)} -> {number(r.last_quarter_p50_ms, 1)} ms"
        + (" (backlog grew: load not sustained)" if r.backlog_grew else "")
        for name, r in results.latency.items()
    ]
    cpu = [
        f"{name} {results.cpu.get((name, 'tandem'), '-')} vs {results.cpu.get((name, 'baseline'), '-')}"
        for name in ("ingest", "fan-out", "latency")
    ]
    lines += [
        "",
        f"store: {store}; {os.cpu_count()} cores; run took {elapsed_s:.0f} s"
        + ("; --quick: short windows, rough figures" if plan is QUICK else ""),
        f"fan-out: the publisher got {number(published[0])} vs {number(published[1])} events/s acknowledged; "
        f"deliveries still owed at the end {number(owed[0])} vs {number(owed[1])}",
        f"latency: offered {number(offered[0])} vs {number(offered[1])} events/s, i.e. {rate * subs:,} "
        f"deliveries/s; delivered {number(delivered[0], 1)}% vs {number(delivered[1], 1)}% of them",
        "latency p50, events sent in the first -> last quarter of the window: " + "; ".join(trend),
        "cores busy, client/server, tandem vs baseline: " + "; ".join(cpu),
        *results.failures,
        *(
            f"{t.name}: {t.stale_not_found} Subscribe calls answered NOT_FOUND for a job whose first Publish "
            "had been acknowledged (a stale read; retried)"
            for t in targets
            if t.stale_not_found
        ),
    ]
    return "\n".join(lines)


def redacted(url: str) -> str:
    """The URL without its password, fit to print."""
    parts = urllib.parse.urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


async def run_benchmark(store: str, plan: Plan) -> int:
    started = time.perf_counter()
    seed = secrets.token_hex(32)
    token = TokenSigner(nacl.signing.SigningKey(bytes.fromhex(seed))).issue("service", "bench", ttl_s=3600)
    metadata: Metadata = (("authorization", f"Bearer {token}"),)
    store_url = "" if store == "sqlite" else store
    run = f"r{secrets.token_hex(4)}"  # fresh job names, so a reused PostgreSQL database does not collide
    results = Results()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-events-") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        events_port, baseline_port = free_port(), free_port()
        events_child = stack.enter_context(
            child_process(
                "events",
                [sys.executable, "-m", "services.events"],
                events_env(folder / "state", events_port, seed, store_url),
                folder,
                port=events_port,
            )
        )
        baseline_child = stack.enter_context(
            child_process(
                "baseline",
                [sys.executable, str(SCRIPT), "--serve-baseline", str(baseline_port)],
                dict(os.environ),
                folder,
                port=baseline_port,
            )
        )
        targets = [Target("tandem", events_child, metadata), Target("baseline", baseline_child, metadata)]
        try:
            for target in targets:
                await target.wait_ready(run)
            # Scenario by scenario, each on both servers back to back, so slow drifts of a shared machine
            # touch both columns of a row alike.
            for target in targets:
                job = f"{run}-{target.name[0]}"
                await results.record("ingest", target, measure_ingest(target, plan, job), results.ingest)
            for target in targets:
                job = f"{run}-{target.name[0]}"
                await results.record("fan-out", target, measure_fanout(target, plan, job), results.fanout)
            for target in targets:
                job = f"{run}-{target.name[0]}"
                await results.record("latency", target, measure_latency(target, plan, job), results.latency)
        finally:
            for target in targets:
                await target.close()
    store_name = redacted(store_url) or "sqlite in a temporary folder (synchronous=FULL)"
    print()
    print(report(results, plan, store_name, time.perf_counter() - started, targets))
    return 1 if results.failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--store", default="sqlite", help="sqlite (default, a temporary file) or a postgresql:// URL"
    )
    parser.add_argument("--quick", action="store_true", help="short windows for a smoke run (< 30 s)")
    parser.add_argument("--serve-baseline", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_baseline is not None:
        asyncio.run(serve_baseline(args.serve_baseline))
        return 0
    if args.store != "sqlite" and not args.store.startswith(("postgresql://", "postgres://")):
        parser.error("--store takes sqlite or a postgresql:// URL")
    # Ctrl-C and SIGTERM (also when started in the background, where SIGINT arrives ignored) unwind through
    # the `finally` blocks, which stop the child servers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(run_benchmark(args.store, QUICK if args.quick else FULL))
    except KeyboardInterrupt:
        print("interrupted; the child servers were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
