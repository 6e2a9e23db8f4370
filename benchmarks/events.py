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
   latency of a delivery is its receive time minus its send time (one clock: `time.perf_counter` is the
   machine's monotonic clock in every process). p50 and p99 over every delivery of every event sent in the
   measured window; a delivery still missing a few seconds after the last publish counts as slower than
   all others. The subscribers live in child processes (`--subscriber-processes`, 2 by default; 0 puts them
   in this process, as before 2026-12-03): receiving 100,000 deliveries/s took 0.8 cores, and in the
   publisher's process it delayed the publisher's schedule and queued its sends behind the deliveries, so
   the figure measured the client as much as the server.

The client is one Python process (and, for latency, its subscriber processes), so on a small machine it can
be the bottleneck itself; that is why the baseline uses the very same client and the ratio between the two
columns is the figure that matters. `--only SCENARIO` runs one measurement (both servers).
Under the table it prints what reading the table needs: the publisher's acknowledged rate during fan-out; the p50 of
events sent in the first and in the last quarter of the latency window (when it grows, the offered load was
not sustained, a backlog built up, and p50/p99 then depend on the window's length more than on anything
else); the latency split at the server's `receive_time` stamp (for tandem, taken when the commit that makes
the event durable starts: before it, the publish's way in and its wait for the writer; after it, the commit
and the fan-out); and the cores the client (with its subscriber processes) and the server kept busy in each
measurement, which tells which side limited a figure (one Python process cannot use much more than one
core).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import resource
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
SUBSCRIBERS_PER_CHANNEL = 10  # the same density in a subscriber process of the latency measurement
START_TIMEOUT_S = 60.0
PRIME_TIMEOUT_S = 20.0
SUBSCRIBE_RETRIES = 20
DRAIN_TIMEOUT_S = 5.0
TOKEN_ENV = "TANDEM_BENCH_TOKEN"  # noqa: S105 - the variable that hands subscriber processes the token
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
    subscriber_processes: int = 2  # latency: child processes the subscribers are spread over (0: in this one)

    @property
    def tick_events(self) -> int:
        return round(self.offered_rate * self.tick_s)


SCENARIOS = ("ingest", "fan-out", "latency")
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
    """N live subscriptions on one job, each calling `on_batch(index, events, receive_time)` per message.

    A subscription answered NOT_FOUND before its first event is retried a few times, and counted: the job's
    first Publish was acknowledged before any Subscribe started, so such an answer is a stale read by the
    server, reported under the table rather than allowed to end the run.
    """

    def __init__(
        self,
        stubs: Sequence[Stub],
        metadata: Metadata,
        job: str,
        count: int,
        on_batch: Callable[[int, Any, float], None],
    ) -> None:
        self._stubs = stubs
        self._metadata = metadata
        self._on_batch = on_batch
        self._request = pb.SubscribeRequest(
            job=job, after_seq=0, heartbeat_interval=duration_pb2.Duration(seconds=30)
        )
        self._calls: list[Any] = [None] * count
        self._count = count
        self.primed = 0
        self.stale_not_found = 0
        self.ready = asyncio.Event()
        self._tasks = [asyncio.create_task(self._consume(index)) for index in range(count)]

    async def _consume(self, index: int) -> None:
        stub = self._stubs[index % len(self._stubs)]
        primed = False
        retries = 0
        while True:
            call: Any = stub.Subscribe(self._request, metadata=self._metadata)  # a grpc.aio stream
            self._calls[index] = call
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
                    self._on_batch(index, reply.events.events, now)
                return
            except grpc.aio.AioRpcError as error:
                if primed or error.code() != grpc.StatusCode.NOT_FOUND or retries == SUBSCRIBE_RETRIES:
                    raise
                retries += 1
                self.stale_not_found += 1
                await asyncio.sleep(0.05)

    async def wait_ready(self, name: str) -> None:
        try:
            await asyncio.wait_for(self.ready.wait(), PRIME_TIMEOUT_S)
        except TimeoutError:
            failed = self.failure()
            await self.close()
            raise RuntimeError(
                f"{name}: {self.primed}/{self._count} subscribers got the priming event: {failed!r}"
            ) from None

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


def subscriber_channels(port: int, count: int) -> list[grpc.aio.Channel]:
    options = [("grpc.use_local_subchannel_pool", 1)]
    return [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options)
        for _ in range(max(1, math.ceil(count / SUBSCRIBERS_PER_CHANNEL)))
    ]


