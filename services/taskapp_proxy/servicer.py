"""gRPC adapter of the taskapp-proxy: registered Task Apps and authenticated rollout calls to them.

Who may call: a job token or an organization principal of the app's organization (eval runs), or a mesh
service. Another organization's app answers NOT_FOUND / TASK_APP_NOT_FOUND, like an app that does not exist.
The app's environment key is read from the vault by runtime injection (the proxy is one of the vault's
injection services) and kept only in memory, for `key_cache_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
from google.protobuf import duration_pb2, json_format, struct_pb2, timestamp_pb2
from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2, events_service_pb2, events_service_pb2_grpc
from tandem.taskapp.v1 import rollout_pb2, task_app_pb2, taskapp_service_pb2, taskapp_service_pb2_grpc
from tandem.vault.v1 import vault_service_pb2_grpc

from mesh import jobtokens, paging
from mesh.aio import cancel_and_wait
from mesh.errors import AlreadyExists, FailedPrecondition, NotFound, R, Unavailable
from mesh.interceptors import current_principal
from mesh.secrets import open_secrets
from mesh.server import Deps, Registration
from mesh.status import RpcError
from mesh.store import Database, IntegrityError, open_database
from services.taskapp_proxy.config import TaskAppProxySettings
from services.taskapp_proxy.rollouts import Limits, RolloutRunner, http_session, key_headers
from services.taskapp_proxy.store import MIGRATIONS
from tandem_taskapp import hosted

SERVICE_NAME = taskapp_service_pb2.DESCRIPTOR.services_by_name["TaskAppService"].full_name
pb = taskapp_service_pb2
Context = grpc.aio.ServicerContext[Any, Any]
log = logging.getLogger("tandem.taskapp_proxy")
Outcome = event_pb2.RolloutCompleted
APP_CACHE_S = 2.0
BATCH_LINGER_S = 0.1  # how long a rollout event waits for others to share its Publish call
MAX_BATCH = 500  # events per Publish call; the contract allows 1,000
PUBLISH_RETRIES = 5
STOP_FLUSH_S = 2.0
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
TASK_INFO_TIMEOUT_S = 10.0


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return stamp


class KeyCache:
    """Environment keys opened from the vault, held in memory for a short time only."""

    def __init__(self, vault: Any, ttl_s: float) -> None:
        self._vault = vault
        self._ttl = ttl_s
        self._keys: dict[str, tuple[str, float]] = {}

    async def get(self, secret: str) -> str:
        cached = self._keys.get(secret)
        if cached is not None and time.monotonic() - cached[1] < self._ttl:
            return cached[0]
        values = await open_secrets(self._vault, [secret], job_token="")
        key = values[secret].decode()
        self._keys[secret] = (key, time.monotonic())
        return key

    def drop(self, secret: str) -> None:
        self._keys.pop(secret, None)


class RolloutEvents:
    """Publishes a `rollout.completed` event per rollout of a job, off the rollout's own path.

    Events wait up to `BATCH_LINGER_S` for others to share their Publish call: one call per rollout was a
    fifth of the mesh's CPU with one rollout in flight. Each event carries this process's producer id and a
    per-job sequence number, so a batch the events service may have stored before a failure is sent again
    without doubling (UNAVAILABLE or DEADLINE_EXCEEDED: retried with backoff), and `stop` sends what is still
    queued. A refused batch (any other status) is logged and dropped, as is an event that finds the queue
    full (the events service gone for long): events are for watching; the trainer has the result."""

    def __init__(self, events: Any) -> None:
        self._events = events
        self._queue: asyncio.Queue[tuple[str, event_pb2.Event]] = asyncio.Queue(maxsize=100_000)
        self._task: asyncio.Task[None] | None = None
        self._producer = f"taskapp-proxy:{uuid.uuid4().hex[:16]}"
        self._seq: dict[str, int] = {}
        self._unsent: list[tuple[str, event_pb2.Event]] = []  # taken off the queue, not yet acknowledged

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="taskapp-rollout-events")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        self._take(len(self._unsent) + self._queue.qsize())
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STOP_FLUSH_S):
                await self._send(retries=0)

    def record(self, job: str, app: str, result: rollout_pb2.RolloutResult) -> None:
        failed = result.HasField("error")
        kind = rollout_pb2.RolloutError.Kind.Name(result.error.kind).removeprefix("KIND_") if failed else ""
        outcome = Outcome.OUTCOME_SUCCEEDED
        if failed:
            outcome = Outcome.OUTCOME_TIMED_OUT if kind == "TIMEOUT" else Outcome.OUTCOME_FAILED
        seq = self._seq.get(job, 0) + 1
        self._seq[job] = seq
        event = event_pb2.Event(
            type="rollout.completed",
            level=types_pb2.LEVEL_WARNING if failed else types_pb2.LEVEL_INFO,
            message=f"rollout {result.trace_correlation_id}: " + (kind.lower() if failed else "ok"),
            producer_id=self._producer,
            producer_seq=seq,
            rollout_completed=event_pb2.RolloutCompleted(
                rollout_id=result.trace_correlation_id,
                task_app=app,
                outcome=outcome,
                reward=result.metrics.outcome_reward if not failed else 0.0,
                num_turns=len(result.trajectory.turns),
                duration=result.duration,
                error_reason=kind,
            ),
        )
        try:
            self._queue.put_nowait((job, event))
        except asyncio.QueueFull:
            log.warning("rollout event of %s dropped: the events queue is full", job)

    def _take(self, most: int) -> None:
        while len(self._unsent) < most and not self._queue.empty():
            self._unsent.append(self._queue.get_nowait())

    async def _loop(self) -> None:
        while True:
            self._unsent.append(await self._queue.get())
            await asyncio.sleep(BATCH_LINGER_S)
            self._take(MAX_BATCH)
            await self._send(retries=PUBLISH_RETRIES)

    async def _send(self, retries: int) -> None:
        """Publishes `_unsent`, one call per job and `MAX_BATCH` events, and empties it."""
        by_job: dict[str, list[event_pb2.Event]] = {}
        for job, event in self._unsent:
            by_job.setdefault(job, []).append(event)
        batches = [
            (job, events[start : start + MAX_BATCH])
            for job, events in by_job.items()
            for start in range(0, len(events), MAX_BATCH)
        ]
        for job, events in batches:
            backoff = 0.2
            for attempt in range(retries + 1):
                try:
                    await self._events.Publish(events_service_pb2.PublishRequest(job=job, events=events))
                    break
                except Exception as error:
                    code = error.code if isinstance(error, RpcError) else None
                    if code not in TRANSIENT or attempt == retries:
                        why = (
                            error.reason or error.code.name
                            if isinstance(error, RpcError)
                            else type(error).__name__
                        )
                        log.warning("could not publish %d rollout events for %s: %s", len(events), job, why)
                        break
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        self._unsent.clear()


class TaskAppServiceServicer(taskapp_service_pb2_grpc.TaskAppServiceServicer):
    """Task App proxy: registered Task Apps and authenticated rollout calls to them."""

    def __init__(
        self,
        db: Database,
        runner: RolloutRunner,
        keys: KeyCache,
        events: RolloutEvents,
        config: TaskAppProxySettings,
        http: aiohttp.ClientSession,
    ) -> None:
        self._db = db
        self._http = http
        self._runner = runner
        self._keys = keys
        self._events = events
        self._config = config
        self._apps: dict[str, tuple[task_app_pb2.TaskApp, float]] = {}

    # ---- helpers ------------------------------------------------------------------------------

    def _visible(self, org: str, name: str) -> None:
        principal = current_principal()
        jobtokens.check_own_task_app(
            principal, name
        )  # a job plays only the apps its job names, whatever exists
        if principal.kind != "service" and principal.org != org:
            raise NotFound(f"{name} not found", reason=R.ERROR_REASON_TASK_APP_NOT_FOUND)

    async def _load(self, name: str, *, cached: bool = False) -> task_app_pb2.TaskApp:
        """The registered app. Rollouts may use a copy up to `APP_CACHE_S` old (registrations change rarely;
        a replica that did not see a change catches up within that time); everything else reads the store."""
        _, org, _, app_id = name.split("/")
        self._visible(org, name)
        hit = self._apps.get(name) if cached else None
        if hit is not None and time.monotonic() - hit[1] < APP_CACHE_S:
            return hit[0]
        row = await self._db.fetchone(
            "SELECT body FROM task_apps WHERE org = ? AND app_id = ?", (org, app_id)
        )
        if row is None:
            self._apps.pop(name, None)
            raise NotFound(f"{name} not found", reason=R.ERROR_REASON_TASK_APP_NOT_FOUND)
        app = task_app_pb2.TaskApp.FromString(bytes(row["body"]))
        self._apps[name] = (app, time.monotonic())
        if self._runner.breaker_open(app.name):
            app.state = task_app_pb2.TaskApp.STATE_CIRCUIT_OPEN
        return app

    def _limits(self, app: task_app_pb2.TaskApp) -> Limits:
        limits = app.limits
        return Limits(
            max_concurrency=limits.max_concurrency or self._config.default_max_concurrency,
            rollout_timeout_s=(
                limits.rollout_timeout.ToNanoseconds() / 1e9
                if limits.HasField("rollout_timeout")
                else self._config.default_rollout_timeout_s
            ),
            max_retries=limits.max_retries
            if limits.HasField("max_retries")
            else self._config.default_max_retries,
        )

    async def _check(self, app: task_app_pb2.TaskApp) -> list[task_app_pb2.CheckResult]:
        from tandem_taskapp.check import run_checks  # noqa: PLC0415 - the kit pulls in the HTTP stack

        key = await self._key(app)
        results = await run_checks(app.base_url, key)
        out = []
        for result in results:
            duration = duration_pb2.Duration()
            duration.FromNanoseconds(int(result.duration_s * 1e9))
            out.append(
                task_app_pb2.CheckResult(
                    check=result.name,
                    passed=result.passed,
                    detail=result.detail,
                    duration=duration,
                    violations=result.violations,
                )
            )
        return out

    async def _key(self, app: task_app_pb2.TaskApp) -> str:
        """The app's key, opened from the vault; an absent secret is NOT_FOUND / SECRET_NOT_FOUND, any other
        vault failure UNAVAILABLE / DEPENDENCY_UNAVAILABLE (never INTERNAL)."""
        if not app.secret_name:
            return ""
        try:
            return await self._keys.get(app.secret_name)
        except RpcError as error:
            if error.reason == "SECRET_NOT_FOUND":
                raise NotFound(
                    f"{app.secret_name} not found", reason=R.ERROR_REASON_SECRET_NOT_FOUND
                ) from None
            raise Unavailable(
                f"the app's key could not be read: {error.reason or error.code.name}",
                reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE,
            ) from None

    async def _task_info(self, app: task_app_pb2.TaskApp) -> struct_pb2.Struct | None:
        key = await self._key(app)
        try:
            async with asyncio.timeout(TASK_INFO_TIMEOUT_S):
                async with self._http.get(
                    app.base_url.rstrip("/") + "/task_info", params={"seed": 0}, headers=key_headers(key)
                ) as response:
                    body = json.loads(await response.read())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        info = struct_pb2.Struct()
        body = hosted.task_info_to_tandem(body)  # stored in Tandem's shape, whatever the app's dialect
        if isinstance(body, dict):
            json_format.ParseDict(body, info, ignore_unknown_fields=True)
        return info

    # ---- registry -----------------------------------------------------------------------------

    async def RegisterTaskApp(
        self, request: pb.RegisterTaskAppRequest, context: Context
    ) -> pb.RegisterTaskAppResponse:
        org = request.parent.split("/")[1]
        self._visible(org, request.parent)
        app = task_app_pb2.TaskApp()
        app.CopyFrom(request.task_app)
        app.name = f"{request.parent}/taskApps/{request.task_app_id}"
        if app.secret_name and app.secret_name.split("/")[1] != org:
            raise NotFound(f"{app.secret_name} not found", reason=R.ERROR_REASON_SECRET_NOT_FOUND)
        checks: list[task_app_pb2.CheckResult] = []
        if self._config.check_on_register:
            checks = await self._check(app)
            failed = [c for c in checks if not c.passed]
            if failed:
                names = ", ".join(f"{c.check} ({c.detail})" for c in failed)
                raise FailedPrecondition(
                    f"the Task App failed its checks: {names}",
                    reason=R.ERROR_REASON_TASK_APP_CHECK_FAILED,
                    metadata={"failed_checks": ",".join(c.check for c in failed)},
                )
        info = await self._task_info(app)
        if info is not None:
            app.task_info.CopyFrom(info)
        app.state = task_app_pb2.TaskApp.STATE_HEALTHY
        app.last_check_results.extend(checks)
        app.last_check_time.CopyFrom(_now())
        app.create_time.CopyFrom(_now())
        app.update_time.CopyFrom(app.create_time)
        if not request.validate_only:
            try:
                await self._db.execute(
                    "INSERT INTO task_apps (org, app_id, body) VALUES (?, ?, ?)",
                    (org, request.task_app_id, app.SerializeToString()),
                )
            except IntegrityError:
                raise AlreadyExists(
                    f"{app.name} already exists", reason=R.ERROR_REASON_ALREADY_EXISTS
                ) from None
        return pb.RegisterTaskAppResponse(task_app=app, check_results=checks)

    async def GetTaskApp(self, request: pb.GetTaskAppRequest, context: Context) -> pb.GetTaskAppResponse:
        return pb.GetTaskAppResponse(task_app=await self._load(request.name))

    async def ListTaskApps(
        self, request: pb.ListTaskAppsRequest, context: Context
    ) -> pb.ListTaskAppsResponse:
        org = request.parent.split("/")[1]
        self._visible(org, request.parent)
        size = paging.page_size(request.page_size)
        query = paging.fingerprint("apps", org)
        cursor = paging.decode(request.page_token, query)
        rows = await self._db.fetchall(
            "SELECT app_id, body FROM task_apps WHERE org = ? AND app_id > ? ORDER BY app_id LIMIT ?",
            (org, cursor.last_key if cursor else "", size + 1),
        )
        apps = [task_app_pb2.TaskApp.FromString(bytes(r["body"])) for r in rows[:size]]
        token = paging.encode(query, last_key=rows[size - 1]["app_id"]) if len(rows) > size else ""
        return pb.ListTaskAppsResponse(task_apps=apps, next_page_token=token)

    async def DeleteTaskApp(
        self, request: pb.DeleteTaskAppRequest, context: Context
    ) -> pb.DeleteTaskAppResponse:
        app = await self._load(request.name)
        _, org, _, app_id = request.name.split("/")
        await self._db.execute("DELETE FROM task_apps WHERE org = ? AND app_id = ?", (org, app_id))
        self._apps.pop(app.name, None)
        self._runner.forget(app.name)
        return pb.DeleteTaskAppResponse()

    async def CheckTaskApp(
        self, request: pb.CheckTaskAppRequest, context: Context
    ) -> pb.CheckTaskAppResponse:
        app = await self._load(request.name)
        checks = await self._check(app)
        passed = all(c.passed for c in checks)
        del app.last_check_results[:]
        app.last_check_results.extend(checks)
        app.last_check_time.CopyFrom(_now())
        app.state = task_app_pb2.TaskApp.STATE_HEALTHY if passed else task_app_pb2.TaskApp.STATE_UNHEALTHY
        _, org, _, app_id = request.name.split("/")
        await self._db.execute(
            "UPDATE task_apps SET body = ? WHERE org = ? AND app_id = ?",
            (app.SerializeToString(), org, app_id),
        )
        return pb.CheckTaskAppResponse(check_results=checks, all_passed=passed, task_app=app)

    # ---- rollouts -----------------------------------------------------------------------------

    async def _rollout(
        self, app_name: str, spec: rollout_pb2.RolloutSpec, job: str
    ) -> rollout_pb2.RolloutResult:
        app = await self._load(app_name, cached=True)
        if job and job.split("/")[1] != app_name.split("/")[1]:
            raise NotFound(f"{app_name} not found", reason=R.ERROR_REASON_TASK_APP_NOT_FOUND)
        result = await self._runner.rollout(app, self._limits(app), spec)
        if result.HasField("error") and result.error.kind == rollout_pb2.RolloutError.KIND_AUTH_REJECTED:
            self._keys.drop(app.secret_name)  # the key may have been rotated: read it again next time
        if job:
            self._events.record(job, app_name, result)
        return result

    async def Rollout(self, request: pb.RolloutRequest, context: Context) -> pb.RolloutResponse:
        return pb.RolloutResponse(result=await self._rollout(request.task_app, request.spec, request.job))

    async def StreamRollouts(
        self, request_iterator: AsyncIterator[pb.StreamRolloutsRequest], context: Context
    ) -> AsyncIterator[pb.StreamRolloutsResponse]:
        done: asyncio.Queue[rollout_pb2.RolloutResult | BaseException | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def one(request: pb.StreamRolloutsRequest) -> None:
            try:
                await done.put(await self._rollout(request.task_app, request.spec, request.job))
            except BaseException as error:  # a NOT_FOUND app ends the stream with that status
                await done.put(error)

        async def intake() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:
                await asyncio.gather(*list(running), return_exceptions=True)
            await done.put(None)

        feeder = asyncio.create_task(intake())
        try:
            while True:
                item = await done.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield pb.StreamRolloutsResponse(result=item)
            await feeder
        finally:
            feeder.cancel()
            for task in list(running):
                task.cancel()


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    config = TaskAppProxySettings()
    db = await open_database(deps.settings.store_url_for("taskapp_proxy"), "taskapp_proxy", MIGRATIONS)
    http = http_session()
    vault = deps.clients.stub(vault_service_pb2_grpc.VaultServiceStub, "vault")
    keys = KeyCache(vault, config.key_cache_s)
    runner = RolloutRunner(
        http,
        keys.get,
        breaker_failures=config.breaker_failures,
        breaker_open_s=config.breaker_open_s,
        max_response_bytes=config.max_response_bytes,
        result_cache=config.result_cache,
    )
    events = RolloutEvents(deps.clients.stub(events_service_pb2_grpc.EventServiceStub, "events"))
    events.start()
    servicer = TaskAppServiceServicer(db, runner, keys, events, config, http)
    taskapp_service_pb2_grpc.add_TaskAppServiceServicer_to_server(servicer, server)
    return Registration(service_names=[SERVICE_NAME], on_stop=[events.stop, http.close, db.close])
