"""`TaskApp` and `create_app`: a researcher's environment served over the Task App HTTP contract
(docs/taskapp-openapi.yaml).

    from tandem_taskapp import Policy, Result, TaskApp

    async def rollout(seed: int, policy: Policy, config: dict) -> Result:
        reply = await policy.chat([{"role": "user", "content": f"Say {seed}"}])
        return Result(outcome_reward=float(reply.strip() == str(seed)))

    app = TaskApp(name="say-the-seed", task_info=lambda seed: {"instance": {"target": seed}}, rollout=rollout)

`create_app(app, api_key)` answers the ASGI app; `python -m tandem_taskapp.serve path/to/app.py` serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import httpx
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tandem_taskapp import schema
from tandem_taskapp.errors import (
    EnvironmentUnavailable,
    InvalidArgument,
    InvalidResult,
    PolicyError,
    TurnLimitReached,
)
from tandem_taskapp.models import MAX_SEED, Result, RolloutRequest, Turn, is_finite_number, normalize_mode
from tandem_taskapp.policy import DEFAULT_TIMEOUT_S, Policy, episode_context, policy_session

log = logging.getLogger("tandem_taskapp")
_tracer = trace.get_tracer("tandem_taskapp")

TaskInfoFn = Callable[[int], Mapping[str, Any] | Awaitable[Mapping[str, Any]]]
RolloutFn = Callable[..., Awaitable[Result | float]]
F = TypeVar("F", bound=Callable[..., Any])

REPLAYED_HEADER = "X-Tandem-Replayed"
MAX_BODY_BYTES = 1 << 20
MAX_CONFIG_BYTES = 64 << 10
MAX_DETAILS_BYTES = 64 << 10
DEFAULT_CACHE_SIZE = 4096


class TaskApp:
    """A Task App: what it is (`task_info`) and how it plays one episode (`rollout`).

    Either pass the two functions (`TaskApp(name=..., task_info=fn, rollout=fn)`, or register them with the
    `@app.on_task_info` / `@app.on_rollout` decorators), or subclass and override `task_info` and `rollout`.

    - `task_info(seed) -> dict`: what `seed` picks; merged over the app-wide description (`task`, `dataset`,
      `rubric`, `limits`), so it may override any of them. Must be deterministic per seed. May be async.
    - `async rollout(seed, policy, config) -> Result | float`: play the episode with `policy` (a `Policy`)
      and return its result (a bare float is the outcome reward). `config` is the request's `env.config`.
      A function that also takes a `request` parameter receives the whole `RolloutRequest` (mode, limits).

    `max_turns` and `max_seconds` are the defaults for a request that leaves its limits at 0."""

    name: str = ""

    def __init__(
        self,
        name: str | None = None,
        *,
        task_info: TaskInfoFn | None = None,
        rollout: RolloutFn | None = None,
        description: str = "",
        version: str = "0.1.0",
        splits: Sequence[Mapping[str, Any]] | None = None,
        default_split: str | None = None,
        rubric: Mapping[str, Any] | None = None,
        max_turns: int = 100,
        max_seconds: int = 600,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        resolved = name or type(self).name or type(self).__name__
        if not resolved:
            raise ValueError("a TaskApp needs a name")
        if not 1 <= max_turns <= 10000:
            raise ValueError("max_turns must be 1 to 10000")
        if not 1 <= max_seconds <= 86400:
            raise ValueError("max_seconds must be 1 to 86400")
        self.name = resolved
        self.description = (
            description or (inspect.getdoc(type(self)) if type(self) is not TaskApp else "") or ""
        )
        self.version = version
        self.splits = [dict(s) for s in (splits or [{"name": "train"}])]
        self.default_split = default_split or str(self.splits[0]["name"])
        self.rubric = dict(rubric or {"outcome": {"description": "The episode's reward."}})
        self.max_turns = max_turns
        self.max_seconds = max_seconds
        self.metadata = dict(metadata or {})
        self._task_info_fn = task_info
        self._rollout_fn = rollout

    def on_task_info(self, fn: F) -> F:
        """Decorator: register the `task_info(seed)` function."""
        self._task_info_fn = fn
        return fn

    def on_rollout(self, fn: F) -> F:
        """Decorator: register the `async rollout(seed, policy, config)` function."""
        self._rollout_fn = fn
        return fn

    def describe(self) -> dict[str, Any]:
        """The app-wide task description: the answer of `GET /task_info` without a seed."""
        info: dict[str, Any] = {
            "task": {
                "id": self.name,
                "name": self.name,
                "description": self.description,
                "version": self.version,
            },
            "dataset": {"splits": [dict(s) for s in self.splits], "default_split": self.default_split},
            "rubric": json.loads(json.dumps(self.rubric)),
            "limits": {"max_turns": self.max_turns, "max_seconds": self.max_seconds},
        }
        if self.metadata:
            info["task_metadata"] = dict(self.metadata)
        return info

    def task_info(self, seed: int) -> Mapping[str, Any] | Awaitable[Mapping[str, Any]]:
        """What `seed` picks. Override, or pass `task_info=` to the constructor."""
        if self._task_info_fn is None:
            return {}
        return self._task_info_fn(seed)

    async def rollout(self, seed: int, policy: Policy, config: dict[str, Any]) -> Result | float:
        """Play one episode. Override, or pass `rollout=` to the constructor."""
        if self._rollout_fn is None:
            raise NotImplementedError(f"Task App {self.name!r} has no rollout function")
        return await _call_rollout(self._rollout_fn, seed, policy, config, None)

    async def run(self, request: RolloutRequest, policy: Policy) -> Result | float:
        """Play the episode of `request`: calls `rollout`, with `request=` when it accepts one."""
        if self._rollout_fn is not None and type(self).rollout is TaskApp.rollout:
            return await _call_rollout(self._rollout_fn, request.seed, policy, dict(request.config), request)
        return await _call_rollout(self.rollout, request.seed, policy, dict(request.config), request)

    async def info_for(self, seed: int | None) -> dict[str, Any]:
        """The body of `GET /task_info`: `describe()`, with `task_info(seed)` merged over it for a seed."""
        info = self.describe()
        if seed is None:
            return info
        extra = self.task_info(seed)
        if inspect.isawaitable(extra):
            extra = await extra
        if not isinstance(extra, Mapping):
            raise InvalidResult("task_info must return a mapping")
        for key, value in extra.items():
            if key in info and isinstance(info[key], dict) and isinstance(value, Mapping):
                info[key] = {**info[key], **value}
            else:
                info[key] = value
        info["seed"] = seed
        return info


def _accepts_request(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "request" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


async def _call_rollout(
    fn: Callable[..., Awaitable[Result | float]],
    seed: int,
    policy: Policy,
    config: dict[str, Any],
    request: RolloutRequest | None,
) -> Result | float:
    if request is not None and _accepts_request(fn):
        return await fn(seed, policy, config, request=request)
    return await fn(seed, policy, config)


# ---------------------------------------------------------------------------------------------------------
# The HTTP server


def error_body(code: str, message: str, details: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The contract's error body: `{"error": {"code", "message"[, "details"]}}`."""
    err: dict[str, Any] = {"code": code, "message": message}
    if details:
        err["details"] = [dict(d) for d in details]
    return {"error": err}


