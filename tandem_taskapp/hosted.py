"""The hosted dialect of the Task App contract: the shapes of the hosted online-RL product's Task Apps, and
their translation to Tandem's contract, so that the trainer sees one shape whatever the app speaks.

An app written to the hosted contract differs from Tandem's in what it answers, not in what it reads (it
takes the same `RolloutRequest`; the proxy adds the hosted names `run_id` and `safety.max_time_s`):

- errors are `{"detail": ...}` (a string, a list or an object), not `{"error": {code, message}}`;
- `GET /health` may take no key at all, so it answers 200 to a wrong key too;
- `GET /task_info` has string `dataset.splits`, an optional `rubric`, `limits.timeout_seconds` and the
  per-seed data in `task_metadata`; without a seed it answers `{"taskset": {...}}`;
- `POST /rollout` answers either the legacy form, `trajectories[].steps[]` (each step `obs`, `tool_calls`,
  `reward`, `done`, `info`) with `metrics.outcome_reward` (or a legacy reward field), or the newer trace
  form, `trace.event_history[]` of `lm_call` events (`llm_request.messages`, `llm_response`) and
  `trace.markov_blanket_message_history[]`;
- it may read the key from `X-API-Keys` (comma-separated) as well as `X-API-Key` and `Authorization`.

The functions here are pure (no I/O): the taskapp-proxy normalises every answer with them and the
conformance kit (`tandem_taskapp.check`) uses them to say which dialect an app speaks. Their JSON schemas
are `HostedError`, `HostedTaskInfo` and `HostedRolloutResponse` in docs/taskapp-openapi.yaml.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "HOSTED",
    "TANDEM",
    "error_to_tandem",
    "is_hosted_error",
    "is_hosted_rollout",
    "is_hosted_task_info",
    "rollout_to_tandem",
    "task_info_to_tandem",
]

TANDEM: Final = "tandem"
HOSTED: Final = "hosted"
# Where a legacy answer keeps its reward when `metrics.outcome_reward` is absent, in the order tried.
_LEGACY_REWARDS: Final = ("reward_mean", "mean_return", "outcome_score")
_MAX_SECONDS: Final = 86_400


def is_hosted_error(body: Any) -> bool:
    """Whether an error body is the hosted `{"detail": ...}` form."""
    return isinstance(body, dict) and "detail" in body and "error" not in body


def error_to_tandem(body: Any, code: str = "UNAUTHENTICATED") -> Any:
    """A hosted `{"detail": ...}` error as Tandem's `{"error": {code, message}}`; others unchanged."""
    if not is_hosted_error(body):
        return body
    detail = body["detail"]
    return {"error": {"code": code, "message": detail if isinstance(detail, str) else json.dumps(detail)}}


def is_hosted_rollout(body: Any) -> bool:
    """Whether a rollout answer is in a hosted form: `trajectories[]` or a `trace`, and no `trajectory`."""
    if not isinstance(body, dict) or "trajectory" in body:
        return False
    return isinstance(body.get("trajectories"), list) or isinstance(body.get("trace"), dict)


def is_hosted_task_info(body: Any) -> bool:
    """Whether a task description carries a hosted mark: a `taskset` wrapper, `task_metadata`, string
    splits, `limits.timeout_seconds`, or no `rubric`."""
    if not isinstance(body, dict):
        return False
    if "taskset" in body and "task" not in body:
        return True
    dataset = body.get("dataset")
    splits = dataset.get("splits") if isinstance(dataset, dict) else None
    limits = body.get("limits")
    return (
        "task_metadata" in body
        or "rubric" not in body
        or (isinstance(splits, list) and any(isinstance(s, str) for s in splits))
        or (isinstance(limits, dict) and "timeout_seconds" in limits)
    )


def task_info_to_tandem(body: Any) -> Any:
    """A hosted task description in Tandem's `TaskInfo` shape; anything else is returned unchanged.

    `{"taskset": {...}}` is unwrapped, string splits become `{"name": ...}`, a missing `rubric` or
    `limits` becomes `{}`, `limits.timeout_seconds` is also given as `limits.max_seconds`, and
    `task_metadata` is also given as `instance`. Hosted fields are kept beside Tandem's."""
    if not is_hosted_task_info(body):
        return body
    out = dict(body)
    if "taskset" in out and "task" not in out and isinstance(out["taskset"], dict):
        out = {**out.pop("taskset"), **out}
    dataset = out.get("dataset")
    if isinstance(dataset, dict) and isinstance(dataset.get("splits"), list):
        splits = [{"name": s} if isinstance(s, str) else s for s in dataset["splits"]]
        out["dataset"] = {**dataset, "splits": splits}
    out.setdefault("rubric", {})
    limits = out.get("limits")
    limits = dict(limits) if isinstance(limits, dict) else {}
    timeout = limits.get("timeout_seconds")
    numeric = isinstance(timeout, int | float) and _is_number(timeout)
    if (
        "max_seconds" not in limits
        and isinstance(timeout, int | float)
        and numeric
        and 1 <= timeout <= _MAX_SECONDS
    ):
        limits["max_seconds"] = int(timeout)
    out["limits"] = limits
    if isinstance(out.get("task_metadata"), dict) and "instance" not in out:
        out["instance"] = out["task_metadata"]
    return out