async def subscribed(
    target: Target, job: str, plan: Plan, on_batch: Callable[[int, Any, float], None]
) -> Subscribers:
    """Open the log with a priming event, subscribe from before it, wait until every subscriber has it."""
    await target.publish(pb.PublishRequest(job=job, events=[realistic_event(1, "")]))
    subs = Subscribers(target.subscriber_stubs, target.metadata, job, plan.subscribers, on_batch)
    try:
        await subs.wait_ready(target.name)
    finally:
        target.stale_not_found += subs.stale_not_found
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

    def on_batch(index: int, events: Any, now: float) -> None:
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
    to_stamp_ms: tuple[float, float]  # p50, p99 from the send to the server's receive_time stamp
    from_stamp_ms: tuple[float, float]  # p50, p99 from that stamp to the delivery

    @property
    def backlog_grew(self) -> bool:
        """Events sent late in the window waited much longer than early ones: the load was not sustained."""
        return self.last_quarter_p50_ms > 2 * self.first_quarter_p50_ms + 20


def percentile(ordered: Sequence[float], fraction: float) -> float:
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def p50_p99_ms(samples_us: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_us)
    return percentile(ordered, 0.50) / 1000, percentile(ordered, 0.99) / 1000


class DeliveryLog:
    """What the subscribers of the latency measurement received: per message, per run of one publish's
    events in it, (send time, server receive_time stamp, receive time, events), all as microseconds of
    `time.perf_counter`, which on Linux is one clock for every process of the machine.

    The events of one publish share a send time and sit together, so a subscriber reads the send time once
    per run of them (telling runs apart by producer_seq), not once per event: the subscribers must stay
    cheaper than the servers they measure."""

    def __init__(self, subscribers: int, per_tick: int) -> None:
        self.records: list[float] = []  # flat: sent, stamp, received, count; sent, stamp, ...
        self._per_tick = per_tick
        self._highest = [0] * subscribers  # the newest producer_seq each subscriber got
        self._wall_offset_us = (time.time() - time.perf_counter()) * 1e6
        self._final = sys.maxsize
        self._drained = asyncio.Event()

    def on_batch(self, index: int, events: Any, now: float) -> None:
        now_us = now * 1e6
        per_tick = self._per_tick
        run, first, count = -1, None, 0
        for event in events:
            tick = event.producer_seq // per_tick
            if tick != run:
                if first is not None:
                    self._record(first, now_us, count)
                run, first, count = tick, event, 0
            count += 1
        if first is not None:
            self._record(first, now_us, count)
        self._highest[index] = events[-1].producer_seq
        if min(self._highest) >= self._final:
            self._drained.set()

    def _record(self, first: event_pb2.Event, now_us: float, count: int) -> None:
        stamp = first.receive_time
        stamp_us = stamp.seconds * 1e6 + stamp.nanos / 1e3 - self._wall_offset_us
        self.records.extend((first.payload.fields["sent_us"].number_value, stamp_us, now_us, count))

    async def drained(self, final_producer_seq: int, timeout_s: float) -> None:
        """Until every subscriber got `final_producer_seq`, or `timeout_s` passed."""
        self._final = final_producer_seq
        if min(self._highest) >= final_producer_seq:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), timeout_s)


