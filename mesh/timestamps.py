"""Seconds (wall-clock or spans) to the protobuf well-known types, the way every service writes them."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2


def stamp(seconds: float | None) -> timestamp_pb2.Timestamp | None:
    """A Timestamp for `seconds` since the epoch; None stays None (the field is left unset)."""
    if seconds is None:
        return None
    value = timestamp_pb2.Timestamp()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def put_stamp(field: timestamp_pb2.Timestamp, seconds: float | None) -> None:
    """`stamp` written into a message's own Timestamp field, with no message made and copied in (a page of
    jobs sets hundreds); None leaves the field unset."""
    if seconds is not None:
        field.FromNanoseconds(int(seconds * 1e9))


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value
