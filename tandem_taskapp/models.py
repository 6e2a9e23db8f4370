"""The SDK's data types: the parsed rollout request and the result a rollout returns. Field names follow
protos/tandem/taskapp/v1/rollout.proto."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["rl", "eval"]

MAX_SEED = 2**64 - 1
MAX_MESSAGE_BYTES = 1 << 20
TRUNCATED_SUFFIX = "…[truncated]"

_MODE_ALIASES: dict[object, Mode] = {
    "rl": "rl",
    "eval": "eval",
    "ROLLOUT_MODE_RL": "rl",
    "ROLLOUT_MODE_EVAL": "eval",
    "ROLLOUT_MODE_UNSPECIFIED": "rl",
    0: "rl",
    1: "rl",
    2: "eval",
}


def normalize_mode(value: object) -> object:
    """The contract's mode (`"rl"` or `"eval"`) for the lowercase names, the proto enum names
    (`ROLLOUT_MODE_RL`) or numbers; any other value is returned unchanged for the schema to reject."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        key: object = value if value.startswith("ROLLOUT_MODE_") else value.lower()
        return _MODE_ALIASES.get(key, value)
    if isinstance(value, int):
        return _MODE_ALIASES.get(value, value)
    return value


@dataclass(frozen=True)
class PolicyConfig:
    """How to call the policy: `policy.config` of the request."""

    model: str
    inference_url: str
    temperature: float | None = None
    max_completion_tokens: int = 0
    top_p: float | None = None  # unset: 1
    top_k: int | None = None  # unset or 0: every token
    min_p: float | None = None  # unset or 0: none
    seed: int | None = None  # the episode's sampling seed; unset: the worker draws one

    def sampling(self) -> dict[str, Any]:
        """The truncations the request set (`top_p`, `top_k`, `min_p`), as chat-completion body fields."""
        values = {"top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
        return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True)
class Limits:
    """The request's safety limits; 0 means the app's default."""

    max_turns: int = 0
    max_seconds: int = 0


@dataclass(frozen=True)
class RolloutRequest:
    """A validated `POST /rollout` body."""

    trace_correlation_id: str
    seed: int
    policy: PolicyConfig
    config: Mapping[str, Any] = field(default_factory=dict)
    mode: Mode = "rl"
    limits: Limits = Limits()

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RolloutRequest:
        """Parse a body that already passed the `RolloutRequest` schema (mode normalized)."""
        env: Mapping[str, Any] = body.get("env") or {}
        pol: Mapping[str, Any] = body["policy"]["config"]
        lim: Mapping[str, Any] = body.get("limits") or {}
        temperature = pol.get("temperature")
        top_p, top_k, min_p = pol.get("top_p"), pol.get("top_k"), pol.get("min_p")
        sampling_seed = pol.get("seed")
        mode = normalize_mode(body.get("mode", "rl"))
        return cls(
            trace_correlation_id=str(body["trace_correlation_id"]),
            seed=int(env.get("seed", 0)),
            config=dict(env.get("config") or {}),
            policy=PolicyConfig(
                model=str(pol["model"]),
                inference_url=str(pol["inference_url"]),
                temperature=None if temperature is None else float(temperature),
                max_completion_tokens=int(pol.get("max_completion_tokens") or 0),
                top_p=None if top_p is None else float(top_p),
                top_k=None if top_k is None else int(top_k),
                min_p=None if min_p is None else float(min_p),
                seed=None if sampling_seed is None else int(sampling_seed),
            ),
            mode="eval" if mode == "eval" else "rl",
            limits=Limits(
                max_turns=int(lim.get("max_turns") or 0),
                max_seconds=int(lim.get("max_seconds") or 0),
            ),
        )

    def to_json(self) -> dict[str, Any]:
        """The canonical JSON form (what `from_json` parses)."""
        pol: dict[str, Any] = {"model": self.policy.model, "inference_url": self.policy.inference_url}
        if self.policy.temperature is not None:
            pol["temperature"] = self.policy.temperature
        if self.policy.max_completion_tokens:
            pol["max_completion_tokens"] = self.policy.max_completion_tokens
        pol.update(self.policy.sampling())
        if self.policy.seed is not None:
            pol["seed"] = self.policy.seed
        return {
            "trace_correlation_id": self.trace_correlation_id,
            "env": {"seed": self.seed, "config": dict(self.config)},
            "policy": {"config": pol},
            "mode": self.mode,
            "limits": {"max_turns": self.limits.max_turns, "max_seconds": self.limits.max_seconds},
        }


@dataclass(frozen=True)
class Message:
    """One chat message of a trajectory."""

    role: str
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": truncate(self.content)}


@dataclass(frozen=True)
class Turn:
    """One step of an episode: the messages around one policy call (observation first, reply last)."""

    messages: tuple[Message, ...]

    @classmethod
    def of(cls, *messages: Message | Mapping[str, Any]) -> Turn:
        return cls(tuple(as_message(m) for m in messages))

    def to_json(self) -> dict[str, Any]:
        return {"messages": [m.to_json() for m in self.messages]}


@dataclass
class Result:
    """What a rollout returns. `turns` None means the turns the `Policy` recorded."""

    outcome_reward: float
    event_rewards: Sequence[float] = ()
    details: Mapping[str, Any] = field(default_factory=dict)
    aborted: bool = False
    turns: Sequence[Turn] | None = None


def content_text(content: object) -> str:
    """The text of an OpenAI message content: a string, a list of parts (text parts joined), or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def as_message(m: Message | Mapping[str, Any]) -> Message:
    if isinstance(m, Message):
        return m
    return Message(role=str(m.get("role", "")), content=content_text(m.get("content")))


def truncate(text: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, ending with `…[truncated]` when cut."""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    keep = limit - len(TRUNCATED_SUFFIX.encode("utf-8"))
    return raw[:keep].decode("utf-8", errors="ignore") + TRUNCATED_SUFFIX


def is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
