"""The reconcile loop: one asyncio task that makes the backends do what the stored jobs say.

Each pass (every `pass_interval_s`, and at once when CreateJob or CancelJob wakes it):

1. observe: poll every launched attempt (`backend.poll`); an attempt stored without a handle (the scheduler
   died during `launch`) is looked up with `backend.find` and launched again when the backend never saw
   it (`launch` is idempotent per attempt key, so this never starts a second copy);
2. decide, per job with the pure rules of `lifecycle`: a task that exited 0, a failure the recovery policy
   restarts (RECOVERING, after the backoff) or not (the job FAILS once its other tasks are stopped),
   auxiliaries stopped `termination_delay` after the primaries ended, `max_duration`, cancellation
   (CANCELLING until every attempt ended, then CANCELLED);
3. admit: the queued groups (PENDING, and RECOVERING whose backoff is over) in queue order, each whole
   when it fits the backend's inventory less what this scheduler's live attempts hold (gang admission),
   with preemption of lower-priority jobs when enabled; then launch each admitted task's attempt.

Every change is stored before it is acted on (attempt row before `launch`, handle right after), together
with the events that report it in the outbox (`store.py`); `EventOutbox` publishes them and retries while
the events service is unreachable. A backend that raises `BackendUnavailable` leaves its jobs as they are
with a message saying so, and the next pass tries again; it never counts as a task failure.

Assumes one scheduler replica drives a store at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from google.protobuf import duration_pb2
from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2, events_service_pb2
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

from mesh.aio import cancel_and_wait, wait_set
from mesh.errors import R
from mesh.identity import TokenSigner
from mesh.secrets import JOB_TOKEN_ENV
from mesh.timestamps import stamp as _stamp
from services.scheduler import expand
from services.scheduler import lifecycle as lc
from services.scheduler.backends.base import (
    NODE_SELECTOR_OPTION,
    POD_HOME,
    Backend,
    BackendUnavailable,
    LaunchRefused,
    LaunchSpec,
    NodeAssignment,
    NodeInventory,
    Observed,
    Phase,
    RegistryLogin,
    Resources,
)
from services.scheduler.backends.task_buckets import (
    BUCKETS_ENV,
    CREDENTIAL_ENVS,
    bucket_plan,
    delete_made_bucket,
    store_with,
)
from services.scheduler.backends.task_image import LOGIN_ENVS
from services.scheduler.expand import SETUP_FAILED_EXIT
from services.scheduler.lifecycle import FailureClass, JobState, TaskState
from services.scheduler.spec import resource_choices, resources_of, s3_location
from services.scheduler.store import AttemptRow, FailureInfo, JobRecord, JobRow, JobStore, TaskRow

log = logging.getLogger("tandem.scheduler")
JobSpec = job_spec_pb2.JobSpec
TaskSpec = job_spec_pb2.TaskSpec
PRODUCER_ID = "scheduler"
MAX_MESSAGE = 4000
HOST_BACKENDS = frozenset({"local", "slurm"})  # run tasks on the host's own files: no mounts elsewhere


def _seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def recovery_policy(spec: JobSpec) -> lc.RecoveryPolicy:
    policy = spec.recovery
    initial = _seconds(policy.initial_backoff) if policy.HasField("initial_backoff") else 10.0
    ceiling = _seconds(policy.max_backoff) if policy.HasField("max_backoff") else 300.0
    return lc.RecoveryPolicy(
        max_restarts_on_errors=policy.max_restarts_on_errors,
        recover_on_exit_codes=frozenset(policy.recover_on_exit_codes),
        initial_backoff_s=initial,
        max_backoff_s=max(ceiling, initial),
        group_scope=policy.scope != job_spec_pb2.RecoveryPolicy.SCOPE_TASK,
    )


def task_resources(task: TaskSpec) -> Resources:
    return resources_of(task)


def placed_resources(task: TaskSpec, slots: Sequence[NodeAssignment]) -> Resources:
    """What one node of the task holds as placed: the accelerator alternative the slots took (their GPU
    count and type), else the task's first choice."""
    choices = resource_choices(task)
    if slots:
        first = slots[0]
        for choice in choices:
            if choice.gpus == len(first.gpu_indices) and choice.gpu_type == first.gpu_type:
                return choice
    return choices[0]


def preemptible(spec: JobSpec) -> bool:
    """SkyPilot's `use_spot` on any task places the whole group as preemptible: a group is admitted, and
    (with group-scope recovery) preempted and restarted, as one."""
    return any(task.resources.preemptible for task in spec.tasks)


def demands_of(spec: JobSpec) -> tuple[lc.Demand, ...]:
    demands = []
    for task in spec.tasks:
        res = task_resources(task)
        alternatives = tuple((r.gpus, r.gpu_type) for r in resource_choices(task)[1:])
        demands.append(
            lc.Demand(
                task.name,
                max(task.num_nodes, 1),
                res.gpus,
                res.cpus,
                res.memory_gib,
                res.gpu_type,
                alternatives,
            )
        )
    return tuple(demands)


def is_serial(spec: JobSpec) -> bool:
    """A pipeline: its tasks run one after another, each once the one before it SUCCEEDED."""
    return spec.execution == JobSpec.EXECUTION_SERIAL


def sibling_hosts(spec: JobSpec) -> bool:
    """Whether the tasks reach each other as `{task}-{rank}.{group}`: a parallel group of several tasks,
    unless it says `inter_connection: false` (SkyPilot's; unset means true)."""
    wanted = spec.inter_connection if spec.HasField("inter_connection") else True
    return wanted and len(spec.tasks) > 1 and not is_serial(spec)


def due_task(record: JobRecord) -> str:
    """The task of a serial group that may run now: the first that has not SUCCEEDED ("" when all have)."""
    for task in record.tasks:
        if task.state is not TaskState.SUCCEEDED:
            return task.task
    return ""


def attempt_key(job: str, task: str, attempt: int) -> str:
    return f"{job.replace('/', '-')}.{task}.{attempt}"


def is_primary(task: TaskSpec) -> bool:
    return task.role != TaskSpec.ROLE_AUXILIARY


def failure_proto(failure: FailureInfo | None) -> job_pb2.Failure | None:
    if failure is None:
        return None
    proto = job_pb2.Failure(
        failure_class=int(failure.failure_class),  # type: ignore[arg-type]
        message=failure.message[:MAX_MESSAGE],
        task=failure.task,
        time=_stamp(failure.time),
    )
    if failure.exit_code is not None:
        proto.exit_code = failure.exit_code
    return proto


def _tail(path: Path | None, lines: int = 10) -> str:
    if path is None or not path.exists():
        return ""
    with path.open("rb") as handle:
        handle.seek(0, 2)
        size = handle.tell()
        handle.seek(max(0, size - 2048))
        text = handle.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


# ---- events -------------------------------------------------------------------------------------------

Publish = Callable[[events_service_pb2.PublishRequest], Awaitable[Any]]
Close = Callable[[events_service_pb2.CloseJobStreamRequest], Awaitable[Any]]


def job_event(job: JobRow, previous: JobState | None) -> tuple[str, bool, bytes]:
    """The outbox entry for a job state change: a Publish, or the CloseJobStream of a terminal state."""
    change = event_pb2.JobStateChanged(
        state=int(job.state),  # type: ignore[arg-type]
        previous_state=int(previous) if previous else 0,  # type: ignore[arg-type]
        failure=failure_proto(job.failure) if job.state in (JobState.FAILED, JobState.RECOVERING) else None,
        restart_count=job.restart_count,
    )
    message = f"job {job.state.name}"
    if job.state is JobState.CANCELLED and job.cancel_reason:
        message += f": {job.cancel_reason}"
    elif job.failure and job.state in (JobState.FAILED, JobState.RECOVERING):
        message += f": {job.failure.message}"
    message = message[:MAX_MESSAGE]
    if job.state in lc.JOB_TERMINAL:
        close = events_service_pb2.CloseJobStreamRequest(job=job.name, state_changed=change, message=message)
        return job.name, True, close.SerializeToString()
    event = event_pb2.Event(type="job.state_changed", message=message, job_state_changed=change)
    event.time.FromNanoseconds(time.time_ns())
    return job.name, False, event.SerializeToString()