async def subscriber_process(port: int, job: str, count: int, per_tick: int) -> None:
    """A child of the latency measurement: `count` subscribers of `job`. Prints `ready` once all have the
    priming event, reads `end FINAL_PRODUCER_SEQ` from stdin, waits for the drain and prints the
    `DeliveryLog` as one JSON line."""
    metadata: Metadata = (("authorization", f"Bearer {os.environ[TOKEN_ENV]}"),)
    channels = subscriber_channels(port, count)
    deliveries = DeliveryLog(count, per_tick)
    subs = Subscribers([Stub(c) for c in channels], metadata, job, count, deliveries.on_batch)
    error: str | None = None
    try:
        try:
            await subs.wait_ready("subscriber process")
        except RuntimeError as not_ready:
            print(json.dumps({"error": str(not_ready)}), flush=True)
            return
        print("ready", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await deliveries.drained(int(line.split()[1]), DRAIN_TIMEOUT_S)
        if (failed := subs.failure()) is not None:
            error = repr(failed)
    finally:
        await subs.close()
        for channel in channels:
            await channel.close()
    result = {"records": deliveries.records, "stale_not_found": subs.stale_not_found, "error": error}
    print(json.dumps(result), flush=True)


class RemoteSubscribers:
    """The latency measurement's subscribers spread over child processes (`subscriber_process`), so that
    receiving 100,000 deliveries/s neither delays the publisher's open-loop schedule nor queues behind it."""

    def __init__(self, target: Target, processes: list[asyncio.subprocess.Process]) -> None:
        self._target = target
        self._processes = processes

    @classmethod
    async def start(cls, target: Target, job: str, plan: Plan, processes: int) -> RemoteSubscribers:
        env = {**os.environ, TOKEN_ENV: target.metadata[0][1].removeprefix("Bearer ")}
        counts = [
            plan.subscribers // processes + (i < plan.subscribers % processes) for i in range(processes)
        ]
        children = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                str(SCRIPT),
                "--subscriber-process",
                str(target.child.port),
                job,
                str(count),
                str(plan.tick_events),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
            )
            for count in counts
        ]
        remote = cls(target, children)
        try:
            for child in children:
                assert child.stdout is not None
                line = await asyncio.wait_for(child.stdout.readline(), START_TIMEOUT_S)
                if line.strip() != b"ready":
                    raise RuntimeError(f"{target.name}: a subscriber process did not start: {line[:500]!r}")
        except BaseException:
            await remote.close()
            raise
        return remote

    async def finish(self, final_producer_seq: int) -> list[float]:
        """The records of every process, once each has drained up to `final_producer_seq`."""
        records: list[float] = []
        for child in self._processes:
            assert child.stdin is not None
            child.stdin.write(f"end {final_producer_seq}\n".encode())
            await child.stdin.drain()
        for child in self._processes:
            assert child.stdout is not None
            out = await asyncio.wait_for(child.stdout.read(), DRAIN_TIMEOUT_S + START_TIMEOUT_S)
            await child.wait()
            result = json.loads(out or b"{}")
            self._target.stale_not_found += result.get("stale_not_found", 0)
            if result.get("error") or "records" not in result:
                raise RuntimeError(f"{self._target.name}: a subscriber failed: {result.get('error')}")
            records.extend(result["records"])
        return records

    async def close(self) -> None:
        for child in self._processes:
            if child.returncode is None:
                child.kill()
                await child.wait()


def summarize(
    records: Sequence[float], window_us: tuple[float, float], expected: int, sent_in_window: int, plan: Plan
) -> LatencyResult:
    low, high = window_us
    first_quarter, last_quarter = low + (high - low) / 4, high - (high - low) / 4
    latencies_us: list[float] = []
    early_us: list[float] = []
    late_us: list[float] = []
    to_stamp_us: list[float] = []
    from_stamp_us: list[float] = []
    for i in range(0, len(records), 4):
        sent_us, stamp_us, received_us, count = records[i : i + 4]
        if not low <= sent_us < high:
            continue
        latency = [received_us - sent_us] * int(count)
        latencies_us.extend(latency)
        if sent_us < first_quarter:
            early_us.extend(latency)
        elif sent_us >= last_quarter:
            late_us.extend(latency)
        to_stamp_us.append(stamp_us - sent_us)  # one sample per run of a publish's events per subscriber
        from_stamp_us.append(received_us - stamp_us)
    delivered = len(latencies_us)
    ordered = sorted(latencies_us) + [math.inf] * max(0, expected - delivered)  # lost: slower than any
    return LatencyResult(
        p50_ms=percentile(ordered, 0.50) / 1000,
        p99_ms=percentile(ordered, 0.99) / 1000,
        offered_per_s=sent_in_window / plan.latency_s,
        delivered_fraction=delivered / expected if expected else math.nan,
        first_quarter_p50_ms=percentile(sorted(early_us), 0.50) / 1000,
        last_quarter_p50_ms=percentile(sorted(late_us), 0.50) / 1000,
        to_stamp_ms=p50_p99_ms(to_stamp_us),
        from_stamp_ms=p50_p99_ms(from_stamp_us),
    )