def _error(
    status: int, code: str, message: str, details: Sequence[Mapping[str, Any]] | None = None
) -> Response:
    headers = {"WWW-Authenticate": 'Bearer realm="task-app"'} if status == 401 else None
    return JSONResponse(error_body(code, message, details), status_code=status, headers=headers)


class _BodyTooLarge(Exception):
    pass


@dataclass
class _Entry:
    fingerprint: str
    task: asyncio.Task[dict[str, Any]]
    result: dict[str, Any] | None = None
    used_at: float = 0.0


class RolloutCache:
    """Finished rollout answers by correlation id (a bounded LRU, optionally forgetting an answer `ttl_s`
    seconds after its last use) plus the episodes in flight, which a duplicate request joins. Failed
    episodes are forgotten, so a retry plays again. Every operation but `in_flight()` is O(1): the
    episodes in flight and the finished answers are kept apart, so neither a bound nor an expiry has to
    look past the answers it drops."""

    def __init__(
        self,
        max_entries: int = DEFAULT_CACHE_SIZE,
        *,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0:
            raise ValueError("max_entries must be 0 or more")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s must be positive (None keeps answers until the bound evicts them)")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._running: dict[str, _Entry] = {}
        self._done: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first

    def get(self, key: str) -> _Entry | None:
        running = self._running.get(key)
        if running is not None:
            return running
        self._expire()
        entry = self._done.get(key)
        if entry is not None:
            entry.used_at = self._clock()
            self._done.move_to_end(key)
        return entry

    def start(self, key: str, fingerprint: str, task: asyncio.Task[dict[str, Any]]) -> _Entry:
        self._done.pop(key, None)
        entry = _Entry(fingerprint, task)
        self._running[key] = entry
        return entry

    def finish(self, key: str, entry: _Entry, result: dict[str, Any] | None) -> None:
        if self._running.get(key) is not entry:
            return
        del self._running[key]
        if result is None:
            return
        entry.result = result
        entry.used_at = self._clock()
        self._done[key] = entry
        while len(self._done) > self.max_entries:
            self._done.popitem(last=False)
        self._expire()

    def in_flight(self) -> list[asyncio.Task[dict[str, Any]]]:
        return [e.task for e in self._running.values()]

    @property
    def running(self) -> int:
        """How many episodes are in flight."""
        return len(self._running)

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        oldest = self._clock() - self.ttl_s
        while self._done:
            first = next(iter(self._done.values()))
            if first.used_at > oldest:
                return
            self._done.popitem(last=False)

    def __len__(self) -> int:
        self._expire()
        return len(self._running) + len(self._done)

    def __contains__(self, key: object) -> bool:
        self._expire()
        return key in self._running or key in self._done


def create_app(
    task_app: TaskApp,
    api_key: str | Sequence[str] | None,
    *,
    public_health: bool = True,
    cache_size: int = DEFAULT_CACHE_SIZE,
    cache_ttl_s: float | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    validate_responses: bool = True,
    policy_timeout: float = DEFAULT_TIMEOUT_S,
    http_client: httpx.AsyncClient | None = None,
) -> Starlette:
    """The ASGI app serving `task_app` over the contract.

    `api_key` is the environment key (or several, e.g. during a rotation); None turns authentication off,
    for local experiments only. With `public_health`, `GET /health` without a key answers a minimal body
    (a wrong key is still refused). A finished answer is kept for repeats of its correlation id: at most
    `cache_size` of them, least recently used dropped first, each for `cache_ttl_s` after its last use
    (None: until the bound drops it). `http_client` is used for policy calls; otherwise the app makes
    one pooled aiohttp session for all its episodes (per event loop) and closes it at shutdown."""
    server = _Server(
        task_app,
        api_key,
        public_health=public_health,
        cache=RolloutCache(cache_size, ttl_s=cache_ttl_s),
        max_body_bytes=max_body_bytes,
        validate_responses=validate_responses,
        policy_timeout=policy_timeout,
        http_client=http_client,
    )
    app = Starlette(
        routes=[
            Route("/health", server.health, methods=["GET"]),
            Route("/task_info", server.task_info, methods=["GET"]),
            Route("/rollout", server.rollout, methods=["POST"]),
        ],
        exception_handlers={HTTPException: _http_exception},
        lifespan=server.lifespan,
    )
    app.state.task_app = task_app
    app.state.rollout_cache = server.cache
    return app


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "INVALID_ARGUMENT")
    if exc.status_code >= 500:
        code = "INTERNAL"
    return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)


