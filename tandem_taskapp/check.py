"""The Task App conformance kit: runs the HTTP contract checks against a live Task App and reports a table.

`run_checks` is what `tandem taskapp check URL` prints and what the taskapp-proxy runs before it registers an
app (the rows become `tandem.taskapp.v1.CheckResult`). The checks, in the order they run:

- `health`: `GET /health` answers 200 with JSON; neither that answer nor one without the key holds the key
  or its first 6 characters.
- `auth_missing_key`: `POST /rollout` and `GET /task_info` without a key answer 401 with no key material.
- `auth_wrong_key`: both answer 401 to a wrong key, the same body for two different wrong keys, echoing
  neither wrong key and holding no key material; so does `/health`, unless it takes no key at all (the
  hosted dialect's key-less health: 200 to no key and to wrong keys, revealing neither).
- `auth_bearer`: `Authorization: Bearer <key>` is accepted (or, in the hosted dialect, `X-API-Keys`, a
  comma-separated list); a wrong key in that form answers 401.
- `task_info_schema`: `GET /task_info?seed=0` answers 200 with JSON valid per docs/taskapp-openapi.yaml.
- `task_info_deterministic`: the same seed twice gives identical JSON (seeds 0 and 1, which may differ).
- `rollout_schema`: a real one-turn rollout against the policy answers 200, valid per the schema, with
  finite rewards.
- `correlation_id_echo`: that answer echoes the `trace_correlation_id` sent.
- `correlation_id_propagated`: the policy saw a call carrying the id in its URL path or in the
  `X-Trace-Correlation-Id` header.
- `timeout_behaviour`: with `limits.max_seconds = 1` and a policy that answers after 3 s, the app answers
  within 1 s plus 1.5 s of slack, with `aborted: true` or a 408/5xx status.
- `idempotent_repeat`: an episode played against a stub policy whose every reply holds a fresh random word,
  sent again with the same correlation id, answers an equal result (`metrics.details`, free-form and often
  timed, is not compared) without calling the policy again: an app that plays a repeat again fails, even a
  deterministic one.
- `dialect`: which dialect the app speaks, `tandem` or `hosted: <where it showed>` (the hosted online-RL
  product's shapes: `{"detail"}` errors, a key-less `/health`, the hosted `task_info`, `trajectories[].steps[]`
  or `trace` rollouts, `X-API-Keys`; `tandem_taskapp/hosted.py`); fails when no rollout answer followed either.

A check that validates an answer accepts it in either dialect (a hosted answer is validated once more after
it is turned into Tandem's shape) and, when it follows neither, lists every violation of the nearer one:
in the row's `violations` (one a line under the row in the table, a list in `--json`), with their count in
the detail.

When no `policy_url` is given the kit serves its own stub policy on 127.0.0.1 (a free port, in this process):
an OpenAI-compatible `/chat/completions` that answers every call with a fixed short reply and records the
calls. Its `inference_url` carries the correlation id in the path, as the trainer's does. The stub is only
reachable by an app on the same host; for a remote app pass `policy_url`, which skips the two checks that
need the stub (`correlation_id_propagated`, `timeout_behaviour`): they pass with a detail starting
`skipped:`. An empty `api_key` means the app takes no key; the auth checks are then skipped the same way.

The kit never prints, logs or returns the key: details quote no response bodies and are redacted anyway.
Importing this module has no side effects; uvicorn runs without its logging config or signal handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import math
import os
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote

import httpx
import jsonschema
import referencing
import referencing.jsonschema
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tandem_taskapp import hosted

__all__ = [
    "CHECK_NAMES",
    "DEFAULT_OPENAPI_PATH",
    "MAX_ANSWER_BYTES",
    "STUB_MODEL",
    "STUB_REPLY",
    "CheckResult",
    "PolicyCall",
    "StubPolicyServer",
    "format_table",
    "main",
    "rollout_request",
    "run_checks",
]

CHECK_NAMES: Final = (
    "health",
    "auth_missing_key",
    "auth_wrong_key",
    "auth_bearer",
    "task_info_schema",
    "task_info_deterministic",
    "rollout_schema",
    "correlation_id_echo",
    "correlation_id_propagated",
    "timeout_behaviour",
    "idempotent_repeat",
    "dialect",
)

DEFAULT_OPENAPI_PATH: Final = Path(__file__).resolve().parent.parent / "docs" / "taskapp-openapi.yaml"
STUB_MODEL: Final = "tandem-check-stub"
STUB_REPLY: Final = "I don't know."
TRACE_HEADER: Final = "X-Trace-Correlation-Id"
KEY_PREFIX_LEN: Final = 6
# timeout_behaviour: the limit sent, how long the stub policy delays, and the slack the app gets on top.
TIMEOUT_LIMIT_S: Final = 1
TIMEOUT_POLICY_DELAY_S: Final = 3.0
TIMEOUT_SLACK_S: Final = 1.5
_TIMEOUT_STATUSES: Final = frozenset({408, *range(500, 600)})
# An answer larger than this fails its check: the proxy runs the kit against apps it does not trust.
MAX_ANSWER_BYTES: Final = 16 * 1024 * 1024
_MAX_RECORDED_CALLS: Final = 10_000
_SKIPPED: Final = "skipped: "
_DETAIL_MAX: Final = 300
_MAX_VIOLATIONS: Final = 200


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One row of the check table; `detail` says what was expected and what came back."""

    name: str
    passed: bool
    detail: str
    duration_s: float
    violations: tuple[str, ...] = ()
    """Every schema violation the check found, each `at <path>: <message>`; empty for other failures."""


