"""The request fields of OpenAI's completions APIs that Tandem refuses instead of ignoring, checked the same
way by the worker's endpoint (`trainer.inference.openai_api`) and by the gateway's relay
(`gateway.openai_http`, before it looks for a worker). In tandem_jobs, without torch, so the gateway imports
nothing of trainer/.

A refused field is INVALID_ARGUMENT with a field violation naming it, which the HTTP endpoints answer as 400
with the field as the error's `param`.
"""

from __future__ import annotations

from typing import Any

from mesh.errors import FieldViolation, InvalidArgument

MAX_N = 16  # samples per request (`n`)

# Fields no engine here honours, each with the values that ask for nothing (and so are accepted).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
}


def invalid(field: str, description: str) -> InvalidArgument:
    """INVALID_ARGUMENT naming `field` (the HTTP answer's `param`)."""
    return InvalidArgument(f"`{field}` {description}", violations=[FieldViolation(field, description)])


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def refuse_unsupported(body: dict[str, Any]) -> None:
    """Refuse what the endpoints would otherwise answer wrongly: a token budget of 0, `n` outside 1 to MAX_N,
    and every field of `_NEUTRAL` set to something other than its neutral values."""
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (not _whole(value) or value < 1):
            raise invalid(field, "must be a whole number of at least 1 (leave it out for no limit)")
    n = body.get("n")
    if n is not None and (not _whole(n) or not 1 <= n <= MAX_N):
        raise invalid("n", f"must be a whole number from 1 to {MAX_N}")
    for field, neutral in _NEUTRAL.items():
        if field in body and not any(
            body[field] == value and type(body[field]) is type(value) for value in neutral
        ):
            raise invalid(field, "is not supported by this endpoint")
