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


# ---- the token-in/token-out route (`POST /inference/v1/generate`) -------------------------------------

MAX_PROMPTS = 64  # prompts of one generate request (a batch)
MAX_CHOICES = 256  # prompts x n of one generate request
MAX_TOP_LOGPROBS = 20
# Top-level fields of a generate request, each with the values accepted for it beyond the checked ones.
_GENERATE_FIELDS = {"model", "token_ids", "sampling_params", "request_id"}
_GENERATE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "priority": (None, 0),
    "cache_salt": (None,),
    "features": (None,),
    "kv_transfer_params": (None,),
    "stream_options": (None,),
}
# Sampling fields honoured, and those that only shape text this route never returns (accepted, no effect).
_SAMPLING_FIELDS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "n",
    "logprobs",
}
_SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "skip_special_tokens": (None, True, False),
    "spaces_between_special_tokens": (None, True, False),
    "detokenize": (None, True, False),
    "flat_logprobs": (None, True, False),
    "stop": (None, [], ""),
    "ignore_eos": (None, False),
    "min_tokens": (None, 0),
    "prompt_logprobs": (None,),
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    return any(value == a and type(value) is type(a) for a in allowed)


def _check_ids(ids: Any, field: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise invalid(field, "must be a non-empty list of token ids")
    for index, token in enumerate(ids):
        if not _whole(token) or token < 0:
            raise invalid(f"{field}[{index}]", "must be a token id, a whole number of at least 0")
    return list(ids)


def generate_prompts(body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """The prompts of a generate request (`token_ids`: one list of ids, or a list of such lists, a batch) and
    whether it was a batch. The ids are checked to be whole and non-negative; their vocabulary and length
    are the worker's to check."""
    ids = body.get("token_ids")
    if isinstance(ids, list) and any(isinstance(p, list) for p in ids):
        if len(ids) > MAX_PROMPTS:
            raise invalid("token_ids", f"holds more than {MAX_PROMPTS} prompts")
        return [_check_ids(prompt, f"token_ids[{index}]") for index, prompt in enumerate(ids)], True
    return [_check_ids(ids, "token_ids")], False


def check_generate(body: dict[str, Any]) -> dict[str, Any]:
    """Check a generate request's shape, the same at the worker and the gateway's relay, and return its
    `sampling_params` (an object; empty when left out). Every sampling field is checked to be of its type
    and range; a field no engine here honours, set to anything but its neutral value, is refused naming it
    (`sampling_params.<name>`), as an unknown field is."""
    for field, value in body.items():
        if field in _GENERATE_NEUTRAL:
            if not _neutral(value, _GENERATE_NEUTRAL[field]):
                raise invalid(field, "is not supported by this endpoint")
        elif field not in _GENERATE_FIELDS:
            raise invalid(field, "is not a field of a generate request")
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or len(request_id) > 256):
        raise invalid("request_id", "must be text of at most 256 characters")
    prompts, _ = generate_prompts(body)
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise invalid("sampling_params", "must be an object")
    _check_sampling_fields(params)
    _check_sampling(params, len(prompts))
    return params


def _check_sampling_fields(params: dict[str, Any]) -> None:
    for field, value in params.items():
        name = f"sampling_params.{field}"
        if field == "extra_args":
            # prime-rl's renderers client asks for its compact logprobs this way; JSON logprobs are its
            # fallback, which this endpoint answers.
            if value is not None and not (isinstance(value, dict) and set(value) <= {"prl_compact_logprobs"}):
                raise invalid(name, "is not supported by this endpoint")
        elif field in _SAMPLING_NEUTRAL:
            if not _neutral(value, _SAMPLING_NEUTRAL[field]):
                raise invalid(name, "is not supported by this endpoint")
        elif field not in _SAMPLING_FIELDS:
            raise invalid(name, "is not a sampling parameter of this endpoint")


def _check_sampling(params: dict[str, Any], prompts: int) -> None:
    def number(field: str, low: float, high: float) -> None:
        value = params.get(field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high
        ):
            raise invalid(f"sampling_params.{field}", f"must be a number from {low:g} to {high:g}")

    def whole(field: str, low: int, high: int, description: str = "") -> None:
        value = params.get(field)
        if value is not None and (not _whole(value) or not low <= value <= high):
            raise invalid(
                f"sampling_params.{field}", description or f"must be a whole number from {low} to {high}"
            )

    whole("max_tokens", 1, 1 << 31, "must be a whole number of at least 1 (leave it out for no limit)")
    number("temperature", 0.0, 2.0)
    number("top_p", 1e-6, 1.0)
    number("min_p", 0.0, 1.0)
    if params.get("top_k") != -1:  # vLLM's "every token", as 0 is here
        whole("top_k", 0, 1_000_000)
    whole("seed", 0, (1 << 63) - 1)
    whole("n", 1, MAX_N)
    whole("logprobs", 0, MAX_TOP_LOGPROBS)
    stops = params.get("stop_token_ids")
    if stops is not None and (
        not isinstance(stops, list) or len(stops) > 64 or not all(_whole(t) and t >= 0 for t in stops)
    ):
        raise invalid("sampling_params.stop_token_ids", "must be a list of at most 64 token ids")
    if prompts * int(params.get("n") or 1) > MAX_CHOICES:
        raise invalid("sampling_params.n", f"gives more than {MAX_CHOICES} choices for this batch")