def task_event(task: TaskRow, previous: TaskState | None) -> tuple[str, bool, bytes]:
    change = event_pb2.TaskStateChanged(
        task=task.task,
        state=int(task.state),  # type: ignore[arg-type]
        previous_state=int(previous) if previous else 0,  # type: ignore[arg-type]
        attempt=max(task.attempt, 0),
        failure=failure_proto(task.failure)
        if task.state in (TaskState.FAILED, TaskState.RECOVERING)
        else None,
    )
    event = event_pb2.Event(
        type="task.state_changed", message=f"task {task.task} {task.state.name}", task_state_changed=change
    )
    event.time.FromNanoseconds(time.time_ns())
    return task.job, False, event.SerializeToString()


_TRANSIENT = frozenset(
    {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN", "ABORTED", "CANCELLED"}
)


class EventOutbox:
    """Publishes the stored outbox in order, job by job, and retries while the events service is down.
    Each event's producer sequence is its outbox id, so a resend after a crash is appended once."""

    def __init__(
        self, store: JobStore, publish: Publish | None, close: Close | None, interval_s: float = 0.2
    ):
        self._store = store
        self._publish = publish
        self._close = close
        self._interval = interval_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._warned = -1e9

    def start(self) -> None:
        if self._publish is not None:
            self._task = asyncio.create_task(self._loop(), name="scheduler-event-outbox")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    def wake(self) -> None:
        self._wake.set()

    async def flush(self, job: str = "") -> bool:
        """Send what is queued (for one job, or all); True when nothing is left."""
        if self._publish is None or self._close is None:
            return True
        async with self._lock:
            pending = await self._store.outbox(job=job)
            if not pending:
                return True
            blocked: set[str] = set()
            for entry in pending:
                if entry.job in blocked:
                    continue
                try:
                    await self._send(entry.id, entry.job, entry.closes, entry.payload)
                except Exception as error:  # the client's RpcError, or a transport failure
                    code = getattr(getattr(error, "code", None), "name", "UNAVAILABLE")
                    if code in _TRANSIENT:
                        if time.monotonic() - self._warned > 30:
                            log.warning("events unavailable (%s); retrying later", code)
                            self._warned = time.monotonic()
                        blocked.add(entry.job)  # keep this job's order: try again later
                        continue
                    log.warning("dropping an event the events service refused: %s", error)
                await self._store.sent([entry.id])
            return not blocked

    async def _send(self, outbox_id: int, job: str, closes: bool, payload: bytes) -> None:
        assert self._publish is not None and self._close is not None
        if closes:
            close = events_service_pb2.CloseJobStreamRequest.FromString(payload)
            close.request_id = f"close-{outbox_id}"
            await self._close(close)
            return
        event = event_pb2.Event.FromString(payload)
        event.producer_id, event.producer_seq = PRODUCER_ID, outbox_id
        await self._publish(events_service_pb2.PublishRequest(job=job, events=[event]))

    async def _loop(self) -> None:
        while True:
            await wait_set(self._wake, self._interval)
            self._wake.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event outbox pass failed")


# ---- the engine ---------------------------------------------------------------------------------------


@dataclass
class EngineConfig:
    work_dir: Path
    default_backend: str = "local"
    pass_interval_s: float = 0.2
    cancel_grace_s: float = 10.0
    aux_stop_grace_s: float = 30.0
    token_ttl_s: float = 3600.0
    aging_s_per_point: float = 30.0
    preemption: bool = False
    health_timeout_s: float = 2.0
    bucket_sync_interval_s: float = 30.0  # uploads of a task's MOUNT buckets while it runs
    targets: Callable[[], Mapping[str, str]] = dict  # service -> host:port, given to tasks at launch


TaskAppHook = Callable[[JobRecord, TaskSpec, str], Awaitable[None]]  # (job, task, endpoint)
OpenSecrets = Callable[[Sequence[str], str], Awaitable[Mapping[str, bytes]]]  # (secret names, job token)
LOGIN_BACKENDS = ("kubernetes",)  # backends whose image puller needs the registry login at launch


@dataclass
class _Live:
    """What the engine remembers in memory beside the store for one active job."""

    record: JobRecord
    spec: JobSpec
    demands: tuple[lc.Demand, ...]
    cancel_sent: set[str] = field(default_factory=set)  # attempt keys already asked to stop
    overrun: bool = False  # ran over max_duration: being stopped, then FAILED


class Engine:
    def __init__(
        self,
        store: JobStore,
        backends: Mapping[str, Backend],
        signer: TokenSigner,
        config: EngineConfig,
        outbox: EventOutbox,
        register_task_app: TaskAppHook | None = None,
        delete_task_app: TaskAppHook | None = None,
        open_secrets: OpenSecrets | None = None,
    ) -> None:
        self.store = store
        self._open_secrets = open_secrets
        self.backends = dict(backends)
        self.signer = signer
        self.config = config
        self.outbox = outbox
        self._register = register_task_app
        self._deregister = delete_task_app
        self._jobs: dict[str, _Live] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.unavailable: dict[str, str] = {}  # backend -> why, while it lasts
        self.inventories: dict[str, list[NodeInventory]] = {}
        self._cleanups: set[asyncio.Task[None]] = set()  # deleting `persistent: false` buckets of ended jobs

    # ---- life -------------------------------------------------------------------------------------

    async def start(self) -> None:
        for record in await self.store.active():
            self._adopt(record)
        self.outbox.start()
        self._task = asyncio.create_task(self._loop(), name="scheduler-engine")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self._cleanups:  # a bucket being deleted is deleted to the end, within a bound
            await asyncio.wait(self._cleanups, timeout=30.0)
        await self.outbox.stop()

    def wake(self) -> None:
        self._wake.set()

    def _adopt(self, record: JobRecord) -> _Live:
        spec = JobSpec.FromString(record.job.spec)
        live = _Live(record, spec, demands_of(spec))
        self._jobs[record.job.name] = live
        return live

    async def _loop(self) -> None:
        while True:
            await wait_set(self._wake, self.config.pass_interval_s)
            self._wake.clear()
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scheduler pass failed; the next one retries")

    # ---- the API the servicer calls -----------------------------------------------------------------

    async def submitted(self, record: JobRecord) -> None:
        """A job CreateJob stored: take it into the loop and send its first event. No lock: a pass never
        iterates the jobs across an await, so adopting one in the middle of a pass is safe."""
        if record.job.name not in self._jobs and record.job.state not in lc.JOB_TERMINAL:
            self._adopt(record)
        self.wake()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.outbox.flush(record.job.name), 5.0)

    async def cancel(self, name: str, reason: str) -> JobRecord:
        async with self._lock:
            live = self._jobs.get(name)
            record = live.record if live else await self.store.get(name)
            job = record.job
            if job.state in (JobState.CANCELLING, JobState.CANCELLED):
                return record
            if job.state in (JobState.SUCCEEDED, JobState.FAILED):
                from mesh.errors import FailedPrecondition  # noqa: PLC0415

                raise FailedPrecondition(
                    f"{name} already {job.state.name}", reason=R.ERROR_REASON_JOB_STATE_CONFLICT
                )
            job.cancel_requested, job.cancel_reason = True, reason
            if not any(self._live_attempts(record)) and job.state in (JobState.PENDING, JobState.RECOVERING):
                for task in record.tasks:
                    if task.state not in lc.TASK_TERMINAL:
                        task.end_time = time.time()
                        await self._set_task(record, task, TaskState.CANCELLED)
                await self._finish(record, JobState.CANCELLED)
            else:
                await self._set_job(record, JobState.CANCELLING)
        self.wake()
        return record

    # ---- one pass ---------------------------------------------------------------------------------

    async def run_pass(self) -> None:
        async with self._lock:
            now = time.time()
            await self._refresh_inventories()
            lives = list(self._jobs.values())
            await asyncio.gather(*(self._observe(live) for live in lives))
            for live in lives:
                await self._advance(live, time.time())
            await self._admit(now)
            for name in [n for n, live in self._jobs.items() if live.record.job.state in lc.JOB_TERMINAL]:
                del self._jobs[name]
        self.outbox.wake()

    async def _refresh_inventories(self) -> None:
        for name, backend in self.backends.items():
            try:
                self.inventories[name] = await backend.inventory()
                self.unavailable.pop(name, None)
            except BackendUnavailable as error:
                self.unavailable[name] = str(error) or "unreachable"

    def _backend(self, name: str) -> Backend:
        return self.backends[name]

    @staticmethod
    def _live_attempts(record: JobRecord) -> list[AttemptRow]:
        return [a for attempts in record.attempts.values() for a in attempts if not a.ended]

    # ---- observing attempts -----------------------------------------------------------------------

    async def _observe(self, live: _Live) -> None:
        for attempt in self._live_attempts(live.record):
            backend = self.backends.get(attempt.backend)
            if backend is None:
                continue
            try:
                if attempt.handle is None:
                    await self._reattach(live, attempt, backend)
                    continue
                observed = await backend.poll(attempt.handle)
            except BackendUnavailable as error:
                await self._note(live, f"backend {attempt.backend} unavailable: {error}; retrying")
                continue
            if live.record.job.message.startswith("backend "):
                await self._note(live, "")  # it answers again
            await self._apply(live, attempt, observed, backend)

    async def _reattach(self, live: _Live, attempt: AttemptRow, backend: Backend) -> None:
        """An attempt stored before a launch that never reported back: find it, else launch it now. A serial
        group's later tasks wait here, their attempts stored at admission, until the one before succeeds."""
        if is_serial(live.spec) and attempt.task != due_task(live.record):
            return
        handle = await backend.find(attempt.key)
        if handle is None:
            task = next(t for t in live.spec.tasks if t.name == attempt.task)
            slots = [
                NodeAssignment(
                    n["rank"], n["node"], n["address"], tuple(n["gpu_indices"]), n.get("gpu_type", "")
                )
                for n in attempt.nodes
            ]
            await self._launch(live, task, attempt, slots)
            return
        attempt.handle = handle
        await self.store.save(attempts=[attempt])

    async def _apply(self, live: _Live, attempt: AttemptRow, observed: Observed, backend: Backend) -> None:
        record = live.record
        task = record.task(attempt.task)
        spec_task = next(t for t in live.spec.tasks if t.name == attempt.task)
        now = time.time()
        if observed.nodes and not attempt.nodes:
            attempt.nodes = [
                {
                    "rank": n.rank,
                    "node": n.node,
                    "address": n.address,
                    "gpu_indices": list(n.gpu_indices),
                    "gpu_type": n.gpu_type,
                }
                for n in observed.nodes
            ]
        if observed.phase is Phase.QUEUED:
            return
        if observed.phase is Phase.RUNNING:
            if attempt.state is TaskState.STARTING:
                if spec_task.kind == TaskSpec.KIND_SERVICE and not await self._healthy(
                    live, spec_task, attempt, now
                ):
                    return
                attempt.state, attempt.start_time = TaskState.RUNNING, now
                if task.state is TaskState.STARTING:
                    task.start_time = now
                    await self._set_task(record, task, TaskState.RUNNING, attempts=[attempt])
                    if spec_task.kind == TaskSpec.KIND_SERVICE:
                        await self._service_ready(live, spec_task, task)
                else:
                    await self.store.save(attempts=[attempt])
            return
        # EXITED or LOST: the attempt is over.
        attempt.ended, attempt.end_time, attempt.exit_code = True, now, observed.exit_code
        if (
            attempt.state is TaskState.STARTING
            and observed.phase is Phase.EXITED
            and task.state is TaskState.STARTING
        ):
            await self._set_task(record, task, TaskState.RUNNING)  # it ran, however briefly
        attempt.state = TaskState.SUCCEEDED if observed.exit_code == 0 else TaskState.FAILED
        if spec_task.kind == TaskSpec.KIND_SERVICE and self._deregister and task.endpoint:
            with contextlib.suppress(Exception):
                await self._deregister(record, spec_task, task.endpoint)
        await self._attempt_ended(live, task, spec_task, attempt, observed, backend)

    async def _attempt_ended(
        self,
        live: _Live,
        task: TaskRow,
        spec_task: TaskSpec,
        attempt: AttemptRow,
        observed: Observed,
        backend: Backend,
    ) -> None:
        record, job, now = live.record, live.record.job, time.time()
        if task.attempt != attempt.attempt or task.state in lc.TASK_TERMINAL:
            await self.store.save(attempts=[attempt])  # a superseded attempt
            return
        if job.cancel_requested:
            task.end_time = now
            await self._set_task(record, task, TaskState.CANCELLED, attempts=[attempt])
            return
        if job.state is JobState.RECOVERING or (job.failure is not None and self._failing(live)):
            # Stopped by the engine for a group restart or because the group failed.
            new = TaskState.RECOVERING if job.state is JobState.RECOVERING else self._stopped_state(spec_task)
            if new in lc.TASK_TERMINAL:
                task.end_time = now
            await self._set_task(record, task, new, attempts=[attempt])
            return
        if task.stop_at is not None and now >= task.stop_at:
            task.end_time = now
            await self._set_task(record, task, TaskState.STOPPED, attempts=[attempt])
            return
        if observed.phase is Phase.EXITED and observed.exit_code == 0:
            task.end_time = now
            await self._set_task(record, task, TaskState.SUCCEEDED, attempts=[attempt])
            return
        lost = observed.phase is Phase.LOST
        failure_class = lc.classify_exit(observed.exit_code, lost=lost, preempted=observed.preempted)
        if observed.exit_code == SETUP_FAILED_EXIT and not observed.preempted:
            failure_class = FailureClass.PRECHECK
        if lost and not observed.preempted:
            message = (
                f"attempt {attempt.attempt} lost: {observed.message or 'the backend no longer knows it'}"
            )
        else:
            message = f"exited with code {observed.exit_code}"
            if observed.message:
                message += f" ({observed.message})"
            tail = _tail(backend.logs(attempt.handle, 0) if attempt.handle else None)
            if tail:
                message += "\n" + tail
        failure = FailureInfo(failure_class, message[-MAX_MESSAGE:], observed.exit_code, task.task, now)
        attempt.failure = failure
        await self._task_failed(live, task, spec_task, failure, attempt)

    async def _task_failed(
        self,
        live: _Live,
        task: TaskRow,
        spec_task: TaskSpec,
        failure: FailureInfo,
        attempt: AttemptRow | None,
    ) -> None:
        record, job, now = live.record, live.record.job, time.time()
        task.failure = failure
        attempts = [attempt] if attempt else []
        verdict_tasks = [
            lc.TaskView(t.task, TaskState.FAILED if t.task == task.task else t.state, is_primary(s))
            for t, s in zip(record.tasks, live.spec.tasks, strict=True)
        ]
        counts = (
            lc.group_verdict(verdict_tasks) is lc.GroupVerdict.FAILED
            or failure.failure_class is FailureClass.PREEMPTED
        )
        if not counts:  # an auxiliary failing after the primaries ended: not the job's failure
            task.end_time = now
            await self._set_task(record, task, TaskState.FAILED, attempts=attempts)
            return
        policy = recovery_policy(live.spec)
        decision = lc.decide_restart(
            policy, failure.failure_class, failure.exit_code, job.budget_used, job.restart_count
        )
        if not decision.restart:
            failure.message = f"{failure.message}\n[tandem] not restarted: {decision.why}"[-MAX_MESSAGE:]
            task.end_time = now
            job.failure = failure
            await self._commit(record, None, [(task, TaskState.FAILED)], attempts)
            return
        job.restart_count += 1
        job.budget_used += int(decision.counts_against_budget)
        job.failure = failure
        job.next_restart_time = now + decision.delay_s
        task.stop_at = None
        await self._commit(record, JobState.RECOVERING, [(task, TaskState.RECOVERING)], attempts)

    def _failing(self, live: _Live) -> bool:
        views = [
            lc.TaskView(t.task, t.state, is_primary(s))
            for t, s in zip(live.record.tasks, live.spec.tasks, strict=True)
        ]
        return lc.group_verdict(views) is lc.GroupVerdict.FAILED

    @staticmethod
    def _stopped_state(spec_task: TaskSpec) -> TaskState:
        return TaskState.CANCELLED if is_primary(spec_task) else TaskState.STOPPED

    # ---- SERVICE tasks ----------------------------------------------------------------------------

    async def _healthy(self, live: _Live, spec_task: TaskSpec, attempt: AttemptRow, now: float) -> bool:
        options = spec_task.service
        host = (
            attempt.nodes[0]["address"] if attempt.nodes and attempt.nodes[0].get("address") else "127.0.0.1"
        )
        timeout = _seconds(options.readiness_timeout) if options.HasField("readiness_timeout") else 600.0
        ok = await _check_health(host, options.port, options.health_path, self.config.health_timeout_s)
        if ok:
            return True
        if now - attempt.create_time > timeout:
            failure = FailureInfo(
                FailureClass.PRECHECK,
                f"the service did not become ready within {timeout:.0f} s",
                None,
                spec_task.name,
                now,
            )
            attempt.failure = failure
            if attempt.handle:
                with contextlib.suppress(BackendUnavailable):
                    await self._backend(attempt.backend).cancel(attempt.handle, self.config.cancel_grace_s)
                    live.cancel_sent.add(attempt.key)
            await self._task_failed(live, live.record.task(spec_task.name), spec_task, failure, None)
        return False

    async def _service_ready(self, live: _Live, spec_task: TaskSpec, task: TaskRow) -> None:
        attempt = live.record.current(task.task)
        host = (
            attempt.nodes[0]["address"]
            if attempt and attempt.nodes and attempt.nodes[0].get("address")
            else "127.0.0.1"
        )
        task.endpoint = f"http://{host}:{spec_task.service.port}"
        await self.store.save(tasks=[task])
        if spec_task.service.HasField("register_task_app") and self._register is not None:
            try:
                await self._register(live.record, spec_task, task.endpoint)
            except Exception as error:  # the proxy refused it (checks failed) or is unreachable
                failure = FailureInfo(
                    FailureClass.PRECHECK,
                    f"Task App registration failed: {getattr(error, 'message', error)}",
                    None,
                    task.task,
                    time.time(),
                )
                if attempt and attempt.handle:
                    with contextlib.suppress(BackendUnavailable):
                        await self._backend(attempt.backend).cancel(
                            attempt.handle, self.config.cancel_grace_s
                        )
                        live.cancel_sent.add(attempt.key)
                await self._task_failed(live, task, spec_task, failure, None)

    # ---- deciding per job -------------------------------------------------------------------------

    async def _advance(self, live: _Live, now: float) -> None:
        job = live.record.job
        if job.state in lc.JOB_TERMINAL:
            return
        if job.cancel_requested:
            await self._advance_cancelling(live, now)
        elif job.state is JobState.RECOVERING:
            await self._advance_recovering(live, now)
        elif job.state in (JobState.STARTING, JobState.RUNNING):
            await self._advance_live(live, now)

    async def _advance_cancelling(self, live: _Live, now: float) -> None:
        record = live.record
        running = self._live_attempts(record)
        await self._stop_all(live, running, self.config.cancel_grace_s)
        if running:
            return
        for task in record.tasks:
            if task.state not in lc.TASK_TERMINAL:
                task.end_time = now
                await self._set_task(record, task, TaskState.CANCELLED)
        await self._finish(record, JobState.CANCELLED)

    async def _advance_recovering(self, live: _Live, now: float) -> None:
        record, job = live.record, live.record.job
        preempted = job.failure is not None and job.failure.failure_class is FailureClass.PREEMPTED
        if not (recovery_policy(live.spec).group_scope or preempted):
            await self._restart_tasks_in_place(live, now)
            return
        running = self._live_attempts(record)
        await self._stop_all(live, running, self.config.cancel_grace_s)
        if running:
            return
        for task in record.tasks:
            if task.state is TaskState.SUCCEEDED and is_serial(live.spec):
                continue  # a pipeline resumes at the task that failed
            if task.state is not TaskState.RECOVERING:
                await self._set_task(record, task, TaskState.RECOVERING)

    async def _advance_live(self, live: _Live, now: float) -> None:
        record, job, spec = live.record, live.record.job, live.spec
        running = self._live_attempts(record)
        limit = _seconds(spec.max_duration) if spec.HasField("max_duration") else 0.0
        if limit and job.start_time and now - job.start_time > limit and not live.overrun:
            live.overrun = True
            job.failure = FailureInfo(
                FailureClass.USER, f"the job ran over max_duration ({limit:.0f} s)", None, "", now
            )
            await self.store.save(job)
        views = [
            lc.TaskView(t.task, t.state, is_primary(s)) for t, s in zip(record.tasks, spec.tasks, strict=True)
        ]
        verdict = lc.group_verdict(views)
        if verdict is lc.GroupVerdict.FAILED or live.overrun:
            await self._stop_all(live, running, self.config.cancel_grace_s)
            if running:
                return
            for task, spec_task in zip(record.tasks, spec.tasks, strict=True):
                if task.state not in lc.TASK_TERMINAL:
                    task.end_time = now
                    await self._set_task(record, task, self._stopped_state(spec_task))
            await self._finish(record, JobState.FAILED)
        elif verdict is lc.GroupVerdict.SUCCEEDED and not running:
            await self._finish(record, JobState.SUCCEEDED)
        elif verdict is lc.GroupVerdict.STOP_AUXILIARIES:
            await self._stop_auxiliaries(live, now)
        elif (
            job.state is JobState.STARTING
            and lc.job_state_for_tasks(t.state for t in self._started(live)) is JobState.RUNNING
        ):
            job.start_time = job.start_time or now
            await self._set_job(record, JobState.RUNNING)

    @staticmethod
    def _started(live: _Live) -> list[TaskRow]:
        """The tasks that decide STARTING -> RUNNING: all of them, or a serial group's up to the one due."""
        if not is_serial(live.spec):
            return list(live.record.tasks)
        due = due_task(live.record)
        names = [t.task for t in live.record.tasks]
        return live.record.tasks[: names.index(due) + 1] if due else list(live.record.tasks)

    async def _stop_all(self, live: _Live, running: Sequence[AttemptRow], grace_s: float) -> None:
        for attempt in running:
            if attempt.key in live.cancel_sent:
                continue
            if attempt.handle is None:
                backend = self.backends.get(attempt.backend)
                if backend is None:
                    continue
                try:
                    attempt.handle = await backend.find(attempt.key)
                except BackendUnavailable:
                    continue
                if attempt.handle is None:  # never launched: nothing to stop
                    attempt.ended, attempt.end_time = True, time.time()
                    await self._attempt_never_ran(live, attempt)
                    continue
                await self.store.save(attempts=[attempt])
            try:
                await self._backend(attempt.backend).cancel(attempt.handle, grace_s)
                live.cancel_sent.add(attempt.key)
            except BackendUnavailable as error:
                await self._note(live, f"backend {attempt.backend} unavailable: {error}; retrying")

    async def _attempt_never_ran(self, live: _Live, attempt: AttemptRow) -> None:
        record = live.record
        task = record.task(attempt.task)
        spec_task = next(t for t in live.spec.tasks if t.name == attempt.task)
        if record.job.cancel_requested:
            new = TaskState.CANCELLED
        elif record.job.state is JobState.RECOVERING:
            new = TaskState.RECOVERING
        else:
            new = self._stopped_state(spec_task)
        if task.state is new or task.state in lc.TASK_TERMINAL:
            await self.store.save(attempts=[attempt])
            return
        await self._set_task(record, task, new, attempts=[attempt])

    async def _stop_auxiliaries(self, live: _Live, now: float) -> None:
        for task, spec_task in zip(live.record.tasks, live.spec.tasks, strict=True):
            if is_primary(spec_task) or task.state in lc.TASK_TERMINAL:
                continue
            if task.stop_at is None:
                task.stop_at = now + _seconds(spec_task.termination_delay)
                await self.store.save(tasks=[task])
            if now >= task.stop_at:
                attempts = [a for a in live.record.attempts.get(task.task, []) if not a.ended]
                if not attempts and task.state in (TaskState.PENDING, TaskState.RECOVERING):
                    task.end_time = now
                    await self._set_task(live.record, task, TaskState.STOPPED)
                await self._stop_all(live, attempts, self.config.aux_stop_grace_s)

    async def _restart_tasks_in_place(self, live: _Live, now: float) -> None:
        """SCOPE_TASK: relaunch each RECOVERING task on its previous nodes once the backoff is over."""
        record, job = live.record, live.record.job
        if job.next_restart_time is not None and now < job.next_restart_time:
            return
        for task, spec_task in zip(record.tasks, live.spec.tasks, strict=True):
            if task.state is not TaskState.RECOVERING:
                continue
            previous = record.current(task.task)
            slots = (
                [
                    NodeAssignment(
                        n["rank"], n["node"], n["address"], tuple(n["gpu_indices"]), n.get("gpu_type", "")
                    )
                    for n in previous.nodes
                ]
                if previous
                else []
            )
            await self._start_attempt(live, spec_task, task, slots, restart=True)
        if all(t.state is not TaskState.RECOVERING for t in record.tasks):
            job.next_restart_time = None
            await self._set_job(record, JobState.STARTING)

    # ---- admission --------------------------------------------------------------------------------

    def _asked_of_backend(
        self, backend: str, placed: Resources, slots: Sequence[NodeAssignment]
    ) -> Resources:
        """What the backend is asked for: the choice placed, its GPU type as the placed nodes report it (a
        Slurm gres type, a Kubernetes label value: what those match exactly), the spec's name when the
        nodes' models differ or are unknown."""
        models = {n.name: n.gpu_type for n in self.inventories.get(backend, [])}
        reported = {models.get(s.node, "") for s in slots}
        if placed.gpu_type and len(reported) == 1 and (model := reported.pop()):
            return replace(placed, gpu_type=model)
        return placed

    def _free_nodes(self, backend: str) -> list[lc.NodeFree]:
        """The backend's nodes less what this scheduler's live attempts hold there (a backend that already
        subtracts them reports less free, and the smaller count wins)."""
        held_gpus: dict[str, set[int]] = {}
        held_cpus: dict[str, float] = {}
        held_mem: dict[str, float] = {}
        for live in self._jobs.values():
            if live.record.job.backend != backend:
                continue
            by_task = {d.task: d for d in live.demands}
            for attempt in self._live_attempts(live.record):
                demand = by_task.get(attempt.task)
                for node in attempt.nodes:
                    held_gpus.setdefault(node["node"], set()).update(node.get("gpu_indices", []))
                    if demand:
                        held_cpus[node["node"]] = held_cpus.get(node["node"], 0.0) + demand.cpus
                        held_mem[node["node"]] = held_mem.get(node["node"], 0.0) + demand.memory_gib
        nodes = []
        for inv in self.inventories.get(backend, []):
            taken = held_gpus.get(inv.name, set())
            free_indices = [i for i in range(inv.gpus) if i not in taken]
            if inv.gpus_free < len(free_indices):  # the backend knows of other users' GPUs
                free_indices = free_indices[: max(inv.gpus_free, 0)] if backend != "local" else free_indices
            cpus = inv.cpus - held_cpus.get(inv.name, 0.0) if inv.cpus else float("inf")
            mem = inv.memory_gib - held_mem.get(inv.name, 0.0) if inv.memory_gib else float("inf")
            nodes.append(lc.NodeFree(inv.name, inv.address, free_indices, cpus, mem, inv.gpu_type, inv.up))
        return nodes

    def _queued(self, backend: str, now: float) -> list[lc.QueuedGroup]:
        queue = []
        for live in self._jobs.values():
            job = live.record.job
            if job.backend != backend or job.cancel_requested:
                continue
            if job.state is JobState.PENDING or (
                job.state is JobState.RECOVERING
                and (job.next_restart_time is None or now >= job.next_restart_time)
                and not self._live_attempts(live.record)
                and all(
                    t.state is TaskState.RECOVERING
                    or (t.state is TaskState.SUCCEEDED and is_serial(live.spec))
                    for t in live.record.tasks
                )
                and (
                    recovery_policy(live.spec).group_scope
                    or job.failure is None
                    or job.failure.failure_class is FailureClass.PREEMPTED
                )
            ):
                queue.append(
                    lc.QueuedGroup(
                        job.name,
                        job.priority,
                        job.waiting_since,
                        job.seq,
                        live.demands,
                        preemptible(live.spec),
                    )
                )
        return queue

    def _running_groups(self, backend: str, releasing: bool = False) -> list[lc.RunningGroup]:
        """Live jobs holding resources on `backend`: the preemption candidates (STARTING, RUNNING), or with
        `releasing` the jobs being stopped (cancelled, or RECOVERING with attempts still alive)."""
        groups = []
        for live in self._jobs.values():
            job = live.record.job
            if job.backend != backend:
                continue
            stopping = job.cancel_requested or job.state is JobState.RECOVERING
            if releasing != stopping or job.state not in (
                JobState.STARTING,
                JobState.RUNNING,
                JobState.RECOVERING,
                JobState.CANCELLING,
            ):
                continue
            placement: lc.Placement = {}
            for attempt in self._live_attempts(live.record):
                placement[attempt.task] = tuple(
                    lc.Slot(
                        n["rank"],
                        n["node"],
                        n.get("address", ""),
                        tuple(n.get("gpu_indices", [])),
                        n.get("gpu_type", ""),
                    )
                    for n in attempt.nodes
                )
            if placement:
                groups.append(
                    lc.RunningGroup(
                        job.name,
                        job.priority,
                        job.start_time or job.create_time,
                        placement,
                        live.demands,
                        preemptible(live.spec),
                    )
                )
        return groups

    def _preempt_for(
        self, backend: str, blocked: lc.QueuedGroup, nodes: list[lc.NodeFree]
    ) -> list[lc.RunningGroup]:
        releasing = self._running_groups(backend, releasing=True)
        return lc.choose_preemption(blocked, nodes, self._running_groups(backend), releasing) or []

    async def _admit(self, now: float) -> None:
        for backend in self.backends:
            if backend in self.unavailable:
                for live in list(self._jobs.values()):
                    if live.record.job.backend == backend and live.record.job.state is JobState.PENDING:
                        await self._note(
                            live, f"backend {backend} unavailable: {self.unavailable[backend]}; waiting"
                        )
                continue
            queue = self._queued(backend, now)
            if not queue:
                continue
            nodes = self._free_nodes(backend)
            result = lc.admit(queue, nodes, now, self.config.aging_s_per_point)
            for group, placement in result.admitted:
                await self._start_group(self._jobs[group.job], placement)
            if result.blocked is not None and self.config.preemption:
                for victim in self._preempt_for(backend, result.blocked, nodes):
                    await self._preempt(self._jobs[victim.job], result.blocked.job)

    async def _preempt(self, live: _Live, by: str) -> None:
        now = time.time()
        record, job = live.record, live.record.job
        failure = FailureInfo(
            FailureClass.PREEMPTED, f"preempted by {by}, a higher-priority job", None, "", now
        )
        job.failure = failure
        job.restart_count += 1
        job.next_restart_time = now
        job.waiting_since = now  # requeued behind what waits at its priority; aging starts again
        await self._set_job(record, JobState.RECOVERING)
        await self._stop_all(live, self._live_attempts(record), self.config.cancel_grace_s)
        log.info("preempting", extra={"job": job.name, "by": by})

    async def _start_group(self, live: _Live, placement: lc.Placement) -> None:
        """Admit the group: the job's STARTING, every task's STARTING and every attempt row are one
        transaction, so a scheduler that dies here leaves either a queued group or attempts to reattach."""
        record, job = live.record, live.record.job
        restart = job.state is JobState.RECOVERING
        old = job.state
        lc.check_job_transition(old, JobState.STARTING)
        job.next_restart_time, job.message, job.state = None, "", JobState.STARTING
        events = [job_event(job, old)]
        prepared = []
        serial = is_serial(live.spec)
        for task, spec_task in zip(record.tasks, live.spec.tasks, strict=True):
            if serial and task.state is TaskState.SUCCEEDED:
                continue  # a pipeline restarted at a later task keeps what already succeeded
            slots = [
                NodeAssignment(s.rank, s.node, s.address, s.gpu_indices, s.gpu_type)
                for s in placement.get(task.task, ())
            ]
            previous = task.state
            attempt = self._next_attempt(record, task, slots, restart)
            events.append(task_event(task, previous))
            prepared.append((spec_task, attempt, slots))
        await self.store.save(job, record.tasks, [a for _, a, _ in prepared], events)  # stored before launch
        for spec_task, attempt, slots in prepared:
            if serial and spec_task.name != due_task(record):
                continue  # launched by _reattach once the task before it has succeeded
            await self._launch(live, spec_task, attempt, slots)

    async def _start_attempt(
        self, live: _Live, spec_task: TaskSpec, task: TaskRow, slots: Sequence[NodeAssignment], restart: bool
    ) -> None:
        """Relaunch one task (SCOPE_TASK): its STARTING and the attempt row are stored before the launch."""
        previous = task.state
        attempt = self._next_attempt(live.record, task, slots, restart)
        await self.store.save(tasks=[task], attempts=[attempt], events=[task_event(task, previous)])
        await self._launch(live, spec_task, attempt, slots)

    @staticmethod
    def _next_attempt(
        record: JobRecord, task: TaskRow, slots: Sequence[NodeAssignment], restart: bool
    ) -> AttemptRow:
        """The task's next attempt, and the task moved to STARTING for it (in memory; the caller stores both)."""
        lc.check_task_transition(task.state, TaskState.STARTING)
        if restart and task.attempt >= 0:
            task.restart_count += 1
        number = task.attempt + 1
        attempt = AttemptRow(
            record.job.name,
            task.task,
            number,
            attempt_key(record.job.name, task.task, number),
            record.job.backend,
            create_time=time.time(),
            nodes=[
                {
                    "rank": s.rank,
                    "node": s.node,
                    "address": s.address,
                    "gpu_indices": list(s.gpu_indices),
                    "gpu_type": s.gpu_type,
                }
                for s in slots
            ],
        )
        record.attempts.setdefault(task.task, []).append(attempt)
        task.attempt, task.state = number, TaskState.STARTING
        task.stop_at = task.end_time = None
        task.endpoint = ""
        return attempt

    async def _launch(
        self, live: _Live, spec_task: TaskSpec, attempt: AttemptRow, slots: Sequence[NodeAssignment]
    ) -> None:
        backend = self._backend(attempt.backend)
        try:
            if spec_task.config.container_run_options and attempt.backend != "local":
                raise LaunchRefused(  # a job without a backend of its own, on a scheduler whose default is another
                    "config.docker.run_options are options of the local backend's docker or podman run, and the "
                    f"task runs on {attempt.backend}"
                )
            spec = self.launch_spec(live, spec_task, attempt, slots)
            if attempt.backend in LOGIN_BACKENDS:
                spec = await self.with_registry_login(spec)
            attempt.handle = await backend.launch(spec)
        except BackendUnavailable as error:
            await self._note(live, f"backend {attempt.backend} unavailable: {error}; retrying the launch")
            return
        except (LaunchRefused, OSError, ValueError) as error:
            now = time.time()
            attempt.ended, attempt.end_time = True, now
            failure = FailureInfo(
                FailureClass.PRECHECK, f"launch refused: {error}", None, spec_task.name, now
            )
            attempt.failure = failure
            await self._task_failed(live, live.record.task(spec_task.name), spec_task, failure, attempt)
            return
        await self.store.save(attempts=[attempt])

    async def with_registry_login(self, spec: LaunchSpec) -> LaunchSpec:
        """`spec` with its image's private registry login (SkyPilot's SKYPILOT_DOCKER_* among the task's
        secrets), opened from the vault with the attempt's own job token, for a backend that hands it to its
        image puller (Kubernetes: a pull Secret of the attempt's). LaunchRefused when it cannot be opened."""
        if not spec.image or not all(name in spec.secret_env for name in LOGIN_ENVS):
            return spec
        names = [spec.secret_env[name] for name in LOGIN_ENVS]
        why = ""
        if self._open_secrets is None:
            why = "no vault to open it from"
        else:
            try:
                values = await self._open_secrets(names, spec.env.get(JOB_TOKEN_ENV, ""))
                username, password, server = (values[name].decode() for name in names)
            except Exception as error:  # the vault's refusal or absence: the image cannot be pulled
                why = str(getattr(error, "message", "") or error)
        if why:
            raise LaunchRefused(
                f"the image {spec.image} could not be pulled: opening its registry login "
                f"({', '.join(LOGIN_ENVS)}) failed: {why}"
            )
        return replace(spec, registry_login=RegistryLogin(username, password, server))

    # ---- state changes: the store first, with the events that report them ------------------------

    async def _commit(
        self,
        record: JobRecord,
        job_state: JobState | None,
        task_states: Sequence[tuple[TaskRow, TaskState]],
        attempts: Sequence[AttemptRow] = (),
    ) -> None:
        """Several changes of one job in one transaction (with the job row, whose counters may have moved),
        so a scheduler that dies in between never finds half of a decision."""
        job = record.job
        events = []
        for task, new in task_states:
            if task.state is not new:
                lc.check_task_transition(task.state, new)
                previous, task.state = task.state, new
                events.append(task_event(task, previous))
        if job_state is not None and job.state is not job_state:
            lc.check_job_transition(job.state, job_state)
            previous_job, job.state = job.state, job_state
            events.append(job_event(job, previous_job))
        await self.store.save(job, [t for t, _ in task_states], attempts, events)

    async def _set_job(self, record: JobRecord, new: JobState) -> None:
        job = record.job
        old = job.state
        if old is new:
            await self.store.save(job)
            return
        lc.check_job_transition(old, new)
        job.state = new
        await self.store.save(job, events=[job_event(job, old)])

    async def _set_task(
        self, record: JobRecord, task: TaskRow, new: TaskState, attempts: Sequence[AttemptRow] = ()
    ) -> None:
        old = task.state
        if old is new:
            await self.store.save(tasks=[task], attempts=attempts)
            return
        lc.check_task_transition(old, new)
        task.state = new
        await self.store.save(tasks=[task], attempts=attempts, events=[task_event(task, old)])

    async def _finish(self, record: JobRecord, new: JobState) -> None:
        job = record.job
        if job.state is JobState.STARTING and new is JobState.SUCCEEDED:  # every task ran, however briefly
            job.start_time = job.start_time or time.time()
            await self._set_job(record, JobState.RUNNING)
        old = job.state
        lc.check_job_transition(old, new)
        job.state, job.end_time, job.message = new, time.time(), ""
        if new is JobState.SUCCEEDED:
            job.failure = None
        await self.store.save(job, events=[job_event(job, old)])
        spec = JobSpec.FromString(job.spec)
        if any(m.bucket.delete_at_end for t in spec.tasks for m in t.file_mounts if m.HasField("bucket")):
            cleanup = asyncio.create_task(self._delete_made_buckets(job, spec), name=f"buckets-{job.name}")
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)

    async def _delete_made_buckets(self, job: JobRow, spec: JobSpec) -> None:
        """SkyPilot's `persistent: false` once the job has ended: each such bucket the job made is deleted, with
        the credentials of the task that mounts it, opened from the vault with a token for that alone (short,
        and not revoked with the job, which has ended). Each outcome is an event of the job's."""
        for task in spec.tasks:
            urls = [m.bucket.url for m in task.file_mounts if m.HasField("bucket") and m.bucket.delete_at_end]
            if not urls:
                continue
            try:
                store = await self._bucket_store(job, task)
                for url in urls:
                    deleted = await asyncio.to_thread(delete_made_bucket, store, url, job.name)
                    what = "deleted (persistent: false)" if deleted else "kept: the job did not make it"
                    await self._log_event(job, f"bucket {url} {what}", types_pb2.LEVEL_INFO)
            except Exception as error:  # the store's or the vault's: reported, the job's outcome stays
                message = f"could not delete the buckets of task {task.name} (persistent: false): {error}"
                log.warning("%s: %s", job.name, message)
                await self._log_event(job, message, types_pb2.LEVEL_WARNING)

    async def _bucket_store(self, job: JobRow, task: TaskSpec) -> Any:
        secrets = {
            env: f"orgs/{job.org}/secrets/{secret}"
            for env, secret in expand.secret_env(task).items()
            if env in CREDENTIAL_ENVS.values()
        }
        given: dict[str, str] = {}
        if secrets and self._open_secrets is not None:
            token = self.signer.issue(
                "job",
                job.name,
                org=job.org,
                ttl_s=120,
                extra={
                    "task": task.name,
                    "attempt": -1,
                    "secrets": sorted(secrets.values()),
                    "task_apps": [],
                },
            )
            opened = await self._open_secrets(list(secrets.values()), token)
            given = {
                field: opened[secrets[env]].decode()
                for field, env in CREDENTIAL_ENVS.items()
                if env in secrets
            }
        return await asyncio.to_thread(store_with, given, *s3_location(task.envs))

    async def _log_event(self, job: JobRow, message: str, level: types_pb2.Level.ValueType) -> None:
        event = event_pb2.Event(type="log", level=level, message=message[:MAX_MESSAGE])
        event.time.FromNanoseconds(time.time_ns())
        await self.store.save(job, events=[(job.name, False, event.SerializeToString())])

    async def _note(self, live: _Live, message: str) -> None:
        """A message on the job saying why it is not moving (a backend down), stored once per change."""
        job = live.record.job
        if job.message != message:
            job.message = message
            if message:  # the job's event log says why it does not move
                event = event_pb2.Event(
                    type="log", level=types_pb2.LEVEL_WARNING, message=message[:MAX_MESSAGE]
                )
                event.time.FromNanoseconds(time.time_ns())
                await self.store.save(job, events=[(job.name, False, event.SerializeToString())])
            else:
                await self.store.save(job)

    # ---- what a task gets -------------------------------------------------------------------------

    def task_dir(self, job: str, task: str) -> Path:
        return self.config.work_dir / "jobs" / job.replace("/", "-") / task

    def log_dir(self, job: str, task: str) -> Path:
        return self.task_dir(job, task) / "logs"

    def volume_dir(self, org: str, volume: str) -> Path:
        """A named volume on a host backend: one folder per organization and name, shared by its tasks."""
        folder = self.config.work_dir / "volumes" / org / volume
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def mint_token(
        self,
        job: str,
        org: str,
        task: str,
        attempt: int,
        secrets: Sequence[str],
        task_apps: Sequence[str] = (),
    ) -> str:
        """The attempt's job token: exactly its job's (mesh/jobtokens.py), revoked when the attempt ends."""
        return self.signer.issue(
            "job",
            job,
            org=org,
            ttl_s=self.config.token_ttl_s,
            extra={
                "task": task,
                "attempt": attempt,
                "secrets": list(secrets),
                "task_apps": list(task_apps),
                "revocable": True,
            },
        )

    def launch_spec(
        self, live: _Live, spec_task: TaskSpec, attempt: AttemptRow, slots: Sequence[NodeAssignment]
    ) -> LaunchSpec:
        """The backend's view of one attempt: the script, the environment (TANDEM_* and SKYPILOT_*, the
        job token), the nodes the engine placed it on, and the secrets by name only."""
        record, job, spec = live.record, live.record.job, live.spec
        task = record.task(spec_task.name)
        secret_env = {
            env: f"orgs/{job.org}/secrets/{secret}" for env, secret in expand.secret_env(spec_task).items()
        }
        token = self.mint_token(
            job.name,
            job.org,
            task.task,
            attempt.attempt,
            sorted(set(secret_env.values())),
            expand.task_apps(job.org, spec_task),
        )
        task_dir = self.task_dir(job.name, task.task)
        log_dir = self.log_dir(job.name, task.task)
        log_dir.mkdir(parents=True, exist_ok=True)
        mounts, mount_env, output, home_links = self.placed_mounts(
            job.org, spec_task, task_dir, on_host=attempt.backend in HOST_BACKENDS
        )
        resume = newest_checkpoint(output) if spec_task.kind == TaskSpec.KIND_ONLINE_RL else None
        placed = placed_resources(spec_task, slots)
        gpus = len(slots[0].gpu_indices) if slots and slots[0].gpu_indices else placed.gpus
        names = [t.name for t in spec.tasks]
        env = expand.task_env(
            spec_task,
            job=job.name,
            attempt=attempt.attempt,
            node_ips=[s.address for s in slots if s.address],
            resume_from=str(resume) if resume else "",
            job_token=token,
            gpus_per_node=gpus,
            task_index=names.index(spec_task.name),
            group_size=len(names),
            backend=attempt.backend,
            user=job.creator,
            serial=is_serial(spec),
        )
        env.update(mount_env)
        if placed.gpus and placed.gpu_type:
            env["TANDEM_GPU_TYPE"] = (
                placed.gpu_type
            )  # the accelerator alternative placed, as the spec names it
        # One trace follows a rollout from the trainer on: its spans go to the mesh's collector, or to a file
        # beside the task's logs when there is none.
        if os.environ.get("TANDEM_OTLP_ENDPOINT"):
            env.setdefault("TANDEM_OTLP_ENDPOINT", os.environ["TANDEM_OTLP_ENDPOINT"])
        elif spec_task.kind == TaskSpec.KIND_ONLINE_RL:
            env.setdefault("TANDEM_TRACE_FILE", str(task_dir / "traces.jsonl"))
        if attempt.backend in HOST_BACKENDS and "PATH" not in spec_task.envs:
            # Tasks on the host find the Python environment Tandem runs in first (its `python`, `torchrun`).
            env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        # Where the mesh's services are; with them and the job token `python -m trainer` publishes to the
        # job's stream, plays rollouts through the proxy and renews its token (trainer/launch.py).
        for service, target in self.config.targets().items():
            env[f"TANDEM_TARGETS__{service.upper()}"] = target
        config_file = ""
        if (
            spec_task.kind == TaskSpec.KIND_ONLINE_RL
            and spec_task.online_rl.WhichOneof("trainer_config") == "config_toml"
        ):
            config_path = task_dir / "trainer.toml"
            config_path.write_text(spec_task.online_rl.config_toml)
            config_file = str(config_path)
        command = expand.command_for(
            spec_task,
            job=job.name,
            gpus_granted=gpus,
            config_file=config_file,
            output_dir=str(output),
            python="python" if spec_task.resources.image else sys.executable,  # an image's own Python
        )
        if home_links:  # first of all, so setup finds them (in an image too: the folders are at their paths)
            command = "\n".join(home_links) + "\n" + command
        siblings = tuple(n for n in names if n != spec_task.name) if sibling_hosts(spec) else ()
        required = bool(siblings) and spec.HasField("inter_connection")  # `true`: no names, no run
        if siblings and attempt.backend in HOST_BACKENDS:
            command = self.with_sibling_hosts(job.name, siblings, command, env, required=required)
        command = self.wrapped(attempt.backend, spec_task, command, env, mounts, secret_env)
        # Each attempt's part of a task's log begins with a line naming it.
        command = f"echo '[tandem] attempt {attempt.attempt}'\n{command}"
        time_limit = _seconds(spec.max_duration) if spec.HasField("max_duration") else 0.0
        return LaunchSpec(
            key=attempt.key,
            job=job.name,
            task=task.task,
            attempt=attempt.attempt,
            command=command,
            env=env,
            num_nodes=max(spec_task.num_nodes, 1),
            resources=self._asked_of_backend(attempt.backend, placed, slots),
            nodes=tuple(slots),
            log_dir=log_dir,
            workdir=task_dir,
            priority=job.priority,
            time_limit_s=time_limit,
            secret_env=secret_env,
            file_mounts=mounts,
            options=backend_options(spec),
            ports=tuple(spec_task.resources.ports),
            preemptible=preemptible(spec),
            image=spec_task.resources.image,
            labels=dict(spec_task.resources.labels),
            pod_config=json.loads(spec_task.config.pod_config_json or "{}"),
            custom_labels=dict(spec_task.config.labels),
            custom_annotations=dict(spec_task.config.annotations),
            queue_name=spec_task.config.kueue_queue,
            sibling_tasks=siblings,
            sibling_hosts_required=required,
        )

    def placed_mounts(
        self, org: str, spec_task: TaskSpec, task_dir: Path, *, on_host: bool
    ) -> tuple[list[tuple[str, str, bool]], dict[str, str], Path, list[str]]:
        """The task's mounts as its backend places them, their variables (`TANDEM_MOUNT_<NAME>`, and HOME for a
        pod with `~/` mounts), the online-RL output folder, and the lines linking the host backends' `~/`
        mounts from $HOME."""
        mounts = expand.file_mounts(spec_task)
        if not on_host:
            mounts, pod_home = expand.pod_home_mounts(mounts)
            env = expand.mount_env(mounts) | ({"HOME": POD_HOME} if pod_home else {})
            output = Path(expand.pod_path(expand.output_dir_for(spec_task, str(task_dir / "output"))))
            return mounts, env, output, []
        for number, (path, source, read_only) in enumerate(list(mounts)):  # volumes and buckets are folders
            if not source:
                folder = task_dir / "buckets" / str(number)
                folder.mkdir(parents=True, exist_ok=True)
                mounts[number] = (path, str(folder), read_only)
        placed, env = expand.host_mounts(mounts, lambda name: str(self.volume_dir(org, name)))
        index = _output_mount(spec_task)
        folder = Path(placed[index][0]) if index is not None else task_dir / "output"
        return placed, env, folder, expand.home_link_lines(mounts, placed)

    def with_sibling_hosts(
        self, job: str, siblings: Sequence[str], command: str, env: dict[str, str], *, required: bool
    ) -> str:
        """On local and Slurm, siblings by host name (`{task}-{rank}.{group}`): each node publishes its own and
        sees the others' in a private /etc/hosts (backends/group_hosts.py). Kubernetes serves them from its
        DNS (backends/kubernetes.py, from `LaunchSpec.sibling_tasks`)."""
        from services.scheduler.backends import group_hosts  # noqa: PLC0415

        env[group_hosts.DIR_ENV] = str(self.task_dir(job, ".hosts"))
        env[group_hosts.TASKS_ENV] = " ".join(siblings)
        if required:
            env[group_hosts.REQUIRED_ENV] = "1"
        return (  # by its file: it needs only the standard library, wherever the task runs
            f"exec {shlex.quote(sys.executable)} {shlex.quote(group_hosts.__file__)}"
            f" bash -euo pipefail -c {shlex.quote(command)}"
        )

    def wrapped(
        self,
        backend: str,
        spec_task: TaskSpec,
        command: str,
        env: dict[str, str],
        mounts: list[tuple[str, str, bool]],
        secret_env: Mapping[str, str],
    ) -> str:
        """The task's script inside what it needs, innermost first: its image (the local backend's docker or
        podman; Slurm and Kubernetes put the whole step in it), the node's check of its `ports`, its
        buckets, its secrets. Adds what that needs to `env` and `mounts`."""
        on_host = backend in HOST_BACKENDS
        image = spec_task.resources.image
        # Where the wrappers run: in the task's image (Kubernetes; Slurm's container step), else on the host.
        inside = not on_host or (image and backend != "local")
        python = "python" if inside else sys.executable
        if image and backend == "local":  # the task's script in the image; its wrappers on the host
            command = expand.in_container(
                spec_task,
                command,
                image=image,
                env_names=[*env, *secret_env],
                folders=[source for _path, source, _read_only in mounts],
                python=python,
            )
        if on_host and spec_task.resources.ports:  # a pod has ports of its own; a process shares the node's
            command = expand.port_check(spec_task, python=python) + command
        command = self.with_buckets(spec_task, command, env, mounts, secret_env, python=python)
        if (not on_host or image) and spec_task.workdir.WhichOneof("source") == "path":
            mounts.append((spec_task.workdir.path, spec_task.workdir.path, True))  # the folder to copy from
        if secret_env and backend in HOST_BACKENDS:
            # Host processes (local, Slurm) open their secrets themselves, by name, with their job token.
            from services.scheduler.backends.task_secrets import SECRETS_ENV, format_secrets  # noqa: PLC0415

            env[SECRETS_ENV] = format_secrets(secret_env)
            command = (
                f"exec {shlex.quote(python)} -m services.scheduler.backends.task_secrets"
                f" bash -euo pipefail -c {shlex.quote(command)}"
            )
        return command

    def with_buckets(
        self,
        task: TaskSpec,
        command: str,
        env: dict[str, str],
        mounts: Sequence[tuple[str, str, bool]],
        secret_env: Mapping[str, str],
        *,
        python: str,
    ) -> str:
        """A task with bucket mounts starts through `task_buckets`, which copies them down before `setup` and
        writes them back while and after it runs; its plan goes in `env`. Credentials are only the task's own
        vault secrets; the endpoint and region only its `envs`."""
        buckets = expand.buckets(task, [path for path, _source, _read_only in mounts])
        if not buckets:
            return command
        endpoint_url, region = s3_location(task.envs)
        env[BUCKETS_ENV] = bucket_plan(
            buckets,
            credentials=[e for e in secret_env if e in CREDENTIAL_ENVS.values()],
            endpoint_url=endpoint_url,
            region=region,
            sync_interval_s=self.config.bucket_sync_interval_s,
        )
        return (
            f"exec {shlex.quote(python)} -m services.scheduler.backends.task_buckets"
            f" bash -euo pipefail -c {shlex.quote(command)}"
        )


