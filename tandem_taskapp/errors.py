"""Typed errors of the Task App SDK. Each maps to one answer of the HTTP contract (docs/taskapp-openapi.yaml)."""

from __future__ import annotations


class TaskAppError(Exception):
    """The base of every error the SDK raises."""


class TurnLimitReached(TaskAppError):
    """The episode used all its policy turns (`limits.max_turns`). Raised by `Policy.chat` before a call that
    would exceed the limit; if the rollout does not catch it, the SDK answers the episode with
    `aborted: true`."""

    def __init__(self, max_turns: int) -> None:
        super().__init__(f"the episode used all {max_turns} policy turns")
        self.max_turns = max_turns


class PolicyError(TaskAppError):
    """A policy call failed: the endpoint could not be reached, answered an error status, or answered a body
    that is not a chat completion. The server answers 502 `POLICY_UNAVAILABLE` (retryable). The message
    never contains the inference URL, which may carry credentials."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class InvalidArgument(TaskAppError):
    """Raised by a Task App's own code for a request it cannot serve (an unknown split, a seed out of
    range). The server answers 400 `INVALID_ARGUMENT` with the message."""


class InvalidResult(TaskAppError):
    """The app produced a result or task description that breaks the contract (a non-finite reward, a body
    the schema rejects, details over 64 KiB). The server answers 500 `INVALID_RESULT`."""


class EnvironmentUnavailable(TaskAppError):
    """The environment the app plays (a separate server, such as an OpenEnv env server) cannot be reached or
    cannot take the episode now. The server answers 503 `UNAVAILABLE` (retryable) with the message, which
    must not contain credentials."""
