"""`Policy`: the async OpenAI-compatible chat client a rollout plays with.

Every call goes to `POST {inference_url}/chat/completions` (the URL embeds the episode's correlation id)
with the headers `X-Trace-Correlation-Id` and W3C `traceparent`, counts against the episode's turn limit,
and is recorded as a trajectory turn."""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
import ssl
import urllib.request
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import aiohttp
import httpx
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from tandem_taskapp.errors import PolicyError, TurnLimitReached
from tandem_taskapp.models import MAX_SEED, Message, PolicyConfig, Turn, as_message, content_text

CORRELATION_HEADER = "X-Trace-Correlation-Id"
DEFAULT_TIMEOUT_S = 300.0

_tracer = trace.get_tracer("tandem_taskapp")

MessageLike = Message | Mapping[str, Any]


class Policy:
    """An OpenAI-compatible chat client bound to one episode.

    `await policy.chat(messages, **overrides)` answers the reply text; `policy.last_response` holds the raw
    chat-completion JSON of the latest call, and `await policy.complete(...)` answers it directly. Overrides
    are merged into the request body (e.g. `stop=["\\n"]`, `temperature=0`, `tools=[...]`).

    Calls go through `client` (an httpx client) when one is given, else through `session` (an aiohttp
    session shared by many episodes, as a Task App server passes), else through an httpx client the policy
    makes and closes itself. `timeout` bounds connecting and each read, as httpx's timeout does."""

    def __init__(
        self,
        config: PolicyConfig,
        *,
        trace_correlation_id: str,
        max_turns: int | None = None,
        client: httpx.AsyncClient | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        parent_context: Context | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.config = config
        self.trace_correlation_id = trace_correlation_id
        self.max_turns = max_turns
        self._client = client
        self._owns_client = client is None
        self._session = session if client is None else None
        self._session_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._timeout = timeout
        self._headers = dict(headers or {})
        self._parent_context = episode_context(parent_context, trace_correlation_id)
        self._turns: list[Turn] = []
        self._history: list[Message] = []
        self.turns_used = 0
        self.last_response: dict[str, Any] | None = None

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def inference_url(self) -> str:
        return self.config.inference_url

    @property
    def temperature(self) -> float | None:
        return self.config.temperature

    @property
    def max_completion_tokens(self) -> int:
        return self.config.max_completion_tokens

    @property
    def turns_left(self) -> int | None:
        """How many calls the episode may still make; None when unlimited."""
        return None if self.max_turns is None else max(0, self.max_turns - self.turns_used)

    @property
    def turns(self) -> list[Turn]:
        """The turns recorded so far (a copy)."""
        return list(self._turns)

    @property
    def chat_completions_url(self) -> str:
        return self.config.inference_url.rstrip("/") + "/chat/completions"

    async def chat(self, messages: Sequence[MessageLike], **overrides: Any) -> str:
        """Call the policy with `messages` (OpenAI format) and answer the reply's text."""
        response = await self.complete(messages, **overrides)
        return _reply_text(response)

    async def complete(self, messages: Sequence[MessageLike], **overrides: Any) -> dict[str, Any]:
        """Call the policy and answer the raw chat-completion JSON.

        Raises `TurnLimitReached` before a call beyond `max_turns`, `PolicyError` when the call fails."""
        if self.max_turns is not None and self.turns_used >= self.max_turns:
            raise TurnLimitReached(self.max_turns)
        self.turns_used += 1
        wire = [_wire_message(m) for m in messages]
        body: dict[str, Any] = {"model": self.config.model, "messages": wire}
        if self.config.temperature is not None:
            body["temperature"] = self.config.temperature
        if self.config.max_completion_tokens:
            body["max_completion_tokens"] = self.config.max_completion_tokens
        # The trainer scores each token under the distribution it was sampled from, so the truncations
        # the job set go with every call (`top_k` and `min_p` as vLLM's extensions of the OpenAI body).
        body.update(self.config.sampling())
        if self.config.seed is not None:  # each call its own draws, the same in every run of the episode
            body["seed"] = (self.config.seed + self.turns_used - 1) % (MAX_SEED + 1)
        body.update(overrides)
        response = await self._post(body)
        self.last_response = response
        self._record([as_message(m) for m in wire], _reply_message(response))
        return response

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _record(self, sent: list[Message], reply: Message) -> None:
        # A multi-turn rollout usually resends the whole conversation; the turn holds only what is new since
        # the previous call (the observation), then the reply.
        n = len(self._history)
        new = sent[n:] if n and sent[:n] == self._history else sent
        self._turns.append(Turn((*new, reply)))
        self._history = [*sent, reply]

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = policy_http_client(self._timeout)
        return self._client

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            **self._headers,
            CORRELATION_HEADER: self.trace_correlation_id,
        }
        with _tracer.start_as_current_span(
            "policy.chat_completions", context=self._parent_context, kind=SpanKind.CLIENT
        ) as span:
            self._inject_trace(span, headers)
            if self._session is not None:
                status, data = await self._post_aiohttp(self._session, body, headers)
            else:
                status, data = await self._post_httpx(body, headers)
            if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
                raise PolicyError("policy answered JSON that is not a chat completion", status_code=status)
            return data

    async def _post_httpx(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
        try:
            r = await self._http().post(
                self.chat_completions_url, content=json.dumps(body), headers=headers, timeout=self._timeout
            )
        except httpx.HTTPError as e:
            raise PolicyError(f"policy call failed: {type(e).__name__}") from None
        if r.status_code >= 400:
            raise PolicyError(f"policy answered HTTP {r.status_code}", status_code=r.status_code)
        try:
            return r.status_code, r.json()
        except ValueError:
            raise PolicyError("policy answered a body that is not JSON", status_code=r.status_code) from None

    async def _post_aiohttp(
        self, session: aiohttp.ClientSession, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, Any]:
        try:
            async with session.post(
                self.chat_completions_url,
                data=json.dumps(body).encode(),
                headers=headers,
                timeout=self._session_timeout,
            ) as r:
                status = r.status
                raw = await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise PolicyError(f"policy call failed: {type(e).__name__}") from None
        if status >= 400:
            raise PolicyError(f"policy answered HTTP {status}", status_code=status)
        try:
            return status, json.loads(raw)
        except ValueError:
            raise PolicyError("policy answered a body that is not JSON", status_code=status) from None

    def _inject_trace(self, span: trace.Span, headers: dict[str, str]) -> None:
        if span.is_recording():
            propagate.inject(headers)
            return
        # No tracing SDK is configured: still send a valid traceparent, a fresh child of the episode's
        # context (see episode_context), so every call of the episode shares one trace.
        parent = trace.get_current_span(self._parent_context).get_span_context()
        child = SpanContext(
            trace_id=parent.trace_id,
            span_id=_new_span_id(),
            is_remote=False,
            trace_flags=parent.trace_flags,
            trace_state=parent.trace_state,
        )
        propagate.inject(
            headers, context=trace.set_span_in_context(NonRecordingSpan(child), self._parent_context)
        )


def policy_http_client(timeout: float = DEFAULT_TIMEOUT_S) -> httpx.AsyncClient:
    """The httpx client a `Policy` makes for itself when it is given neither a client nor a session."""
    return httpx.AsyncClient(timeout=timeout, verify=_tls_context())


def policy_session() -> aiohttp.ClientSession:
    """A pooled aiohttp session for the policy calls of many episodes (a Task App server makes one). Not
    httpx: its connection pool scans every pooled connection on each request, which cost more than half of
    an app's CPU with 64 episodes in flight. Same trust as httpx (the shared TLS context, `HTTP(S)_PROXY`
    when set at start-up), no cap on connections (no episode waits for another's), no cookie jar. Must be
    made on the running event loop."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=_tls_context()),
        timeout=aiohttp.ClientTimeout(total=None),
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=proxy_configured(),
    )


PROXIED_SCHEMES = ("http", "https", "ws", "wss")  # the ones aiohttp reads from `*_PROXY` variables


def proxy_configured() -> bool:
    """Whether an `HTTP(S)_PROXY` (or `WS(S)_PROXY`) variable is set, i.e. whether an aiohttp session should
    trust the environment. The scheme matters: urllib takes every variable ending in `_proxy` for one, the
    mesh's own `TANDEM_PORTS__TASKAPP_PROXY` included, and a session that trusts the environment looks up
    proxies and `.netrc` in a worker thread on every request."""
    proxies = urllib.request.getproxies()
    return any(scheme in proxies for scheme in PROXIED_SCHEMES)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once: loading the CA bundle for every episode's client cost most
    of a Task App's CPU (about 80% in a profile of the single-turn app at 10 episodes/s)."""
    return httpx.create_ssl_context()


def trace_id_for(trace_correlation_id: str) -> int:
    """The 128-bit trace id used for an episode that arrived without a trace context."""
    digest = hashlib.sha256(b"tandem-trace:" + trace_correlation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:16], "big") or 1


