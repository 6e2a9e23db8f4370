"""The gateway's OpenAI-compatible HTTP endpoint (`ServerInfo.openai_base_url`): `GET /v1/models`,
`POST /v1/chat/completions` and `POST /v1/completions` (with `stream: true` too), authenticated with the
organization API keys (`Authorization: Bearer tdm_...`) and accepting the model ids of Infer
(`orgs/{org}/jobs/{job}/checkpoints/{checkpoint}`, `latest` for the newest). Each call is relayed to the
checkpoint's inference worker (`gateway.inference`); errors are OpenAI-style JSON with the Tandem reason
as `code`, and 429 / 503 carry `Retry-After`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from gateway.dashboard import Dashboard
from gateway.httpinput import json_object, read_body
from gateway.inference import Endpoint
from gateway.orgs import Orgs
from mesh.errors import NotFound, R, TandemError
from mesh.identity import Principal

if TYPE_CHECKING:
    from gateway.servicer import GatewayServicer

MODEL_ID = re.compile(
    r"^orgs/[a-z][a-z0-9-]{0,62}/jobs/[a-z][a-z0-9-]{0,62}/checkpoints/[a-z][a-z0-9-]{0,62}$"
)
MAX_BODY_BYTES = 4 * 1024 * 1024
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "FAILED_PRECONDITION": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "UNIMPLEMENTED": 501,
}


def _error(error: TandemError) -> JSONResponse:
    status = HTTP_STATUS.get(error.code, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    body = {"error": {"message": error.message, "type": kind, "code": error.reason_name}}
    return JSONResponse(body, status_code=status, headers=headers)


class OpenAIEndpoint:
    def __init__(self, servicer: GatewayServicer, orgs: Orgs) -> None:
        self._servicer = servicer
        self._orgs = orgs

    async def _principal(self, request: Request) -> Principal:
        return await self._orgs.authenticate_bearer(request.headers.get("authorization", ""))

    async def models(self, request: Request) -> Response:
        try:
            principal = await self._principal(request)
            found = await self._servicer.list_models(principal)
        except TandemError as error:
            return _error(error)
        data = [
            {
                "id": c.name,
                "object": "model",
                "created": c.create_time.seconds,
                "owned_by": c.name.split("/")[1],
            }
            for c in found
        ]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        return await self._relay(request, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._relay(request, "/v1/completions")

    async def _relay(self, request: Request, route: str) -> Response:
        try:
            principal = await self._principal(request)
            body = json_object(await read_body(request, MAX_BODY_BYTES))
            model = body.get("model")
            if not isinstance(model, str) or not MODEL_ID.fullmatch(model):
                raise NotFound(
                    "`model` must be a checkpoint, orgs/{org}/jobs/{job}/checkpoints/{checkpoint}",
                    reason=R.ERROR_REASON_CHECKPOINT_NOT_FOUND,
                )
            scope = self._servicer.scope_of(principal, model, R.ERROR_REASON_JOB_NOT_FOUND)
            checkpoint, worker = await self._servicer.worker_for(scope, model)
            body["model"] = checkpoint.name
            if body.get("stream"):
                return await self._stream(worker, route, body)
            status, answer = await self._servicer.post_json(worker, route, body)
        except TandemError as error:
            return _error(error)
        return JSONResponse(answer, status_code=status)

    async def _stream(self, worker: Endpoint, route: str, body: dict[str, Any]) -> Response:
        session = self._servicer.http
        response = await session.post(worker.base_url + route, json=body, headers=worker.headers)
        if response.status != 200:
            answer = await response.read()
            response.release()
            return Response(answer, status_code=response.status, media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            except aiohttp.ClientError:
                return
            finally:
                response.release()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    def app(self, extra: list[BaseRoute] | None = None) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                *(extra or []),
            ]
        )


@dataclass
class RunningHttp:
    base_url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def start(
    servicer: GatewayServicer,
    orgs: Orgs,
    host: str,
    port: int,
    dashboard_key: bytes | None = None,
    tls: tuple[str, str] | None = None,
    reuse_port: bool = False,
) -> RunningHttp:
    """The HTTP server: the OpenAI-compatible endpoint, and the dashboard (`gateway.dashboard`) when
    `dashboard_key` (the HMAC key of its stream tokens) is given; HTTPS with `tls` (certificate and key
    files). With `reuse_port` other gateway replicas may listen on the same port (SO_REUSEPORT)."""
    extra = Dashboard(servicer, orgs, dashboard_key).routes() if dashboard_key is not None else []
    server = uvicorn.Server(
        uvicorn.Config(
            OpenAIEndpoint(servicer, orgs).app(extra),
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,  # open event streams must not hold up a drain
            ssl_certfile=tls[0] if tls else None,
            ssl_keyfile=tls[1] if tls else None,
        )
    )
    sockets = [_reusable_socket(host, port)] if reuse_port else None
    task = asyncio.create_task(server.serve(sockets=sockets), name="gateway-openai-http")
    while not server.started:
        if task.done():
            await task
            raise RuntimeError("the gateway's OpenAI-compatible endpoint did not start")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RunningHttp(f"{'https' if tls else 'http'}://{host}:{bound}/v1", server, task)


def _reusable_socket(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` that other processes may bind too (SO_REUSEPORT): the kernel spreads
    new connections over every process listening on it. uvicorn binds only without the option."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
