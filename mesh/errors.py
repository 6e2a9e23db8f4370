"""Domain errors: what went wrong, in terms a client can branch on.

Domain code raises these and never imports grpc. `mesh.status` is the one place that turns them into a
canonical gRPC status with a `google.rpc.ErrorInfo` whose reason is the stable name from
`tandem.common.v1.ErrorReason` (without its `ERROR_REASON_` prefix).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tandem.common.v1 import errors_pb2

ERROR_DOMAIN = "tandem.dev"


def reason_name(reason: int) -> str:
    """The wire form of a reason: `ERROR_REASON_SECRET_NOT_FOUND` -> `SECRET_NOT_FOUND`."""
    return errors_pb2.ErrorReason.Name(reason).removeprefix("ERROR_REASON_")  # type: ignore[arg-type]


R = errors_pb2.ErrorReason


@dataclass(frozen=True)
class FieldViolation:
    """One invalid request field: its path (`spec.tasks[0].name`) and what is wrong with it."""

    field: str
    description: str


class TandemError(Exception):
    """Base of every domain error. `code` is a canonical status code name (`NOT_FOUND`)."""

    code = "INTERNAL"
    default_reason: int = R.ERROR_REASON_INTERNAL

    def __init__(
        self,
        message: str,
        *,
        reason: int | None = None,
        metadata: Mapping[str, str] | None = None,
        violations: list[FieldViolation] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason if reason is not None else self.default_reason
        self.metadata = dict(metadata or {})
        self.violations = list(violations or [])
        self.retry_after_s = retry_after_s

    @property
    def reason_name(self) -> str:
        return reason_name(self.reason)


class InvalidArgument(TandemError):
    code = "INVALID_ARGUMENT"
    default_reason = R.ERROR_REASON_INVALID_ARGUMENT


class NotFound(TandemError):
    code = "NOT_FOUND"
    default_reason = R.ERROR_REASON_NOT_FOUND


class AlreadyExists(TandemError):
    code = "ALREADY_EXISTS"
    default_reason = R.ERROR_REASON_ALREADY_EXISTS


class FailedPrecondition(TandemError):
    code = "FAILED_PRECONDITION"
    default_reason = R.ERROR_REASON_FAILED_PRECONDITION


class OutOfRange(TandemError):
    code = "OUT_OF_RANGE"
    default_reason = R.ERROR_REASON_OUT_OF_RANGE


class PermissionDenied(TandemError):
    code = "PERMISSION_DENIED"
    default_reason = R.ERROR_REASON_PERMISSION_DENIED


class Unauthenticated(TandemError):
    code = "UNAUTHENTICATED"
    default_reason = R.ERROR_REASON_INVALID_CREDENTIALS


class ResourceExhausted(TandemError):
    code = "RESOURCE_EXHAUSTED"
    default_reason = R.ERROR_REASON_RATE_LIMITED


class Unavailable(TandemError):
    code = "UNAVAILABLE"
    default_reason = R.ERROR_REASON_DEPENDENCY_UNAVAILABLE


class Aborted(TandemError):
    code = "ABORTED"
    default_reason = R.ERROR_REASON_ABORTED


class DeadlineExceeded(TandemError):
    code = "DEADLINE_EXCEEDED"
    default_reason = R.ERROR_REASON_DEADLINE_EXCEEDED


class Unimplemented(TandemError):
    code = "UNIMPLEMENTED"
    default_reason = R.ERROR_REASON_NOT_IMPLEMENTED


class Internal(TandemError):
    code = "INTERNAL"
    default_reason = R.ERROR_REASON_INTERNAL
