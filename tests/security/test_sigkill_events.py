"""Fault injection for the events service: SIGKILL the process in the middle of a publish storm with live
subscribers, restart it on the same port and state, and check the etcd-watch guarantees with a checker.

Publishers are idempotent producers (producer_id + producer_seq) that retry the same batch until it is
acknowledged; subscribers resume with after_seq = the last seq they saw. Afterwards every job's log must
be exactly 1..last_seq, every acknowledged event must be in it exactly once at its acknowledged seq, no
event may appear twice (a batch in flight at the kill and retried after the restart included), and every
subscriber must have seen exactly 1..last_seq in order despite its reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from tandem.events.v1 import event_pb2, events_service_pb2_grpc
from tandem.events.v1 import events_service_pb2 as pb

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.settings import Settings
from mesh.status import RpcError
from tests.support.mesh import mesh_settings
from tests.support.processes import ROOT, mesh_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SERVICE = "tandem.events.v1.EventService"
JOBS = ("orgs/acme/jobs/storm-a", "orgs/acme/jobs/storm-b")
PRODUCERS = 4
SUBSCRIBERS_PER_JOB = 3
STORM_BEFORE_KILL_S = 1.5
STORM_AFTER_RESTART_S = 1.5
STARTUP_TIMEOUT_S = 30.0
RETRY_DEADLINE_S = 30.0
CATCH_UP_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = 5.0
# What a client sees while the server is dead or restarting; anything else is a real failure.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class EventsProcess:
    """`python -m services.events` as a child process with a fixed port, state dir and mesh key."""

    def __init__(self, env: dict[str, str], port: int, logs: Path) -> None:
        self.env = env
        self.port = port
        self.logs = logs
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.logs / f"events-{self.starts}.log"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.starts += 1
        with self.log_path.open("wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.events"],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    async def wait_serving(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        while True:
            assert self.proc is not None
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, f"not SERVING in {STARTUP_TIMEOUT_S}s"
            with contextlib.suppress(grpc.aio.AioRpcError):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
                    check = channel.unary_unary(
                        "/grpc.health.v1.Health/Check",
                        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                        response_deserializer=health_pb2.HealthCheckResponse.FromString,
                    )
                    reply = await check(request, timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no drain, no shutdown hooks
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Link:
    """One client's channel; reopened after a failure so reconnecting does not wait out grpc's backoff."""

    def __init__(self, target: str, settings: Settings, token: str) -> None:
        self._target, self._settings, self._token = target, settings, token
        self.channel = open_channel(target, settings, token=token)
        self.stub = events_service_pb2_grpc.EventServiceStub(self.channel)

    async def reset(self) -> None:
        await self.channel.close()
        self.channel = open_channel(self._target, self._settings, token=self._token)
        self.stub = events_service_pb2_grpc.EventServiceStub(self.channel)


@dataclass
class Tally:
    """What the publishers were told: every acknowledged (producer, producer_seq) and its (job, seq)."""

    acked: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    history: list[tuple[str, list[event_pb2.Event]]] = field(default_factory=list)
    batches: int = 0
    retries: int = 0
    retried_batches: int = 0
    duplicates_on_retry: int = 0
    codes: Counter[str] = field(default_factory=Counter)

    def record(self, job: str, batch: list[event_pb2.Event], reply: pb.PublishResponse) -> None:
        assert len(reply.seqs) == len(batch), (len(reply.seqs), len(batch))
        for event, seq in zip(batch, reply.seqs, strict=True):
            key = (event.producer_id, event.producer_seq)
            assert key not in self.acked, f"{key} acknowledged twice"
            self.acked[key] = (job, seq)
        self.history.append((job, batch))
        self.batches += 1


@dataclass
class Watch:
    """Every seq one subscriber of `job` received, in arrival order, across reconnects."""

    job: str
    seen: list[int] = field(default_factory=list)
    reconnects: int = 0
    codes: Counter[str] = field(default_factory=Counter)


async def publish_until_acked(
    link: Link, job: str, batch: list[event_pb2.Event], tally: Tally
) -> pb.PublishResponse:
    """Publish the same batch (same producer ids and seqs) until the service acknowledges it."""
    deadline = time.monotonic() + RETRY_DEADLINE_S
    failures = 0
    while True:
        try:
            reply = await link.stub.Publish(pb.PublishRequest(job=job, events=batch), timeout=CALL_TIMEOUT_S)
        except RpcError as error:
            if error.code not in TRANSIENT or time.monotonic() > deadline:
                raise
            tally.codes[error.code.name] += 1
            tally.retries += 1
            failures += 1
            await asyncio.sleep(min(0.02 * 2**failures, 0.3))
            await link.reset()
            continue
        if failures:
            tally.retried_batches += 1
            tally.duplicates_on_retry += reply.duplicate_count
        return reply


async def publisher(index: int, link: Link, stop: asyncio.Event, tally: Tally) -> None:
    producer = f"producer-{index}"
    job = JOBS[index % len(JOBS)]
    next_seq = 1
    number = 0
    while not stop.is_set():
        size = 1 + (number * 7 + index * 5) % 20  # 1..20, varied, deterministic
        number += 1
        batch = [
            event_pb2.Event(type="log", message=f"{producer}:{p}", producer_id=producer, producer_seq=p)
            for p in range(next_seq, next_seq + size)
        ]
        next_seq += size
        tally.record(job, batch, await publish_until_acked(link, job, batch, tally))


async def subscriber(link: Link, watch: Watch, deadline: float) -> None:
    """Tail the job; when the stream breaks, resume after the last seq seen."""
    while True:
        after = watch.seen[-1] if watch.seen else 0
        stream = link.stub.Subscribe(pb.SubscribeRequest(job=watch.job, after_seq=after))
        try:
            async for reply in stream:
                watch.seen.extend(e.seq for e in reply.events.events)
        except RpcError as error:
            if error.code not in TRANSIENT or time.monotonic() > deadline:
                raise
            watch.codes[error.code.name] += 1
        finally:
            stream.cancel()
        watch.reconnects += 1
        await asyncio.sleep(0.05)
        await link.reset()


async def list_all(stub: events_service_pb2_grpc.EventServiceAsyncStub, job: str) -> list[event_pb2.Event]:
    events: list[event_pb2.Event] = []
    token = ""
    while True:
        reply = await stub.ListEvents(pb.ListEventsRequest(job=job, page_size=300, page_token=token))
        events.extend(reply.events)
        token = reply.next_page_token
        if not token:
            return events


async def last_seqs(stub: events_service_pb2_grpc.EventServiceAsyncStub) -> dict[str, int]:
    infos = [await stub.GetJobStreamInfo(pb.GetJobStreamInfoRequest(job=job)) for job in JOBS]
    return {info.info.job: info.info.last_seq for info in infos}


async def test_acknowledged_events_survive_sigkill_mid_storm(tmp_path: Path) -> None:
    started = time.monotonic()
    state = tmp_path / "state"
    env, ports = mesh_env(state)
    seed = secrets.token_hex(32)
    env["TANDEM_MESH_KEY"] = seed
    server = EventsProcess(env, ports["events"], tmp_path)
    links: list[Link] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        server.start()
        await server.wait_serving()
        target = f"127.0.0.1:{server.port}"
        settings = mesh_settings(tmp_path)
        token = TokenSigner(load_signing_key(seed, state)).issue("service", "scheduler", ttl_s=600)

        def link() -> Link:
            links.append(Link(target, settings, token))
            return links[-1]

        control = link()
        tally = Tally()
        for job in JOBS:  # open both logs before subscribers attach
            opener = f"opener-{job.rsplit('/', 1)[-1]}"
            first = [event_pb2.Event(type="log", message=f"{opener}:1", producer_id=opener, producer_seq=1)]
            tally.record(job, first, await control.stub.Publish(pb.PublishRequest(job=job, events=first)))

        watches = [Watch(job) for job in JOBS for _ in range(SUBSCRIBERS_PER_JOB)]
        stop = asyncio.Event()
        hard_deadline = time.monotonic() + 90
        readers = [asyncio.create_task(subscriber(link(), w, hard_deadline)) for w in watches]
        writers = [asyncio.create_task(publisher(i, link(), stop, tally)) for i in range(PRODUCERS)]
        tasks = readers + writers

        await asyncio.sleep(STORM_BEFORE_KILL_S)
        acked_at_kill, batches_at_kill = len(tally.acked), len(tally.history)
        server.kill()
        killed = time.monotonic()
        server.start()
        await server.wait_serving()
        downtime = time.monotonic() - killed
        await asyncio.sleep(STORM_AFTER_RESTART_S)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*writers), RETRY_DEADLINE_S + 10)

        # A retry whose acknowledgement the crash swallowed: the last batch each producer had acknowledged
        # before the kill, sent again to the restarted process, is answered with its original seqs.
        replayed = {batch[0].producer_id: (job, batch) for job, batch in tally.history[:batches_at_kill]}
        for job, batch in replayed.values():
            again = await control.stub.Publish(pb.PublishRequest(job=job, events=batch))
            assert again.duplicate_count == len(batch), (job, again.duplicate_count, len(batch))
            assert list(again.seqs) == [tally.acked[(e.producer_id, e.producer_seq)][1] for e in batch]

        last = await last_seqs(control.stub)
        catch_up = time.monotonic() + CATCH_UP_TIMEOUT_S
        while not all(max(w.seen, default=0) >= last[w.job] for w in watches):
            failed = [t for t in readers if t.done()]
            if failed:
                failed[0].result()  # a subscriber gave up: raise its error
            assert time.monotonic() < catch_up, {w.job: max(w.seen, default=0) for w in watches}
            await asyncio.sleep(0.05)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)

        # The storm really straddled the crash.
        assert 0 < acked_at_kill < len(tally.acked), (acked_at_kill, len(tally.acked))
        assert tally.retries > 0, "no publish failed: the kill did not interrupt the storm"
        assert all(w.reconnects >= 1 for w in watches), [w.reconnects for w in watches]

        # 1. Each log is exactly 1..last_seq: ordered, no gaps, no duplicates.
        logs = {job: await list_all(control.stub, job) for job in JOBS}
        for job, events in logs.items():
            assert [e.seq for e in events] == list(range(1, last[job] + 1)), job
            assert all(e.job == job for e in events)

        # 2. Every acknowledged event is in the log exactly once, at the seq it was acknowledged with.
        by_seq = {(job, e.seq): e for job, events in logs.items() for e in events}
        messages = Counter(e.message for events in logs.values() for e in events)
        for (producer, producer_seq), (job, seq) in tally.acked.items():
            expected = f"{producer}:{producer_seq}"
            stored = by_seq.get((job, seq))
            assert stored is not None, f"acknowledged {expected} at {job}#{seq} is missing"
            assert stored.message == expected, f"{job}#{seq} holds {stored.message}, acknowledged {expected}"
            assert messages[expected] == 1, f"{expected} stored {messages[expected]} times"

        # 3. Nothing stored twice or unacknowledged: a batch in flight at the kill, retried, is stored once.
        stored_keys = Counter(
            (job, e.producer_id, e.producer_seq) for job, events in logs.items() for e in events
        )
        assert max(stored_keys.values()) == 1, [k for k, n in stored_keys.items() if n > 1][:10]
        assert sum(len(events) for events in logs.values()) == len(tally.acked)
        for producer in {name for name, _ in tally.acked}:
            order = sorted((p, seq) for (name, p), (_, seq) in tally.acked.items() if name == producer)
            assert [seq for _, seq in order] == sorted(seq for _, seq in order), f"{producer} reordered"

        # 4. Every subscriber saw the complete sequence, in order, once, across its reconnects.
        for index, watch in enumerate(watches):
            expected_seqs = list(range(1, last[watch.job] + 1))
            assert watch.seen == expected_seqs, (
                index,
                watch.job,
                len(watch.seen),
                last[watch.job],
                [s for s, n in Counter(watch.seen).items() if n > 1][:10],
            )

        print(
            f"\nevents-crash: acknowledged={len(tally.acked)} (at kill {acked_at_kill})"
            f" batches={tally.batches} failed_attempts={tally.retries} {dict(tally.codes)}"
            f" retried_batches={tally.retried_batches} duplicates_on_retry={tally.duplicates_on_retry}"
            f" last_seqs={last} subscriber_reconnects={[w.reconnects for w in watches]}"
            f" downtime={downtime:.2f}s runtime={time.monotonic() - started:.1f}s"
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for each in links:
            await each.channel.close()
        server.close()
