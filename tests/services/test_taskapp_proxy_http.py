"""The proxy's HTTP calls to a Task App (`services.taskapp_proxy.rollouts` over its aiohttp session) against
real loopback servers: answer size limits, deadlines, transport failures and their retries, auth refusal,
and what goes on the wire. No gRPC: the runner is domain code."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tandem.taskapp.v1 import rollout_pb2, task_app_pb2

from services.taskapp_proxy.rollouts import Limits, RolloutRunner, http_session
from tests.support import taskapps

pytestmark = pytest.mark.timeout(60)
Kind = rollout_pb2.RolloutError
KEY = "env-key-0a1b2c3d"
MAX_ANSWER = 4096
LIMITS = Limits(max_concurrency=8, rollout_timeout_s=5.0, max_retries=2)


def answer(correlation: str, padding: str = "") -> dict[str, object]:
    return {
        "trace_correlation_id": correlation,
        "metrics": {"outcome_reward": 1.0, "event_rewards": [], "details": {"pad": padding}},
        "trajectory": {"turns": []},
        "aborted": False,
    }


class App:
    """Behaviour by path suffix of the base URL: /ok, /big, /big-chunked, /hang, /refuse."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []

    async def rollout(self, request: Request) -> Response:
        raw = await request.body()
        self.bodies.append(raw)
        self.headers.append(dict(request.headers))
        correlation = json.loads(raw)["trace_correlation_id"]
        mode = request.path_params["mode"]
        if mode == "big":
            return JSONResponse(answer(correlation, "x" * (2 * MAX_ANSWER)))
        if mode == "big-chunked":

            async def chunks() -> AsyncIterator[bytes]:
                encoded = json.dumps(answer(correlation, "x" * (2 * MAX_ANSWER))).encode()
                for start in range(0, len(encoded), 512):
                    yield encoded[start : start + 512]

            return StreamingResponse(chunks(), media_type="application/json")
        if mode == "hang":
            await asyncio.sleep(30)
        if mode == "refuse":
            return JSONResponse({"error": {"code": "UNAUTHENTICATED", "message": "no"}}, 401)
        return JSONResponse(answer(correlation, "y" * (MAX_ANSWER // 2)))

    def asgi(self) -> Starlette:
        return Starlette(routes=[Route("/{mode}/rollout", self.rollout, methods=["POST"])])


@contextlib.asynccontextmanager
async def broken_server(reply: bytes) -> AsyncIterator[str]:
    """A raw TCP server that reads a request, writes `reply` and hangs up: a cut or garbled answer."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
async def runner() -> AsyncIterator[RolloutRunner]:
    async def keys(secret: str) -> str:
        return KEY

    session = http_session()
    try:
        yield RolloutRunner(session, keys, max_response_bytes=MAX_ANSWER, breaker_failures=100)
    finally:
        await session.close()


def app_at(url: str) -> task_app_pb2.TaskApp:
    return task_app_pb2.TaskApp(name="orgs/acme/taskApps/t", base_url=url, secret_name="orgs/acme/secrets/k")


def spec(correlation: str, max_seconds: int = 0) -> rollout_pb2.RolloutSpec:
    return rollout_pb2.RolloutSpec(
        trace_correlation_id=correlation,
        env=rollout_pb2.RolloutEnv(seed=3),
        limits=rollout_pb2.RolloutLimits(max_seconds=max_seconds),
        policy=rollout_pb2.RolloutPolicy(
            config=rollout_pb2.RolloutPolicyConfig(model="policy", inference_url="http://127.0.0.1:9/v1/ep")
        ),
    )


async def test_an_answer_within_the_limit_is_parsed_and_the_call_carries_key_and_id(
    runner: RolloutRunner,
) -> None:
    app = App()
    async with taskapps.serve_app(app.asgi()) as url:
        result = await runner.rollout(app_at(f"{url}/ok/"), LIMITS, spec("ep-ok"))
    assert not result.HasField("error"), result.error.message
    assert (result.trace_correlation_id, result.metrics.outcome_reward, result.attempts) == ("ep-ok", 1.0, 1)
    headers = app.headers[-1]
    assert headers["x-api-key"] == KEY
    assert headers["x-trace-correlation-id"] == "ep-ok"
    assert headers["content-type"] == "application/json"
    sent = json.loads(app.bodies[-1])
    assert (sent["mode"], sent["env"]["seed"]) == ("rl", 3)
    assert b": " not in app.bodies[-1]  # compact JSON, as before


@pytest.mark.parametrize("mode", ["big", "big-chunked"])
async def test_an_oversized_answer_is_refused(runner: RolloutRunner, mode: str) -> None:
    async with taskapps.serve_app(App().asgi()) as url:
        result = await runner.rollout(app_at(f"{url}/{mode}"), LIMITS, spec(f"ep-{mode}"))
        after = await runner.rollout(app_at(f"{url}/ok"), LIMITS, spec(f"ep-{mode}-after"))
    assert result.error.kind == Kind.KIND_RESPONSE_TOO_LARGE
    assert str(MAX_ANSWER) in result.error.message
    assert not result.error.retryable and result.attempts == 1
    assert not after.HasField("error")  # the pooled session is still usable


async def test_a_hanging_app_times_out_at_the_shorter_deadline_without_a_retry(runner: RolloutRunner) -> None:
    app = App()
    async with taskapps.serve_app(app.asgi()) as url:
        result = await runner.rollout(app_at(f"{url}/hang"), LIMITS, spec("ep-hang", max_seconds=1))
    assert result.error.kind == Kind.KIND_TIMEOUT
    assert "1.0s" in result.error.message  # limits.max_seconds, shorter than the app's 5 s
    assert result.attempts == 1 and len(app.bodies) == 1


@pytest.mark.parametrize(
    "reply",
    [
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{"trace',
        b"this is not HTTP\r\n\r\n",
        b"",
    ],
    ids=["cut-short", "garbled", "hung-up"],
)
async def test_transport_failures_are_unreachable_and_retried(runner: RolloutRunner, reply: bytes) -> None:
    async with broken_server(reply) as url:
        result = await runner.rollout(app_at(url), LIMITS, spec("ep-broken"))
    assert result.error.kind == Kind.KIND_UNREACHABLE
    assert result.error.retryable
    assert result.attempts == LIMITS.max_retries + 1


async def test_nothing_listening_is_unreachable(runner: RolloutRunner) -> None:
    result = await runner.rollout(app_at("http://127.0.0.1:9"), LIMITS, spec("ep-down"))
    assert result.error.kind == Kind.KIND_UNREACHABLE
    assert result.attempts == LIMITS.max_retries + 1


async def test_a_refused_key_is_auth_rejected_and_not_retried(runner: RolloutRunner) -> None:
    app = App()
    async with taskapps.serve_app(app.asgi()) as url:
        result = await runner.rollout(app_at(f"{url}/refuse"), LIMITS, spec("ep-refused"))
    assert (result.error.kind, result.error.http_status, result.attempts) == (Kind.KIND_AUTH_REJECTED, 401, 1)
    assert KEY not in result.error.message
