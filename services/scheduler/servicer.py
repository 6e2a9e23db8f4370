"""gRPC adapter of the scheduler service: proto in, domain call (`engine`, `store`), proto out.

Who may call what: organization principals (user tokens the gateway issues for API keys) act on their own
organization only, and another organization's jobs read exactly like absent ones (NOT_FOUND); mesh services
(the gateway, forwarding for a scoped user) are trusted; a job token may read its own job and refresh itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from tandem.events.v1 import events_service_pb2_grpc
from tandem.scheduler.v1 import (
    cluster_pb2,
    job_pb2,
    job_spec_pb2,
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
)
from tandem.taskapp.v1 import task_app_pb2, taskapp_service_pb2, taskapp_service_pb2_grpc
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from mesh import paging
from mesh.errors import (
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    OutOfRange,
    R,
    Unauthenticated,
    Unavailable,
)
from mesh.identity import Principal, TokenVerifier
from mesh.interceptors import current_principal
from mesh.jobtokens import JobLiveness, Lookup, why_ended
from mesh.secrets import open_secrets as open_vault_secrets
from mesh.server import Deps, Registration
from mesh.settings import SettingsError
from mesh.status import RpcError
from mesh.store import open_database
from mesh.timestamps import put_stamp
from mesh.timestamps import stamp as _stamp
from services.scheduler import lifecycle as lc
from services.scheduler import spec as specs
from services.scheduler.backends.base import Backend, BackendUnavailable, NodeInventory
from services.scheduler.config import SchedulerSettings
from services.scheduler.engine import (
    Engine,
    EngineConfig,
    EventOutbox,
    backend_options,
    demands_of,
    failure_proto,
    job_event,
)
from services.scheduler.store import MIGRATIONS, JobRecord, JobRow, JobStore, TaskRow

log = logging.getLogger("tandem.scheduler")
SERVICE_NAME = scheduler_service_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
pb = scheduler_service_pb2
Context = grpc.aio.ServicerContext[Any, Any]
JobSpec = job_spec_pb2.JobSpec
BACKEND_NAMES = {
    job_spec_pb2.BACKEND_LOCAL: "local",
    job_spec_pb2.BACKEND_SLURM: "slurm",
    job_spec_pb2.BACKEND_KUBERNETES: "kubernetes",
}
BACKEND_ENUMS = {name: value for value, name in BACKEND_NAMES.items()}
LOG_CHUNK = 1024 * 1024
HEARTBEAT_S = 15.0


def job_proto(record: JobRecord) -> job_pb2.Job:
    # Fields are filled in place (the spec parsed into its field, tasks added, times set): a ListJobs page
    # builds this for every job, and building sub-messages apart copies each one in again.
    job = record.job
    proto = job_pb2.Job(
        name=job.name,
        state=int(job.state),  # type: ignore[arg-type]
        backend=BACKEND_ENUMS.get(job.backend, job_spec_pb2.BACKEND_UNSPECIFIED),
        restart_count=job.restart_count,
        creator=job.creator,
        request_id=job.request_id,
    )
    proto.spec.ParseFromString(job.spec)
    if job.state in (lc.JobState.FAILED, lc.JobState.RECOVERING):
        failure = failure_proto(job.failure)
        if failure is not None:
            proto.failure.CopyFrom(failure)
    put_stamp(proto.create_time, job.create_time)
    put_stamp(proto.start_time, job.start_time)
    put_stamp(proto.end_time, job.end_time)
    for task in record.tasks:
        _task_proto(record, task, proto.tasks.add())
    return proto


def _task_proto(record: JobRecord, task: TaskRow, status: job_pb2.TaskStatus) -> None:
    status.task = task.task
    status.state = int(task.state)  # type: ignore[assignment]
    status.restart_count = task.restart_count
    status.endpoint = task.endpoint
    if task.failure is not None:
        failure = failure_proto(task.failure)
        assert failure is not None
        status.failure.CopyFrom(failure)
    put_stamp(status.end_time, task.end_time)
    current = record.current(task.task)
    status.attempt = max(task.attempt, 0)
    if current is not None:
        put_stamp(status.start_time, current.start_time)
        for node in current.nodes:
            status.nodes.add(
                rank=int(node["rank"]),
                node=str(node.get("node", "")),
                address=str(node.get("address", "")),
                gpu_indices=[int(i) for i in node.get("gpu_indices", [])],
            )
        handle = current.handle or {}
        if current.backend == "local" and "pid" in handle:
            status.backend_handle.local.pid = int(handle["pid"])
            status.backend_handle.local.pgid = int(handle.get("pgid", handle["pid"]))
        elif current.backend == "slurm" and handle.get("job_id"):
            status.backend_handle.slurm.job_id = str(handle["job_id"])
            status.backend_handle.slurm.cluster = str(handle.get("cluster", ""))
        elif current.backend == "kubernetes" and handle.get("job"):
            k8s = status.backend_handle.kubernetes  # the backend's handle: one batch/v1 Job (kubernetes.py)
            k8s.api_version = "batch/v1"
            k8s.kind = "Job"
            k8s.namespace = str(handle.get("namespace", ""))
            k8s.name = str(handle["job"])
            k8s.uid = str(handle.get("uid", ""))


def _node_proto(backend: str, node: NodeInventory) -> cluster_pb2.Node:
    return cluster_pb2.Node(
        name=node.name,
        backend=BACKEND_ENUMS.get(backend, job_spec_pb2.BACKEND_UNSPECIFIED),
        state=cluster_pb2.Node.STATE_READY if node.up else cluster_pb2.Node.STATE_DOWN,
        gpu_type=node.gpu_type,
        gpu_count=node.gpus,
        gpus_free=node.gpus_free,
        cpus=node.cpus,
        cpus_free=node.cpus_free,
        memory_gib=node.memory_gib,
        memory_free_gib=node.memory_free_gib,
        labels=dict(node.labels),
    )


def _job_id(spec: JobSpec) -> str:
    stem = "".join(c if c.isalnum() else "-" for c in spec.display_name.lower()).strip("-") or "job"
    if not stem[0].isalpha():
        stem = "job-" + stem
    stem = "-".join(part for part in stem.split("-") if part)[:50].rstrip("-")
    return f"{stem}-{secrets.token_hex(4)}"


def _fingerprint(request: pb.CreateJobRequest) -> str:
    body = pb.CreateJobRequest(parent=request.parent, job_id=request.job_id, spec=request.spec)
    return hashlib.sha256(body.SerializeToString(deterministic=True)).hexdigest()


class SchedulerServiceServicer(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    """Scheduler: job groups, priorities, placement and recovery over local processes, Slurm, Kubernetes."""

    def __init__(
        self,
        engine: Engine,
        store: JobStore,
        verifier: TokenVerifier,
        default_backend: str,
        vault: Any,  # the vault's typed stub (mesh.clients); None refuses specs that name secrets
        task_apps: Any = None,  # the taskapp-proxy's typed stub; None skips the Task App id check
    ) -> None:
        self._task_apps = task_apps
        self._engine = engine
        self._store = store
        self._verifier = verifier
        self._default = default_backend
        self._vault = vault

    # ---- who is calling -----------------------------------------------------------------------

    @staticmethod
    def _check_org(org: str, missing: str, reason: int) -> Principal:
        principal = current_principal()
        if principal.kind == "service" or (principal.kind == "user" and principal.org == org):
            return principal
        raise NotFound(missing, reason=reason)

    async def _visible_job(self, name: str) -> JobRecord:
        org = name.split("/")[1]
        principal = current_principal()
        allowed = principal.kind == "service" or (principal.kind == "user" and principal.org == org)
        if principal.kind == "job" and principal.subject == name:
            allowed = True
        if not allowed:
            raise NotFound(f"{name} not found", reason=R.ERROR_REASON_JOB_NOT_FOUND)
        return await self._store.get(name)

    # ---- jobs ---------------------------------------------------------------------------------

    def _resolve_backend(self, spec: JobSpec) -> str:
        name = BACKEND_NAMES.get(spec.backend, self._default) if spec.backend else self._default
        if name not in self._engine.backends:
            raise Unavailable(
                f"the {name} backend is not configured on this scheduler",
                reason=R.ERROR_REASON_BACKEND_UNAVAILABLE,
            )
        return name

    async def _inventory(self, backend: Backend) -> list[NodeInventory]:
        try:
            return await backend.inventory()
        except BackendUnavailable as error:
            raise Unavailable(
                f"the {backend.name} backend is unreachable: {error}",
                reason=R.ERROR_REASON_BACKEND_UNAVAILABLE,
            ) from None

    async def _check_options(self, backend: Backend, spec: JobSpec) -> None:
        """The job's `slurm` or `kubernetes` options must name what the backend has (a Slurm cluster and
        partition, a Kubernetes context): FailedPrecondition / FAILED_PRECONDITION naming each field."""
        which = spec.WhichOneof("backend_options")
        try:
            problems = await backend.option_problems(backend_options(spec))
        except BackendUnavailable as error:
            raise Unavailable(
                f"the {backend.name} backend is unreachable: {error}",
                reason=R.ERROR_REASON_BACKEND_UNAVAILABLE,
            ) from None
        if problems:
            raise FailedPrecondition(
                "; ".join(problems.values()),
                reason=R.ERROR_REASON_FAILED_PRECONDITION,
                violations=[FieldViolation(f"spec.{which}.{key}", why) for key, why in problems.items()],
            )

    async def _check_secrets(self, org: str, spec: JobSpec) -> None:
        wanted = specs.secret_names(spec)
        if not wanted:
            return
        if self._vault is None:
            raise Unavailable("no vault to check the job's secrets against")
        known: set[str] = set()
        token = ""
        while True:
            try:
                page = await self._vault.ListSecrets(
                    vault_service_pb2.ListSecretsRequest(
                        parent=f"orgs/{org}", page_size=1000, page_token=token
                    )
                )
            except RpcError as error:
                if error.code == grpc.StatusCode.NOT_FOUND:
                    break  # an organization the vault never saw has no secrets
                raise Unavailable(f"the vault did not answer: {error.message}") from None
            known.update(s.name.rsplit("/", 1)[-1] for s in page.secrets)
            token = page.next_page_token
            if not token:
                break
        found: list[FieldViolation] = []
        for t_index, task in enumerate(spec.tasks):
            for s_index, binding in enumerate(task.secrets):
                if binding.secret not in known:
                    found.append(
                        FieldViolation(
                            f"spec.tasks[{t_index}].secrets[{s_index}].secret",
                            f"orgs/{org}/secrets/{binding.secret} does not exist",
                        )
                    )
            if task.WhichOneof("kind_options") == "service":
                key = task.service.register_task_app.api_key_secret
                if key and key not in known:
                    found.append(
                        FieldViolation(
                            f"spec.tasks[{t_index}].service.register_task_app.api_key_secret",
                            f"orgs/{org}/secrets/{key} does not exist",
                        )
                    )
        if found:
            raise NotFound(
                f"the job names secrets that do not exist: {', '.join(v.field for v in found)}",
                reason=R.ERROR_REASON_SECRET_NOT_FOUND,
                violations=found,
            )

    async def _check_task_apps(self, org: str, spec: JobSpec) -> None:
        """A managed Task App id must not name an app that is already registered (by a user or another job)."""
        if self._task_apps is None:
            return
        for index, task in enumerate(spec.tasks):
            if task.WhichOneof("kind_options") != "service" or not task.service.HasField("register_task_app"):
                continue
            name = f"orgs/{org}/taskApps/{task.service.register_task_app.app_id}"
            try:
                await self._task_apps.GetTaskApp(taskapp_service_pb2.GetTaskAppRequest(name=name))
            except RpcError as error:
                if error.code == grpc.StatusCode.NOT_FOUND:
                    continue
                raise Unavailable(f"the taskapp-proxy did not answer: {error.message}") from None
            field = f"spec.tasks[{index}].service.register_task_app.app_id"
            raise AlreadyExists(
                f"{name} is already registered",
                reason=R.ERROR_REASON_ALREADY_EXISTS,
                violations=[FieldViolation(field, f"{name} is already registered")],
            )

    async def CreateJob(self, request: pb.CreateJobRequest, context: Context) -> pb.CreateJobResponse:
        org = request.parent.split("/")[1]
        principal = self._check_org(org, f"{request.parent} not found", R.ERROR_REASON_ORG_NOT_FOUND)
        spec = request.spec
        try:
            specs.check_spec(spec)
        except InvalidArgument as error:
            error.violations = [FieldViolation(f"spec.{v.field}", v.description) for v in error.violations]
            raise
        specs.check_placement(spec)
        backend_name = self._resolve_backend(spec)
        nodes = await self._inventory(self._engine.backends[backend_name])
        specs.check_fits(spec, nodes)
        await self._check_options(self._engine.backends[backend_name], spec)
        await self._check_secrets(org, spec)
        if not request.request_id or await self._store.find_request(org, request.request_id) is None:
            await self._check_task_apps(org, spec)  # a retry finds its own job's app registered
        job_id = request.job_id or _job_id(spec)
        now = time.time()
        name = f"orgs/{org}/jobs/{job_id}"
        row = JobRow(
            name=name,
            org=org,
            spec=spec.SerializeToString(deterministic=True),
            priority=spec.priority,
            backend=backend_name,
            create_time=now,
            request_id=request.request_id,
            creator=principal.subject,
            waiting_since=now,
        )
        tasks = [TaskRow(name, task.name, index) for index, task in enumerate(spec.tasks)]
        if request.validate_only:
            return pb.CreateJobResponse(job=job_proto(JobRecord(row, tasks)))
        demands_of(spec)  # the spec is well formed for the engine too
        record, _ = await self._store.create(row, tasks, _fingerprint(request), job_event(row, None)[2])
        answer = job_proto(record)  # as stored: the engine may move it on at once
        await self._engine.submitted(record)
        return pb.CreateJobResponse(job=answer)

    async def GetJob(self, request: pb.GetJobRequest, context: Context) -> pb.GetJobResponse:
        return pb.GetJobResponse(job=job_proto(await self._visible_job(request.name)))

    async def ListJobs(self, request: pb.ListJobsRequest, context: Context) -> pb.ListJobsResponse:
        org = request.parent.split("/")[1]
        self._check_org(org, f"{request.parent} not found", R.ERROR_REASON_ORG_NOT_FOUND)
        size = paging.page_size(request.page_size, default=100)
        states = sorted({lc.JobState(int(s)) for s in request.states})
        query = paging.fingerprint("jobs", org, tuple(int(s) for s in states))
        cursor = paging.decode(request.page_token, query)
        records = await self._store.list_jobs(org, states, cursor.last_number if cursor else 0, size + 1)
        token = paging.encode(query, last_number=records[size - 1].job.seq) if len(records) > size else ""
        return pb.ListJobsResponse(jobs=[job_proto(r) for r in records[:size]], next_page_token=token)

    async def CancelJob(self, request: pb.CancelJobRequest, context: Context) -> pb.CancelJobResponse:
        await self._visible_job(request.name)
        if current_principal().kind == "job":
            raise NotFound(f"{request.name} not found", reason=R.ERROR_REASON_JOB_NOT_FOUND)
        await self._engine.cancel(request.name, request.reason)
        return pb.CancelJobResponse(job=job_proto(await self._store.get(request.name)))

    # ---- logs ---------------------------------------------------------------------------------

    def _log_file(self, record: JobRecord, task: str, rank: int) -> Path:
        current = record.current(task)
        if current is not None and current.handle:
            backend = self._engine.backends.get(current.backend)
            if backend is not None and (path := backend.logs(current.handle, rank)) is not None:
                return path
        return self._engine.log_dir(record.job.name, task) / f"rank-{rank}.log"

    async def StreamLogs(
        self, request: pb.StreamLogsRequest, context: Context
    ) -> AsyncIterator[pb.StreamLogsResponse]:
        record = await self._visible_job(request.job)
        spec = JobSpec.FromString(record.job.spec)
        names = [t.name for t in spec.tasks]
        task_name = request.task or (names[0] if len(names) == 1 else "")
        if task_name not in names:
            what = (
                "task is required: the job has several tasks"
                if not request.task
                else f"no task {request.task}"
            )
            raise InvalidArgument(what, violations=[FieldViolation("task", what)])
        task_spec = spec.tasks[names.index(task_name)]
        if request.rank >= max(task_spec.num_nodes, 1):
            what = f"task {task_name} has {max(task_spec.num_nodes, 1)} node(s)"
            raise InvalidArgument(what, violations=[FieldViolation("rank", what)])
        path = self._log_file(record, task_name, request.rank)
        size = path.stat().st_size if path.exists() else 0
        offset = request.offset
        if offset > size:
            raise OutOfRange(
                f"offset {offset} is past the end of the log ({size})", reason=R.ERROR_REASON_CURSOR_AHEAD
            )
        if offset == 0 and request.tail_bytes and size > request.tail_bytes:
            offset = _line_start(path, size - request.tail_bytes)
        idle_since = time.monotonic()
        while True:
            record = await self._store.get(request.job)
            task = record.task(task_name)
            terminal = task.state in lc.TASK_TERMINAL or record.job.state in lc.JOB_TERMINAL
            attempt = max(task.attempt, 0)
            path = self._log_file(record, task_name, request.rank)
            data = _read(path, offset, LOG_CHUNK)
            if data:
                at_end = offset + len(data) >= (path.stat().st_size if path.exists() else 0)
                yield pb.StreamLogsResponse(
                    data=data,
                    offset=offset,
                    next_offset=offset + len(data),
                    attempt=attempt,
                    end_of_log=terminal and at_end and not request.follow,
                )
                offset += len(data)
                idle_since = time.monotonic()
                if not at_end:
                    continue
                if not request.follow:
                    return
                if terminal:
                    yield pb.StreamLogsResponse(
                        offset=offset, next_offset=offset, attempt=attempt, end_of_log=True
                    )
                    return
            elif not request.follow or terminal:
                yield pb.StreamLogsResponse(
                    offset=offset, next_offset=offset, attempt=attempt, end_of_log=terminal
                )
                return
            elif time.monotonic() - idle_since >= HEARTBEAT_S:
                yield pb.StreamLogsResponse(offset=offset, next_offset=offset, attempt=attempt)
                idle_since = time.monotonic()
            await asyncio.sleep(0.1)

    # ---- cluster and tokens -------------------------------------------------------------------

    async def GetClusterInfo(
        self, request: pb.GetClusterInfoRequest, context: Context
    ) -> pb.GetClusterInfoResponse:
        current_principal()
        wanted = {BACKEND_NAMES[b] for b in request.backends if b in BACKEND_NAMES}
        names = sorted(self._engine.backends, key=lambda n: (n != self._default, n))
        response = pb.GetClusterInfoResponse()
        answered = 0
        for name in names:
            if wanted and name not in wanted:
                continue
            info = cluster_pb2.BackendInfo(
                backend=BACKEND_ENUMS[name], is_default=name == self._default, available=True
            )
            try:
                nodes = await self._engine.backends[name].inventory()
                answered += 1
            except BackendUnavailable as error:
                info.available, info.message = False, f"unreachable: {error}"
                nodes = []
            response.backends.append(info)
            if request.include_nodes:
                response.nodes.extend(
                    _node_proto(name, n) for n in sorted(nodes, key=lambda n: n.name)[:10000]
                )
        if response.backends and not answered:
            raise Unavailable("no configured backend answers", reason=R.ERROR_REASON_BACKEND_UNAVAILABLE)
        return response

    async def RefreshJobToken(
        self, request: pb.RefreshJobTokenRequest, context: Context
    ) -> pb.RefreshJobTokenResponse:
        if not request.job_token:
            raise Unauthenticated("job_token is empty", reason=R.ERROR_REASON_MISSING_CREDENTIALS)
        principal = self._verifier.verify(request.job_token)
        if principal.kind != "job":
            raise Unauthenticated("job_token is not a job token", reason=R.ERROR_REASON_INVALID_CREDENTIALS)
        ext = dict(principal.claims.get("ext", {}))
        record = await self._store.find(principal.subject)
        task = next((t for t in record.tasks if t.task == ext.get("task")), None) if record else None
        if record is None or task is None:
            raise Unauthenticated("the token's job is unknown", reason=R.ERROR_REASON_INVALID_CREDENTIALS)
        if record.job.state in lc.JOB_TERMINAL:
            raise FailedPrecondition(
                f"{record.job.name} is {record.job.state.name}", reason=R.ERROR_REASON_JOB_STATE_CONFLICT
            )
        if int(ext.get("attempt", -1)) != task.attempt:
            raise FailedPrecondition(
                f"attempt {ext.get('attempt')} of task {task.task} was superseded by attempt {task.attempt}",
                reason=R.ERROR_REASON_JOB_STATE_CONFLICT,
            )
        token = self._engine.mint_token(
            record.job.name,
            record.job.org,
            task.task,
            task.attempt,
            list(ext.get("secrets", [])),
            list(ext.get("task_apps", [])),
        )
        expires = self._verifier.verify(token).expires_at
        return pb.RefreshJobTokenResponse(job_token=token, expire_time=_stamp(expires))


def _read(path: Path, offset: int, limit: int) -> bytes:
    if not path.exists():
        return b""
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read(limit)


def _line_start(path: Path, offset: int) -> int:
    """The first line start at or after `offset` (the tail starts on a whole line)."""
    if offset <= 0:
        return 0
    with path.open("rb") as handle:
        handle.seek(offset - 1)
        chunk = handle.read(64 * 1024)
    newline = chunk.find(b"\n")
    return offset + newline if newline >= 0 else offset


# ---- wiring -------------------------------------------------------------------------------------


# How a backend whose tasks run as the mesh's own account serves organizations: by default only one (the
# first to launch); with run_as = mesh set explicitly, every one, the operator having said they trust each other.
ONE_ORGANIZATION = "so it serves one organization only, the first to launch"
TRUSTED = (
    "and it serves every organization (run_as = mesh: the operator trusts them all with each other's data)"
)


def resolve_run_as(backend: str, run_as: str, sandbox: str = "off") -> tuple[str, bool, str]:
    """What `run_as` (and, on the local backend, `sandbox`) mean on this machine: (`mesh` or `org`, whether
    tasks run in bubblewrap, the reason for the choice, logged at start-up). A choice that cannot hold here is
    a `SettingsError` naming the setting."""
    from services.scheduler.backends import sandbox as sandboxing  # noqa: PLC0415

    setting = f"TANDEM_SCHEDULER_{backend.upper()}__"
    root = os.geteuid() == 0
    problem = sandboxing.problem() if backend == "local" and sandbox != "off" else "the sandbox is off"
    unreachable = sandboxing.unreachable(sandboxing.runtime_paths())
    if run_as == "org" and not root:
        raise SettingsError(
            f"{setting}RUN_AS=org needs the scheduler to run as root (it starts tasks as other users)"
        )
    if sandbox == "bwrap" and problem:
        raise SettingsError(f"{setting}SANDBOX=bwrap, but {problem}")
    if run_as == "auto":
        if not root:
            run_as, why = "mesh", "the scheduler is not root, so it cannot start tasks as other users"
        elif not problem:
            run_as, why = "org", "root, with bubblewrap"
        elif not unreachable:
            run_as, why = "org", "root, and other users can reach Tandem's Python environment"
        else:
            run_as = "mesh"
            why = (
                f"other users cannot reach Tandem's Python environment ({unreachable[0]}) and {problem}"
                if backend == "local"
                else f"the job's user could not reach Tandem's Python environment ({unreachable[0]})"
            )
    else:
        why = f"{setting}RUN_AS={run_as}"
    use_sandbox = run_as == "org" and backend == "local" and not problem
    return run_as, use_sandbox, why


def make_backends(config: SchedulerSettings, work_dir: Path, hide: Sequence[Path] = ()) -> dict[str, Backend]:
    """The configured backends; each module is imported only when its backend is enabled. `hide`: folders a
    sandboxed task finds empty besides the scheduler's work folder (the mesh's state folder)."""
    backends: dict[str, Backend] = {}
    for name in config.enabled_backends():
        if name == "local":
            from services.scheduler.backends.local import LocalBackend  # noqa: PLC0415

            local = config.local
            run_as, use_sandbox, why = resolve_run_as("local", local.run_as, local.sandbox)
            if run_as == "mesh":
                log.warning(
                    "local backend: tasks run as the scheduler's own account (%s) and can read the mesh's"
                    " state, %s; run as root (with bubblewrap) for per-organization users",
                    why,
                    ONE_ORGANIZATION if local.run_as == "auto" else TRUSTED,
                )
            else:
                log.info(
                    "local backend: each organization's tasks run as its own user%s (%s)",
                    " in a bubblewrap sandbox" if use_sandbox else "",
                    why,
                )
            backends[name] = LocalBackend(
                work_dir / "local",
                gpus=local.gpus,
                gpu_type=local.gpu_type,
                cpus=local.cpus,
                memory_gib=local.memory_gib,
                run_as=run_as,
                sandbox=use_sandbox,
                hide=hide,
                one_organization=run_as == "mesh" and local.run_as == "auto",
                container_runtimes=local.container_runtimes,
                image_pull_timeout_s=local.image_pull_timeout_s,
            )
        elif name == "slurm":
            from services.scheduler.backends.slurm import SlurmBackend  # noqa: PLC0415

            s = config.slurm
            run_as, _, why = resolve_run_as("slurm", s.run_as)
            if run_as == "mesh":
                log.warning(
                    "slurm backend: jobs run as the scheduler's own account (%s) and can read the mesh's"
                    " state, %s; run as root with TANDEM_SCHEDULER_SLURM__RUN_AS=org",
                    why,
                    ONE_ORGANIZATION if s.run_as == "auto" else TRUSTED,
                )
            else:
                log.info("slurm backend: each organization's jobs run as its own user (%s)", why)
            backends[name] = SlurmBackend(
                partition=s.partition,
                account=s.account,
                qos=s.qos,
                cluster=s.cluster,
                env={"SLURM_CONF": str(s.conf)} if s.conf else None,
                run_as=run_as,
                work_dir=work_dir,
                one_organization=run_as == "mesh" and s.run_as == "auto",
                container_runtime=s.container_runtime,
                preemptible_qos=s.preemptible_qos,
            )
        else:
            from services.scheduler.backends.kubernetes import (  # noqa: PLC0415
                KubernetesBackend,
                connect,
            )

            k = config.kubernetes
            configuration, context = connect(k.kubeconfig, k.context)
            backends[name] = KubernetesBackend(
                image=k.image,
                namespace=k.namespace,
                namespaces=k.namespaces,
                service_account=k.service_account,
                configuration=configuration,
                context=context,
                run_as_user=k.run_as_user,
                network_policy=k.network_policy,
                allowed_capabilities=k.allowed_capabilities,
            )
    return backends


def task_app_hooks(
    stub: Any,  # TaskAppServiceStub from mesh.clients
) -> tuple[Any, Any]:
    async def register(record: JobRecord, task: job_spec_pb2.TaskSpec, endpoint: str) -> None:
        registration = task.service.register_task_app
        secret = registration.api_key_secret
        await stub.RegisterTaskApp(
            taskapp_service_pb2.RegisterTaskAppRequest(
                parent=f"orgs/{record.job.org}",
                task_app_id=registration.app_id,
                task_app=task_app_pb2.TaskApp(
                    base_url=endpoint,
                    secret_name=f"orgs/{record.job.org}/secrets/{secret}" if secret else "",
                    display_name=f"{record.job.name} {task.name}"[:128],
                    managing_job=record.job.name,
                ),
                request_id=hashlib.sha256(f"{record.job.name}/{task.name}/{endpoint}".encode()).hexdigest()[
                    :32
                ],
            )
        )

    async def delete(record: JobRecord, task: job_spec_pb2.TaskSpec, endpoint: str) -> None:
        if not task.service.HasField("register_task_app"):
            return
        await stub.DeleteTaskApp(
            taskapp_service_pb2.DeleteTaskAppRequest(
                name=f"orgs/{record.job.org}/taskApps/{task.service.register_task_app.app_id}"
            )
        )

    return register, delete


def local_lookup(store: JobStore) -> Lookup:
    """Job liveness read from the scheduler's own store (mesh/jobtokens.py)."""

    async def lookup(job: str, task: str, attempt: int) -> str | None:
        record = await store.find(job)
        if record is None:
            return f"{job} is not a job of this deployment"
        return why_ended(job_proto(record), task, attempt)

    return lookup


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    config = SchedulerSettings()
    work_dir = config.work_dir or deps.settings.state_dir / "scheduler"
    db = await open_database(deps.settings.store_url_for("scheduler"), "scheduler", MIGRATIONS)
    store = JobStore(db)
    deps.auth.liveness = JobLiveness(local_lookup(store))  # this process holds the jobs: no call needed
    backends = make_backends(config, work_dir, hide=(deps.settings.state_dir,))
    events = deps.clients.stub(events_service_pb2_grpc.EventServiceStub, "events")
    outbox = EventOutbox(store, events.Publish, events.CloseJobStream, config.pass_interval_s)
    task_apps = deps.clients.stub(taskapp_service_pb2_grpc.TaskAppServiceStub, "taskapp_proxy")
    register, delete = task_app_hooks(task_apps)
    vault = deps.clients.stub(vault_service_pb2_grpc.VaultServiceStub, "vault")
    settings = deps.settings
    engine = Engine(
        store,
        backends,
        deps.signer,
        EngineConfig(
            work_dir=work_dir,
            default_backend=config.default_backend,
            pass_interval_s=config.pass_interval_s,
            cancel_grace_s=config.cancel_grace_s,
            aux_stop_grace_s=config.aux_stop_grace_s,
            token_ttl_s=config.token_ttl_s,
            aging_s_per_point=config.aging_s_per_point,
            preemption=config.preemption,
            health_timeout_s=config.health_timeout_s,
            bucket_sync_interval_s=config.bucket_sync_interval_s,
            targets=lambda: {
                s: settings.target(s) for s in ("events", "vault", "taskapp_proxy", "scheduler")
            },
        ),
        outbox,
        register,
        delete,
        open_secrets=lambda names, token: open_vault_secrets(vault, names, token),
    )
    await engine.start()
    servicer = SchedulerServiceServicer(
        engine, store, deps.verifier, config.default_backend, vault, task_apps
    )
    scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)

    async def close_backends() -> None:
        for backend in backends.values():
            await backend.close()

    return Registration(
        service_names=[SERVICE_NAME],
        public_methods=[f"/{SERVICE_NAME}/RefreshJobToken"],
        on_stop=[engine.stop, close_backends, db.close],
    )


__all__: Sequence[str] = ["SchedulerServiceServicer", "job_proto", "setup"]