def rollout_to_tandem(body: Any) -> Any:
    """A hosted rollout answer in Tandem's `RolloutResponse` shape; anything else is returned unchanged.

    - `trace_correlation_id`: the answer's own, else its legacy `run_id`;
    - `metrics.outcome_reward`: the answer's own, else `metrics.outcome_objectives.reward`, else a legacy
      `reward_mean`, `mean_return` or `outcome_score`, else the sum of the steps' rewards; left out when
      there is none, so that the caller reports it missing;
    - `metrics.event_rewards`: the answer's own, else the steps' rewards in order;
    - `metrics.details`: the answer's own details, with every other hosted metric under `details.hosted`;
    - `trajectory.turns`: a legacy step becomes a turn of the observation (a `user` message) and the
      action (an `assistant` message of its tool calls); an `lm_call` event of the trace form becomes a
      turn of its request's messages and the reply; without events, the message history is one turn;
    - `aborted`: the answer's own, else whether a step was `truncated`."""
    if not is_hosted_rollout(body):
        return body
    metrics = body.get("metrics")
    metrics = metrics if isinstance(metrics, dict) else {}
    trajectories = [t for t in body.get("trajectories") or [] if isinstance(t, dict)]
    steps = [s for t in trajectories for s in t.get("steps") or [] if isinstance(s, dict)]
    turns = [_step_turn(step) for step in steps]
    trace = body.get("trace")
    if not turns and isinstance(trace, dict):
        turns = _trace_turns(trace)
    step_rewards = [s["reward"] for s in steps if _is_number(s.get("reward"))]
    out_metrics: dict[str, Any] = {}
    reward = _outcome_reward(metrics, step_rewards)
    if reward is not None:
        out_metrics["outcome_reward"] = reward
    events = metrics.get("event_rewards")
    out_metrics["event_rewards"] = events if isinstance(events, list) else step_rewards
    details = metrics.get("details")
    details = dict(details) if isinstance(details, dict) else {}
    rest = {k: v for k, v in metrics.items() if k not in ("outcome_reward", "event_rewards", "details")}
    if rest:
        details["hosted"] = rest
    out_metrics["details"] = details
    aborted = body.get("aborted")
    if not isinstance(aborted, bool):
        aborted = any(s.get("truncated") is True for s in steps)
    correlation = body.get("trace_correlation_id", body.get("run_id"))
    return {
        "trace_correlation_id": correlation,
        "metrics": out_metrics,
        "trajectory": {"turns": [t for t in turns if t["messages"]]},
        "aborted": aborted,
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _outcome_reward(metrics: Mapping[str, Any], step_rewards: list[Any]) -> Any:
    if "outcome_reward" in metrics:
        return metrics["outcome_reward"]  # checked by the caller, whatever it is
    objectives = metrics.get("outcome_objectives")
    if isinstance(objectives, dict) and "reward" in objectives:
        return objectives["reward"]
    for name in _LEGACY_REWARDS:
        if name in metrics:
            return metrics[name]
    returns = metrics.get("episode_returns")
    if isinstance(returns, list) and returns and all(_is_number(r) for r in returns):
        return sum(returns) / len(returns)
    return sum(step_rewards) if step_rewards else None


def _text(value: Any) -> str:
    """Message content as text: a string as it is, OpenAI content parts joined, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        parts = [p.get("text") for p in value]
        if all(isinstance(p, str) for p in parts):
            return "".join(str(p) for p in parts)
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _message(raw: Any, default_role: str) -> dict[str, str] | None:
    if isinstance(raw, dict):
        role = raw.get("role") or raw.get("message_type") or default_role
        content = raw.get("content", raw.get("text", ""))
        if content is None and raw.get("tool_calls"):
            content = raw["tool_calls"]
        return {"role": str(role), "content": _text("" if content is None else content)}
    if isinstance(raw, str):
        return {"role": default_role, "content": raw}
    return None


def _step_turn(step: Mapping[str, Any]) -> dict[str, list[dict[str, str]]]:
    messages = []
    obs = step.get("obs")
    if obs is not None:
        messages.append({"role": "user", "content": _text(obs)})
    calls = step.get("tool_calls")
    if calls:
        messages.append({"role": "assistant", "content": _text(calls)})
    return {"messages": messages}


def _reply(response: Any) -> dict[str, str] | None:
    """The assistant message of an `llm_response`: OpenAI's `choices[0].message`, a `message`, or text."""
    if isinstance(response, dict):
        choices = response.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            return _message(choices[0].get("message"), "assistant")
        if "message" in response:
            return _message(response["message"], "assistant")
        if "content" in response:
            return _message(response, "assistant")
        return None
    return _message(response, "assistant")


def _trace_turns(trace: Mapping[str, Any]) -> list[dict[str, list[dict[str, str]]]]:
    turns = []
    for event in trace.get("event_history") or []:
        if not isinstance(event, dict) or event.get("type", "lm_call") != "lm_call":
            continue
        request = event.get("llm_request")
        raw = request.get("messages") if isinstance(request, dict) else None
        messages = [m for m in (_message(r, "user") for r in raw or []) if m is not None]
        reply = _reply(event.get("llm_response"))
        if reply is not None:
            messages.append(reply)
        turns.append({"messages": messages})
    if turns:
        return turns
    history = trace.get("markov_blanket_message_history") or []
    messages = [m for m in (_message(r, "user") for r in history) if m is not None]
    return [{"messages": messages}]
