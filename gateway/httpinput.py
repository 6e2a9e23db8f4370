"""Reading what HTTP clients send, with the same guarantees as the gRPC side: a body is refused past its
limit while it streams in (memory stays flat whatever a client sends), JSON nested too deep to parse is a
malformed request, and numbers in queries and headers are ASCII digits within their type's range. Each
failure is a typed error with a reason, never an HTTP 500."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from mesh.errors import InvalidArgument, R

DIGITS = re.compile(r"[0-9]{1,20}")
UINT64_MAX = 2**64 - 1


def too_large(size: int, limit: int) -> InvalidArgument:
    return InvalidArgument(
        f"the body is at least {size} bytes; the limit is {limit}", reason=R.ERROR_REASON_PAYLOAD_TOO_LARGE
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, read piece by piece and refused once it passes `limit` bytes (a declared
    Content-Length past it is refused before anything is read)."""
    declared = request.headers.get("content-length", "")
    if DIGITS.fullmatch(declared) and int(declared) > limit:
        raise too_large(int(declared), limit)
    pieces: list[bytes] = []
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise too_large(size, limit)
        pieces.append(piece)
    return b"".join(pieces)


def json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object body; MALFORMED_REQUEST for anything else, deeply nested input included."""
    try:
        body: Any = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidArgument("the body is not JSON", reason=R.ERROR_REASON_MALFORMED_REQUEST) from None
    if not isinstance(body, dict):
        raise InvalidArgument("the body must be a JSON object", reason=R.ERROR_REASON_MALFORMED_REQUEST)
    return body


def whole_number(text: str, what: str, high: int = UINT64_MAX) -> int:
    """`text` as a number from 0 to `high`, written in ASCII digits (no `²`, no sign, no spaces)."""
    if not DIGITS.fullmatch(text) or int(text) > high:
        raise InvalidArgument(f"{what} must be a whole number from 0 to {high}")
    return int(text)
