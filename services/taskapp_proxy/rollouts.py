"""Calling Task Apps: one rollout as a typed result, never a crash, never a silent zero reward.

Per app the proxy keeps a concurrency limit, a circuit breaker, the environment key (read from the vault by
runtime injection and kept in memory only, briefly) and the episodes in flight or recently finished by
correlation id: a repeat joins the running episode or gets the recorded result. Retries are only for
failures where the request may not have been acted on (connection failures, 502/503/504), with the same
correlation id, which the contract makes idempotent. Domain code: no grpc import.

Every app is called through one pooled aiohttp session (`http_session`): httpx's connection pool scanned
every pooled connection on each request, a quarter of the mesh's CPU at 64 rollouts in flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from google.protobuf import json_format
from opentelemetry import propagate, trace
from tandem.taskapp.v1 import rollout_pb2, task_app_pb2

from tandem_taskapp import hosted, schema
from tandem_taskapp.policy import proxy_configured

Kind = rollout_pb2.RolloutError.Kind
KeyFetcher = Callable[[str], Awaitable[str]]
RETRYABLE_STATUS = frozenset({502, 503, 504})
BREAKER_KINDS = frozenset({Kind.KIND_UNREACHABLE, Kind.KIND_TIMEOUT, Kind.KIND_HTTP_STATUS})
MAX_CONNECTIONS = 1024
_tracer = trace.get_tracer("tandem.taskapp_proxy")


def http_session(max_connections: int = MAX_CONNECTIONS) -> aiohttp.ClientSession:
    """The one session the proxy calls every app with: pooled keep-alive connections, no session-wide
    timeout (each call brings its own deadline), no cookie jar (an app's cookies are not sent back to it,
    nor to another app on the same host). It trusts the same CA bundle httpx would (`SSL_CERT_FILE`,
    `SSL_CERT_DIR`, else certifi's), in a TLS context built once, and honours `HTTP(S)_PROXY` / `NO_PROXY`
    when they are set at start-up. Must be made on the running event loop."""
    connector = aiohttp.TCPConnector(
        limit=max_connections, limit_per_host=0, ssl=httpx.create_ssl_context(), keepalive_timeout=30.0
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        cookie_jar=aiohttp.DummyCookieJar(),
        # Proxy variables are looked up on every request when trusted; where none is set, skip that.
        trust_env=proxy_configured(),
    )


@dataclass
class Limits:
    max_concurrency: int
    rollout_timeout_s: float
    max_retries: int


@dataclass
class Breaker:
    """Opens after `threshold` consecutive failures; after `open_s` one trial call decides."""

    threshold: int
    open_s: float
    failures: int = 0
    opened_at: float | None = None
    trial_running: bool = False

    def allow(self) -> bool:
        if self.opened_at is None:
            return True
        if time.monotonic() - self.opened_at < self.open_s or self.trial_running:
            return False
        self.trial_running = True
        return True

    def record(self, ok: bool) -> None:
        self.trial_running = False
        if ok:
            self.failures, self.opened_at = 0, None
            return
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = time.monotonic()

    @property
    def open(self) -> bool:
        return self.opened_at is not None


@dataclass
class _AppState:
    limits: Limits
    breaker: Breaker
    slots: asyncio.Semaphore
    in_flight: dict[str, asyncio.Future[rollout_pb2.RolloutResult]] = field(default_factory=dict)
    finished: OrderedDict[str, tuple[bytes, rollout_pb2.RolloutResult]] = field(default_factory=OrderedDict)


def _error(kind: Any, message: str, *, status: int = 0, retryable: bool = False) -> rollout_pb2.RolloutError:
    return rollout_pb2.RolloutError(
        kind=kind, message=message[:1000], http_status=status, retryable=retryable
    )


def key_headers(key: str) -> dict[str, str]:
    """The headers that carry an app's key: `X-API-Key`, and `X-API-Keys` (a comma-separated list, here of
    one) for apps written to the hosted dialect, which may read either. None for an app without a key."""
    return {"X-API-Key": key, "X-API-Keys": key} if key else {}


def encode_json(body: Any) -> bytes:
    """A request body as httpx's `json=` wrote it: compact, UTF-8, NaN refused."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def spec_json(spec: rollout_pb2.RolloutSpec) -> dict[str, Any]:
    """The HTTP body: snake_case names, mode as the contract's lowercase word."""
    body = json_format.MessageToDict(
        spec, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )  # seed 0 and other zero values are sent, not left for the app to guess
    body["mode"] = "eval" if spec.mode == rollout_pb2.ROLLOUT_MODE_EVAL else "rl"
    body["env"]["seed"] = int(
        spec.env.seed
    )  # proto3 JSON writes 64-bit integers as strings; apps expect a number
    if spec.policy.config.HasField("seed"):
        body["policy"]["config"]["seed"] = int(spec.policy.config.seed)  # a number too
    # The hosted dialect's names for the same things (tandem_taskapp/hosted.py); other apps ignore them.
    body["run_id"] = spec.trace_correlation_id
    if spec.limits.max_seconds:
        body["safety"] = {"max_time_s": int(spec.limits.max_seconds)}
    return body