class _CheckFailed(Exception):
    """Raised inside a check: the check failed with this detail (and these schema violations)."""

    def __init__(self, detail: str, violations: Sequence[str] = ()) -> None:
        super().__init__(detail)
        self.detail = detail
        self.violations = tuple(violations)


# --------------------------------------------------------------------------------------------- stub policy


@dataclass(frozen=True, slots=True)
class PolicyCall:
    """One request the stub policy received."""

    method: str
    path: str
    trace_header: str | None
    body: Any

    def carries(self, correlation_id: str) -> bool:
        """Whether the call names the episode: in its URL path or its `X-Trace-Correlation-Id` header."""
        return self.trace_header == correlation_id or correlation_id in unquote(self.path)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves the host process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class StubPolicyServer:
    """A tiny OpenAI-compatible policy on 127.0.0.1: every `POST .../chat/completions` gets `reply`.

    Paths under `/slow/` answer after `slow_delay_s` (or at shutdown, whichever is first); paths under
    `/random/` answer `reply` and a fresh random word, so that two plays of one episode differ. Every
    request is recorded in `calls`. Use as `async with StubPolicyServer() as policy:`.
    """

    reply: str = STUB_REPLY
    slow_delay_s: float = TIMEOUT_POLICY_DELAY_S
    calls: list[PolicyCall] = field(default_factory=list)
    _server: _QuietServer | None = field(default=None, init=False, repr=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _stop: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _port: int = field(default=0, init=False, repr=False)

    @property
    def base_url(self) -> str:
        if not self._port:
            raise RuntimeError("the stub policy is not running")
        return f"http://127.0.0.1:{self._port}"

    def inference_url(self, correlation_id: str, *, slow: bool = False, random: bool = False) -> str:
        """The `inference_url` for one episode: the correlation id in the path, as the trainer builds it."""
        kind = "slow" if slow else "random" if random else "traces"
        return f"{self.base_url}/{kind}/{correlation_id}/v1"

    def calls_for(self, correlation_id: str) -> list[PolicyCall]:
        return [call for call in self.calls if call.carries(correlation_id)]

    async def _handle(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        path = request.url.path
        if len(self.calls) < _MAX_RECORDED_CALLS:
            self.calls.append(PolicyCall(request.method, path, request.headers.get(TRACE_HEADER), body))
        if request.method == "GET" and path.endswith("/models"):
            return JSONResponse({"object": "list", "data": [{"id": STUB_MODEL, "object": "model"}]})
        if request.method != "POST" or not path.endswith("/chat/completions"):
            return JSONResponse({"error": {"message": "not found", "type": "not_found"}}, status_code=404)
        if path.startswith("/slow/"):
            with contextlib.suppress(
                TimeoutError
            ):  # asyncio.timeout: wait_for may lose a cancel (mesh/aio.py)
                async with asyncio.timeout(self.slow_delay_s):
                    await self._stop.wait()
        model = body.get("model") if isinstance(body, dict) else None
        model = model if isinstance(model, str) else STUB_MODEL
        created = int(time.time())
        reply = f"{self.reply} {secrets.token_hex(4)}" if path.startswith("/random/") else self.reply
        if isinstance(body, dict) and body.get("stream") is True:
            return StreamingResponse(self._stream(model, created, reply), media_type="text/event-stream")
        return JSONResponse(
            {
                "id": "chatcmpl-tandem-check",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _stream(self, model: str, created: int, reply: str) -> AsyncIterator[str]:
        base = {"id": "chatcmpl-tandem-check", "object": "chat.completion.chunk", "created": created}
        for delta, finish in (({"role": "assistant", "content": reply}, None), ({}, "stop")):
            chunk = {
                **base,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    async def start(self) -> None:
        self._stop = asyncio.Event()
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])])
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
        # every keep-alive answer waits ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the stub policy server stopped at start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception, SystemExit):
                await asyncio.wait_for(self._task, timeout=5)
        self._server = self._task = None

    async def __aenter__(self) -> StubPolicyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# --------------------------------------------------------------------------------------------- schemas

_OPENAPI_URI: Final = "urn:tandem:taskapp-openapi"

# Used when docs/taskapp-openapi.yaml is absent (e.g. an installed wheel): the shapes of the contract.
_ERROR_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
        }
    },
}
_FALLBACK_SCHEMAS: Final[dict[tuple[str, str, str], dict[str, Any]]] = {
    ("get", "/health", "200"): {"type": "object", "required": ["healthy"]},
    ("get", "/health", "401"): _ERROR_SCHEMA,
    ("get", "/task_info", "200"): {"type": "object"},
    ("get", "/task_info", "401"): _ERROR_SCHEMA,
    ("post", "/rollout", "401"): _ERROR_SCHEMA,
    ("post", "/rollout", "200"): {
        "type": "object",
        "required": ["trace_correlation_id", "metrics", "trajectory", "aborted"],
        "properties": {
            "trace_correlation_id": {"type": "string"},
            "metrics": {
                "type": "object",
                "required": ["outcome_reward"],
                "properties": {
                    "outcome_reward": {"type": "number"},
                    "event_rewards": {"type": "array", "items": {"type": "number"}},
                    "details": {"type": "object"},
                },
            },
            "trajectory": {
                "type": "object",
                "properties": {
                    "turns": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "messages": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["role", "content"],
                                        "properties": {
                                            "role": {"type": "string"},
                                            "content": {"type": "string"},
                                        },
                                    },
                                }
                            },
                        },
                    }
                },
            },
            "aborted": {"type": "boolean"},
        },
    },
}


