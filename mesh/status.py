"""The one mapping between domain errors and gRPC status, in both directions.

Servers turn a `TandemError` into a canonical status code plus `google.rpc.Status` details (ErrorInfo with
the stable reason, BadRequest for field violations, RetryInfo when the caller should wait). Clients turn a
failed call back into `RpcError`, which carries `.code` and `.reason`; nobody parses message text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from mesh.errors import ERROR_DOMAIN, FieldViolation, TandemError, reason_name

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class _Status(
    NamedTuple(
        "_Status",
        [
            ("code", grpc.StatusCode),
            ("details", str),
            ("trailing_metadata", tuple[tuple[str, str | bytes], ...]),
        ],
    ),
    grpc.Status,
):
    """A status with trailing metadata beyond the details blob (the request id)."""


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def status_for(error: TandemError, request_id: str = "") -> grpc.Status:
    """The status a server sends for a domain error."""
    info = error_details_pb2.ErrorInfo(domain=ERROR_DOMAIN, reason=error.reason_name)
    info.metadata.update(error.metadata)
    if request_id:
        info.metadata["request_id"] = request_id
    details = [_pack(info)]
    if error.violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in error.violations
            ]
        )
        details.append(_pack(bad))
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    code = grpc.StatusCode[error.code]
    proto = status_pb2.Status(code=code.value[0], message=error.message, details=details)
    base = rpc_status.to_status(proto)
    trailing = tuple(base.trailing_metadata) + ((("x-request-id", request_id),) if request_id else ())
    return _Status(base.code, base.details, trailing)


class RpcError(Exception):
    """A failed call as a client sees it: canonical `code`, stable `reason`, and the details."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str = "",
        metadata: dict[str, str] | None = None,
        violations: list[FieldViolation] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = metadata or {}
        self.violations = violations or []
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason or '-'}: {self.message}"

    @property
    def request_id(self) -> str:
        return self.metadata.get("request_id", "")


def _details_blob(trailing: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in trailing or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            return value
    return None


def rpc_error_from(error: grpc.RpcError) -> RpcError:
    """Decode a failed call (sync or asyncio) into an `RpcError`."""
    code: grpc.StatusCode = error.code()
    message: str = error.details() or ""
    trailing: Any = error.trailing_metadata()
    blob = _details_blob(trailing)
    if blob is None:
        return RpcError(code, message)
    status = status_pb2.Status.FromString(blob)
    result = RpcError(code, status.message or message)
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            result.reason = info.reason
            result.metadata = dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            result.violations = [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            result.retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
    return result


__all__ = ["RpcError", "reason_name", "rpc_error_from", "status_for"]