class _Server:
    def __init__(
        self,
        task_app: TaskApp,
        api_key: str | Sequence[str] | None,
        *,
        public_health: bool,
        cache: RolloutCache,
        max_body_bytes: int,
        validate_responses: bool,
        policy_timeout: float,
        http_client: httpx.AsyncClient | None,
    ) -> None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        if api_key is not None and (not keys or any(not k for k in keys)):
            raise ValueError("the environment key must not be empty")
        self.task_app = task_app
        self.keys: tuple[bytes, ...] | None = None if api_key is None else tuple(k.encode() for k in keys)
        self.public_health = public_health
        self.cache = cache
        self.max_body_bytes = max_body_bytes
        self.validate_responses = validate_responses
        self.policy_timeout = policy_timeout
        self.http_client = http_client
        self._session: tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession] | None = None

    def _policy_session(self) -> aiohttp.ClientSession | None:
        """The session policy calls go through when no `http_client` was given: one the app owns, made on
        first use on this event loop. A client made per episode cost a connection pool, a TCP connection
        and its teardown per rollout."""
        if self.http_client is not None:
            return None
        loop = asyncio.get_running_loop()
        if self._session is None or self._session[0] is not loop:
            self._session = (loop, policy_session())
        return self._session[1]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            tasks = self.cache.in_flight()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._session is not None:
                owned, self._session = self._session[1], None
                await owned.close()
            # The episodes' spans leave before the process does: uvicorn re-raises SIGTERM once shut down,
            # which ends the process without running exit handlers.
            flush = getattr(trace.get_tracer_provider(), "force_flush", None)
            if callable(flush):
                await asyncio.to_thread(flush)

    # -- auth ------------------------------------------------------------------------------------------

    def _auth(self, request: Request) -> bool | None:
        """True for a right key, False for a wrong one, None for none presented (or auth off: True)."""
        if self.keys is None:
            return True
        presented: list[str] = []
        if (k := request.headers.get("x-api-key")) is not None:
            presented.append(k)
        authz = request.headers.get("authorization")
        if authz is not None:
            scheme, _, token = authz.partition(" ")
            if scheme.lower() == "bearer":
                presented.append(token.strip())
        if not presented:
            return None
        ok = False
        for given in presented:
            raw = given.encode("utf-8", errors="surrogateescape")
            for key in self.keys:
                ok |= hmac.compare_digest(raw, key)
        return ok

    @staticmethod
    def _unauthenticated() -> Response:
        return _error(
            401,
            "UNAUTHENTICATED",
            "missing or invalid environment key: send it as X-API-Key or Authorization: Bearer",
        )

    # -- routes ----------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        auth = self._auth(request)
        if auth is False or (auth is None and not self.public_health):
            return self._unauthenticated()
        body: dict[str, Any] = {"healthy": True}
        if auth:
            body.update(task=self.task_app.name, version=self.task_app.version, in_flight=self.cache.running)
        return JSONResponse(body)

    async def task_info(self, request: Request) -> Response:
        if not self._auth(request):
            return self._unauthenticated()
        raw = request.query_params.get("seed")
        seed: int | None = None
        if raw is not None:
            if not raw.isdigit() or not raw.isascii() or int(raw) > MAX_SEED:
                return _error(400, "INVALID_ARGUMENT", "seed must be an integer from 0 to 2^64-1")
            seed = int(raw)
        try:
            info = await self.task_app.info_for(seed)
            body = _encode(info)
            problems = schema.errors("TaskInfo", json.loads(body)) if self.validate_responses else []
            if problems:
                raise InvalidResult("the task description breaks the TaskInfo schema: " + _summary(problems))
        except InvalidArgument as e:
            return _error(400, "INVALID_ARGUMENT", str(e))
        except EnvironmentUnavailable as e:
            log.warning("task_info of %s: %s", self.task_app.name, e)
            return _error(503, "UNAVAILABLE", str(e))
        except InvalidResult as e:
            log.error("task_info of %s: %s", self.task_app.name, e)
            return _error(500, "INVALID_RESULT", str(e))
        except Exception:
            log.exception("task_info of %s failed", self.task_app.name)
            return _error(500, "INTERNAL", "task_info failed; see the Task App's log")
        return Response(body, media_type="application/json")

    async def rollout(self, request: Request) -> Response:
        if not self._auth(request):
            return self._unauthenticated()
        parsed = await self._parse_rollout(request)
        if isinstance(parsed, Response):
            return parsed
        spec, fingerprint = parsed
        cid = spec.trace_correlation_id
        entry = self.cache.get(cid)
        replayed = entry is not None
        if entry is not None and entry.fingerprint != fingerprint:
            return _error(
                409, "REQUEST_ID_REUSED", "this trace_correlation_id was already used with a different body"
            )
        if entry is None:
            entry = self._start(spec, fingerprint, propagate.extract(request.headers))
        try:
            result = entry.result if entry.result is not None else await asyncio.shield(entry.task)
        except InvalidArgument as e:
            return _error(400, "INVALID_ARGUMENT", str(e))
        except PolicyError as e:
            return _error(502, "POLICY_UNAVAILABLE", str(e))
        except EnvironmentUnavailable as e:
            return _error(503, "UNAVAILABLE", str(e))
        except InvalidResult as e:
            return _error(500, "INVALID_RESULT", str(e))
        except asyncio.CancelledError:
            if entry.task.cancelled() and not _current_task_cancelling():
                return _error(503, "UNAVAILABLE", "the Task App is shutting down")
            raise
        except Exception:
            return _error(500, "INTERNAL", "the rollout failed; see the Task App's log")
        headers = {REPLAYED_HEADER: "true"} if replayed else None
        return Response(_encode(result), media_type="application/json", headers=headers)

    async def _parse_rollout(self, request: Request) -> tuple[RolloutRequest, str] | Response:
        try:
            raw = await self._read_body(request)
        except _BodyTooLarge:
            return _error(413, "PAYLOAD_TOO_LARGE", f"the body exceeds {self.max_body_bytes} bytes")
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except ValueError:
            return _error(400, "INVALID_ARGUMENT", "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "INVALID_ARGUMENT", "the body is not a JSON object")
        if "mode" in body:
            body["mode"] = normalize_mode(body["mode"])
        problems = schema.errors("RolloutRequest", body)
        problems += _extra_request_checks(body) if not problems else []
        if problems:
            return _error(422, "VALIDATION_FAILED", "the body breaks the RolloutRequest schema", problems)
        spec = RolloutRequest.from_json(body)
        return spec, hashlib.sha256(_encode(spec.to_json())).hexdigest()

    def _start(self, spec: RolloutRequest, fingerprint: str, parent: Context) -> _Entry:
        cid = spec.trace_correlation_id
        task = asyncio.get_running_loop().create_task(self._play(spec, parent), name=f"rollout {cid}")
        entry = self.cache.start(cid, fingerprint, task)

        def settle(t: asyncio.Task[dict[str, Any]]) -> None:
            self._settle(cid, entry, t)

        task.add_done_callback(settle)
        return entry

    def _settle(self, cid: str, entry: _Entry, task: asyncio.Task[dict[str, Any]]) -> None:
        if task.cancelled():
            self.cache.finish(cid, entry, None)
            return
        exc = task.exception()
        if isinstance(exc, EnvironmentUnavailable):
            log.warning("rollout %s of %s: %s", cid, self.task_app.name, exc)
        elif exc is not None and not isinstance(exc, InvalidArgument | PolicyError | InvalidResult):
            log.error("rollout %s of %s failed", cid, self.task_app.name, exc_info=exc)
        self.cache.finish(cid, entry, None if exc is not None else task.result())

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
        return b"".join(chunks)

    # -- the episode -----------------------------------------------------------------------------------

    async def _play(self, spec: RolloutRequest, parent: Context) -> dict[str, Any]:
        # The episode's server span continues the caller's trace (its `traceparent`), or the trace derived
        # from the correlation id; the policy calls are its children.
        with _tracer.start_as_current_span(
            "taskapp.rollout",
            context=episode_context(parent, spec.trace_correlation_id),
            kind=trace.SpanKind.SERVER,
            attributes={
                "tandem.trace_correlation_id": spec.trace_correlation_id,
                "tandem.task_app": self.task_app.name,
            },
        ) as span:
            parent = trace.set_span_in_context(span, parent)
            return await self._play_episode(spec, parent)

    async def _play_episode(self, spec: RolloutRequest, parent: Context) -> dict[str, Any]:
        app = self.task_app
        max_turns = spec.limits.max_turns or app.max_turns
        max_seconds = spec.limits.max_seconds or app.max_seconds
        # Answer a little before the deadline, so the aborted result reaches the caller (whose own deadline
        # is the same max_seconds) in time.
        budget = max_seconds - min(1.0, 0.1 * max_seconds)
        policy = Policy(
            spec.policy,
            trace_correlation_id=spec.trace_correlation_id,
            max_turns=max_turns,
            client=self.http_client,
            session=self._policy_session(),
            timeout=self.policy_timeout,
            parent_context=parent,
        )
        async with policy:
            try:
                async with asyncio.timeout(budget) as deadline:
                    out = await app.run(spec, policy)
                result = _as_result(out)
            except TimeoutError:
                if not deadline.expired():
                    raise
                result = Result(
                    0.0, details={"abort_reason": "max_seconds", "max_seconds": max_seconds}, aborted=True
                )
            except TurnLimitReached:
                result = Result(
                    0.0, details={"abort_reason": "max_turns", "max_turns": max_turns}, aborted=True
                )
            return self._response(spec, result, policy.turns)

    def _response(self, spec: RolloutRequest, result: Result, recorded: list[Turn]) -> dict[str, Any]:
        if not is_finite_number(result.outcome_reward):
            raise InvalidResult(f"outcome_reward must be a finite number, got {result.outcome_reward!r}")
        events = list(result.event_rewards)
        if not all(is_finite_number(r) for r in events):
            raise InvalidResult("every event reward must be a finite number")
        if len(events) > 10000:
            raise InvalidResult("at most 10000 event rewards")
        try:
            encoded = _encode(dict(result.details))
        except (TypeError, ValueError) as e:
            raise InvalidResult(f"details must be JSON with finite numbers: {e}") from None
        details = json.loads(encoded)  # plain JSON values, which encode to the same bytes again
        if len(encoded) > MAX_DETAILS_BYTES:
            raise InvalidResult("details exceed 64 KiB once encoded")
        turns = recorded if result.turns is None else list(result.turns)
        body: dict[str, Any] = {
            "trace_correlation_id": spec.trace_correlation_id,
            "metrics": {
                "outcome_reward": float(result.outcome_reward),
                "event_rewards": [float(r) for r in events],
                "details": details,
            },
            "trajectory": {"turns": [t.to_json() for t in turns]},
            "aborted": bool(result.aborted),
        }
        if self.validate_responses:
            problems = schema.errors("RolloutResponse", body)
            if problems:
                raise InvalidResult("the result breaks the RolloutResponse schema: " + _summary(problems))
        return body


def _as_result(out: object) -> Result:
    if isinstance(out, Result):
        return out
    if isinstance(out, int | float) and not isinstance(out, bool):
        return Result(float(out))
    raise InvalidResult(f"rollout must return a Result or a float, got {type(out).__name__}")


def _extra_request_checks(body: Mapping[str, Any]) -> list[dict[str, str]]:
    problems: list[dict[str, str]] = []
    env = body.get("env")
    if isinstance(env, Mapping):
        seed = env.get("seed", 0)
        if int(seed) > MAX_SEED:
            problems.append({"path": "$.env.seed", "message": "seed must be at most 2^64-1"})
        config = env.get("config")
        if config is not None and len(_encode(config)) > MAX_CONFIG_BYTES:
            problems.append({"path": "$.env.config", "message": "config exceeds 64 KiB once encoded"})
    policy = body.get("policy")
    policy_config = policy.get("config") if isinstance(policy, Mapping) else None
    if isinstance(policy_config, Mapping) and int(policy_config.get("seed", 0)) > MAX_SEED:
        problems.append({"path": "$.policy.config.seed", "message": "seed must be at most 2^64-1"})
    return problems


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _encode(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _summary(problems: Sequence[Mapping[str, str]]) -> str:
    return "; ".join(f"{p['path']}: {p['message']}" for p in problems[:3])


def _current_task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