async def measure_latency(target: Target, plan: Plan, run: str) -> LatencyResult:
    """Publish-to-deliver latency at a fixed offered load (open loop) with `plan.subscribers` subscribers,
    in `plan.subscriber_processes` child processes (0: in this process, beside the publisher)."""
    job = f"orgs/{ORG}/jobs/{run}-latency"
    deliveries = DeliveryLog(plan.subscribers, plan.tick_events)
    local: Subscribers | None = None
    remote: RemoteSubscribers | None = None
    if plan.subscriber_processes:
        await target.publish(pb.PublishRequest(job=job, events=[realistic_event(1, "")]))
        remote = await RemoteSubscribers.start(target, job, plan, plan.subscriber_processes)
    else:
        local = await subscribed(target, job, plan, deliveries.on_batch)
    inflight: set[asyncio.Task[int]] = set()
    try:
        start = time.perf_counter()
        end = start + plan.warmup_s + plan.latency_s
        window_us = ((start + plan.warmup_s) * 1e6, end * 1e6)
        sent_in_window = 0
        seq = plan.tick_events  # batch k holds producer seqs [k * tick_events, (k + 1) * tick_events)
        tick = 0
        while (moment := start + tick * plan.tick_s) < end:
            await sleep_until(moment)
            sent_us = time.perf_counter() * 1e6
            request = timed_batch(job, "bench/latency", seq, plan.tick_events, sent_us)
            task = asyncio.create_task(target.publish(request))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            if window_us[0] <= sent_us < window_us[1]:
                sent_in_window += plan.tick_events
            seq += plan.tick_events
            tick += 1
        await asyncio.gather(*inflight)
        final = seq - 1
        if remote is not None:
            records = await remote.finish(final)
        else:
            assert local is not None
            await deliveries.drained(final, DRAIN_TIMEOUT_S)
            if (failed := local.failure()) is not None:
                raise RuntimeError(f"{target.name}: a subscriber failed: {failed!r}")
            records = deliveries.records
        expected = sent_in_window * plan.subscribers
        return summarize(records, window_us, expected, sent_in_window, plan)
    finally:
        for task in inflight:
            task.cancel()
        if local is not None:
            await local.close()
        if remote is not None:
            await remote.close()


@dataclass
class CpuUse:
    """Cores kept busy during one measurement, by the client (this process) and by the server."""

    client: float
    server: float

    def __str__(self) -> str:
        return f"{self.client:.2f}/{self.server:.2f}"


