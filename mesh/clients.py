"""Typed clients for calling other services, with deadlines and identity always set.

`ClientFactory.stub(VaultServiceStub, "vault")` returns the generated, typed stub on a shared channel whose
interceptors (a) give every unary call the default deadline unless the caller set one, (b) attach this
service's signed identity token and the current request id, (c) propagate the trace context, and (d) turn
failures into `mesh.status.RpcError` with `.code` and `.reason`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from mesh.identity import TokenSigner
from mesh.interceptors import AUTHORIZATION_KEY, REQUEST_ID_KEY
from mesh.observability import request_id_var
from mesh.settings import Settings
from mesh.status import rpc_error_from

StubT = TypeVar("StubT")
TOKEN_TTL_S = 300.0


def _with_metadata(
    details: grpc.aio.ClientCallDetails, extra: list[tuple[str, str]], timeout: float | None
) -> Any:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    present = {key for key, _ in metadata}
    for key, value in extra:
        if key not in present:
            metadata.add(key, value)
    return grpc.aio.ClientCallDetails(
        method=details.method,
        timeout=timeout,
        metadata=metadata,
        credentials=details.credentials,
        wait_for_ready=details.wait_for_ready,
    )


class _Identity:
    """Caches this process's service token and renews it well before it expires."""

    def __init__(self, signer: TokenSigner | None, subject: str, token: str | Callable[[], str] = "") -> None:
        self._signer = signer
        self._subject = subject
        self._source = token if callable(token) else None  # a token someone else renews (a job's)
        self._token = "" if callable(token) else token
        self._renew_at = float("inf") if token else 0.0

    def metadata(self) -> list[tuple[str, str]]:
        extra: list[tuple[str, str]] = []
        if self._source is not None:
            self._token = self._source()
        elif self._signer is not None and time.time() >= self._renew_at:
            self._token = self._signer.issue("service", self._subject, ttl_s=TOKEN_TTL_S)
            self._renew_at = time.time() + TOKEN_TTL_S / 2
        if self._token:
            extra.append((AUTHORIZATION_KEY, f"Bearer {self._token}"))
        if rid := request_id_var.get():
            extra.append((REQUEST_ID_KEY, rid))
        return extra


class _UnaryInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, identity: _Identity, deadline_s: float) -> None:
        self._identity = identity
        self._deadline = deadline_s

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        timeout = details.timeout if details.timeout is not None else self._deadline
        call = await continuation(_with_metadata(details, self._identity.metadata(), timeout), request)
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise rpc_error_from(error) from None


class _StreamUnaryInterceptor(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, identity: _Identity, deadline_s: float) -> None:
        self._identity = identity
        self._deadline = deadline_s

    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: Any, requests: Any
    ) -> Any:
        timeout = details.timeout if details.timeout is not None else self._deadline
        call = await continuation(_with_metadata(details, self._identity.metadata(), timeout), requests)
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise rpc_error_from(error) from None


class _StreamingInterceptor(grpc.aio.UnaryStreamClientInterceptor):
    """Long streams get no default deadline (they are meant to stay open); identity still applies."""

    def __init__(self, identity: _Identity) -> None:
        self._identity = identity

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        call = await continuation(
            _with_metadata(details, self._identity.metadata(), details.timeout), request
        )
        return _relay(call)


class _BidiInterceptor(grpc.aio.StreamStreamClientInterceptor):
    """The same for bidirectional streams (grpc files an interceptor under one call shape only)."""

    def __init__(self, identity: _Identity) -> None:
        self._identity = identity

    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: Any, requests: Any
    ) -> Any:
        call = await continuation(
            _with_metadata(details, self._identity.metadata(), details.timeout), requests
        )
        return _relay(call)


async def _relay(call: Any) -> AsyncIterator[Any]:
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as error:
        raise rpc_error_from(error) from None


def channel_options(settings: Settings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes * 2 + 64 * 1024),
        ("grpc.max_send_message_length", settings.max_message_bytes * 2 + 64 * 1024),
        ("grpc.keepalive_time_ms", int(settings.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def open_channel(
    target: str,
    settings: Settings,
    *,
    signer: TokenSigner | None = None,
    subject: str = "client",
    token: str | Callable[[], str] = "",
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """A channel whose calls carry identity and deadlines. Pass `signer` (mesh services) or a `token` (or a
    function that answers the current one, for a token that is renewed while the channel is open).
    `credentials` (TLS to a public endpoint such as the gateway's) win over the mesh's mTLS settings."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors  # noqa: PLC0415

    identity = _Identity(signer, subject, token)
    interceptors: list[Any] = [
        _UnaryInterceptor(identity, settings.default_deadline_s),
        _StreamUnaryInterceptor(identity, settings.default_deadline_s),
        _StreamingInterceptor(identity),
        _BidiInterceptor(identity),
        *aio_client_interceptors(),  # type: ignore[no-untyped-call]
    ]
    if credentials is not None:
        return grpc.aio.secure_channel(
            target, credentials, channel_options(settings), interceptors=interceptors
        )
    tls = settings.tls
    if tls.enabled:
        assert tls.cert_file and tls.key_file and tls.ca_file
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca_file.read_bytes(),
            private_key=tls.key_file.read_bytes(),
            certificate_chain=tls.cert_file.read_bytes(),
        )
        return grpc.aio.secure_channel(
            target, credentials, channel_options(settings), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, channel_options(settings), interceptors=interceptors)


class ClientFactory:
    """One channel per peer service, shared by every stub of that peer."""

    def __init__(self, settings: Settings, signer: TokenSigner, subject: str) -> None:
        self._settings = settings
        self._signer = signer
        self._subject = subject
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, service: str) -> grpc.aio.Channel:
        if service not in self._channels:
            self._channels[service] = open_channel(
                self._settings.target(service), self._settings, signer=self._signer, subject=self._subject
            )
        return self._channels[service]

    def stub(self, stub_type: Callable[[grpc.aio.Channel], StubT], service: str) -> StubT:
        return stub_type(self.channel(service))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
