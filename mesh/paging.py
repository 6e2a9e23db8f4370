"""Opaque page tokens for List calls (AIP-158).

A token is a base64url `tandem.common.v1.PageCursor`: the position after the last item returned and a
fingerprint of the query, so a token replayed against a different filter is refused instead of silently
paging through the wrong results.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

from google.protobuf.message import DecodeError
from tandem.common.v1 import types_pb2

from mesh.errors import InvalidArgument, R

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


def page_size(requested: int, default: int = DEFAULT_PAGE_SIZE, maximum: int = MAX_PAGE_SIZE) -> int:
    """0 means the default; anything larger than the maximum is capped (AIP-158), negatives are refused."""
    if requested < 0:
        raise InvalidArgument("page_size must not be negative")
    return min(requested or default, maximum)


def fingerprint(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def encode(query_fingerprint: str, last_key: str = "", last_number: int = 0) -> str:
    cursor = types_pb2.PageCursor(
        query_fingerprint=query_fingerprint, last_key=last_key, last_number=last_number
    )
    return base64.urlsafe_b64encode(cursor.SerializeToString()).decode().rstrip("=")


def decode(token: str, query_fingerprint: str) -> types_pb2.PageCursor | None:
    """The cursor in `token`, None for the first page.

    INVALID_PAGE_TOKEN if the token is not ours or belongs to another query.
    """
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        cursor = types_pb2.PageCursor.FromString(raw)
    except (binascii.Error, ValueError, DecodeError):
        raise InvalidArgument("page_token is malformed", reason=R.ERROR_REASON_INVALID_PAGE_TOKEN) from None
    if cursor.query_fingerprint != query_fingerprint:
        raise InvalidArgument(
            "page_token belongs to a different query", reason=R.ERROR_REASON_INVALID_PAGE_TOKEN
        )
    return cursor
