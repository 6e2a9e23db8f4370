"""Serve a verifiers environment (the `verifiers` package, its `verifiers.v1` API) as a Task App.

    from tandem_taskapp.verifiers_env import verifiers_task_app

    app = verifiers_task_app("my-taskset")          # an installed verifiers taskset/environment id
    app = verifiers_task_app("envs/my_env.py")      # or a file defining one (its folder goes on sys.path)

or from the command line: `tandem taskapp serve --verifiers my-taskset --port 8001 --key-from-stdin`.

How the contract maps onto verifiers:

- `seed` picks the taskset's task `seed mod N` (N tasks, in `load()` order); an infinite taskset's task
  number `seed`. `GET /task_info?seed=N` answers that task's data as `instance.task` and its key.
- Each rollout plays one `Env.run_episode(task, ModelContext(model, client=EvalClientConfig(...)))`. The
  client is the episode's policy: `base_url` is `policy.config.inference_url` (which embeds the correlation
  id), every model call carries the `X-Trace-Correlation-Id` header, and the request's sampling
  (temperature, `max_completion_tokens`, `top_p`, `top_k`, `min_p`, and the sampling `seed`) is the
  episode's `Sampling`. Every model call of an episode carries the episode's seed (verifiers sends one
  sampling config per episode; the SDK's `Policy` instead adds the turn's index), so a run replays its
  episodes exactly, and the turns of one episode draw from the same random stream. The key it
  sends comes from `TANDEM_POLICY_API_KEY` (verifiers sends `EMPTY` when that is unset, as Tandem's
  inference workers need no key).
- The reward is the mean `Trace.reward` of the episode's trainable traces (one trace for a single-agent
  env); every trace's reward and metric values go in `metrics.details.verifiers`. Each trace's final branch
  becomes turns: the messages since the previous model reply, then the reply.
- A model call that failed answers 502 `POLICY_UNAVAILABLE`; any other failed episode answers 500 with
  the episode's errors in the app's log. An episode that hit a verifiers limit (its `max_turns`, a timeout)
  is answered with `aborted: true` and the reason in `details.abort_reason`.

An agent seat whose config sets no `runtime` runs its harness as a local subprocess (verifiers' own default
is Prime's hosted sandboxes, which need a Prime login and a tunnel); name another in the env config
(`{"agent": {"runtime": {"type": "docker"}}}`) to change that.

`verifiers` is optional: install the `verifiers` extra (`pip install 'tandem[verifiers]'`). It pins
`openai<3`, so it lives in an environment of its own where another package needs a newer `openai`
(`make setup-verifiers` makes `.venv-verifiers`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import math
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from tandem_taskapp.app import TaskApp
from tandem_taskapp.errors import InvalidArgument, PolicyError, TaskAppError
from tandem_taskapp.models import Message, Result, Turn, content_text
from tandem_taskapp.policy import CORRELATION_HEADER, Policy

log = logging.getLogger("tandem_taskapp.verifiers")

POLICY_KEY_ENV = "TANDEM_POLICY_API_KEY"
MAX_DETAIL_CHARS = 500


class VerifiersUnavailable(TaskAppError):
    """The `verifiers` package cannot be imported in this Python."""


class EpisodeFailed(TaskAppError):
    """A verifiers episode ended with errors that are not the policy's (the environment's own failure)."""


def _vf() -> Any:
    try:
        import verifiers.v1 as vf  # noqa: PLC0415 - optional: only a verifiers app imports it
    except ImportError as e:
        raise VerifiersUnavailable(
            f"cannot import verifiers ({e}): install the `verifiers` extra (pip install 'tandem[verifiers]'), "
            "in an environment of its own where another package needs openai 3 (make setup-verifiers)"
        ) from None
    return vf


def resolve_env_id(env: str) -> str:
    """The verifiers id for `env`: an id as it is, or a `path/to/module.py` file, whose folder goes first on
    `sys.path` so that verifiers imports it by its module name."""
    if not env.endswith(".py"):
        return env
    path = Path(env).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such verifiers environment file: {env}")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    if importlib.util.find_spec(path.stem) is None:
        raise ImportError(f"cannot import {path.stem} from {folder}")
    return path.stem


def env_config(env_id: str, config: Mapping[str, Any] | None = None) -> Any:
    """The verifiers `EnvConfig` for taskset `env_id` with `config` (an env config as verifiers' TOML or
    `--env.*` flags give it) over it; every agent seat without a `runtime` runs as a local subprocess."""
    vf = _vf()
    raw: dict[str, Any] = json.loads(json.dumps(dict(config or {})))
    taskset = raw.get("taskset")
    raw["taskset"] = {**(taskset if isinstance(taskset, dict) else {}), "id": env_id}
    cls = vf.env_config_type(env_id, str(raw.get("id") or ""))
    for role, field in cls.model_fields.items():
        if isinstance(field.default, vf.AgentConfig):
            seat = raw.get(role)
            seat = dict(seat) if isinstance(seat, dict) else {}
            seat.setdefault("runtime", {"type": "subprocess"})
            raw[role] = seat
    return vf.resolve_env_config(raw)


class _Serving:
    """One `Env.serving()` context (the interception server and shared tools) held while any episode runs:
    entered by the first episode, left by the last. Two contexts at once would share the env's attributes."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self._users = 0
        self._lock = asyncio.Lock()
        self._context: contextlib.AbstractAsyncContextManager[Any] | None = None

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        async with self._lock:
            if self._users == 0:
                context = self._env.serving()
                await context.__aenter__()
                self._context = context
            self._users += 1
        try:
            yield
        finally:
            async with self._lock:
                self._users -= 1
                if self._users == 0 and self._context is not None:
                    context, self._context = self._context, None
                    await context.__aexit__(None, None, None)