def backend_options(spec: JobSpec) -> dict[str, str]:
    """The job's `slurm` or `kubernetes` block as `LaunchSpec.options`: only what is set, node selector
    labels as `node_selector.<label>`."""
    which = spec.WhichOneof("backend_options")
    if which == "slurm":
        slurm = spec.slurm
        chosen = {
            "partition": slurm.partition,
            "account": slurm.account,
            "qos": slurm.qos,
            "cluster": slurm.cluster,
        }
        return {k: v for k, v in chosen.items() if v}
    if which == "kubernetes":
        k8s = spec.kubernetes
        chosen = {
            "namespace": k8s.namespace,
            "priority_class_name": k8s.priority_class_name,
            "context": k8s.context,
        }
        chosen.update({f"{NODE_SELECTOR_OPTION}{label}": value for label, value in k8s.node_selector.items()})
        return {k: v for k, v in chosen.items() if v}
    return {}


def _output_mount(task: TaskSpec) -> int | None:
    """The mount an online_rl task's trainer writes to (`expand.output_dir_for`): its first read-write
    volume, if it has one."""
    if task.kind != TaskSpec.KIND_ONLINE_RL:
        return None
    for index, mount in enumerate(task.file_mounts):
        if mount.WhichOneof("source") == "volume" and not mount.read_only:
            return index
    return None


def newest_checkpoint(output: Path) -> Path | None:
    """The newest complete checkpoint folder under `<output>/checkpoints` (a `.partial` one is not)."""
    folder = output / "checkpoints"
    if not folder.is_dir():
        return None
    done = sorted(p for p in folder.glob("step-*") if p.is_dir() and not p.name.endswith(".partial"))
    return done[-1] if done else None


async def _check_health(host: str, port: int, path: str, timeout_s: float) -> bool:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        return False
    try:
        if not path:
            return True
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        parts = line.split()
        return len(parts) >= 2 and parts[1] == b"200"
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
