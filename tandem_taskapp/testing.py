"""Test helpers: a small OpenAI-compatible fake policy server (until the inference worker exists), and a
way to run any ASGI app on a loopback port in a background thread.

    policy = FakePolicyServer(["7", "3"])          # scripted replies, in order (the last one repeats)
    with serve_in_thread(policy.app) as policy_url, serve_in_thread(create_app(app, key)) as app_url:
        ...  # POST {app_url}/rollout with inference_url=policy.inference_url(policy_url, cid)
        policy.requests[0].headers["x-trace-correlation-id"]

Run it alone for local experiments: `python -m tandem_taskapp.testing --port 9000 --reply A`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

Responder = Callable[[list[dict[str, Any]], dict[str, Any]], str | Awaitable[str]]


@dataclass(frozen=True)
class RecordedRequest:
    """One chat-completion request the fake server received."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = self.body.get("messages", [])
        return msgs

    @property
    def correlation_id(self) -> str | None:
        return self.headers.get("x-trace-correlation-id")


class FakePolicyServer:
    """An OpenAI-compatible chat-completions server with deterministic replies.

    `replies` is one fixed reply, a script (a sequence answered in order, the last one repeated), or a
    function `(messages, body) -> str` (may be async). It serves `POST /v1/chat/completions` and
    `POST /<any prefix>/chat/completions` (so an inference URL that embeds a correlation id works), and
    `GET /v1/models`. Every request is recorded in `requests` (lowercase header names). `status_code`
    other than 200 makes every call fail with that status; `delay` sleeps before each answer."""

    def __init__(
        self,
        replies: str | Sequence[str] | Responder = "ok",
        *,
        model: str = "fake-policy",
        delay: float = 0.0,
        status_code: int = 200,
    ) -> None:
        self.replies = replies
        self.model = model
        self.delay = delay
        self.status_code = status_code
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self.app: ASGIApp = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/{prefix:path}/chat/completions", self._chat, methods=["POST"]),
                Route("/chat/completions", self._chat, methods=["POST"]),
            ]
        )

    @staticmethod
    def inference_url(base_url: str, trace_correlation_id: str) -> str:
        """An inference URL that embeds the correlation id in its path, as the trainer builds them."""
        return f"{base_url.rstrip('/')}/v1/traces/{trace_correlation_id}"

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    def requests_for(self, trace_correlation_id: str) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.correlation_id == trace_correlation_id]

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(
                {"error": {"message": "body is not JSON", "type": "invalid_request_error"}}, 400
            )
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return JSONResponse(
                {"error": {"message": "messages is required", "type": "invalid_request_error"}}, 400
            )
        with self._lock:
            index = len(self.requests)
            self.requests.append(RecordedRequest(request.url.path, dict(request.headers), body))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.status_code != 200:
            return JSONResponse(
                {"error": {"message": "scripted failure", "type": "server_error"}}, self.status_code
            )
        text = await self._reply(index, body)
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        completion_tokens = len(text.split())
        return JSONResponse(
            {
                "id": f"chatcmpl-fake-{index}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", self.model),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    async def _reply(self, index: int, body: dict[str, Any]) -> str:
        replies = self.replies
        if isinstance(replies, str):
            return replies
        if callable(replies):
            out = replies(list(body["messages"]), body)
            if inspect.isawaitable(out):
                out = await out
            return str(out)
        if not replies:
            return ""
        return replies[min(index, len(replies) - 1)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def serve_in_thread(
    app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 10.0
) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread; yields its base URL (`http://host:port`). Port 0
    picks a free one. The server stops when the block ends."""
    sock = socket.socket(
        socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )  # asyncio sets TCP_NODELAY only then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn:{bound_port}"
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tandem_taskapp.testing [--host H] [--port P] [--reply TEXT]...`: serve the fake policy."""
    p = argparse.ArgumentParser(prog="python -m tandem_taskapp.testing", description=FakePolicyServer.__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--reply", action="append", help="a scripted reply; repeat for a script (default: ok)")
    args = p.parse_args(argv)
    replies: str | list[str] = args.reply or "ok"
    uvicorn.run(FakePolicyServer(replies).app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
