"""The gateway's OpenAI-compatible HTTP endpoint (`ServerInfo.openai_base_url`): `GET /v1/models`,
`GET /v1/models/{id}`, `POST /v1/chat/completions` and `POST /v1/completions` (with `stream: true` too),
and the worker's token-in/token-out `POST /inference/v1/generate` (at the root, beside `/v1`, as vLLM serves
it), authenticated with the organization API keys (`Authorization: Bearer tdm_...`) and accepting the model ids
of Infer (`orgs/{org}/jobs/{job}/checkpoints/{checkpoint}`, `latest` for the newest). Fields no worker
honours are refused before a worker is looked for (`tandem_jobs.openai_fields`); each other call is
relayed to the checkpoint's inference worker (`gateway.inference`). Errors, an unknown route under `/v1/`
included, are OpenAI's `{"error": {"message", "type", "param", "code"}}` with the Tandem reason as `code` and
a refused field as `param`; 429 / 503 carry `Retry-After`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from tandem.trainer.v1 import checkpoint_pb2

from gateway.dashboard import Dashboard
from gateway.httpinput import json_object, read_body
from gateway.inference import STARTING_RETRY_S, Endpoint
from gateway.orgs import Orgs
from mesh.errors import NotFound, R, TandemError, Unavailable
from mesh.identity import Principal
from tandem_jobs.openai_fields import check_generate, refuse_unsupported

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


ERROR_TYPE = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: `type` from the HTTP status, the Tandem reason as `code`, the field as `param`."""
    kind = ERROR_TYPE.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(error: TandemError) -> JSONResponse:
    status = HTTP_STATUS.get(error.code, 500)
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    param = error.violations[0].field if error.violations else None
    body = error_body(status, error.message, error.reason_name, param)
    return JSONResponse(body, status_code=status, headers=headers)


def stream_error(body: dict[str, Any]) -> bytes:
    """An error after a stream has begun (its status is sent): one `data:` event holding the error object,
    which the openai client raises as an APIError, then the end of the stream."""
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def internal_error(request: Request, exc: Exception) -> Response:
    """A failure no handler expected: 500 as an OpenAI error (the exception is still logged)."""
    return JSONResponse(error_body(500, "internal error", "INTERNAL"), status_code=500)


async def route_error(request: Request, exc: Exception) -> Response:
    """An unknown route or method under `/v1/` or `/inference/` as an OpenAI error (404 NOT_FOUND, 405
    NOT_IMPLEMENTED); elsewhere (the dashboard's pages) Starlette's own answer."""
    if not isinstance(exc, HTTPException):
        raise exc
    if not (request.url.path + "/").startswith(("/v1/", "/inference/")):
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    if exc.status_code == 405:
        message = f"{request.method} is not a method of {request.url.path}"
        return JSONResponse(error_body(405, message, "NOT_IMPLEMENTED"), status_code=405, headers=exc.headers)
    message = f"{request.method} {request.url.path} is not a route of this endpoint"
    return JSONResponse(error_body(exc.status_code, message, "NOT_FOUND"), status_code=exc.status_code)


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
        data = [_model_object(c) for c in found]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}`: one checkpoint (`latest` answers the newest one, by its own name)."""
        try:
            principal = await self._principal(request)
            found = await self._servicer.get_model(principal, _model_id(request.path_params["model"]))
        except TandemError as error:
            return _error(error)
        return JSONResponse(_model_object(found))

    async def chat(self, request: Request) -> Response:
        return await self._relay(request, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._relay(request, "/v1/completions")

    async def generate(self, request: Request) -> Response:
        """`POST /inference/v1/generate`, token ids in and out (the worker's route, relayed)."""
        return await self._relay(request, "/inference/v1/generate", check_generate)

    async def _relay(
        self,
        request: Request,
        route: str,
        check: Callable[[dict[str, Any]], object] = refuse_unsupported,
    ) -> Response:
        try:
            principal = await self._principal(request)
            body = json_object(await read_body(request, MAX_BODY_BYTES))
            model = _model_id(body.get("model"))
            check(body)  # before any worker is looked for (or started)
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
        try:
            response = await session.post(worker.base_url + route, json=body, headers=worker.headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable(
                f"the inference worker did not answer: {type(exc).__name__}",
                reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE,
                retry_after_s=STARTING_RETRY_S,
            ) from None
        if response.status != 200:
            answer = await response.read()
            response.release()
            return Response(answer, status_code=response.status, media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, TimeoutError) as exc:  # the client raises an APIError on this event
                message = f"the inference worker stopped answering: {type(exc).__name__}"
                yield stream_error(error_body(503, message, "DEPENDENCY_UNAVAILABLE"))
            finally:
                response.release()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    def app(self, extra: list[BaseRoute] | None = None) -> Starlette:
        return Starlette(
            exception_handlers={HTTPException: route_error, Exception: internal_error},
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/inference/v1/generate", self.generate, methods=["POST"]),
                *(extra or []),
            ],
        )


def _model_id(model: object) -> str:
    if not isinstance(model, str) or not MODEL_ID.fullmatch(model):
        raise NotFound(
            "`model` must be a checkpoint, orgs/{org}/jobs/{job}/checkpoints/{checkpoint}",
            reason=R.ERROR_REASON_CHECKPOINT_NOT_FOUND,
        )
    return model


def _model_object(checkpoint: checkpoint_pb2.Checkpoint) -> dict[str, Any]:
    return {
        "id": checkpoint.name,
        "object": "model",
        "created": checkpoint.create_time.seconds,
        "owned_by": checkpoint.name.split("/")[1],
    }


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