def client_cpu_seconds() -> float:
    """This process and its children that ended (the latency measurement's subscriber processes; the
    servers end only after the run)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return float(cpu_seconds() + children.ru_utime + children.ru_stime)


async def metered(target: Target, measurement: Awaitable[T]) -> tuple[T, CpuUse]:
    pid = target.child.proc.pid
    wall, client, server = time.perf_counter(), client_cpu_seconds(), cpu_seconds(pid)
    result = await measurement
    elapsed = time.perf_counter() - wall
    return result, CpuUse((client_cpu_seconds() - client) / elapsed, (cpu_seconds(pid) - server) / elapsed)


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


def report(
    results: Results,
    plan: Plan,
    store: str,
    elapsed_s: float,
    targets: Sequence[Target],
    scenarios: Sequence[str] = SCENARIOS,
) -> str:
    ingest = both(results.ingest, lambda r: r)
    fanout = both(results.fanout, lambda r: r.deliveries_per_s)
    p50 = both(results.latency, lambda r: r.p50_ms)
    p99 = both(results.latency, lambda r: r.p99_ms)
    fan_ratio = fanout[0] / fanout[1] if fanout[1] else math.nan
    subs, rate = plan.subscribers, plan.offered_rate

    def row(label: str, pair: tuple[float, float], goal: str, digits: int = 0) -> tuple[str, ...]:
        return (label, number(pair[0], digits), number(pair[1], digits), ratio(*pair), goal)

    by_scenario = {
        "ingest": [
            row(
                f"ingest, {plan.publishers} publishers x {plan.batch} (events/s)",
                ingest,
                f">= 20,000/s: {verdict(ingest[0], ingest[0] >= 20_000)}",
            )
        ],
        "fan-out": [
            row(
                f"fan-out to {subs} subscribers (deliveries/s)",
                fanout,
                f">= 0.5x baseline: {verdict(fan_ratio, fan_ratio >= 0.5)}",
            )
        ],
        "latency": [
            row(f"latency p50 @ {rate:,} ev/s, {subs} subs (ms)", p50, "-", 1),
            row(
                f"latency p99 @ {rate:,} ev/s, {subs} subs (ms)",
                p99,
                f"<= 50 ms: {verdict(p99[0], p99[0] <= 50)}",
                1,
            ),
        ],
    }
    rows: list[tuple[str, ...]] = [("metric", "tandem events", "baseline (no storage)", "ratio", "goal")]
    for scenario in scenarios:
        rows += by_scenario[scenario]
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
        for name in scenarios
    ]
    notes = {
        "fan-out": [
            f"fan-out: the publisher got {number(published[0])} vs {number(published[1])} events/s "
            f"acknowledged; deliveries still owed at the end {number(owed[0])} vs {number(owed[1])}",
        ],
        "latency": [
            f"latency: offered {number(offered[0])} vs {number(offered[1])} events/s, i.e. {rate * subs:,} "
            f"deliveries/s; delivered {number(delivered[0], 1)}% vs {number(delivered[1], 1)}% of them"
            f" ({plan.subscriber_processes or 'no'} subscriber processes)",
            "latency p50, events sent in the first -> last quarter of the window: " + "; ".join(trend),
            "latency split at the server's receive_time stamp, p50/p99 ms, send -> stamp + stamp -> delivery: "
            + "; ".join(
                f"{name} {number(r.to_stamp_ms[0], 1)}/{number(r.to_stamp_ms[1], 1)}"
                f" + {number(r.from_stamp_ms[0], 1)}/{number(r.from_stamp_ms[1], 1)}"
                for name, r in results.latency.items()
            ),
        ],
    }
    lines += [
        "",
        f"store: {store}; {os.cpu_count()} cores; run took {elapsed_s:.0f} s"
        + ("; --quick: short windows, rough figures" if plan.latency_s == QUICK.latency_s else ""),
        *(note for scenario in scenarios for note in notes.get(scenario, ())),
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


async def run_benchmark(store: str, plan: Plan, scenarios: Sequence[str] = SCENARIOS) -> int:
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
            measurements: dict[str, tuple[Callable[[Target, Plan, str], Awaitable[Any]], dict[str, Any]]] = {
                "ingest": (measure_ingest, results.ingest),
                "fan-out": (measure_fanout, results.fanout),
                "latency": (measure_latency, results.latency),
            }
            for scenario in scenarios:
                measure, into = measurements[scenario]
                for target in targets:
                    job = f"{run}-{target.name[0]}"
                    await results.record(scenario, target, measure(target, plan, job), into)
        finally:
            for target in targets:
                await target.close()
    store_name = redacted(store_url) or "sqlite in a temporary folder (synchronous=FULL)"
    print()
    print(report(results, plan, store_name, time.perf_counter() - started, targets, scenarios))
    return 1 if results.failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--store", default="sqlite", help="sqlite (default, a temporary file) or a postgresql:// URL"
    )
    parser.add_argument("--quick", action="store_true", help="short windows for a smoke run (< 30 s)")
    parser.add_argument(
        "--only",
        action="append",
        choices=SCENARIOS,
        help="run only this measurement (repeatable); the others' cells read 'error'",
    )
    parser.add_argument(
        "--subscriber-processes",
        type=int,
        default=FULL.subscriber_processes,
        metavar="N",
        help="latency: spread the subscribers over N child processes; 0 keeps them in the measuring process"
        f" (default {FULL.subscriber_processes})",
    )
    parser.add_argument("--subscriber-process", nargs=4, metavar="ARG", help=argparse.SUPPRESS)
    parser.add_argument("--serve-baseline", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_baseline is not None:
        asyncio.run(serve_baseline(args.serve_baseline))
        return 0
    if args.subscriber_process is not None:
        port, job, count, per_tick = args.subscriber_process
        asyncio.run(subscriber_process(int(port), job, int(count), int(per_tick)))
        return 0
    if args.subscriber_processes < 0:
        parser.error("--subscriber-processes takes 0 or more")
    if args.store != "sqlite" and not args.store.startswith(("postgresql://", "postgres://")):
        parser.error("--store takes sqlite or a postgresql:// URL")
    # Ctrl-C and SIGTERM (also when started in the background, where SIGINT arrives ignored) unwind through
    # the `finally` blocks, which stop the child servers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        scenarios = [s for s in SCENARIOS if s in (args.only or SCENARIOS)]
        plan = dataclasses.replace(
            QUICK if args.quick else FULL, subscriber_processes=args.subscriber_processes
        )
        return asyncio.run(run_benchmark(args.store, plan, scenarios))
    except KeyboardInterrupt:
        print("interrupted; the child servers were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