_FALLBACK_HOSTED: Final[dict[str, dict[str, Any]]] = {
    "HostedError": {"type": "object", "required": ["detail"]},
    "HostedTaskInfo": {"type": "object", "required": ["task", "dataset"]},
    "HostedRolloutResponse": {
        "type": "object",
        "required": ["metrics"],
        "anyOf": [{"required": ["trajectories"]}, {"required": ["trace"]}],
    },
}


def _pointer_token(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


class _Schemas:
    """Response validators from the OpenAPI document, falling back to the built-in shapes."""

    def __init__(self, path: Path | None) -> None:
        self.source = "built-in schema"
        self._doc: dict[str, Any] | None = None
        self._registry: referencing.Registry[Any] = referencing.Registry()
        if path is not None and path.is_file():
            try:
                doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError):
                doc = None
            if isinstance(doc, dict) and isinstance(doc.get("paths"), dict):
                self._doc = doc
                self.source = path.name
                resource = referencing.jsonschema.DRAFT202012.create_resource(doc)
                self._registry = referencing.Registry().with_resource(_OPENAPI_URI, resource)

    def validator(
        self, method: str, route: str, *, status: str = "200", request: bool = False
    ) -> jsonschema.Draft202012Validator:
        """The validator of the `status` answer (or with `request`, the request body) of `method route`."""
        pointer = self._pointer(method, route, status=status, request=request)
        if pointer is None:
            schema: dict[str, Any] = {} if request else _FALLBACK_SCHEMAS.get((method, route, status), {})
            return jsonschema.Draft202012Validator(schema)
        return jsonschema.Draft202012Validator({"$ref": f"{_OPENAPI_URI}#{pointer}"}, registry=self._registry)

    def component(self, name: str) -> jsonschema.Draft202012Validator:
        """The validator of `components.schemas[name]` (the hosted dialect's shapes live there)."""
        schemas = (self._doc or {}).get("components", {}).get("schemas", {})
        if isinstance(schemas, dict) and name in schemas:
            ref = f"{_OPENAPI_URI}#/components/schemas/{_pointer_token(name)}"
            return jsonschema.Draft202012Validator({"$ref": ref}, registry=self._registry)
        return jsonschema.Draft202012Validator(_FALLBACK_HOSTED.get(name, {}))

    def _pointer(self, method: str, route: str, *, status: str, request: bool) -> str | None:
        if self._doc is None:
            return None
        operation = self._doc["paths"].get(route, {})
        operation = operation.get(method) if isinstance(operation, dict) else None
        if not isinstance(operation, dict):
            return None
        base = f"/paths/{_pointer_token(route)}/{method}"
        if request:
            container, where = operation.get("requestBody"), f"{base}/requestBody"
        else:
            responses = operation.get("responses")
            if not isinstance(responses, dict):
                return None
            wanted = (status, f"{status[0]}XX", "default")
            found = next((s for s in wanted if s in responses), None)
            if found is None:
                return None
            container, where = responses[found], f"{base}/responses/{found}"
        if not isinstance(container, dict):
            return None
        if "$ref" in container:  # a shared response or request body under components
            ref = container["$ref"]
            if not (isinstance(ref, str) and ref.startswith("#/")):
                return None
            where = ref[1:]
            container = self._resolve(ref)
            if not isinstance(container, dict):
                return None
        content = container.get("content")
        if not isinstance(content, dict):
            return None
        media = next((m for m in content if m.split(";")[0].strip() == "application/json"), None)
        if media is None or not isinstance(content[media], dict) or "schema" not in content[media]:
            return None
        return f"{where}/content/{_pointer_token(media)}/schema"

    def _resolve(self, ref: str) -> Any:
        node: Any = self._doc
        for token in ref[2:].split("/"):
            if not isinstance(node, dict):
                return None
            node = node.get(token.replace("~1", "/").replace("~0", "~"))
        return node


def _schema_errors(validator: jsonschema.Draft202012Validator, instance: Any) -> list[str]:
    """Every violation of the schema by `instance`, shallowest first, each `at <path>: <message>`."""
    errors = sorted(
        validator.iter_errors(instance), key=lambda e: (len(e.absolute_path), str(e.absolute_path))
    )
    out = []
    for error in errors[:_MAX_VIOLATIONS]:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        out.append(_short(f"at {where}: {error.message}"))
    if len(errors) > _MAX_VIOLATIONS:
        out.append(f"... and {len(errors) - _MAX_VIOLATIONS} more")
    return out


def _breaks(what: str, source: str, violations: Sequence[str]) -> _CheckFailed:
    """The failure of an answer that breaks a schema: the detail names the count, the rows list each."""
    count = f"{len(violations)} violation{'s' if len(violations) != 1 else ''}"
    return _CheckFailed(f"{what} breaks the {source} ({count}): " + "; ".join(violations), violations)


