"""Server interceptors, applied in one fixed order by `mesh.server`:

1. `RequestContextInterceptor`: request id (from `x-request-id` or new), a server span per call (named
   by the method, parented by the caller's trace context carried in metadata, with the `rpc.*` attributes
   and the status code), one structured log line per call, and the single place where domain errors
   become gRPC status (unknown exceptions become INTERNAL with the request id, never internals).
2. `AuthInterceptor`: the caller's token -> `Principal` in `current_principal()`; public methods pass.
3. `ValidationInterceptor`: size limit, parsing and contract rules on every request message, answering
   MESSAGE_TOO_LARGE, MALFORMED_REQUEST or INVALID_ARGUMENT with the fields named.

Each interceptor wraps a method's handler once and keeps the result: the wrappers hold nothing of a call
(what a call needs, they take from its context), so a call costs each interceptor a dictionary lookup, not a
new handler and its closures. The span is started here rather than by OpenTelemetry's aio interceptor,
which builds its wrappers around every call's details anew and so defeats that.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import SpanKind, Status, StatusCode

from mesh import jobtokens
from mesh.errors import InvalidArgument as InvalidArgumentError
from mesh.errors import R, ResourceExhausted, TandemError, Unauthenticated, Unimplemented
from mesh.identity import Principal, TokenVerifier
from mesh.jobtokens import JobLiveness
from mesh.observability import caller_var, request_id_var
from mesh.status import status_for
from mesh.validation import violations

log = logging.getLogger("tandem.rpc")
_tracer = trace.get_tracer("tandem.rpc")

principal_var: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "tandem_principal", default=None
)

REQUEST_ID_KEY = "x-request-id"
AUTHORIZATION_KEY = "authorization"
ALWAYS_PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Behavior = Callable[..., Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Authenticator = Callable[[str], Awaitable[Principal | None]]


def current_principal() -> Principal:
    """The authenticated caller of the call being served; raises if the method was public."""
    principal = principal_var.get()
    if principal is None:
        raise Unauthenticated("this call requires credentials", reason=R.ERROR_REASON_MISSING_CREDENTIALS)
    return principal


class _MetadataGetter(Getter[Sequence[tuple[str, Any]]]):
    """Reads trace context (`traceparent`, `tracestate`, baggage) out of a call's invocation metadata."""

    def get(self, carrier: Sequence[tuple[str, Any]], key: str) -> list[str] | None:
        found = [value for name, value in carrier if name == key and isinstance(value, str)]
        return found or None

    def keys(self, carrier: Sequence[tuple[str, Any]]) -> list[str]:
        return [name for name, _ in carrier]


_METADATA = _MetadataGetter()


def _metadata(context: grpc.aio.ServicerContext[Any, Any], key: str) -> str:
    for item_key, value in context.invocation_metadata() or ():
        if item_key == key and isinstance(value, str):
            return value
    return ""


def _rewrap(
    handler: Handler,
    wrap_unary: Callable[[Behavior], Behavior],
    wrap_stream: Callable[[Behavior], Behavior],
    *,
    raw_requests: bool = False,
) -> Handler:
    """A copy of `handler` whose behavior is wrapped; unary responses and streamed ones differ in shape.

    With `raw_requests` the new handler receives undecoded request bytes (the validator decodes them).
    """
    deserializer = None if raw_requests else handler.request_deserializer
    serializer = _passthrough(handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), deserializer, serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            wrap_unary(handler.stream_unary), deserializer, serializer
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream), deserializer, serializer
        )
    assert handler.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), deserializer, serializer)


