"""Serve an OpenEnv environment (a server written on openenv-core, local or remote) as a Task App.

    from tandem_taskapp.openenv_env import OpenEnvAdapter, openenv_task_app

    adapter = OpenEnvAdapter(
        prompt=lambda observation: observation["message"],          # observation -> the next user message
        action=lambda text, observation: {"guess": int(text)},    # the policy's reply -> the env's action
    )
    app = openenv_task_app("http://127.0.0.1:8010", adapter)

or from the command line:
`tandem taskapp serve --openenv http://127.0.0.1:8010 --openenv-adapter my_adapter.py:adapter`.

How the contract maps onto OpenEnv (its wire protocol; this module does not import openenv):

- Each rollout opens one WebSocket session (`/ws`) on the env server, so the episode has an environment
  instance of its own, sends `reset` with `seed` (and `episode_id`, the correlation id, and the request's
  `env.config["reset"]` fields), then loops: the observation becomes the next user message
  (`adapter.prompt`), the policy answers it (`policy.config.inference_url`, the `X-Trace-Correlation-Id`
  header), the reply becomes an action (`adapter.action`), and `step` sends it. The loop ends when the
  env answers `done`, or when the episode's turn limit is spent (`aborted: true`, `abort_reason: max_turns`).
- The reward is the sum of the step rewards (and of the reset's reward, when it has one); each step's
  reward is an event reward, and `metrics.details.openenv` holds the step count, whether the env ended the
  episode, and the final observation when it is small.
- Every call resends the conversation so far (with `adapter.system` first when set); each turn of the
  trajectory is the new observation and the reply.
- `GET /task_info?seed=N` resets a session with that seed and answers its first observation as
  `instance.observation` (deterministic for an env whose reset depends only on the seed).
- An env server that cannot be reached, or that is at its session limit, answers 503 `UNAVAILABLE`
  (retryable); an env that answers a message with an error (an action its schema refuses) fails the
  rollout with 500 `INTERNAL`, the env's message in the app's log. An adapter function may raise
  `InvalidArgument` to refuse a request (400)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx

from tandem_taskapp.app import TaskApp
from tandem_taskapp.errors import EnvironmentUnavailable, InvalidArgument, TaskAppError
from tandem_taskapp.models import Result, RolloutRequest
from tandem_taskapp.policy import Policy

log = logging.getLogger("tandem_taskapp.openenv")

PromptFn = Callable[[Mapping[str, Any]], str | Sequence[Mapping[str, Any]]]
ActionFn = Callable[[str, Mapping[str, Any]], Mapping[str, Any]]

DEFAULT_ENV_TIMEOUT_S = 60.0
MAX_OBSERVATION_DETAIL_BYTES = 8 << 10
# The env's errors that say it cannot take this episode now (a retry may find room), not that it failed.
_BUSY_CODES = frozenset({"CAPACITY_REACHED", "FACTORY_ERROR"})


class OpenEnvError(TaskAppError):
    """The OpenEnv server answered an episode's message with an error (its `code` and `message`)."""

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class OpenEnvAdapter:
    """How a Tandem episode plays an OpenEnv environment.

    - `prompt(observation) -> str | messages`: the observation (the fields of the env's Observation, without
      `reward`, `done` and `metadata`) as the next user message's text, or as the messages to append.
    - `action(text, observation) -> dict`: the policy's reply as the env's action (the fields of its Action).
    - `system`: a system message sent first, if any.
    - `reset`: extra fields for every `reset` (the request's `env.config["reset"]` is laid over them)."""

    prompt: PromptFn
    action: ActionFn
    system: str | None = None
    reset: Mapping[str, Any] | None = None


