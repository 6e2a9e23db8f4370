"""Tandem's Task App SDK: write an environment as a few functions and serve it over the Task App HTTP
contract (docs/taskapp-openapi.yaml). The package is `tandem_taskapp` because `tandem.taskapp` is the
generated protobuf package of the taskapp-proxy contract.

    from tandem_taskapp import Policy, Result, TaskApp

    async def rollout(seed: int, policy: Policy, config: dict) -> Result:
        reply = await policy.chat([{"role": "user", "content": "Say hi"}])
        return Result(outcome_reward=float("hi" in reply.lower()))

    app = TaskApp(name="say-hi", rollout=rollout)

Serve it with `python -m tandem_taskapp.serve app.py --port 8001` (key from `ENVIRONMENT_API_KEY`)."""

from tandem_taskapp.app import REPLAYED_HEADER, RolloutCache, TaskApp, create_app, error_body
from tandem_taskapp.errors import (
    EnvironmentUnavailable,
    InvalidArgument,
    InvalidResult,
    PolicyError,
    TaskAppError,
    TurnLimitReached,
)
from tandem_taskapp.models import Limits, Message, Mode, PolicyConfig, Result, RolloutRequest, Turn
from tandem_taskapp.policy import CORRELATION_HEADER, Policy

__all__ = [
    "CORRELATION_HEADER",
    "REPLAYED_HEADER",
    "EnvironmentUnavailable",
    "InvalidArgument",
    "InvalidResult",
    "Limits",
    "Message",
    "Mode",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "Result",
    "RolloutCache",
    "RolloutRequest",
    "TaskApp",
    "TaskAppError",
    "Turn",
    "TurnLimitReached",
    "create_app",
    "error_body",
]