# --------------------------------------------------------------------------------------------- helpers


def rollout_request(
    correlation_id: str,
    inference_url: str,
    *,
    seed: int = 0,
    model: str = STUB_MODEL,
    max_turns: int = 1,
    max_seconds: int = 30,
) -> dict[str, Any]:
    """The body of a `POST /rollout` the kit sends."""
    return {
        "trace_correlation_id": correlation_id,
        "env": {"seed": seed, "config": {}},
        "policy": {
            "config": {
                "model": model,
                "inference_url": inference_url,
                "temperature": 0.0,
                "max_completion_tokens": 64,
            }
        },
        "mode": "eval",
        "limits": {"max_turns": max_turns, "max_seconds": max_seconds},
        # The hosted dialect's names for the id and the time limit, as the proxy sends them too.
        "run_id": correlation_id,
        "safety": {"max_time_s": max_seconds},
    }


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _short(text: str, limit: int = _DETAIL_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    text: str
    headers: Mapping[str, str]
    elapsed_s: float

    def json(self) -> Any:
        """The parsed body; raises ValueError when it is not JSON."""
        return json.loads(self.text)


def _parse_json(answer: _Answer, what: str) -> Any:
    try:
        return answer.json()
    except ValueError:
        raise _CheckFailed(f"{what} answered HTTP {answer.status} with a body that is not JSON") from None


def _finite_rewards(body: Any) -> str | None:
    """None when every reward is a finite number, else what is wrong."""
    metrics = body.get("metrics") if isinstance(body, dict) else None
    if not isinstance(metrics, dict) or "outcome_reward" not in metrics:
        return "metrics.outcome_reward is missing"
    rewards = [("outcome_reward", metrics["outcome_reward"])]
    events = metrics.get("event_rewards") or []
    if isinstance(events, list):
        rewards += [(f"event_rewards[{i}]", r) for i, r in enumerate(events)]
    for name, reward in rewards:
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            return f"metrics.{name} is not a number"
        if not math.isfinite(reward):
            return f"metrics.{name} is {reward!r}, not finite"
    return None


# --------------------------------------------------------------------------------------------- the checks


class _Kit:
    def __init__(
        self,
        client: httpx.AsyncClient,
        api_key: str,
        *,
        policy: StubPolicyServer | None,
        policy_url: str | None,
        policy_model: str,
        timeout_s: float,
        schemas: _Schemas,
    ) -> None:
        self.client = client
        self.key = api_key
        self.policy = policy
        self.policy_url = policy_url
        self.model = policy_model
        self.timeout_s = timeout_s
        self.schemas = schemas
        self.run_id = secrets.token_hex(6)
        self.needles = [n for n in {api_key, api_key[:KEY_PREFIX_LEN]} if n]
        self.rollout_id = self.correlation_id("rollout")
        self.rollout_body: dict[str, Any] | None = None
        self.rollout_answer: _Answer | None = None
        self.rollout_json: Any = None
        self.rollout_calls: list[PolicyCall] = []
        self.rollout_conformed = False
        self.hosted: list[str] = []  # what the app answered in the hosted dialect, in the order seen

    def correlation_id(self, purpose: str) -> str:
        return f"tandem-check-{self.run_id}-{purpose}"

    def inference_url(self, correlation_id: str, *, slow: bool = False, random: bool = False) -> str:
        if self.policy is not None:
            return self.policy.inference_url(correlation_id, slow=slow, random=random)
        assert self.policy_url is not None
        return self.policy_url

    def speaks_hosted(self, what: str) -> None:
        if what not in self.hosted:
            self.hosted.append(what)

    def conform(
        self,
        what: str,
        tandem: jsonschema.Draft202012Validator,
        hosted_schema: str,
        body: Any,
        *,
        evidence: str,
        normalise: Callable[[Any], Any] = lambda body: body,
    ) -> Any:
        """`body` in Tandem's shape: as it is when it follows Tandem's contract, normalised when it follows
        the hosted dialect's `hosted_schema`. Neither: fails with every violation of the nearer one."""
        found = _schema_errors(tandem, body)
        if not found:
            return body
        in_hosted = _schema_errors(self.schemas.component(hosted_schema), body)
        if not in_hosted:
            normalised = normalise(body)
            again = _schema_errors(tandem, normalised)
            if again:
                raise _breaks(f"{what}, read in the hosted dialect,", self.schemas.source, again)
            self.speaks_hosted(evidence)
            return normalised
        if len(in_hosted) < len(found):
            raise _breaks(what, f"{self.schemas.source} (hosted dialect, {hosted_schema})", in_hosted)
        raise _breaks(what, self.schemas.source, found)

    def redact(self, text: str) -> str:
        for needle in sorted(self.needles, key=len, reverse=True):
            text = text.replace(needle, "***")
        return text

    def headers(self, key: str | None = None, *, bearer: bool = False) -> dict[str, str]:
        key = self.key if key is None else key
        if not key:
            return {}
        return {"Authorization": f"Bearer {key}"} if bearer else {"X-API-Key": key}

    async def request(
        self,
        method: str,
        route: str,
        *,
        headers: Mapping[str, str],
        params: Mapping[str, int] | None = None,
        body: Any = None,
        deadline_s: float | None = None,
    ) -> _Answer:
        """One HTTP call with a hard total deadline; transport failures become check failures."""
        deadline = self.timeout_s if deadline_s is None else deadline_s
        started = time.monotonic()
        request = self.client.build_request(
            method, route, headers=dict(headers), params=params, json=body, timeout=deadline
        )
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(deadline):
                response = await self.client.send(request, stream=True)
                try:
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > MAX_ANSWER_BYTES:
                            raise _CheckFailed(
                                f"{method} {route} answered more than {MAX_ANSWER_BYTES} bytes"
                            )
                        chunks.append(chunk)
                finally:
                    await response.aclose()
        except (TimeoutError, httpx.TimeoutException):
            raise _CheckFailed(f"{method} {route} did not answer within {deadline:.1f}s") from None
        except httpx.HTTPError as error:
            raise _CheckFailed(f"{method} {route} failed: {type(error).__name__}") from None
        return _Answer(
            response.status_code,
            b"".join(chunks).decode(response.encoding or "utf-8", errors="replace"),
            {k.lower(): v for k, v in response.headers.items()},
            time.monotonic() - started,
        )

    def leaks(self, answer: _Answer, extra: Sequence[str] = ()) -> bool:
        """Whether the answer's body or headers hold the key, its prefix or one of `extra`."""
        haystacks = [answer.text, *answer.headers.values()]
        with contextlib.suppress(ValueError):
            haystacks.append(json.dumps(answer.json(), ensure_ascii=False))
        needles = [n for n in (*self.needles, *extra, *(e[:KEY_PREFIX_LEN] for e in extra)) if n]
        return any(needle in hay for hay in haystacks for needle in needles)

    # ----- checks; each returns a detail for a pass or raises _CheckFailed

    async def check_health(self) -> str:
        answer = await self.request("GET", "/health", headers=self.headers())
        if answer.status != 200:
            raise _CheckFailed(f"GET /health answered HTTP {answer.status}, expected 200")
        body = _parse_json(answer, "GET /health")
        if self.leaks(answer):
            raise _CheckFailed("GET /health reveals key material (the key or its first 6 characters)")
        problem = _schema_errors(self.schemas.validator("get", "/health"), body)
        if problem:
            raise _breaks("GET /health", self.schemas.source, problem)
        if self.key:
            anonymous = await self.request("GET", "/health", headers={})
            if self.leaks(anonymous):
                raise _CheckFailed("GET /health without a key reveals key material")
        return ""

    async def _rejects(
        self, method: str, route: str, headers: Mapping[str, str], how: str, presented: str = ""
    ) -> _Answer:
        """Send an unauthenticated call; it must answer 401 with an error body free of key material."""
        body = None
        params = None
        if route == "/rollout":
            cid = self.correlation_id("unauthorized")
            body = rollout_request(cid, self.inference_url(cid), model=self.model, max_seconds=5)
        elif route == "/task_info":
            params = {"seed": 0}
        answer = await self.request(method, route, headers=headers, params=params, body=body)
        if answer.status != 401:
            raise _CheckFailed(f"{method} {route} {how} answered HTTP {answer.status}, expected 401")
        if self.leaks(answer, extra=[presented] if presented else []):
            echo = "echoes the presented key or " if presented else ""
            raise _CheckFailed(
                f"the 401 of {method} {route} {how} reveals key material ({echo}holds the key's first "
                f"{KEY_PREFIX_LEN} characters)"
            )
        try:
            error_body = answer.json()
        except ValueError:
            raise _CheckFailed(f"the 401 of {method} {route} {how} is not JSON") from None
        self.conform(
            f"the 401 of {method} {route} {how}",
            self.schemas.validator(method.lower(), route, status="401"),
            "HostedError",
            error_body,
            evidence='errors as {"detail": ...}',
            normalise=hosted.error_to_tandem,
        )
        return answer

    async def check_auth_missing_key(self) -> str:
        if not self.key:
            return _SKIPPED + "no key given, the app takes none"
        for method, route in (("POST", "/rollout"), ("GET", "/task_info")):
            await self._rejects(method, route, {}, "without a key")
        return ""

    async def check_auth_wrong_key(self) -> str:
        if not self.key:
            return _SKIPPED + "no key given, the app takes none"
        # One wrong key shares the real key's prefix (an app echoing it leaks that prefix), one does not.
        wrong = [
            self.key[:KEY_PREFIX_LEN] + "wrong" + secrets.token_hex(max(4, len(self.key) // 2)),
            secrets.token_hex(24),
        ]
        for method, route in (("POST", "/rollout"), ("GET", "/task_info"), ("GET", "/health")):
            bodies = set()
            if route == "/health" and await self.open_health(wrong):
                continue
            for key in wrong:
                answer = await self._rejects(method, route, self.headers(key), "with a wrong key", key)
                bodies.add(answer.text)
            if len(bodies) > 1:
                raise _CheckFailed(f"the 401 of {method} {route} differs between two wrong keys")
        return ""

    async def open_health(self, wrong: Sequence[str]) -> bool:
        """Whether `/health` takes no key at all (the hosted dialect's key-less health): it answers 200 to
        no key and to each wrong key, revealing neither key."""
        for key in wrong:
            answer = await self.request("GET", "/health", headers=self.headers(key))
            if answer.status != 200:
                return False
            if self.leaks(answer, extra=[key]):
                raise _CheckFailed("GET /health with a wrong key reveals key material")
        anonymous = await self.request("GET", "/health", headers={})
        if anonymous.status != 200:
            return False
        self.speaks_hosted("a key-less /health")
        return True

    async def check_auth_bearer(self) -> str:
        if not self.key:
            return _SKIPPED + "no key given, the app takes none"
        answer = await self.request(
            "GET", "/task_info", headers=self.headers(bearer=True), params={"seed": 0}
        )
        form = "Authorization: Bearer"
        if answer.status != 200:
            # The hosted dialect's other form: X-API-Keys, a comma-separated list of keys to try.
            keys = {"X-API-Keys": f"{secrets.token_hex(12)},{self.key}"}
            listed = await self.request("GET", "/task_info", headers=keys, params={"seed": 0})
            if listed.status != 200:
                raise _CheckFailed(
                    f"GET /task_info with Authorization: Bearer answered HTTP {answer.status} and with "
                    f"X-API-Keys HTTP {listed.status}, expected 200"
                )
            self.speaks_hosted("the key in X-API-Keys")
            form = "X-API-Keys"
        # Only the status here: what a 401 may hold is auth_missing_key's and auth_wrong_key's business.
        wrong_key = secrets.token_hex(24)
        wrong = self.headers(wrong_key, bearer=True) if form != "X-API-Keys" else {"X-API-Keys": wrong_key}
        answer = await self.request("GET", "/task_info", headers=wrong, params={"seed": 0})
        if answer.status != 401:
            raise _CheckFailed(
                f"GET /task_info with a wrong {'bearer ' if form != 'X-API-Keys' else ''}key"
                f"{' in X-API-Keys' if form == 'X-API-Keys' else ''} answered HTTP {answer.status}, expected 401"
            )
        return "" if form != "X-API-Keys" else "Authorization: Bearer refused; X-API-Keys accepted"

    async def task_info(self, seed: int) -> Any:
        answer = await self.request("GET", "/task_info", headers=self.headers(), params={"seed": seed})
        if answer.status != 200:
            raise _CheckFailed(f"GET /task_info?seed={seed} answered HTTP {answer.status}, expected 200")
        return _parse_json(answer, f"GET /task_info?seed={seed}")

    async def check_task_info_schema(self) -> str:
        body = await self.task_info(0)
        self.conform(
            "GET /task_info?seed=0",
            self.schemas.validator("get", "/task_info"),
            "HostedTaskInfo",
            body,
            evidence="task_info in the hosted shape",
            normalise=hosted.task_info_to_tandem,
        )
        if "task_info in the hosted shape" in self.hosted:
            return f"validated against {self.schemas.source} in the hosted dialect"
        return f"validated against {self.schemas.source}"

    async def check_task_info_deterministic(self) -> str:
        for seed in (0, 1):
            first, second = await self.task_info(seed), await self.task_info(seed)
            if _canonical(first) != _canonical(second):
                raise _CheckFailed(f"GET /task_info?seed={seed} answered different JSON twice")
        return ""

    async def rollout(self, body: dict[str, Any], *, deadline_s: float | None = None) -> _Answer:
        headers = {**self.headers(), TRACE_HEADER: body["trace_correlation_id"]}
        return await self.request("POST", "/rollout", headers=headers, body=body, deadline_s=deadline_s)

    async def check_rollout_schema(self) -> str:
        cid = self.rollout_id
        self.rollout_body = rollout_request(
            cid,
            self.inference_url(cid),
            model=self.model,
            max_seconds=min(86_400, max(1, math.floor(self.timeout_s))),
        )
        seen = len(self.policy.calls) if self.policy is not None else 0
        answer = await self.rollout(self.rollout_body, deadline_s=self.timeout_s + 2)
        if self.policy is not None:
            self.rollout_calls = self.policy.calls[seen:]
        if answer.status != 200:
            raise _CheckFailed(f"POST /rollout answered HTTP {answer.status}, expected 200")
        body = _parse_json(answer, "POST /rollout")
        self.rollout_answer, self.rollout_json = answer, body
        form = "rollouts in the trace form"
        if isinstance(body, dict) and isinstance(body.get("trajectories"), list):
            form = "rollouts as trajectories[].steps[]"
        body = self.conform(
            "POST /rollout",
            self.schemas.validator("post", "/rollout"),
            "HostedRolloutResponse",
            body,
            evidence=form,
            normalise=hosted.rollout_to_tandem,
        )
        self.rollout_json = body
        self.rollout_conformed = True
        problem = _finite_rewards(body)
        if problem is not None:
            raise _CheckFailed(problem)
        how = " in the hosted dialect" if form in self.hosted else ""
        return f"validated against {self.schemas.source}{how}; answered in {answer.elapsed_s:.2f}s"

    def first_rollout(self) -> Any:
        if self.rollout_answer is None:
            raise _CheckFailed("no rollout answer to inspect (see rollout_schema)")
        return self.rollout_json

    async def check_correlation_id_echo(self) -> str:
        body = self.first_rollout()
        echoed = body.get("trace_correlation_id") if isinstance(body, dict) else None
        if echoed != self.rollout_id:
            shown = self.redact(_short(repr(echoed), 80))
            raise _CheckFailed(f"trace_correlation_id is {shown}, expected {self.rollout_id!r}")
        return ""

    async def check_correlation_id_propagated(self) -> str:
        if self.policy is None:
            return _SKIPPED + "--policy-url was given, so the kit cannot see the policy calls"
        if self.rollout_body is None:
            raise _CheckFailed("no rollout was sent (see rollout_schema)")
        carrying = self.policy.calls_for(self.rollout_id)
        if carrying:
            return f"{len(carrying)} policy call(s) carried the id"
        if not self.rollout_calls:
            raise _CheckFailed("the rollout made no call to the policy at its inference_url")
        raise _CheckFailed(
            f"the policy saw {len(self.rollout_calls)} call(s) during the rollout, none with the "
            f"correlation id in the URL path or {TRACE_HEADER}"
        )

    async def check_timeout_behaviour(self) -> str:
        if self.policy is None:
            return _SKIPPED + "--policy-url was given, so the kit cannot slow the policy down"
        cid = self.correlation_id("timeout")
        body = rollout_request(
            cid, self.inference_url(cid, slow=True), model=self.model, max_seconds=TIMEOUT_LIMIT_S
        )
        limit = TIMEOUT_LIMIT_S + TIMEOUT_SLACK_S
        try:
            answer = await self.rollout(body, deadline_s=limit)
        except _CheckFailed as failed:
            raise _CheckFailed(
                f"with limits.max_seconds={TIMEOUT_LIMIT_S} and a policy answering after "
                f"{TIMEOUT_POLICY_DELAY_S:.0f}s: {failed.detail}"
            ) from None
        took = f"answered in {answer.elapsed_s:.2f}s"
        if answer.status in _TIMEOUT_STATUSES:
            return f"{took} with HTTP {answer.status}"
        if answer.status != 200:
            raise _CheckFailed(f"{took} with HTTP {answer.status}; expected aborted: true, 408 or 5xx")
        result = hosted.rollout_to_tandem(_parse_json(answer, "POST /rollout"))
        if not (isinstance(result, dict) and result.get("aborted") is True):
            raise _CheckFailed(f"{took} with HTTP 200 but not aborted: true")
        return f"{took} with aborted: true"

    async def check_idempotent_repeat(self) -> str:
        """A repeat must answer the recorded result. With the kit's stub, the episode is played against a
        policy whose every reply holds a fresh random word, so an app that plays a repeated id again (and
        only happens to be deterministic) answers differently, or is seen calling the policy again."""
        self.first_rollout()
        if self.policy is None:
            assert self.rollout_body is not None
            body, first = self.rollout_body, self.rollout_json
        else:
            cid = self.correlation_id("repeat")
            body = rollout_request(
                cid,
                self.inference_url(cid, random=True),
                model=self.model,
                max_seconds=min(86_400, max(1, math.floor(self.timeout_s))),
            )
            answer = await self.rollout(body, deadline_s=self.timeout_s + 2)
            if answer.status != 200:
                raise _CheckFailed(f"POST /rollout answered HTTP {answer.status}, expected 200")
            first = hosted.rollout_to_tandem(_parse_json(answer, "POST /rollout"))
        calls = len(self.policy.calls_for(body["trace_correlation_id"])) if self.policy else 0
        answer = await self.rollout(body, deadline_s=self.timeout_s + 2)
        if answer.status != 200:
            raise _CheckFailed(f"the repeated POST /rollout answered HTTP {answer.status}, expected 200")
        second = hosted.rollout_to_tandem(_parse_json(answer, "the repeated POST /rollout"))
        differing = _differences(first, second)
        if differing:
            raise _CheckFailed("the repeat answered a different result: " + ", ".join(differing))
        if self.policy is not None and len(self.policy.calls_for(body["trace_correlation_id"])) > calls:
            raise _CheckFailed(
                "the repeat played the episode again (it called the policy); a repeated "
                "trace_correlation_id must answer the recorded result"
            )
        if self.policy is None:
            return "played again with the same result (--policy-url: the kit cannot see the policy calls)"
        replayed = answer.headers.get("x-tandem-replayed") == "true"
        return "replayed the recorded result" if replayed else "answered the recorded result"

    async def check_dialect(self) -> str:
        """Which dialect the app speaks: Tandem's, or the hosted one, and where it showed. Unknown (a
        failure) when no rollout answer followed either."""
        if not self.rollout_conformed:
            raise _CheckFailed("unknown: no rollout answer followed either dialect (see rollout_schema)")
        if not self.hosted:
            return hosted.TANDEM
        return f"{hosted.HOSTED}: " + ", ".join(self.hosted)


def _differences(first: Any, second: Any) -> list[str]:
    """Top-level fields that differ between two results; `metrics.details` is app-specific and ignored."""

    def comparable(result: Any) -> Any:
        if not isinstance(result, dict):
            return result
        result = dict(result)
        if isinstance(result.get("metrics"), dict):
            result["metrics"] = {k: v for k, v in result["metrics"].items() if k != "details"}
        return result

    a, b = comparable(first), comparable(second)
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [] if _canonical(a) == _canonical(b) else ["(the whole answer)"]
    return sorted(k for k in a.keys() | b.keys() if _canonical(a.get(k)) != _canonical(b.get(k)))


async def run_checks(
    base_url: str,
    api_key: str,
    *,
    policy_url: str | None = None,
    timeout_s: float = 30,
    policy_model: str = STUB_MODEL,
    openapi_path: Path | None = DEFAULT_OPENAPI_PATH,
) -> list[CheckResult]:
    """Run every conformance check against the Task App at `base_url`, in order; one row per check.

    `api_key` is sent as `X-API-Key` (and once as a bearer token); empty means the app takes no key.
    `policy_url` is an OpenAI-compatible base URL the app should call instead of the kit's stub policy;
    `policy_model` the model id sent with it. `timeout_s` bounds each HTTP call (a rollout gets 2 s more).
    A failing app never raises: failures are rows. Raises ValueError for a URL that is not http(s).
    """
    if not base_url.startswith(("http://", "https://")):
        raise ValueError("base_url must be an http:// or https:// URL")
    if policy_url is not None and not policy_url.startswith(("http://", "https://")):
        raise ValueError("policy_url must be an http:// or https:// URL")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError("timeout_s must be a positive number of seconds")
    schemas = _Schemas(openapi_path)
    results: list[CheckResult] = []
    async with contextlib.AsyncExitStack() as stack:
        # trust_env=False: no proxy variables, and no .netrc that would add credentials to keyless probes.
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, trust_env=False)
        )
        policy = None
        if policy_url is None:
            policy = await stack.enter_async_context(StubPolicyServer())
        kit = _Kit(
            client,
            api_key,
            policy=policy,
            policy_url=policy_url,
            policy_model=policy_model,
            timeout_s=timeout_s,
            schemas=schemas,
        )
        for name in CHECK_NAMES:
            check: Callable[[], Awaitable[str]] = getattr(kit, f"check_{name}")
            started = time.monotonic()
            violations: tuple[str, ...] = ()
            try:
                detail, passed = await check(), True
            except _CheckFailed as failed:
                detail, passed, violations = failed.detail, False, failed.violations
            except Exception as error:  # a bug or an odd answer must cost one row, never the table
                detail, passed = f"the check itself failed: {type(error).__name__}: {error}", False
            results.append(
                CheckResult(
                    name,
                    passed,
                    _short(kit.redact(detail)),
                    time.monotonic() - started,
                    tuple(kit.redact(v) for v in violations),
                )
            )
    return results


# --------------------------------------------------------------------------------------------- CLI


def format_table(results: Sequence[CheckResult]) -> str:
    """The results as aligned columns: check, result (PASS/FAIL), time, detail."""
    rows = [("check", "result", "time", "detail")]
    rows += [(r.name, "PASS" if r.passed else "FAIL", f"{r.duration_s:.2f}s", r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    indent = " " * (widths[0] + widths[1] + widths[2] + 6)
    for index, (name, result, took, detail) in enumerate(rows):
        line = f"{name:<{widths[0]}}  {result:<{widths[1]}}  {took:>{widths[2]}}  {detail}"
        lines.append(line.rstrip())
        if index:  # every schema violation of a failed check, one a line under its row
            lines += [f"{indent}- {v}" for v in results[index - 1].violations]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem taskapp check",
        description="Run the Task App conformance checks against a running Task App. The key is read from "
        "stdin (--key-from-stdin) or the ENVIRONMENT_API_KEY variable, never from the command line.",
    )
    parser.add_argument("url", metavar="URL", help="the Task App's base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--key-from-stdin", action="store_true", help="read the app's key from stdin")
    parser.add_argument(
        "--policy-url",
        help="an OpenAI-compatible base URL for the app to call instead of the kit's stub policy on "
        "127.0.0.1 (needed when the app runs on another host); skips the checks that need the stub",
    )
    parser.add_argument(
        "--policy-model",
        default=STUB_MODEL,
        help="the model id to send with --policy-url (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per HTTP call (default %(default)s)"
    )
    return parser


def main(argv: list[str]) -> int:
    """`tandem taskapp check URL [--key-from-stdin] ...`: exit 0 iff every check passed, 1 if one failed, 2
    for a usage error."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://", "https://")):
        parser.error("URL must start with http:// or https://")
    if args.policy_url is not None and not args.policy_url.startswith(("http://", "https://")):
        parser.error("--policy-url must start with http:// or https://")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        parser.error("--timeout must be positive")
    if args.key_from_stdin:
        # At a terminal, prompt without echo; from a pipe, take the first line.
        key = (getpass.getpass("Task App key: ") if sys.stdin.isatty() else sys.stdin.readline()).strip()
        if not key:
            parser.error("--key-from-stdin: stdin held no key")
    else:
        key = os.environ.get("ENVIRONMENT_API_KEY", "").strip()
        if not key:
            parser.error("no key: pass --key-from-stdin or set ENVIRONMENT_API_KEY")
    results = asyncio.run(
        run_checks(
            args.url,
            key,
            policy_url=args.policy_url,
            timeout_s=args.timeout,
            policy_model=args.policy_model,
        )
    )
    all_passed = all(r.passed for r in results)
    if args.json:
        dialect = next((r.detail for r in results if r.name == "dialect" and r.passed), "")
        document = {
            "all_passed": all_passed,
            "dialect": dialect.split(":", 1)[0],
            "check_results": [{**asdict(r), "violations": list(r.violations)} for r in results],
        }
        print(json.dumps(document, indent=2))
    else:
        print(format_table(results))
        failed = sum(not r.passed for r in results)
        print(f"\n{len(results) - failed}/{len(results)} checks passed")
    return 0 if all_passed else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
