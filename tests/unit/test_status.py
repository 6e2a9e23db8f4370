"""The error model round trip: domain error -> gRPC status -> typed client error, with every detail."""

from __future__ import annotations

import grpc
import pytest

from mesh.errors import (
    FieldViolation,
    InvalidArgument,
    NotFound,
    R,
    ResourceExhausted,
    TandemError,
    reason_name,
)
from mesh.status import STATUS_DETAILS_KEY, RpcError, rpc_error_from, status_for


class _FakeCallError(grpc.RpcError):
    """What grpc hands a client: code, details and trailing metadata (built from a real status)."""

    def __init__(self, status: grpc.Status) -> None:
        self._status = status

    def code(self) -> grpc.StatusCode:
        return self._status.code

    def details(self) -> str:
        return self._status.details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return tuple(self._status.trailing_metadata)


def round_trip(error: TandemError, request_id: str = "") -> RpcError:
    return rpc_error_from(_FakeCallError(status_for(error, request_id)))


def test_reason_names_drop_the_prefix() -> None:
    assert reason_name(R.ERROR_REASON_SECRET_NOT_FOUND) == "SECRET_NOT_FOUND"
    assert reason_name(R.ERROR_REASON_CURSOR_COMPACTED) == "CURSOR_COMPACTED"


def test_code_reason_message_and_metadata_survive() -> None:
    error = round_trip(
        NotFound("no such secret", reason=R.ERROR_REASON_SECRET_NOT_FOUND, metadata={"x": "1"}), "rid-9"
    )
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.reason == "SECRET_NOT_FOUND"
    assert error.message == "no such secret"
    assert error.metadata == {"x": "1", "request_id": "rid-9"}
    assert error.request_id == "rid-9"


def test_field_violations_survive() -> None:
    violations = [
        FieldViolation("spec.tasks[0].name", "is required"),
        FieldViolation("priority", "must be <= 1000"),
    ]
    error = round_trip(
        InvalidArgument("bad spec", reason=R.ERROR_REASON_INVALID_JOB_SPEC, violations=violations)
    )
    assert error.reason == "INVALID_JOB_SPEC"
    assert error.violations == violations


def test_retry_info_survives() -> None:
    error = round_trip(ResourceExhausted("slow down", retry_after_s=1.5))
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.reason == "RATE_LIMITED"
    assert error.retry_after_s == pytest.approx(1.5)


def test_request_id_is_also_a_plain_trailer() -> None:
    status = status_for(NotFound("x"), "rid-1")
    keys = dict(status.trailing_metadata)
    assert keys["x-request-id"] == "rid-1"
    assert STATUS_DETAILS_KEY in keys


def test_a_failure_without_details_still_decodes() -> None:
    class Bare(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection refused"

        def trailing_metadata(self) -> tuple[()]:
            return ()

    error = rpc_error_from(Bare())
    assert (error.code, error.reason, error.message) == (
        grpc.StatusCode.UNAVAILABLE,
        "",
        "connection refused",
    )


def test_every_domain_error_maps_to_a_canonical_code() -> None:
    for cls in TandemError.__subclasses__():
        error = cls("x")
        assert grpc.StatusCode[error.code]
        assert error.reason_name and error.reason_name != "UNSPECIFIED"