def parse_result(raw: bytes, correlation_id: str) -> rollout_pb2.RolloutResult:
    """The app's answer as a result; a contract violation becomes a typed error, never an exception. An
    answer in the hosted dialect (`trajectories[].steps[]` or a `trace`) is first turned into Tandem's
    shape, so the trainer sees one shape whatever the app speaks."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return rollout_pb2.RolloutResult(error=_error(Kind.KIND_MALFORMED_RESPONSE, "the answer is not JSON"))
    if not isinstance(body, dict):
        return rollout_pb2.RolloutResult(
            error=_error(Kind.KIND_MALFORMED_RESPONSE, "the answer is not an object")
        )
    body = hosted.rollout_to_tandem(body)
    echoed = body.get("trace_correlation_id")
    if echoed != correlation_id:
        return rollout_pb2.RolloutResult(
            error=_error(
                Kind.KIND_CORRELATION_MISMATCH, f"the answer is for {str(echoed)[:128]!r}, not this episode"
            )
        )
    metrics = body.get("metrics")
    if not isinstance(metrics, dict) or "outcome_reward" not in metrics:
        return rollout_pb2.RolloutResult(
            error=_error(Kind.KIND_MALFORMED_RESPONSE, "metrics.outcome_reward is missing")
        )
    rewards = [metrics.get("outcome_reward"), *(metrics.get("event_rewards") or [])]
    if not all(isinstance(r, int | float) and not isinstance(r, bool) for r in rewards):
        return rollout_pb2.RolloutResult(
            error=_error(Kind.KIND_MALFORMED_RESPONSE, "rewards must be numbers")
        )
    if not all(math.isfinite(float(r)) for r in rewards):
        return rollout_pb2.RolloutResult(
            error=_error(Kind.KIND_NON_FINITE_REWARD, "a reward is NaN or infinite")
        )
    violations = schema.errors("RolloutResponse", body, limit=3)
    if violations:
        where = "; ".join(f"{v['path']}: {v['message']}" for v in violations)
        return rollout_pb2.RolloutResult(
            error=_error(Kind.KIND_MALFORMED_RESPONSE, f"the answer breaks the contract's schema: {where}")
        )
    kept = {k: body[k] for k in ("trace_correlation_id", "metrics", "trajectory", "aborted") if k in body}
    try:
        return json_format.ParseDict(kept, rollout_pb2.RolloutResult(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as error:
        return rollout_pb2.RolloutResult(
            error=_error(Kind.KIND_MALFORMED_RESPONSE, f"the answer breaks the schema: {error}")
        )


class RolloutRunner:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        keys: KeyFetcher,
        *,
        breaker_failures: int = 5,
        breaker_open_s: float = 30.0,
        max_response_bytes: int = 64 * 1024 * 1024,
        result_cache: int = 10_000,
    ) -> None:
        self._http = http
        self._keys = keys
        self._breaker_failures = breaker_failures
        self._breaker_open_s = breaker_open_s
        self._max_response = max_response_bytes
        self._result_cache = result_cache
        self._apps: dict[str, _AppState] = {}

    def _state(self, app: str, limits: Limits) -> _AppState:
        state = self._apps.get(app)
        if state is None or state.limits != limits:
            state = _AppState(
                limits,
                Breaker(self._breaker_failures, self._breaker_open_s),
                asyncio.Semaphore(limits.max_concurrency),
            )
            self._apps[app] = state
        return state

    def breaker_open(self, app: str) -> bool:
        state = self._apps.get(app)
        return state is not None and state.breaker.open

    def forget(self, app: str) -> None:
        self._apps.pop(app, None)

    async def rollout(
        self, app: task_app_pb2.TaskApp, limits: Limits, spec: rollout_pb2.RolloutSpec
    ) -> rollout_pb2.RolloutResult:
        state = self._state(app.name, limits)
        correlation = spec.trace_correlation_id
        fingerprint = spec.SerializeToString(deterministic=True)
        if correlation in state.finished:
            recorded_spec, recorded = state.finished[correlation]
            if recorded_spec == fingerprint:
                return recorded
        running = state.in_flight.get(correlation)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[rollout_pb2.RolloutResult] = asyncio.get_running_loop().create_future()
        state.in_flight[correlation] = future
        try:
            result = await self._run(app, state, spec)
            future.set_result(result)
        except BaseException as error:
            future.set_exception(error)
            raise
        finally:
            state.in_flight.pop(correlation, None)
            if not future.done():
                future.cancel()
        if not result.HasField("error") or not result.error.retryable:
            state.finished[correlation] = (fingerprint, result)
            while len(state.finished) > self._result_cache:
                state.finished.popitem(last=False)
        return result

    async def _run(
        self, app: task_app_pb2.TaskApp, state: _AppState, spec: rollout_pb2.RolloutSpec
    ) -> rollout_pb2.RolloutResult:
        started = time.monotonic()
        timeout = state.limits.rollout_timeout_s
        if spec.limits.max_seconds:
            timeout = min(timeout, float(spec.limits.max_seconds))
        deadline = started + timeout

        def finish(result: rollout_pb2.RolloutResult, attempts: int) -> rollout_pb2.RolloutResult:
            result.attempts = attempts
            result.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
            if not result.trace_correlation_id:
                result.trace_correlation_id = spec.trace_correlation_id
            return result

        if not state.breaker.allow():
            return finish(
                rollout_pb2.RolloutResult(
                    error=_error(Kind.KIND_CIRCUIT_OPEN, "the app's circuit breaker is open")
                ),
                0,
            )
        try:
            await asyncio.wait_for(state.slots.acquire(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            state.breaker.trial_running = False
            return finish(
                rollout_pb2.RolloutResult(
                    error=_error(Kind.KIND_CONCURRENCY_LIMIT, "no concurrency slot freed up")
                ),
                0,
            )
        try:
            try:
                key = await self._keys(app.secret_name) if app.secret_name else ""
            except Exception as exc:  # any vault failure is reported as this kind
                state.breaker.trial_running = False
                reason = getattr(exc, "reason", "") or type(exc).__name__
                return finish(
                    rollout_pb2.RolloutResult(
                        error=_error(
                            Kind.KIND_SECRET_UNAVAILABLE, f"the app's key could not be read: {reason}"
                        )
                    ),
                    0,
                )
            result, attempts = await self._attempts(app, state, spec, key, deadline)
        finally:
            state.slots.release()
        failed_kind = result.error.kind if result.HasField("error") else 0
        state.breaker.record(failed_kind not in BREAKER_KINDS or failed_kind == 0)
        return finish(result, attempts)

    async def _attempts(
        self,
        app: task_app_pb2.TaskApp,
        state: _AppState,
        spec: rollout_pb2.RolloutSpec,
        key: str,
        deadline: float,
    ) -> tuple[rollout_pb2.RolloutResult, int]:
        url = app.base_url.rstrip("/") + "/rollout"
        with _tracer.start_as_current_span(
            "taskapp.rollout",
            kind=trace.SpanKind.CLIENT,
            attributes={"tandem.trace_correlation_id": spec.trace_correlation_id, "url.full": url},
        ) as span:
            result, attempts = await self._attempts_traced(state, spec, key, url, deadline)
            span.set_attribute("tandem.attempts", attempts)
            if result.HasField("error"):
                span.set_status(trace.StatusCode.ERROR, result.error.message)
            return result, attempts

    async def _attempts_traced(
        self,
        state: _AppState,
        spec: rollout_pb2.RolloutSpec,
        key: str,
        url: str,
        deadline: float,
    ) -> tuple[rollout_pb2.RolloutResult, int]:
        headers = key_headers(key)
        headers["X-Trace-Correlation-Id"] = spec.trace_correlation_id
        headers["Content-Type"] = "application/json"
        propagate.inject(headers)  # the app's spans continue this rollout's trace (W3C traceparent)
        body = encode_json(spec_json(spec))  # once per episode, not per attempt
        attempts = 0
        backoff = 0.1
        while True:
            attempts += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return rollout_pb2.RolloutResult(
                    error=_error(Kind.KIND_TIMEOUT, "the rollout deadline passed")
                ), attempts - 1
            result = await self._attempt(url, headers, body, spec, remaining)
            error = result.error if result.HasField("error") else None
            if error is None or not error.retryable or attempts > state.limits.max_retries:
                return result, attempts
            await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff *= 2

    async def _attempt(
        self,
        url: str,
        headers: dict[str, str],
        body: bytes,
        spec: rollout_pb2.RolloutSpec,
        budget_s: float,
    ) -> rollout_pb2.RolloutResult:
        timeout = budget_s
        too_large = rollout_pb2.RolloutResult(
            error=_error(Kind.KIND_RESPONSE_TOO_LARGE, f"the answer exceeds {self._max_response} bytes")
        )
        try:
            # One deadline covers the pool wait, connecting, sending and reading the whole answer.
            async with asyncio.timeout(timeout):
                async with self._http.post(url, data=body, headers=headers) as response:
                    status = response.status
                    declared = response.content_length
                    if (
                        declared is not None
                        and declared > self._max_response
                        and "Content-Encoding" not in response.headers
                    ):
                        return too_large
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in response.content.iter_any():  # decoded bytes, as they arrive
                        size += len(chunk)
                        if size > self._max_response:
                            return too_large
                        chunks.append(chunk)
        except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
            return rollout_pb2.RolloutResult(
                error=_error(Kind.KIND_TIMEOUT, f"no answer within {timeout:.1f}s")
            )
        except aiohttp.ClientError as error:  # refused, reset, closed early, garbled HTTP
            return rollout_pb2.RolloutResult(
                error=_error(
                    Kind.KIND_UNREACHABLE,
                    f"the app could not be reached: {type(error).__name__}",
                    retryable=True,
                )
            )
        if status in (401, 403):
            return rollout_pb2.RolloutResult(
                error=_error(Kind.KIND_AUTH_REJECTED, "the app refused the key", status=status)
            )
        if not 200 <= status < 300:
            return rollout_pb2.RolloutResult(
                error=_error(
                    Kind.KIND_HTTP_STATUS,
                    f"the app answered HTTP {status}",
                    status=status,
                    retryable=status in RETRYABLE_STATUS,
                )
            )
        return parse_result(chunks[0] if len(chunks) == 1 else b"".join(chunks), spec.trace_correlation_id)