class VerifiersTaskApp(TaskApp):
    """A verifiers `Env` served over the Task App contract (see the module's description)."""

    def __init__(
        self,
        env: Any,
        *,
        name: str | None = None,
        description: str = "",
        max_turns: int = 100,
        max_seconds: int = 600,
    ) -> None:
        vf = _vf()
        if not isinstance(env, vf.Env):
            raise TypeError(f"a verifiers Env is needed, got {type(env).__name__}")
        env_name = str(env.config.env_id)
        super().__init__(
            name or env_name.replace("+", "-").replace("/", "-").replace("@", "-"),
            description=description or f"The verifiers environment {env_name}.",
            version=_version(),
            rubric={"outcome": {"description": "The episode's verifiers reward (Trace.reward)."}},
            max_turns=max_turns,
            max_seconds=max_seconds,
            metadata={"verifiers_env": env_name},
        )
        self.env = env
        self._infinite = not env.taskset.bounded
        self._tasks: list[Any] = [] if self._infinite else list(env.taskset)
        if not self._infinite and not self._tasks:
            raise ValueError(f"the verifiers taskset of {env_name} has no tasks")
        self._serving = _Serving(env)

    def task_for(self, seed: int) -> Any:
        """The task `seed` picks."""
        if not self._infinite:
            return self._tasks[seed % len(self._tasks)]
        task = next(itertools.islice(iter(self.env.taskset), seed, seed + 1), None)
        if task is None:
            raise InvalidArgument(f"the taskset has no task {seed}")
        return task

    def task_info(self, seed: int) -> Mapping[str, Any]:
        task = self.task_for(seed)
        data = task.data.model_dump(mode="json", exclude_none=True)
        return {"instance": {"task_key": task.key, "task": data}}

    async def rollout(self, seed: int, policy: Policy, config: dict[str, Any]) -> Result:
        vf = _vf()
        task = self.task_for(seed)
        context = vf.ModelContext(
            model=policy.model,
            client=vf.EvalClientConfig(
                base_url=policy.inference_url,
                api_key_var=POLICY_KEY_ENV,
                headers={CORRELATION_HEADER: policy.trace_correlation_id},
            ),
            sampling=vf.SamplingConfig(**_sampling(policy)),
        )
        async with self._serving.hold():
            episode = await self.env.run_episode(task, context)
        return episode_result(episode)


def _sampling(policy: Policy) -> dict[str, Any]:
    values: dict[str, Any] = dict(policy.config.sampling())
    if policy.temperature is not None:
        values["temperature"] = policy.temperature
    if policy.max_completion_tokens:
        values["max_tokens"] = policy.max_completion_tokens
    if policy.config.seed is not None:  # passed through as the request's `seed` (verifiers' extra keys)
        values["seed"] = policy.config.seed
    return values


