"""A scriptable Task App for proxy tests: real HTTP on a loopback port (Starlette + uvicorn), behaviour
chosen by the episode's seed, every request recorded; and the repository's example apps served in-thread."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tandem_taskapp import create_app
from tandem_taskapp.serve import load_task_app
from tandem_taskapp.testing import serve_in_thread
from tests.support.postgres import free_port

ROOT = Path(__file__).resolve().parents[2]

OK, FAIL_500, HANG, MALFORMED, NAN_REWARD, WRONG_ID, SLOW, FLAKY = range(8)


@dataclass
class FakeTaskApp:
    key: str
    seen: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    flaky_failures: int = 2
    concurrent: int = 0
    peak_concurrent: int = 0

    async def health(self, request: Request) -> Response:
        return JSONResponse({"healthy": True})

    async def task_info(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": {"code": "unauthorized", "message": "missing or wrong key"}}, 401)
        return JSONResponse({"task": {"name": "fake"}, "seed": int(request.query_params.get("seed", 0))})

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), self.key.encode())

    async def rollout(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": {"code": "unauthorized", "message": "missing or wrong key"}}, 401)
        body = await request.json()
        self.seen.append(body)
        self.headers.append(dict(request.headers))
        seed = int(body["env"].get("seed", 0))
        correlation = body["trace_correlation_id"]
        self.concurrent += 1
        self.peak_concurrent = max(self.peak_concurrent, self.concurrent)
        try:
            if seed == FAIL_500:
                return JSONResponse({"error": "boom"}, 500)
            if seed == HANG:
                await asyncio.sleep(30)
            if seed == MALFORMED:
                return Response(b"{not json", media_type="application/json")
            if seed == NAN_REWARD:
                return Response(
                    b'{"trace_correlation_id": "%s", "metrics": {"outcome_reward": NaN}}'
                    % correlation.encode(),
                    media_type="application/json",
                )
            if seed == WRONG_ID:
                correlation = "someone-else"
            if seed == SLOW:
                await asyncio.sleep(0.3)
            if (
                seed == FLAKY
                and sum(1 for s in self.seen if s["trace_correlation_id"] == body["trace_correlation_id"])
                <= self.flaky_failures
            ):
                return JSONResponse({"error": "try again"}, 503)
            return JSONResponse(
                {
                    "trace_correlation_id": correlation,
                    "metrics": {
                        "outcome_reward": 1.0 if seed != SLOW else 0.5,
                        "event_rewards": [0.25],
                        "details": {"seed": seed},
                    },
                    "trajectory": {
                        "turns": [
                            {
                                "messages": [
                                    {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "yo"},
                                ]
                            }
                        ]
                    },
                    "aborted": False,
                }
            )
        finally:
            self.concurrent -= 1

    def asgi(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health),
                Route("/task_info", self.task_info),
                Route("/rollout", self.rollout, methods=["POST"]),
            ]
        )


@contextlib.asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app on a free loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.contextmanager
def example_app_in_thread(key: str, script: str = "single_turn.py") -> Iterator[str]:
    """An example Task App from examples/taskapps (the single-turn one, which passes every check by default)
    served in this process on a loopback port; yields its base URL."""
    app = load_task_app(str(ROOT / "examples" / "taskapps" / script))
    with serve_in_thread(create_app(app, key)) as url:
        yield url