def _new_span_id() -> int:
    return secrets.randbits(64) or 1


def _wire_message(m: MessageLike) -> dict[str, Any]:
    if isinstance(m, Message):
        return {"role": m.role, "content": m.content}
    return dict(m)


def _reply_message(response: Mapping[str, Any]) -> Message:
    msg = _first_message(response)
    text = content_text(msg.get("content"))
    if not text and msg.get("tool_calls"):
        text = json.dumps(msg["tool_calls"], ensure_ascii=False)
    return Message(role=str(msg.get("role") or "assistant"), content=text)


def _reply_text(response: Mapping[str, Any]) -> str:
    return content_text(_first_message(response).get("content"))


def _first_message(response: Mapping[str, Any]) -> Mapping[str, Any]:
    choice = response["choices"][0]
    if not isinstance(choice, Mapping):
        raise PolicyError("policy answered a choice that is not an object")
    msg = choice.get("message")
    if isinstance(msg, Mapping):
        return msg
    if isinstance(choice.get("text"), str):  # a completions-style choice
        return {"role": "assistant", "content": choice["text"]}
    raise PolicyError("policy answered a choice without a message")


def episode_context(parent: Context | None, trace_correlation_id: str) -> Context:
    """The context every policy call of the episode is a child of, so the episode is one trace: the incoming
    request's trace when it carried one, else a trace whose id is derived from the correlation id."""
    if trace.get_current_span(parent).get_span_context().is_valid:
        assert parent is not None
        return parent
    root = SpanContext(
        trace_id=trace_id_for(trace_correlation_id),
        span_id=_new_span_id(),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(root), parent)