def episode_result(episode: Any) -> Result:
    """A finished verifiers `Episode` as the rollout's result: reward, details and turns."""
    traces = list(episode.traces)
    failed_calls = [call for trace in traces for call in trace.calls if call.error is not None]
    if failed_calls:
        error = failed_calls[0].error
        raise PolicyError(
            f"the environment's model call failed: {error.type}"
            + (f" (HTTP {error.status_code})" if error.status_code else ""),
            status_code=error.status_code,
        )
    timed_out = bool(episode.is_timeout) or any(t.is_timeout for t in traces)
    errors = [*episode.errors, *(e for t in traces for e in t.errors)]
    if errors and not timed_out:
        for e in errors:
            log.error("verifiers episode %s: %s: %s\n%s", episode.id, e.type, e.message, e.traceback or "")
        raise EpisodeFailed(
            "the verifiers episode failed: " + "; ".join(f"{e.type}: {e.message}" for e in errors)[:2000]
        )
    scored = [t for t in traces if t.agent.trainable] or traces
    rewards = [float(t.reward) for t in scored]
    reward = sum(rewards) / len(rewards) if rewards else 0.0
    if not math.isfinite(reward):
        reward = 0.0
    details: dict[str, Any] = {
        "verifiers": {
            "env": episode.env.id,
            "task_key": episode.task.key,
            "traces": [_trace_details(t) for t in traces],
        }
    }
    stop = next((t.stop_condition for t in traces if t.stop_condition), None)
    aborted = timed_out or any(t.is_truncated for t in traces)
    if timed_out:
        details["abort_reason"] = "verifiers_timeout"
    elif aborted:
        details["abort_reason"] = stop or "length"
    turns = [turn for t in traces for turn in trace_turns(t)]
    return Result(outcome_reward=reward, details=details, aborted=aborted, turns=turns)


def _trace_details(trace: Any) -> dict[str, Any]:
    def finite(value: object) -> float | None:
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

    return {
        "agent": trace.agent.name,
        "trainable": bool(trace.agent.trainable),
        "reward": finite(trace.reward),
        "rewards": {k: finite(r.value) if r is not None else None for k, r in trace.rewards.items()},
        "metrics": {k: finite(v) for k, v in trace.metrics.items()},
        "stop_condition": trace.stop_condition,
        "turns": int(trace.num_turns),
    }


def trace_turns(trace: Any) -> list[Turn]:
    """The trace's final branch as turns: the messages since the previous model reply, then the reply; the
    messages after the last reply (a final observation) are a turn of their own."""
    branches = trace.branches
    if not branches:
        return []
    turns: list[Turn] = []
    pending: list[Message] = []
    for node in branches[-1].nodes:
        message = _message(node.message)
        if node.sampled and message.role == "assistant":
            turns.append(Turn((*pending, message)))
            pending = []
        else:
            pending.append(message)
    if pending:
        turns.append(Turn(tuple(pending)))
    return turns


def _message(message: Any) -> Message:
    wire = message.model_dump(mode="json", exclude_none=True)
    text = content_text(wire.get("content"))
    if not text and wire.get("tool_calls"):
        text = json.dumps(wire["tool_calls"], ensure_ascii=False)
    return Message(role=str(wire.get("role") or ""), content=text)


def _version() -> str:
    try:
        return importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def verifiers_task_app(
    env: str | Any,
    *,
    config: Mapping[str, Any] | None = None,
    name: str | None = None,
    description: str = "",
    max_turns: int = 100,
    max_seconds: int = 600,
) -> VerifiersTaskApp:
    """A Task App playing the verifiers environment `env`: a verifiers `Env`, an installed taskset id
    (`my-taskset`, `owner/my-taskset@1.0`), or a `path/to/env.py` file that defines one; `config` is the
    env config laid over it (`{"agent": {"max_turns": 4}}`)."""
    vf = _vf()
    if not isinstance(env, vf.Env):
        env = vf.load_environment(env_config(resolve_env_id(str(env)), config))
    elif config:
        raise ValueError("config applies to an env id or file; an Env object carries its own")
    return VerifiersTaskApp(
        env, name=name, description=description, max_turns=max_turns, max_seconds=max_seconds
    )