def _passthrough(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """The handler's response serializer, letting already-serialized `bytes` responses through unchanged.

    A streaming handler that sends one message to many callers can serialize it once and yield the bytes;
    messages are serialized exactly as before.
    """
    if serializer is None or getattr(serializer, "_tandem_passthrough", False):
        return serializer

    def serialize(response: Any) -> bytes:
        if type(response) is bytes:
            return response
        return serializer(response)

    serialize._tandem_passthrough = True  # type: ignore[attr-defined]
    return serialize


def _stream_of(result: Any) -> AsyncIterator[Any]:
    """A streaming behavior's result as an async iterator, whether it is one already or a coroutine that
    sends with write()."""
    if inspect.isasyncgen(result) or hasattr(result, "__aiter__"):
        iterator: AsyncIterator[Any] = result
        return iterator
    return _drain(result)


async def _drain(result: Awaitable[Any]) -> AsyncIterator[Any]:
    await result
    return
    yield  # an async generator that yields nothing


class _Interceptor(grpc.aio.ServerInterceptor):
    """Wraps each method handler with `around(method, request, context, proceed)`, once per method."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}  # method -> (handler, its wrapped copy)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        kept = self._wrapped.get(method)
        if kept is not None and kept[0] is handler:  # the same handler as the last call's: the same wrapper
            return kept[1]
        wrapped = self.wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def wrap(self, method: str, handler: Handler) -> Handler:
        return _rewrap(handler, self._wrap_unary(method), self._wrap_stream(method))

    def _wrap_unary(self, method: str) -> Callable[[Behavior], Behavior]:
        def wrap_unary(behavior: Behavior) -> Behavior:
            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                async def proceed() -> Any:
                    return await behavior(request, context)

                return await self.around(method, context, proceed)

            return unary

        return wrap_unary

    def _wrap_stream(self, method: str) -> Callable[[Behavior], Behavior]:
        def wrap_stream(behavior: Behavior) -> Behavior:
            # The whole stream runs inside one `around_stream`, yielding as it goes; the inner behavior is
            # opened inside it too, so its errors meet this interceptor. A plain function returning the
            # generator, so each streamed message passes one generator per interceptor, not three.
            def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                return self.around_stream(method, context, lambda: _stream_of(behavior(request, context)))

            return stream

        return wrap_stream

    async def around(
        self, method: str, context: grpc.aio.ServicerContext[Any, Any], proceed: Callable[[], Awaitable[Any]]
    ) -> Any:
        await self.before(method, context)
        return await proceed()

    async def around_stream(
        self,
        method: str,
        context: grpc.aio.ServicerContext[Any, Any],
        open_stream: Callable[[], AsyncIterator[Any]],
    ) -> AsyncIterator[Any]:
        await self.before(method, context)
        async for item in open_stream():
            yield item

    async def before(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        return None


class RequestContextInterceptor(_Interceptor):
    """Request id, a log line per call, and the mapping of errors to status."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    async def _fail(
        self, context: grpc.aio.ServicerContext[Any, Any], error: BaseException, rid: str
    ) -> None:
        if isinstance(error, TandemError):
            await context.abort_with_status(status_for(error, rid))
        if isinstance(error, NotImplementedError):  # the generated base class of a method not written yet
            missing = Unimplemented("this method is not implemented by this server yet")
            await context.abort_with_status(status_for(missing, rid))
        log.exception("unhandled error", extra={"service": self._service})
        internal = TandemError(f"internal error; quote request id {rid} when reporting it")
        await context.abort_with_status(status_for(internal, rid))

    def _start(self, context: grpc.aio.ServicerContext[Any, Any]) -> tuple[str, contextvars.Token[str]]:
        rid = _metadata(context, REQUEST_ID_KEY)[:64] or uuid.uuid4().hex
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
        return rid, request_id_var.set(rid)

    def _span(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """The call's server span, current while it runs, a child of the caller's span when the metadata
        carries one (OpenTelemetry's semantic conventions for RPC: `rpc.system`, `rpc.service`,
        `rpc.method`, `rpc.grpc.status_code`)."""
        service, _, name = method.lstrip("/").partition("/")
        carrier: Sequence[tuple[str, Any]] = tuple(context.invocation_metadata() or ())
        return _tracer.start_as_current_span(
            method,
            context=propagate.extract(carrier, getter=_METADATA),
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
            record_exception=False,
            set_status_on_exception=False,
        )

    def _log(
        self,
        method: str,
        context: grpc.aio.ServicerContext[Any, Any],
        started: float,
        error: Any,
        span: trace.Span,
    ) -> None:
        code = "OK"
        reason = ""
        if isinstance(error, TandemError):
            code, reason = error.code, error.reason_name
        elif isinstance(error, NotImplementedError):
            code, reason = "UNIMPLEMENTED", "NOT_IMPLEMENTED"
        elif error is not None:
            code = getattr(context.code(), "name", "") or "UNKNOWN"
        status = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
        span.set_attribute("rpc.grpc.status_code", status.value[0])
        if error is not None:
            if not isinstance(error, TandemError | NotImplementedError):
                span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{code} {reason}".strip()))
        log.info(
            "rpc",
            extra={
                "service": self._service,
                "method": method,
                "code": code,
                "reason": reason,
                "duration_ms": round((time.perf_counter() - started) * 1000, 3),
            },
        )

    async def around(
        self, method: str, context: grpc.aio.ServicerContext[Any, Any], proceed: Callable[[], Awaitable[Any]]
    ) -> Any:
        rid, token = self._start(context)
        started = time.perf_counter()
        error: BaseException | None = None
        with self._span(method, context) as span:
            try:
                return await proceed()
            except Exception as exc:
                error = exc
                await self._fail(context, exc, rid)
            finally:
                self._log(method, context, started, error, span)
                request_id_var.reset(token)

    def _wrap_stream(self, method: str) -> Callable[[Behavior], Behavior]:
        # The outermost interceptor: gRPC runs a streaming behavior as an async generator only when the
        # function itself is one (a bound partial of one counts), so this one is a generator function.
        def wrap_stream(behavior: Behavior) -> Behavior:
            return functools.partial(self._stream, method, behavior)

        return wrap_stream

    async def _stream(
        self, method: str, behavior: Behavior, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        rid, token = self._start(context)
        started = time.perf_counter()
        error: BaseException | None = None
        with self._span(method, context) as span:
            try:
                async for item in _stream_of(behavior(request, context)):
                    yield item
            except Exception as exc:
                error = exc
                await self._fail(context, exc, rid)
            finally:
                self._log(method, context, started, error, span)
            # A stream the client cancelled is closed by the event loop from another context, where the
            # token does not apply; that context ends with the call anyway.
            with contextlib.suppress(ValueError):
                request_id_var.reset(token)


class AuthInterceptor(_Interceptor):
    """Authenticates every non-public call. Authenticators are tried in order (mesh tokens first; the
    gateway adds organization API keys); the first that recognises the credential decides."""

    def __init__(self, verifier: TokenVerifier, public_methods: Collection[str]) -> None:
        super().__init__()
        self._verifier = verifier
        self._public = public_methods
        self.authenticators: list[Authenticator] = []
        # Revokes the tokens of ended jobs (mesh/jobtokens.py); set by the server bootstrap.
        self.liveness: JobLiveness | None = None

    async def before(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        header = _metadata(context, AUTHORIZATION_KEY)
        if method.startswith(ALWAYS_PUBLIC_PREFIXES) or method in self._public:
            if header:
                # A public method still learns who is calling when credentials are offered.
                try:
                    principal_var.set(await self._authenticate(header))
                except TandemError:
                    principal_var.set(None)
            else:
                principal_var.set(None)
            return
        if not header:
            raise Unauthenticated("this call requires credentials", reason=R.ERROR_REASON_MISSING_CREDENTIALS)
        principal = await self._authenticate(header)
        if principal.kind == "job":
            jobtokens.check_method(principal, method)
            if self.liveness is not None:
                await self.liveness.check(principal)
        principal_var.set(principal)
        caller_var.set(f"{principal.kind}:{principal.subject}")

    async def _authenticate(self, header: str) -> Principal:
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not credential:
            raise Unauthenticated(
                "authorization must be 'Bearer <token>'", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            )
        if credential.startswith("tdm1."):
            return self._verifier.verify(credential)
        for authenticate in self.authenticators:
            principal = await authenticate(credential)
            if principal is not None:
                return principal
        raise Unauthenticated("credentials are not recognised", reason=R.ERROR_REASON_INVALID_CREDENTIALS)


class ValidationInterceptor(_Interceptor):
    """Parses each request itself (so size and decoding failures get reasons) and checks contract rules."""

    def __init__(self, max_message_bytes: int) -> None:
        super().__init__()
        self._limit = max_message_bytes

    def wrap(self, method: str, handler: Handler) -> Handler:
        parse = handler.request_deserializer
        if parse is None:
            return handler

        def check(raw: bytes) -> Message:
            if len(raw) > self._limit:
                raise ResourceExhausted(
                    f"request is {len(raw)} bytes; the limit is {self._limit}",
                    reason=R.ERROR_REASON_MESSAGE_TOO_LARGE,
                    metadata={"limit_bytes": str(self._limit)},
                )
            try:
                message: Message = parse(raw)
            except (DecodeError, ValueError, TypeError):
                raise InvalidArgumentError(
                    "request is not a valid protobuf message for this method",
                    reason=R.ERROR_REASON_MALFORMED_REQUEST,
                ) from None
            found = violations(message)
            if found:
                names = ", ".join(v.field for v in found[:5])
                raise InvalidArgumentError(f"invalid request: {names}", violations=found)
            return message

        async def checked_iter(requests: AsyncIterator[bytes]) -> AsyncIterator[Message]:
            async for raw in requests:
                yield check(raw)

        def prepare(request: Any) -> Any:
            return check(request) if isinstance(request, bytes) else checked_iter(request)

        def wrap_unary(behavior: Behavior) -> Behavior:
            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                return await behavior(prepare(request), context)

            return unary

        def wrap_stream(behavior: Behavior) -> Behavior:
            # No generator of its own: the interceptors outside open this inside theirs, so a request that
            # fails its checks raises there, where errors become status.
            def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                return _stream_of(behavior(prepare(request), context))

            return stream

        return _rewrap(handler, wrap_unary, wrap_stream, raw_requests=True)


def server_interceptors(
    service: str, verifier: TokenVerifier, public_methods: Collection[str], max_message_bytes: int
) -> tuple[Sequence[grpc.aio.ServerInterceptor], AuthInterceptor]:
    """The interceptors in their fixed order, and the auth interceptor for adding authenticators."""
    auth = AuthInterceptor(verifier, public_methods)
    chain: list[grpc.aio.ServerInterceptor] = [
        RequestContextInterceptor(service),
        auth,
        ValidationInterceptor(max_message_bytes),
    ]
    return chain, auth
