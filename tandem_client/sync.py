"""`Client`: the blocking form of `AsyncClient`, for scripts and notebooks.

    with Client() as tandem:                     # TANDEM_GATEWAY, TANDEM_API_KEY
        job = tandem.create_job(rl_config_toml=open("job.toml").read())
        for event in tandem.watch_events(job.name):
            print(event.seq, event.type, event.message)

It runs one `AsyncClient` on an event loop in a background thread it owns, so both forms share one
implementation (deadlines, typed errors, resuming watches). Methods take the same arguments and return the
same messages; `watch_events` and `stream_job_logs` are plain iterators.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from tandem_client.aio import DEFAULT_DEADLINE_S, AsyncClient

P = ParamSpec("P")
R = TypeVar("R")


def _blocking(
    method: Callable[Concatenate[AsyncClient, P], Awaitable[R]],
) -> Callable[Concatenate[Client, P], R]:
    def call(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(method(self._client, *args, **kwargs))

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


def _streaming(
    method: Callable[Concatenate[AsyncClient, P], AsyncIterator[R]],
) -> Callable[Concatenate[Client, P], Iterator[R]]:
    def call(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[R]:
        return self._iterate(method(self._client, *args, **kwargs))

    call.__name__ = method.__name__
    call.__doc__ = f"As `AsyncClient.{method.__name__}`, as a plain iterator; closing it ends the stream."
    return call


class Client:
    """A blocking connection to one Tandem gateway; arguments as `AsyncClient`. Close it, or use `with`."""

    def __init__(
        self,
        gateway: str | None = None,
        api_key: str | None = None,
        *,
        org: str | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        tls: bool | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-client", daemon=True)
        self._thread.start()

        async def make() -> AsyncClient:  # the channel belongs to the loop it is created on
            return AsyncClient(gateway, api_key, org=org, deadline_s=deadline_s, tls=tls, ca_file=ca_file)

        self._client = self._run(make())
        self.gateway = self._client.gateway

    def _run(self, coroutine: Awaitable[R]) -> R:
        async def wrapped() -> R:
            return await coroutine

        future = asyncio.run_coroutine_threadsafe(wrapped(), self._loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    org = _blocking(AsyncClient.org)
    job_name = _blocking(AsyncClient.job_name)
    get_server_info = _blocking(AsyncClient.get_server_info)
    create_org = _blocking(AsyncClient.create_org)
    get_org = _blocking(AsyncClient.get_org)
    create_api_key = _blocking(AsyncClient.create_api_key)
    list_api_keys = _blocking(AsyncClient.list_api_keys)
    revoke_api_key = _blocking(AsyncClient.revoke_api_key)
    get_public_key = _blocking(AsyncClient.get_public_key)
    put_secret = _blocking(AsyncClient.put_secret)
    list_secrets = _blocking(AsyncClient.list_secrets)
    delete_secret = _blocking(AsyncClient.delete_secret)
    register_task_app = _blocking(AsyncClient.register_task_app)
    check_task_app = _blocking(AsyncClient.check_task_app)
    list_task_apps = _blocking(AsyncClient.list_task_apps)
    get_task_app = _blocking(AsyncClient.get_task_app)
    delete_task_app = _blocking(AsyncClient.delete_task_app)
    create_job = _blocking(AsyncClient.create_job)
    create_rl_job = _blocking(AsyncClient.create_rl_job)
    get_job = _blocking(AsyncClient.get_job)
    list_jobs = _blocking(AsyncClient.list_jobs)
    cancel_job = _blocking(AsyncClient.cancel_job)
    list_events = _blocking(AsyncClient.list_events)
    list_metrics = _blocking(AsyncClient.list_metrics)
    list_checkpoints = _blocking(AsyncClient.list_checkpoints)
    infer = _blocking(AsyncClient.infer)
    list_inference_workers = _blocking(AsyncClient.list_inference_workers)
    stop_inference_worker = _blocking(AsyncClient.stop_inference_worker)

    watch_events = _streaming(AsyncClient.watch_events)
    stream_job_logs = _streaming(AsyncClient.stream_job_logs)

    def _iterate(self, stream: AsyncIterator[R]) -> Iterator[R]:
        try:
            while True:
                try:
                    yield self._run(anext(stream))
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                closing = getattr(stream, "aclose", None)
                if closing is not None:
                    self._run(closing())


__all__ = ["Client"]
