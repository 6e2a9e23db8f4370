"""What a job token may do, decided in one place, and its revocation when the job ends.

The scheduler gives each task attempt a job token (`TANDEM_JOB_TOKEN`, kind `job`, subject the job's
name). It is exactly its job's credential:

- **Methods.** Every service's auth interceptor lets a job token call only `JOB_METHODS`: open its declared
  secrets, publish and read its own job's events and metrics, read its own job and refresh its token, and
  play rollouts on the Task Apps its job names. Anything else, on any service and at the gateway, is
  PERMISSION_DENIED / OUTSIDE_JOB_SCOPE.
- **Resources.** The services then check the resource is the job's own (`check_own_job`,
  `check_own_task_app`): another job's events, another app, another organization's anything.
- **Revocation.** Tokens the scheduler mints carry `ext.revocable`; each call made with one asks the
  scheduler whether the job still runs (`JobLiveness`, cached for `LIVE_CACHE_S`) and an ended, unknown or
  superseded job answers UNAUTHENTICATED / CREDENTIALS_REVOKED. So a token stops working within
  `LIVE_CACHE_S` of its job's end, not only at its expiry. When the scheduler cannot be asked the call
  fails UNAVAILABLE: a job token is never taken on trust.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from mesh.errors import PermissionDenied, R, Unauthenticated, Unavailable
from mesh.identity import Principal

JOB_METHODS = frozenset(
    {
        "/tandem.vault.v1.VaultService/OpenSecrets",
        "/tandem.events.v1.EventService/Publish",
        "/tandem.events.v1.EventService/PublishMetrics",
        "/tandem.events.v1.EventService/Subscribe",
        "/tandem.events.v1.EventService/ListEvents",
        "/tandem.events.v1.EventService/ListMetrics",
        "/tandem.events.v1.EventService/GetJobStreamInfo",
        "/tandem.scheduler.v1.SchedulerService/GetJob",
        "/tandem.scheduler.v1.SchedulerService/RefreshJobToken",
        "/tandem.taskapp.v1.TaskAppService/GetTaskApp",
        "/tandem.taskapp.v1.TaskAppService/Rollout",
        "/tandem.taskapp.v1.TaskAppService/StreamRollouts",
    }
)
LIVE_CACHE_S = 2.0
ENDED_CACHE_SIZE = 4096


def claims(principal: Principal) -> dict[str, Any]:
    ext = principal.claims.get("ext")
    return ext if isinstance(ext, dict) else {}


def outside(what: str) -> PermissionDenied:
    return PermissionDenied(f"a job token may not {what}", reason=R.ERROR_REASON_OUTSIDE_JOB_SCOPE)


def check_method(principal: Principal, method: str) -> None:
    """PERMISSION_DENIED / OUTSIDE_JOB_SCOPE when a job token calls a method no job needs."""
    if principal.kind == "job" and method not in JOB_METHODS:
        raise outside(f"call {method.rsplit('/', 1)[-1]}")


def check_own_job(principal: Principal, job: str) -> None:
    """A job token names only its own job."""
    if principal.kind == "job" and principal.subject != job:
        raise outside("reach another job")


def check_own_task_app(principal: Principal, app: str) -> None:
    """A job token plays rollouts only on the Task Apps its job names (`ext.task_apps`; `orgs/{org}/taskApps/*`
    names every app of the organization, for a config the scheduler could not read)."""
    if principal.kind != "job":
        return
    named = list(claims(principal).get("task_apps") or [])
    if app not in named and f"orgs/{principal.org}/taskApps/*" not in named:
        raise outside(f"use {app}, which its job does not name")


# (job name, task, attempt) -> None when it runs; a message when the token is revoked.
Lookup = Callable[[str, str, int], Awaitable[str | None]]


_ENDED_JOB = {"STATE_SUCCEEDED", "STATE_FAILED", "STATE_CANCELLED"}
_ENDED_TASK = {"STATE_SUCCEEDED", "STATE_FAILED", "STATE_CANCELLED", "STATE_STOPPED"}
LOOKUP_TIMEOUT_S = 5.0


def why_ended(job: Any, task: str, attempt: int) -> str | None:
    """None while `attempt` of `task` of the scheduler's `job` (a `scheduler.v1.Job`) runs, else why not."""
    state = job.State.Name(job.state)
    if state in _ENDED_JOB:
        return f"{job.name} is {state.removeprefix('STATE_')}"
    status = next((t for t in job.tasks if t.task == task), None)
    if status is None:
        return f"{job.name} has no task {task}"
    if status.State.Name(status.state) in _ENDED_TASK:
        return f"task {task} of {job.name} has ended"
    if status.attempt != attempt:
        return f"attempt {attempt} of task {task} was superseded by attempt {status.attempt}"
    return None


def scheduler_lookup(clients: Any) -> Lookup:
    """Ask the scheduler (a service call with this service's own token) whether a job's attempt runs."""
    from tandem.scheduler.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc  # noqa: PLC0415

    from mesh.status import RpcError  # noqa: PLC0415

    async def lookup(job: str, task: str, attempt: int) -> str | None:
        stub = clients.stub(scheduler_service_pb2_grpc.SchedulerServiceStub, "scheduler")
        try:
            reply = await stub.GetJob(scheduler_service_pb2.GetJobRequest(name=job), timeout=LOOKUP_TIMEOUT_S)
        except RpcError as error:
            if error.reason == "JOB_NOT_FOUND":
                return f"{job} is not a job of this deployment"
            raise
        return why_ended(reply.job, task, attempt)

    return lookup


class JobLiveness:
    """Revokes the tokens of jobs that ended. `lookup(job, task, attempt)` answers None while that attempt
    of the job runs, else why not (the scheduler's store in its own process, its GetJob elsewhere)."""

    def __init__(self, lookup: Lookup, cache_s: float = LIVE_CACHE_S) -> None:
        self.lookup = lookup
        self._cache_s = cache_s
        self._live: dict[tuple[str, str, int], float] = {}
        self._ended: OrderedDict[tuple[str, str, int], str] = OrderedDict()

    async def check(self, principal: Principal) -> None:
        ext = claims(principal)
        if principal.kind != "job" or not ext.get("revocable"):
            return
        key = (principal.subject, str(ext.get("task", "")), int(ext.get("attempt", -1)))
        ended = self._ended.get(key)
        if ended is None:
            if time.monotonic() - self._live.get(key, -self._cache_s) < self._cache_s:
                return
            try:
                ended = await self.lookup(*key)
            except Unavailable:
                raise
            except Exception as error:  # the scheduler could not be asked: refuse, never trust
                raise Unavailable(
                    f"cannot check the job token's job: {type(error).__name__}",
                    reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE,
                    retry_after_s=1.0,
                ) from None
            if ended is None:
                self._live[key] = time.monotonic()
                return
            self._live.pop(key, None)
            self._ended[key] = ended
            if len(self._ended) > ENDED_CACHE_SIZE:
                self._ended.popitem(last=False)
        raise Unauthenticated(
            f"the job token was revoked: {ended}", reason=R.ERROR_REASON_CREDENTIALS_REVOKED
        )
