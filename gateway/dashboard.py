"""The gateway's dashboard: a few static pages (`/`, `/jobs/{job}`, `gateway/static/`) and the JSON and
server-sent-events API they read (`/api/...`), served by the same HTTP server as the OpenAI-compatible
endpoint and scoped to the organization of the API key exactly like the gRPC API (another organization's
job is 404, as an absent one).

Authentication. The page asks for the API key once, keeps it in `sessionStorage` (gone with the tab) and
sends it as `Authorization: Bearer` on every `fetch`. `EventSource` cannot set headers, so before it opens a
job's event stream the page POSTs the key to `/api/v1/stream-tokens` and gets a stream token: an HMAC (keyed
from the mesh key, so every gateway replica accepts it) over the organization, the key's name, the one job
it may read and an expiry `STREAM_TOKEN_TTL_S` away. It is passed as `?token=` and grants nothing but
reading that job's events; it is only checked when a stream opens, so a browser reconnecting after it
expired gets 401 and the page fetches a new one.

The event stream (`GET /api/v1/orgs/{org}/jobs/{job}/events`) relays the events service's Subscribe: each
event is one SSE message whose `id:` is the event's seq and whose data is the event as proto3 JSON. A
reconnecting browser sends `Last-Event-ID` and the stream resumes with `after_seq` set to it (the page also
passes `?after=` when it opens a new EventSource), so an event is never repeated nor missed. While idle the
stream sends `event: heartbeat` messages (no id) with the log's cursor; `event: end` closes a finished job's
stream, `event: failure` (the reason as `code`) one the events service ended with an error.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.scheduler.v1 import job_pb2

from gateway.httpinput import json_object, read_body, whole_number
from gateway.orgs import Orgs
from mesh.errors import InvalidArgument, NotFound, R, TandemError, Unauthenticated
from mesh.identity import Principal
from mesh.interceptors import principal_var

if TYPE_CHECKING:
    from gateway.servicer import GatewayServicer

STREAM_TOKEN_TTL_S = 60.0
STREAM_TOKEN_BODY_BYTES = 4096  # {"job": "orgs/.../jobs/..."} is far smaller
NO_CONTEXT: Any = None  # the gateway's handlers never read their gRPC context
HEARTBEAT_S = 15.0
RETRY_MS = 2000
JOB_NAME = re.compile(r"orgs/[a-z][a-z0-9-]{0,62}/jobs/[a-z][a-z0-9-]{0,62}")
STATIC = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def stream_key(mesh_seed: bytes) -> bytes:
    """The HMAC key of stream tokens, derived from the mesh signing key (shared by every replica)."""
    return hmac.new(mesh_seed, b"tandem.dashboard.stream-token.v1", hashlib.sha256).digest()


def _error(error: TandemError) -> JSONResponse:
    from gateway.openai_http import HTTP_STATUS  # noqa: PLC0415 - the two modules import each other

    status = HTTP_STATUS.get(error.code, 500)
    body = {"error": {"message": error.message, "code": error.reason_name}}
    return JSONResponse(body, status_code=status, headers=SECURITY_HEADERS)


def _json(body: Any) -> JSONResponse:
    return JSONResponse(body, headers=SECURITY_HEADERS)


def _job_name(request: Request) -> str:
    """`orgs/{org}/jobs/{job}` of the path; NOT_FOUND for anything that is not such a name."""
    name = f"orgs/{request.path_params['org']}/jobs/{request.path_params['job']}"
    if not JOB_NAME.fullmatch(name):
        raise NotFound(f"{name} not found", reason=R.ERROR_REASON_JOB_NOT_FOUND)
    return name


def _job_row(job: Any) -> dict[str, Any]:
    tasks = list(job.tasks)
    done = sum(1 for t in tasks if t.state in _TASK_DONE)
    return {
        "name": job.name,
        "id": job.name.rsplit("/", 1)[1],
        "display_name": job.spec.display_name,
        "state": _job_state(job.state),
        "create_time": job.create_time.ToJsonString() if job.HasField("create_time") else "",
        "progress": {"tasks_done": done, "tasks": len(tasks)},
        "tasks": [{"task": t.task, "state": _task_state(t.state)} for t in tasks],
    }


def _job_state(value: job_pb2.Job.State.ValueType) -> str:
    return job_pb2.Job.State.Name(value).removeprefix("STATE_")


def _task_state(value: job_pb2.TaskStatus.State.ValueType) -> str:
    return job_pb2.TaskStatus.State.Name(value).removeprefix("STATE_")


_TASK_DONE = frozenset(
    {
        job_pb2.TaskStatus.STATE_SUCCEEDED,
        job_pb2.TaskStatus.STATE_FAILED,
        job_pb2.TaskStatus.STATE_CANCELLED,
        job_pb2.TaskStatus.STATE_STOPPED,
    }
)


def _sse(fields: list[tuple[str, str]]) -> bytes:
    return ("".join(f"{name}: {value}\n" for name, value in fields) + "\n").encode()


class Dashboard:
    def __init__(
        self, servicer: GatewayServicer, orgs: Orgs, key: bytes, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        self._servicer = servicer
        self._orgs = orgs
        self._key = key
        self._heartbeat_s = heartbeat_s

    # ---- credentials --------------------------------------------------------------------------

    async def _principal(self, request: Request) -> Principal:
        principal = await self._orgs.authenticate_bearer(request.headers.get("authorization", ""))
        if not principal.org:  # the admin credential: it has no organization's jobs to show
            raise Unauthenticated("credentials are not recognised", reason=R.ERROR_REASON_INVALID_CREDENTIALS)
        return principal

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()

    def issue(self, principal: Principal, job: str, now: float | None = None) -> tuple[str, float]:
        expires = int((now or time.time()) + STREAM_TOKEN_TTL_S)
        payload = f"{principal.org}|{principal.subject}|{job}|{expires}"
        return f"{expires}.{principal.subject}.{self._sign(payload)}", float(expires)

    async def _stream_principal(self, token: str, job: str) -> Principal:
        """The principal a stream token was issued to, if it was issued for `job`, has not expired and its
        API key is still active (a revoked key opens no more streams, even with a fresh token)."""
        expires_text, _, rest = token.partition(".")
        subject, _, signature = rest.rpartition(".")
        org = job.split("/")[1]
        payload = f"{org}|{subject}|{job}|{expires_text}"
        if not (expires_text.isdigit() and subject and hmac.compare_digest(signature, self._sign(payload))):
            raise Unauthenticated(
                "the stream token is not valid for this job", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            )
        now = time.time()
        if int(expires_text) < now:
            raise Unauthenticated("the stream token has expired", reason=R.ERROR_REASON_CREDENTIALS_EXPIRED)
        try:
            key = await self._orgs.get_key(org, subject.rsplit("/", 1)[1])
        except NotFound:
            key = None
        if key is None or key.revoke_time is not None or key.expired(now):
            raise Unauthenticated(
                "the stream token's API key is no longer valid", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            )
        return Principal(kind="user", subject=subject, org=org, token_id=key.key_id)

    async def _call(
        self, principal: Principal, method: Callable[[Any, Any], Awaitable[Any]], message: Any
    ) -> Any:
        """One gateway RPC handler run as `principal`: the same scoping, forwarding and rate limit as gRPC."""
        reset = principal_var.set(principal)
        try:
            return await method(message, NO_CONTEXT)
        finally:
            principal_var.reset(reset)

    # ---- pages --------------------------------------------------------------------------------

    def _page(self, name: str) -> Response:
        text = resources.files("gateway").joinpath("static", name).read_text(encoding="utf-8")
        return Response(text, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    async def index(self, request: Request) -> Response:
        return self._page("index.html")

    async def job_page(self, request: Request) -> Response:
        return self._page("job.html")

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return Response("not found", status_code=404, headers=SECURITY_HEADERS)
        data = resources.files("gateway").joinpath("static", name).read_bytes()
        return Response(data, media_type=STATIC[name], headers=SECURITY_HEADERS)

    # ---- JSON API -----------------------------------------------------------------------------

    async def session(self, request: Request) -> Response:
        """Who the key is: the page checks the key here and learns its organization."""
        try:
            principal = await self._principal(request)
        except TandemError as error:
            return _error(error)
        return _json({"org": principal.org, "key": principal.subject})

    async def jobs(self, request: Request) -> Response:
        try:
            principal = await self._principal(request)
            reply = await self._call(
                principal,
                self._servicer.ListJobs,
                pb.ListJobsRequest(parent=f"orgs/{principal.org}", page_size=100),
            )
        except TandemError as error:
            return _error(error)
        return _json({"jobs": [_job_row(j) for j in reply.jobs]})

    async def job(self, request: Request) -> Response:
        try:
            principal = await self._principal(request)
            name = _job_name(request)
            reply = await self._call(principal, self._servicer.GetJob, pb.GetJobRequest(name=name))
        except TandemError as error:
            return _error(error)
        return _json({"job": _job_row(reply.job)})

    async def checkpoints(self, request: Request) -> Response:
        try:
            principal = await self._principal(request)
            name = _job_name(request)
            reply = await self._call(
                principal,
                self._servicer.ListCheckpoints,
                pb.ListCheckpointsRequest(parent=name, page_size=100),
            )
        except TandemError as error:
            return _error(error)
        rows = [json_format.MessageToDict(c, preserving_proto_field_name=True) for c in reply.checkpoints]
        return _json({"checkpoints": rows})

    async def stream_token(self, request: Request) -> Response:
        try:
            principal = await self._principal(request)
            body = json_object(await read_body(request, STREAM_TOKEN_BODY_BYTES))
            job = body.get("job")
            if not isinstance(job, str):
                raise InvalidArgument('the body must be {"job": "orgs/{org}/jobs/{job}"}')
            self._check_job(principal, job)
            await self._stream_info(principal, job)
        except TandemError as error:
            return _error(error)
        token, expires = self.issue(principal, job)
        return _json({"token": token, "expire_time": expires})

    def _check_job(self, principal: Principal, job: str) -> None:
        parts = job.split("/")
        if len(parts) != 4 or parts[0] != "orgs" or parts[2] != "jobs" or parts[1] != principal.org:
            raise NotFound(f"{job} not found", reason=R.ERROR_REASON_JOB_NOT_FOUND)

    async def _stream_info(self, principal: Principal, job: str) -> None:
        """NOT_FOUND unless the job has an event log the principal may read (via the gateway's ListEvents)."""
        await self._call(principal, self._servicer.ListEvents, pb.ListEventsRequest(job=job, page_size=1))

    # ---- server-sent events -------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        try:
            job = _job_name(request)
            token = request.query_params.get("token", "")
            if token:
                principal = await self._stream_principal(token, job)
            else:  # a script with the key itself, as on the rest of the API
                principal = await self._principal(request)
            self._check_job(principal, job)
            resume = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
            after_seq = whole_number(resume, "Last-Event-ID (or ?after=), an event seq,")
            heartbeat_s = self._heartbeat_s
            asked = request.query_params.get("heartbeat_s", "")
            if asked:  # a client may ask for another heartbeat interval, 1 to 60 s as Subscribe's
                heartbeat_s = min(60.0, max(1.0, float(whole_number(asked, "heartbeat_s", 3600))))
            await self._stream_info(principal, job)
        except TandemError as error:
            return _error(error)
        subscribe = pb.SubscribeEventsRequest(job=job, after_seq=after_seq, end_when_terminal=True)
        subscribe.heartbeat_interval.FromNanoseconds(int(heartbeat_s * 1e9))
        headers = {**SECURITY_HEADERS, "X-Accel-Buffering": "no"}
        return StreamingResponse(
            self._relay(principal, subscribe), media_type="text/event-stream", headers=headers
        )

    async def _relay(
        self, principal: Principal, subscribe: pb.SubscribeEventsRequest
    ) -> AsyncIterator[bytes]:
        principal_var.set(principal)
        yield _sse([("retry", str(RETRY_MS))])
        stream: Any = self._servicer.SubscribeEvents(subscribe, NO_CONTEXT)
        try:
            async for item in stream:
                kind = item.WhichOneof("kind")
                if kind == "events":
                    for event in item.events.events:
                        data = json_format.MessageToDict(event, preserving_proto_field_name=True)
                        yield _sse(
                            [("id", str(event.seq)), ("data", json.dumps(data, separators=(",", ":")))]
                        )
                elif kind == "heartbeat":
                    beat = {"cursor": item.heartbeat.cursor, "last_seq": item.heartbeat.last_seq}
                    yield _sse([("event", "heartbeat"), ("data", json.dumps(beat))])
                elif kind == "end":
                    end = {
                        "terminal_seq": item.end.terminal_seq,
                        "state": _job_state(item.end.terminal_state),
                    }
                    yield _sse([("event", "end"), ("data", json.dumps(end))])
                    return
        except TandemError as error:
            # Named `failure`: EventSource's own `error` event is the connection's.
            failure = {"code": error.reason_name, "message": error.message}
            yield _sse([("event", "failure"), ("data", json.dumps(failure))])
        finally:
            await stream.aclose()

    def routes(self) -> list[BaseRoute]:
        job = "/api/v1/orgs/{org:str}/jobs/{job:str}"
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/jobs/{job:str}", self.job_page, methods=["GET"]),
            Route("/static/{name:str}", self.static, methods=["GET"]),
            Route("/api/v1/session", self.session, methods=["GET"]),
            Route("/api/v1/jobs", self.jobs, methods=["GET"]),
            Route("/api/v1/stream-tokens", self.stream_token, methods=["POST"]),
            Route(job, self.job, methods=["GET"]),
            Route(job + "/checkpoints", self.checkpoints, methods=["GET"]),
            Route(job + "/events", self.events, methods=["GET"]),
        ]
