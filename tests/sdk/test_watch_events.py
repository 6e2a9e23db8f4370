"""A watch of a job's events survives the server restarting and the connection being cut: every event
arrives exactly once, in seq order. Against the real events service (the stream the gateway forwards), through
a real TCP connection that the test cuts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tandem.events.v1 import event_pb2, events_service_pb2_grpc
from tandem.events.v1 import events_service_pb2 as pb
from tandem.scheduler.v1 import job_pb2

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.settings import Settings
from mesh.status import RpcError
from tandem_client.events import Cursor, resume_events
from tests.support.mesh import mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(60)
JOB = "orgs/acme/jobs/run-1"


class CuttableProxy:
    """A TCP forwarder in front of a server whose open connections the test can cut at once."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()
        self._writers.discard(writer)

    def cut(self) -> int:
        cut = len(self._writers)
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        return cut

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def subscriber(address: str, settings: Settings, token: str) -> tuple[Any, Any]:
    channel = open_channel(address, settings, token=token)
    stub: Any = events_service_pb2_grpc.EventServiceStub(channel)

    def open_stream(after_seq: int) -> AsyncIterator[Any]:
        stream: AsyncIterator[Any] = stub.Subscribe(
            pb.SubscribeRequest(job=JOB, after_seq=after_seq, end_when_terminal=True)
        )
        return stream

    return channel, open_stream


async def publish(address: str, settings: Settings, token: str, *messages: str, close: bool = False) -> None:
    async with open_channel(address, settings, token=token) as channel:
        stub = events_service_pb2_grpc.EventServiceStub(channel)
        if messages:
            events = [event_pb2.Event(type="log", message=m) for m in messages]
            await stub.Publish(pb.PublishRequest(job=JOB, events=events))
        if close:
            await stub.CloseJobStream(
                pb.CloseJobStreamRequest(
                    job=JOB, state_changed=event_pb2.JobStateChanged(state=job_pb2.Job.STATE_SUCCEEDED)
                )
            )


async def wait_for(condition: Any, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("the condition never held")


async def collect(open_stream: Any, cursor: Cursor, seen: list[event_pb2.Event]) -> None:
    async for event in resume_events(open_stream, cursor, reconnect_for_s=30):
        seen.append(event)


async def test_a_watch_resumes_after_the_server_restarts(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    seen: list[event_pb2.Event] = []
    cursor = Cursor()
    async with running_mesh(settings, services=["events"]) as first:
        token = TokenSigner(load_signing_key("", settings.state_dir)).issue("service", "scheduler")
        address = first.address("events")
        await publish(address, settings, token, *(f"before {i}" for i in range(5)))
        channel, open_stream = subscriber(address, settings, token)
        watcher = asyncio.create_task(collect(open_stream, cursor, seen))
        await wait_for(lambda: len(seen) == 5)
    # The server is gone: the watch keeps retrying from seq 5 until it is back, on the same port.
    await wait_for(lambda: cursor.reconnects >= 1)
    async with running_mesh(settings, services=["events"]) as second:
        assert second.address("events") == address
        await publish(address, settings, token, *(f"after {i}" for i in range(5)), close=True)
        await asyncio.wait_for(watcher, 30)
    await channel.close()
    assert [e.seq for e in seen] == list(range(1, 12))
    assert [e.message for e in seen[:10]] == [f"before {i}" for i in range(5)] + [
        f"after {i}" for i in range(5)
    ]
    assert seen[-1].job_state_changed.state == job_pb2.Job.STATE_SUCCEEDED
    assert cursor.seq == 11
    assert cursor.terminal_state == job_pb2.Job.STATE_SUCCEEDED


async def test_a_watch_resumes_after_the_connection_is_cut(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    seen: list[event_pb2.Event] = []
    cursor = Cursor()
    async with running_mesh(settings, services=["events"]) as mesh:
        token = TokenSigner(load_signing_key("", settings.state_dir)).issue("service", "scheduler")
        address = mesh.address("events")
        proxy = CuttableProxy(address)
        await proxy.start()
        channel, open_stream = subscriber(proxy.address, settings, token)
        watcher: asyncio.Task[None] | None = None
        for round_ in range(3):
            await publish(address, settings, token, *(f"r{round_} e{i}" for i in range(4)))
            watcher = watcher or asyncio.create_task(collect(open_stream, cursor, seen))
            await wait_for(lambda r=round_: len(seen) == 5 * r + 4)
            assert proxy.cut() >= 1
            # Published while the watch is disconnected: it must still see these, once.
            await publish(address, settings, token, f"r{round_} while cut")
            await wait_for(lambda r=round_: len(seen) == 5 * (r + 1))
        await publish(address, settings, token, close=True)
        assert watcher is not None
        await asyncio.wait_for(watcher, 30)
        await channel.close()
        await proxy.close()
    assert [e.seq for e in seen] == list(range(1, 17))
    assert cursor.reconnects >= 3
    assert [e.message for e in seen[:5]] == ["r0 e0", "r0 e1", "r0 e2", "r0 e3", "r0 while cut"]


async def test_a_watch_from_a_cursor_skips_what_was_seen(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    async with running_mesh(settings, services=["events"]) as mesh:
        token = TokenSigner(load_signing_key("", settings.state_dir)).issue("service", "scheduler")
        address = mesh.address("events")
        await publish(address, settings, token, *(str(i) for i in range(6)), close=True)
        channel, open_stream = subscriber(address, settings, token)
        seen: list[event_pb2.Event] = []
        await collect(open_stream, Cursor(seq=4), seen)
        await channel.close()
    assert [e.seq for e in seen] == [5, 6, 7]


async def test_a_watch_waits_for_the_first_event_of_a_job_that_exists(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    async with running_mesh(settings, services=["events"]) as mesh:
        token = TokenSigner(load_signing_key("", settings.state_dir)).issue("service", "scheduler")
        address = mesh.address("events")
        channel, open_stream = subscriber(address, settings, token)
        asked: list[bool] = []

        async def exists() -> bool:
            asked.append(True)
            return True

        seen: list[event_pb2.Event] = []
        cursor = Cursor()

        async def watch() -> None:
            async for event in resume_events(open_stream, cursor, log_pending=exists):
                seen.append(event)

        watcher = asyncio.create_task(watch())
        await wait_for(lambda: bool(asked))  # NOT_FOUND was answered: no event log yet
        await publish(address, settings, token, "first", close=True)
        await asyncio.wait_for(watcher, 30)

        async def absent() -> bool:
            return False

        with pytest.raises(RpcError) as missing:
            async for _ in resume_events(
                lambda seq: open_stream_for(address, settings, token, "orgs/acme/jobs/nope", seq),
                Cursor(),
                log_pending=absent,
            ):
                pass
        await channel.close()
    assert [e.message for e in seen] == ["first", ""]
    assert missing.value.reason == "JOB_NOT_FOUND"


def open_stream_for(
    address: str, settings: Settings, token: str, job: str, after_seq: int
) -> AsyncIterator[Any]:
    async def stream() -> AsyncIterator[Any]:
        async with open_channel(address, settings, token=token) as channel:
            stub: Any = events_service_pb2_grpc.EventServiceStub(channel)
            async for reply in stub.Subscribe(pb.SubscribeRequest(job=job, after_seq=after_seq)):
                yield reply

    return stream()