def ws_url(base_url: str) -> str:
    """The env server's `/ws` URL for its HTTP base URL."""
    parts = urlsplit(base_url.rstrip("/"))
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
        raise ValueError(f"an OpenEnv server URL is http(s)://host[:port][/path], got {base_url!r}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path + "/ws", "", ""))


class OpenEnvSession:
    """One `/ws` session on an OpenEnv server: `reset`, `step`, `state`, then `close`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, timeout: float) -> None:
        self._ws = ws
        self._timeout = timeout

    async def reset(self, **fields: Any) -> dict[str, Any]:
        """`{"observation": {...}, "reward": float | None, "done": bool}` of the reset."""
        return await self._send({"type": "reset", "data": fields}, "observation")

    async def step(self, action: Mapping[str, Any]) -> dict[str, Any]:
        """`{"observation": {...}, "reward": float | None, "done": bool}` of the step."""
        return await self._send({"type": "step", "data": dict(action)}, "observation")

    async def state(self) -> dict[str, Any]:
        """The env's `State` (`episode_id`, `step_count`, and the env's own fields)."""
        return await self._send({"type": "state"}, "state")

    async def close(self) -> None:
        if not self._ws.closed:
            with contextlib.suppress(aiohttp.ClientError, ConnectionError, RuntimeError):
                await self._ws.send_str(json.dumps({"type": "close"}))
            await self._ws.close()

    async def _send(self, message: Mapping[str, Any], expected: str) -> dict[str, Any]:
        try:
            await self._ws.send_str(json.dumps(message))
            reply = await self._ws.receive(timeout=self._timeout)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
            raise EnvironmentUnavailable(f"the OpenEnv session failed: {type(e).__name__}") from None
        except TimeoutError:
            raise EnvironmentUnavailable(
                f"the OpenEnv server did not answer {message['type']} in {self._timeout:g}s"
            ) from None
        if reply.type is not aiohttp.WSMsgType.TEXT:
            raise EnvironmentUnavailable(f"the OpenEnv server closed the session ({reply.type.name})")
        try:
            body = json.loads(reply.data)
        except ValueError:
            raise OpenEnvError("the OpenEnv server answered a message that is not JSON") from None
        if not isinstance(body, dict):
            raise OpenEnvError("the OpenEnv server answered a message that is not an object")
        data = body.get("data")
        if body.get("type") == "error":
            detail = data if isinstance(data, dict) else {}
            code = str(detail.get("code") or "")
            text = f"the OpenEnv server refused {message['type']}: {code or 'error'}: {detail.get('message', '')}"
            if code in _BUSY_CODES:
                raise EnvironmentUnavailable(text)
            raise OpenEnvError(text, code=code)
        if body.get("type") != expected or not isinstance(data, dict):
            raise OpenEnvError(f"the OpenEnv server answered {body.get('type')!r} to {message['type']}")
        return data


class OpenEnvTaskApp(TaskApp):
    """An OpenEnv environment served over the Task App contract (see the module's description)."""

    def __init__(
        self,
        base_url: str,
        adapter: OpenEnvAdapter,
        *,
        name: str | None = None,
        description: str = "",
        max_turns: int = 100,
        max_seconds: int = 600,
        env_timeout: float = DEFAULT_ENV_TIMEOUT_S,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(adapter, OpenEnvAdapter):
            raise TypeError(f"an OpenEnvAdapter is needed, got {type(adapter).__name__}")
        self.ws_url = ws_url(base_url)
        env_meta = dict(metadata or {})
        env_name = str(env_meta.get("name") or "openenv")
        super().__init__(
            name or env_name,
            description=description
            or str(env_meta.get("description") or f"The OpenEnv environment {env_name}."),
            version=str(env_meta.get("version") or "0.1.0"),
            rubric={"outcome": {"description": "The sum of the OpenEnv environment's step rewards."}},
            max_turns=max_turns,
            max_seconds=max_seconds,
            metadata={"openenv_env": env_name},
        )
        self.base_url = base_url.rstrip("/")
        self.adapter = adapter
        self.env_timeout = env_timeout

    async def _open(self, http: aiohttp.ClientSession) -> OpenEnvSession:
        try:
            ws = await http.ws_connect(self.ws_url, timeout=aiohttp.ClientWSTimeout(ws_close=5.0))
        except (aiohttp.ClientError, OSError) as e:
            raise EnvironmentUnavailable(
                f"cannot open a session on the OpenEnv server: {type(e).__name__}"
            ) from None
        return OpenEnvSession(ws, self.env_timeout)

    def _reset_fields(self, seed: int, episode_id: str | None, config: Mapping[str, Any]) -> dict[str, Any]:
        extra = config.get("reset", {})
        if not isinstance(extra, Mapping):
            raise InvalidArgument('env.config["reset"] must be an object: the fields sent with reset')
        fields: dict[str, Any] = {**(self.adapter.reset or {}), **extra, "seed": seed}
        if episode_id is not None:
            fields["episode_id"] = episode_id
        return fields

    async def task_info(self, seed: int) -> Mapping[str, Any]:
        async with aiohttp.ClientSession() as http:
            session = await self._open(http)
            try:
                first = await session.reset(**self._reset_fields(seed, None, {}))
            finally:
                await session.close()
        return {"instance": {"observation": first.get("observation") or {}}}

    async def rollout(
        self, seed: int, policy: Policy, config: dict[str, Any], request: RolloutRequest | None = None
    ) -> Result:
        episode_id = request.trace_correlation_id if request is not None else policy.trace_correlation_id
        async with aiohttp.ClientSession() as http:
            session = await self._open(http)
            try:
                return await self._play(session, seed, policy, config, episode_id)
            finally:
                await asyncio.shield(session.close())

    async def _play(
        self, session: OpenEnvSession, seed: int, policy: Policy, config: Mapping[str, Any], episode_id: str
    ) -> Result:
        answer = await session.reset(**self._reset_fields(seed, episode_id, config))
        first_reward = _reward(answer.get("reward"))
        rewards: list[float] = []
        messages: list[dict[str, Any]] = []
        if self.adapter.system:
            messages.append({"role": "system", "content": self.adapter.system})
        steps = 0
        done = bool(answer.get("done"))
        while not done and policy.turns_left != 0:
            observation = _observation(answer)
            messages.extend(_prompt_messages(self.adapter.prompt(observation)))
            reply = await policy.chat(messages)
            messages.append({"role": "assistant", "content": reply})
            action = self.adapter.action(reply, observation)
            if not isinstance(action, Mapping):
                raise TypeError(f"the adapter's action must return a mapping, got {type(action).__name__}")
            answer = await session.step(action)
            steps += 1
            rewards.append(_reward(answer.get("reward")))
            done = bool(answer.get("done"))
        details: dict[str, Any] = {"openenv": {"steps": steps, "done": done}}
        final = _observation(answer)
        if len(json.dumps(final, default=str)) <= MAX_OBSERVATION_DETAIL_BYTES:
            details["openenv"]["final_observation"] = final
        if not done:
            details["abort_reason"] = "max_turns"
            details["max_turns"] = policy.max_turns
        return Result(
            outcome_reward=first_reward + sum(rewards),
            event_rewards=rewards,
            details=details,
            aborted=not done,
        )


def _observation(answer: Mapping[str, Any]) -> dict[str, Any]:
    observation = answer.get("observation")
    return dict(observation) if isinstance(observation, Mapping) else {}


def _reward(value: object) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return float(value)
    raise OpenEnvError(f"the OpenEnv server answered a reward that is not a finite number: {value!r}")


def _prompt_messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [dict(m) for m in prompt if isinstance(m, Mapping)] if isinstance(prompt, Sequence) else []
    if messages and len(messages) == len(prompt):
        return messages
    raise TypeError("the adapter's prompt must return a string or a list of message objects")


def env_metadata(base_url: str, timeout: float = 30.0) -> dict[str, Any]:
    """The env server's `GET /metadata` (name, description, version); raises `EnvironmentUnavailable` when
    the server cannot be reached or does not answer as an OpenEnv server does."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/metadata", timeout=timeout)
    except httpx.HTTPError as e:
        raise EnvironmentUnavailable(
            f"cannot reach the OpenEnv server {base_url}: {type(e).__name__}"
        ) from None
    try:
        body = r.json() if r.status_code == 200 else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise EnvironmentUnavailable(
            f"{base_url} does not answer GET /metadata as an OpenEnv server does (HTTP {r.status_code})"
        )
    return body


def openenv_task_app(
    base_url: str,
    adapter: OpenEnvAdapter,
    *,
    name: str | None = None,
    description: str = "",
    max_turns: int = 100,
    max_seconds: int = 600,
    env_timeout: float = DEFAULT_ENV_TIMEOUT_S,
) -> OpenEnvTaskApp:
    """A Task App playing the OpenEnv environment served at `base_url` (`http://host:port`) through
    `adapter`. Reads the server's `/metadata` first (its name names the app unless `name` does), so a
    server that is not up is refused here."""
    ws_url(base_url)
    metadata = env_metadata(base_url)
    return OpenEnvTaskApp(
        base_url,
        adapter,
        name=name,
        description=description,
        max_turns=max_turns,
        max_seconds=max_seconds,
        env_timeout=env_timeout,
        metadata=metadata,
    )
