"""gRPC adapter of the gateway, Tandem's public API: proto in, a domain call (`orgs`, `rljob`,
`checkpoints`) or a call forwarded to the internal service that owns the resource, proto out.

Every call but GetServerInfo and CreateOrg is scoped to the caller's organization: a `parent` or `name`
in another organization answers NOT_FOUND with the resource's own reason, exactly like an absent one.
Forwarded calls carry an org-scoped token (`forward.ForwardTokens`), so the internal services check the
organization again. Each organization (or, for the admin credential, the caller) has a token bucket.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import grpc
from google.protobuf import duration_pb2, timestamp_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.events.v1 import events_service_pb2 as events_pb
from tandem.events.v1 import events_service_pb2_grpc
from tandem.gateway.v1 import gateway_service_pb2, gateway_service_pb2_grpc, org_pb2, server_info_pb2
from tandem.scheduler.v1 import job_pb2, job_spec_pb2, scheduler_service_pb2_grpc
from tandem.scheduler.v1 import scheduler_service_pb2 as sched_pb
from tandem.taskapp.v1 import task_app_pb2, taskapp_service_pb2_grpc
from tandem.taskapp.v1 import taskapp_service_pb2 as taskapp_pb
from tandem.trainer.v1 import checkpoint_pb2, config_pb2
from tandem.vault.v1 import org_key_pb2, vault_service_pb2_grpc
from tandem.vault.v1 import vault_service_pb2 as vault_pb

from gateway import checkpoints as ckpt
from gateway import dashboard, inference, openai_http, rljob
from gateway.config import GatewaySettings
from gateway.forward import Forwarded, ForwardTokens, Scope, convert
from gateway.orgs import ADMIN_SUBJECT, KeyRow, OrgRow, Orgs, is_admin, load_admin_key
from gateway.ratelimit import RateLimiter
from gateway.store import MIGRATIONS
from mesh.errors import InvalidArgument, NotFound, PermissionDenied, R, Unavailable
from mesh.identity import Principal, load_signing_key
from mesh.interceptors import current_principal, principal_var
from mesh.secrets import seal_for_upload
from mesh.server import Deps, Registration
from mesh.status import RpcError
from mesh.store import open_database
from mesh.timestamps import stamp as _stamp

log = logging.getLogger("tandem.gateway")
Context = grpc.aio.ServicerContext[Any, Any]
pb = gateway_service_pb2

SERVICE_NAME = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
PUBLIC_METHODS = (f"/{SERVICE_NAME}/GetServerInfo",)
API_PACKAGES = tuple(
    f"tandem.{area}.v1" for area in ("common", "gateway", "vault", "scheduler", "taskapp", "events")
)
HEALTH_CACHE_S = 2.0
HEALTH_TIMEOUT_S = 1.0

# (component, settings key, gRPC service) behind the gateway, in the order ServerInfo lists them.
INTERNAL = (
    ("vault", "vault", "tandem.vault.v1.VaultService"),
    ("scheduler", "scheduler", "tandem.scheduler.v1.SchedulerService"),
    ("taskapp-proxy", "taskapp_proxy", "tandem.taskapp.v1.TaskAppService"),
    ("events", "events", "tandem.events.v1.EventService"),
)
Status = server_info_pb2.ServiceStatus


def tandem_version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass
class _Observation:
    status: server_info_pb2.ServiceStatus
    observed_at: float


T = TypeVar("T")


def current_principal_or_none() -> Principal | None:
    return principal_var.get()


def _limit_key(principal: Principal) -> str:
    return f"org:{principal.org}" if principal.org else f"{principal.kind}:{principal.subject}"


def _peer_host(context: Context) -> str:
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0]


def _org(name: str) -> str:
    """The organization id of `orgs/{org}/...` (the contract's patterns have checked the shape)."""
    return name.split("/")[1]


def _org_proto(row: OrgRow) -> org_pb2.Org:
    return org_pb2.Org(
        name=f"orgs/{row.org}", display_name=row.display_name, create_time=_stamp(row.create_time)
    )


def _key_proto(row: KeyRow) -> org_pb2.ApiKey:
    now = time.time()
    state = org_pb2.ApiKey.STATE_ACTIVE
    if row.revoke_time is not None:
        state = org_pb2.ApiKey.STATE_REVOKED
    elif row.expired(now):
        state = org_pb2.ApiKey.STATE_EXPIRED
    return org_pb2.ApiKey(
        name=row.name,
        display_name=row.display_name,
        key_prefix=row.key_prefix,
        state=state,
        creator=row.creator,
        create_time=_stamp(row.create_time),
        expire_time=_stamp(row.expire_time),
        revoke_time=_stamp(row.revoke_time),
        last_use_time=_stamp(row.last_use_time),
    )


def _fingerprint(request: Message) -> str:
    copy = type(request)()
    copy.CopyFrom(request)
    if copy.DESCRIPTOR.fields_by_name.get("request_id") is not None:
        copy.ClearField("request_id")
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


async def _forwarded(call: Awaitable[T]) -> T:
    try:
        return await call
    except RpcError as error:
        raise Forwarded.of(error) from None


MIN_KEY_TTL_S = 3600.0
MAX_KEY_TTL_S = 10 * 365 * 86400.0


class GatewayServicer(gateway_service_pb2_grpc.GatewayServiceServicer):
    """The public surface; every call is scoped to the caller's organization."""

    def __init__(self, deps: Deps, orgs: Orgs, config: GatewaySettings) -> None:
        self._deps = deps
        self._orgs = orgs
        self._config = config
        self._timeout = config.forward_timeout_s
        self._limiter = RateLimiter(config.rate_per_s, config.rate_burst)
        self._public_limiter = RateLimiter(config.rate_per_s, config.rate_burst)
        self._tokens = ForwardTokens(deps.signer)
        self._vault = deps.clients.stub(vault_service_pb2_grpc.VaultServiceStub, "vault")
        self._scheduler = deps.clients.stub(scheduler_service_pb2_grpc.SchedulerServiceStub, "scheduler")
        self._task_apps = deps.clients.stub(taskapp_service_pb2_grpc.TaskAppServiceStub, "taskapp_proxy")
        self._events = deps.clients.stub(events_service_pb2_grpc.EventServiceStub, "events")
        seed = load_signing_key(deps.settings.mesh_key, deps.settings.state_dir).encode()
        self._workers = inference.Workers(seed, config.infer_idle_s)
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=config.infer_timeout_s))
        self.openai_base_url = ""
        self._started = time.time()
        self._cache: dict[str, _Observation] = {}
        self._refresh = asyncio.Lock()

    async def _probe(self, component: str, key: str, service: str) -> server_info_pb2.ServiceStatus:
        target = self._deps.settings.target(key)
        stub: Any = self._deps.clients.stub(
            health_pb2_grpc.HealthStub, key
        )  # the stubs' typing omits methods
        started = time.perf_counter()
        status = Status(component=component, service=service, address=target, version=tandem_version())
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_TIMEOUT_S)
            status.serving_status = {
                health_pb2.HealthCheckResponse.SERVING: Status.SERVING_STATUS_SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING: Status.SERVING_STATUS_NOT_SERVING,
                health_pb2.HealthCheckResponse.SERVICE_UNKNOWN: Status.SERVING_STATUS_SERVICE_UNKNOWN,
            }.get(reply.status, Status.SERVING_STATUS_NOT_SERVING)
        except RpcError as error:
            if error.code == grpc.StatusCode.NOT_FOUND:
                status.serving_status = Status.SERVING_STATUS_SERVICE_UNKNOWN
            else:
                status.serving_status = Status.SERVING_STATUS_UNREACHABLE
                status.detail = f"{error.code.name.lower().replace('_', ' ')} after {HEALTH_TIMEOUT_S:g}s"
        if status.serving_status != Status.SERVING_STATUS_SERVING and not status.detail:
            status.detail = (
                Status.ServingStatus.Name(status.serving_status).removeprefix("SERVING_STATUS_").lower()
            )
        elapsed = duration_pb2.Duration()
        elapsed.FromNanoseconds(int((time.perf_counter() - started) * 1e9))
        status.latency.CopyFrom(elapsed)
        status.check_time.FromSeconds(int(time.time()))
        return status

    async def _internal_statuses(self) -> list[server_info_pb2.ServiceStatus]:
        async with self._refresh:  # one probe round at a time, however many callers ask
            now = time.time()
            stale = [
                row
                for row in INTERNAL
                if now - self._cache.get(row[0], _Observation(Status(), 0)).observed_at > HEALTH_CACHE_S
            ]
            fresh = await asyncio.gather(*(self._probe(*row) for row in stale))
            for row, status in zip(stale, fresh, strict=True):
                self._cache[row[0]] = _Observation(status, now)
            return [self._cache[row[0]].status for row in INTERNAL]

    async def GetServerInfo(
        self,
        request: gateway_service_pb2.GetServerInfoRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> gateway_service_pb2.GetServerInfoResponse:
        caller = current_principal_or_none()
        self._public_limiter.take(_limit_key(caller) if caller else f"peer:{_peer_host(context)}")
        settings = self._deps.settings
        own = Status(
            component="gateway",
            service=SERVICE_NAME,
            address=settings.target("gateway"),
            serving_status=Status.SERVING_STATUS_SERVING,
            version=tandem_version(),
        )
        own.check_time.FromSeconds(int(time.time()))
        statuses = [own, *await self._internal_statuses()]
        colocated = {key for _, key, _ in INTERNAL} <= set(self._deps.colocated)
        info = server_info_pb2.ServerInfo(
            version=tandem_version(),
            build_revision=os.environ.get("TANDEM_BUILD_REVISION", ""),
            api_packages=list(API_PACKAGES),
            topology=(
                server_info_pb2.ServerInfo.TOPOLOGY_SINGLE_PROCESS
                if colocated
                else server_info_pb2.ServerInfo.TOPOLOGY_DISTRIBUTED
            ),
            services=statuses,
            all_serving=all(s.serving_status == Status.SERVING_STATUS_SERVING for s in statuses),
            openai_base_url=self.openai_base_url,
        )
        info.server_time.CopyFrom(timestamp_pb2.Timestamp(seconds=int(time.time())))
        info.start_time.CopyFrom(timestamp_pb2.Timestamp(seconds=int(self._started)))
        return gateway_service_pb2.GetServerInfoResponse(server_info=info)

    async def close(self) -> None:
        await self.http.close()

    # ---- who is calling -----------------------------------------------------------------------

    def _caller(self) -> Principal:
        principal = current_principal()
        self._limiter.take(_limit_key(principal))
        return principal

    async def _relay(
        self, call: Callable[..., Awaitable[T]], request: Any, inner: type[Any], scope: Scope
    ) -> T:
        """`request` as the internal service's message `inner`, sent with the caller's scope and a deadline;
        the service's failure re-raised as its own."""
        return await _forwarded(call(convert(request, inner), metadata=scope.metadata, timeout=self._timeout))

    def _scope(self, name: str, reason: int) -> Scope:
        """The caller, if `name` lies in its organization; NOT_FOUND with `reason` otherwise."""
        principal = self._caller()
        if not principal.org or principal.org != _org(name):
            raise NotFound(f"{name} not found", reason=reason)
        return self._tokens.scope(principal)

    # ---- organizations and API keys -----------------------------------------------------------

    async def CreateOrg(self, request: pb.CreateOrgRequest, context: Context) -> pb.CreateOrgResponse:
        principal = self._caller()
        if not is_admin(principal):
            raise PermissionDenied("CreateOrg needs the deployment's admin credential")
        fingerprint = _fingerprint(request)
        method = "CreateOrg"
        earlier = await self._orgs.find_request("", request.request_id, method, fingerprint)
        if earlier is not None:
            return pb.CreateOrgResponse.FromString(earlier)  # the key itself was never stored
        org, key, plaintext = await self._orgs.create_org(request.org_id, request.display_name, ADMIN_SUBJECT)
        answer = pb.CreateOrgResponse(org=_org_proto(org), api_key=_key_proto(key))
        await self._orgs.remember_request(
            "", request.request_id, method, fingerprint, answer.SerializeToString()
        )
        answer.key = plaintext
        return answer

    async def GetOrg(self, request: pb.GetOrgRequest, context: Context) -> pb.GetOrgResponse:
        principal = self._caller()
        name = request.name or f"orgs/{principal.org}"
        if not principal.org or _org(name) != principal.org:
            raise NotFound(f"{name} not found", reason=R.ERROR_REASON_ORG_NOT_FOUND)
        return pb.GetOrgResponse(org=_org_proto(await self._orgs.get_org(principal.org)))

    async def CreateApiKey(
        self, request: pb.CreateApiKeyRequest, context: Context
    ) -> pb.CreateApiKeyResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        ttl_s: float | None = None
        if request.HasField("ttl"):
            ttl_s = request.ttl.ToNanoseconds() / 1e9
            if not MIN_KEY_TTL_S <= ttl_s <= MAX_KEY_TTL_S:
                raise InvalidArgument(
                    "ttl must be between 1 hour and 10 years",
                    violations=[ckpt.violation("ttl", "must be between 1 hour and 10 years")],
                )
        fingerprint = _fingerprint(request)
        earlier = await self._orgs.find_request(scope.org, request.request_id, "CreateApiKey", fingerprint)
        if earlier is not None:
            return pb.CreateApiKeyResponse.FromString(earlier)
        key, plaintext = await self._orgs.create_key(
            scope.org, request.display_name, scope.principal.subject, ttl_s
        )
        answer = pb.CreateApiKeyResponse(api_key=_key_proto(key))
        await self._orgs.remember_request(
            scope.org, request.request_id, "CreateApiKey", fingerprint, answer.SerializeToString()
        )
        answer.key = plaintext
        return answer

    async def ListApiKeys(self, request: pb.ListApiKeysRequest, context: Context) -> pb.ListApiKeysResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        keys, token = await self._orgs.list_keys(
            scope.org, request.page_size, request.page_token, request.show_inactive
        )
        return pb.ListApiKeysResponse(api_keys=[_key_proto(k) for k in keys], next_page_token=token)

    async def RevokeApiKey(
        self, request: pb.RevokeApiKeyRequest, context: Context
    ) -> pb.RevokeApiKeyResponse:
        scope = self._scope(request.name, R.ERROR_REASON_ORG_NOT_FOUND)
        key = await self._orgs.revoke_key(scope.org, request.name.rsplit("/", 1)[1])
        return pb.RevokeApiKeyResponse(api_key=_key_proto(key))

    # ---- secrets (vault) ----------------------------------------------------------------------

    async def GetPublicKey(
        self, request: pb.GetPublicKeyRequest, context: Context
    ) -> pb.GetPublicKeyResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        reply = await _forwarded(
            self._vault.GetPublicKey(
                vault_pb.GetPublicKeyRequest(parent=request.parent),
                metadata=scope.metadata,
                timeout=self._timeout,
            )
        )
        key = org_key_pb2.OrgKey(
            name=f"{request.parent}/keys/{reply.key_id}",
            key_id=reply.key_id,
            alg=reply.alg,
            public_key=reply.public_key,
            state=org_key_pb2.OrgKey.STATE_ACTIVE,
            create_time=reply.create_time,
        )
        return pb.GetPublicKeyResponse(key=key)

    async def PutSecret(self, request: pb.PutSecretRequest, context: Context) -> pb.PutSecretResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        reply = await self._relay(self._vault.PutSecret, request, vault_pb.PutSecretRequest, scope)
        return convert(reply, pb.PutSecretResponse)

    async def ListSecrets(self, request: pb.ListSecretsRequest, context: Context) -> pb.ListSecretsResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        reply = await self._relay(self._vault.ListSecrets, request, vault_pb.ListSecretsRequest, scope)
        return convert(reply, pb.ListSecretsResponse)

    async def DeleteSecret(
        self, request: pb.DeleteSecretRequest, context: Context
    ) -> pb.DeleteSecretResponse:
        scope = self._scope(request.name, R.ERROR_REASON_SECRET_NOT_FOUND)
        await self._relay(self._vault.DeleteSecret, request, vault_pb.DeleteSecretRequest, scope)
        return pb.DeleteSecretResponse()

    # ---- Task Apps (taskapp-proxy) ------------------------------------------------------------

    async def RegisterTaskApp(
        self, request: pb.RegisterTaskAppRequest, context: Context
    ) -> pb.RegisterTaskAppResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        reply = await self._relay(
            self._task_apps.RegisterTaskApp, request, taskapp_pb.RegisterTaskAppRequest, scope
        )
        return convert(reply, pb.RegisterTaskAppResponse)

    async def _check_task_app(self, scope: Scope, name: str) -> taskapp_pb.CheckTaskAppResponse:
        return await _forwarded(
            self._task_apps.CheckTaskApp(
                taskapp_pb.CheckTaskAppRequest(name=name), metadata=scope.metadata, timeout=self._timeout
            )
        )

    async def CheckTaskApp(
        self, request: pb.CheckTaskAppRequest, context: Context
    ) -> pb.CheckTaskAppResponse:
        scope = self._scope(request.name, R.ERROR_REASON_TASK_APP_NOT_FOUND)
        return convert(await self._check_task_app(scope, request.name), pb.CheckTaskAppResponse)

    async def ListTaskApps(
        self, request: pb.ListTaskAppsRequest, context: Context
    ) -> pb.ListTaskAppsResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        reply = await self._relay(
            self._task_apps.ListTaskApps, request, taskapp_pb.ListTaskAppsRequest, scope
        )
        return convert(reply, pb.ListTaskAppsResponse)

    async def GetTaskApp(self, request: pb.GetTaskAppRequest, context: Context) -> pb.GetTaskAppResponse:
        scope = self._scope(request.name, R.ERROR_REASON_TASK_APP_NOT_FOUND)
        reply = await self._relay(self._task_apps.GetTaskApp, request, taskapp_pb.GetTaskAppRequest, scope)
        return convert(reply, pb.GetTaskAppResponse)

    async def DeleteTaskApp(
        self, request: pb.DeleteTaskAppRequest, context: Context
    ) -> pb.DeleteTaskAppResponse:
        scope = self._scope(request.name, R.ERROR_REASON_TASK_APP_NOT_FOUND)
        await self._relay(self._task_apps.DeleteTaskApp, request, taskapp_pb.DeleteTaskAppRequest, scope)
        return pb.DeleteTaskAppResponse()

    # ---- jobs (scheduler) ---------------------------------------------------------------------

    async def _submit(
        self, scope: Scope, parent: str, job_id: str, spec: Any, request_id: str, validate_only: bool
    ) -> Any:
        reply = await _forwarded(
            self._scheduler.CreateJob(
                sched_pb.CreateJobRequest(
                    parent=parent,
                    job_id=job_id,
                    spec=spec,
                    request_id=request_id,
                    validate_only=validate_only,
                ),
                metadata=scope.metadata,
                timeout=self._timeout,
            )
        )
        return reply.job

    async def _register_bare_app(
        self, scope: Scope, config: config_pb2.TrainerConfig, job_id: str, validate_only: bool
    ) -> tuple[config_pb2.TrainerConfig, str] | None:
        """A config's bare Task App (`base_url`, with `secret_name` as its key) registered for the job under
        a generated id, and the config and its TOML naming that registration instead; None for a config
        that names a registered app. Registering runs the checks with the key opened from that secret, so a
        `validate_only` call checks the app too (and stores nothing). A repeat of the same job finds its
        own registration and checks it again."""
        target = config.task_app
        if not target.base_url:
            return None
        parent = f"orgs/{scope.org}"
        app_id = rljob.bare_app_id(job_id, secrets.token_hex(6))
        name = f"{parent}/taskApps/{app_id}"
        request = taskapp_pb.RegisterTaskAppRequest(
            parent=parent,
            task_app_id=app_id,
            task_app=task_app_pb2.TaskApp(base_url=target.base_url, secret_name=target.secret_name),
            validate_only=validate_only,
        )
        try:
            await _forwarded(
                self._task_apps.RegisterTaskApp(request, metadata=scope.metadata, timeout=self._timeout)
            )
        except Forwarded as error:
            if error.reason != R.ERROR_REASON_ALREADY_EXISTS:
                raise
            existing = await _forwarded(
                self._task_apps.GetTaskApp(
                    taskapp_pb.GetTaskAppRequest(name=name), metadata=scope.metadata, timeout=self._timeout
                )
            )
            same = (existing.task_app.base_url, existing.task_app.secret_name) == (
                target.base_url,
                target.secret_name,
            )
            if not same:
                raise
            checked = await self._check_task_app(scope, name)
            rljob.refuse_failed_checks(name, "task_app.base_url", checked.check_results)
        named = rljob.naming(config, name)
        return named, rljob.to_toml(named)

    async def _rl_spec(
        self,
        scope: Scope,
        config: config_pb2.TrainerConfig,
        toml: str,
        field: str,
        *,
        job_id: str = "",
        validate_only: bool = False,
        **options: Any,
    ) -> Any:
        """The job group of an online-RL config, once the Task App it names passes its checks now (a bare
        `base_url` app is registered for the job first, `_register_bare_app`)."""
        bare = await self._register_bare_app(scope, config, job_id, validate_only)
        if bare is not None:
            config, toml = bare
        app = rljob.task_app_of(config)
        rljob.check_task_app(scope.org, app)
        if app and bare is None:
            checked = await self._check_task_app(scope, app)
            rljob.refuse_failed_checks(app, f"{field}.task_app.name", checked.check_results)
        return rljob.job_spec(config, toml, **options)

    async def _check_spec_task_apps(
        self, scope: Scope, spec: job_spec_pb2.JobSpec, job_id: str, validate_only: bool
    ) -> None:
        """The Task Apps named by a spec's inline online-RL configs pass their checks now; a config's bare
        `base_url` app is registered for the job and the config rewritten to name it (`_register_bare_app`).
        A config that does not parse is left to the scheduler, which names the field. An app that one of the
        group's own `service` tasks registers (`register_task_app`) exists only once the scheduler starts
        that task, so it is not checked here."""
        own = {
            f"orgs/{scope.org}/taskApps/{task.service.register_task_app.app_id}"
            for task in spec.tasks
            if task.WhichOneof("kind_options") == "service" and task.service.register_task_app.app_id
        }
        for index, task in enumerate(spec.tasks):
            if task.WhichOneof("kind_options") != "online_rl":
                continue
            if task.online_rl.WhichOneof("trainer_config") != "config_toml":
                continue
            field = f"spec.tasks[{index}].online_rl.config_toml"
            try:
                config = rljob.parse_toml(task.online_rl.config_toml, field)
            except InvalidArgument:
                continue
            bare = await self._register_bare_app(scope, config, job_id, validate_only)
            if bare is not None:
                task.online_rl.config_toml = bare[1]
                continue
            app = rljob.task_app_of(config)
            rljob.check_task_app(scope.org, app)
            if app and app not in own:
                checked = await self._check_task_app(scope, app)
                rljob.refuse_failed_checks(app, f"{field}.task_app.name", checked.check_results)

    async def CreateJob(self, request: pb.CreateJobRequest, context: Context) -> pb.CreateJobResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        source = request.WhichOneof("source")
        if source == "spec":
            spec = job_spec_pb2.JobSpec()
            spec.CopyFrom(request.spec)
            await self._check_spec_task_apps(scope, spec, request.job_id, request.validate_only)
        elif source == "rl_config_toml":
            config = rljob.parse_toml(request.rl_config_toml, "rl_config_toml")
            spec = await self._rl_spec(
                scope,
                config,
                request.rl_config_toml,
                "rl_config_toml",
                job_id=request.job_id,
                validate_only=request.validate_only,
            )
        else:
            raise InvalidArgument(
                "set spec or rl_config_toml",
                reason=R.ERROR_REASON_INVALID_JOB_SPEC,
                violations=[ckpt.violation("source", "set spec or rl_config_toml")],
            )
        job = await self._submit(
            scope, request.parent, request.job_id, spec, request.request_id, request.validate_only
        )
        return pb.CreateJobResponse(job=job)

    async def CreateRlJob(self, request: pb.CreateRlJobRequest, context: Context) -> pb.CreateRlJobResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        toml = rljob.to_toml(request.config)
        config = rljob.parse_toml(toml, "config")
        spec = await self._rl_spec(
            scope,
            config,
            toml,
            "config",
            job_id=request.job_id,
            validate_only=request.validate_only,
            display_name=request.display_name,
            backend=request.backend,
            priority=request.priority,
            recovery=request.recovery if request.HasField("recovery") else None,
            max_duration=request.max_duration if request.HasField("max_duration") else None,
            file_mounts=request.file_mounts,
            secrets=request.secrets,
        )
        job = await self._submit(
            scope, request.parent, request.job_id, spec, request.request_id, request.validate_only
        )
        return pb.CreateRlJobResponse(job=job)

    async def GetJob(self, request: pb.GetJobRequest, context: Context) -> pb.GetJobResponse:
        scope = self._scope(request.name, R.ERROR_REASON_JOB_NOT_FOUND)
        reply = await self._relay(self._scheduler.GetJob, request, sched_pb.GetJobRequest, scope)
        return pb.GetJobResponse(job=reply.job)

    async def ListJobs(self, request: pb.ListJobsRequest, context: Context) -> pb.ListJobsResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        reply = await self._relay(self._scheduler.ListJobs, request, sched_pb.ListJobsRequest, scope)
        return convert(reply, pb.ListJobsResponse)

    async def CancelJob(self, request: pb.CancelJobRequest, context: Context) -> pb.CancelJobResponse:
        scope = self._scope(request.name, R.ERROR_REASON_JOB_NOT_FOUND)
        reply = await self._relay(self._scheduler.CancelJob, request, sched_pb.CancelJobRequest, scope)
        return pb.CancelJobResponse(job=reply.job)

    async def StreamJobLogs(
        self, request: pb.StreamJobLogsRequest, context: Context
    ) -> AsyncIterator[pb.StreamJobLogsResponse]:
        scope = self._scope(request.job, R.ERROR_REASON_JOB_NOT_FOUND)
        stream: Any = self._scheduler.StreamLogs(
            convert(request, sched_pb.StreamLogsRequest), metadata=scope.metadata
        )
        try:
            async for item in stream:
                yield convert(item, pb.StreamJobLogsResponse)
        except RpcError as error:
            raise Forwarded.of(error) from None

    # ---- events (events service) --------------------------------------------------------------

    async def SubscribeEvents(
        self, request: pb.SubscribeEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeEventsResponse]:
        scope = self._scope(request.job, R.ERROR_REASON_JOB_NOT_FOUND)
        stream: Any = self._events.Subscribe(
            convert(request, events_pb.SubscribeRequest), metadata=scope.metadata
        )
        try:
            async for item in stream:
                yield convert(item, pb.SubscribeEventsResponse)
        except RpcError as error:
            raise Forwarded.of(error) from None

    async def ListEvents(self, request: pb.ListEventsRequest, context: Context) -> pb.ListEventsResponse:
        scope = self._scope(request.job, R.ERROR_REASON_JOB_NOT_FOUND)
        reply = await self._relay(self._events.ListEvents, request, events_pb.ListEventsRequest, scope)
        return convert(reply, pb.ListEventsResponse)

    async def ListMetrics(self, request: pb.ListMetricsRequest, context: Context) -> pb.ListMetricsResponse:
        scope = self._scope(request.job, R.ERROR_REASON_JOB_NOT_FOUND)
        reply = await self._relay(self._events.ListMetrics, request, events_pb.ListMetricsRequest, scope)
        return convert(reply, pb.ListMetricsResponse)

    # ---- checkpoints and inference ------------------------------------------------------------

    def _checkpoints(self, scope: Scope) -> ckpt.CheckpointIndex:
        async def list_events(request: events_pb.ListEventsRequest) -> events_pb.ListEventsResponse:
            return await _forwarded(
                self._events.ListEvents(request, metadata=scope.metadata, timeout=self._timeout)
            )

        async def list_metrics(request: events_pb.ListMetricsRequest) -> events_pb.ListMetricsResponse:
            return await _forwarded(
                self._events.ListMetrics(request, metadata=scope.metadata, timeout=self._timeout)
            )

        return ckpt.CheckpointIndex(list_events, list_metrics)

    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: Context
    ) -> pb.ListCheckpointsResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_JOB_NOT_FOUND)
        found, token = await self._checkpoints(scope).page(
            request.parent, request.page_size, request.page_token
        )
        return pb.ListCheckpointsResponse(checkpoints=found, next_page_token=token)

    async def Infer(self, request: pb.InferRequest, context: Context) -> pb.InferResponse:
        scope = self._scope(request.model, R.ERROR_REASON_JOB_NOT_FOUND)
        if bool(request.messages) == bool(request.prompt):
            raise InvalidArgument(
                "set exactly one of messages and prompt",
                violations=[ckpt.violation("messages", "set exactly one of messages and prompt")],
            )
        route, body = inference.openai_body(request, "")
        checkpoint, worker = await self.worker_for(scope, request.model)
        body["model"] = checkpoint.name
        status, answer = await self.post_json(worker, route, body)
        if status != 200:
            raise inference.worker_error(status, answer)
        return inference.infer_response(answer, checkpoint)

    async def worker_for(
        self, scope: Scope, model: str
    ) -> tuple[checkpoint_pb2.Checkpoint, inference.Endpoint]:
        """The checkpoint a model id names and a ready worker serving it."""
        checkpoint = await self._checkpoints(scope).resolve(model)

        async def get_job(name: str) -> job_pb2.Job | None:
            try:
                reply = await self._scheduler.GetJob(
                    sched_pb.GetJobRequest(name=name), metadata=scope.metadata, timeout=self._timeout
                )
            except RpcError as error:
                if error.code == grpc.StatusCode.NOT_FOUND:
                    return None
                raise Forwarded.of(error) from None
            return reply.job

        async def create_job(org: str, job_id: str, spec: job_spec_pb2.JobSpec) -> job_pb2.Job:
            await self._put_worker_key(scope, org, checkpoint.name)
            try:
                job: job_pb2.Job = await self._submit(scope, f"orgs/{org}", job_id, spec, job_id, False)
            except Forwarded as error:
                existing = (
                    await get_job(f"orgs/{org}/jobs/{job_id}") if error.code == "ALREADY_EXISTS" else None
                )
                if existing is None:  # another gateway replica started it a moment ago, or a real failure
                    raise
                return existing
            return job

        return checkpoint, await self._workers.endpoint(checkpoint, get_job, create_job)

    async def _put_worker_key(self, scope: Scope, org: str, checkpoint: str) -> None:
        """Upload the key of `checkpoint`'s worker, sealed to the organization's key, as the secret its job
        binds (a new version of the same value when it exists)."""
        parent = f"orgs/{org}"
        public = await _forwarded(
            self._vault.GetPublicKey(
                vault_pb.GetPublicKeyRequest(parent=parent), metadata=scope.metadata, timeout=self._timeout
            )
        )
        sealed = seal_for_upload(public.public_key, self._workers.key(checkpoint).encode())
        await _forwarded(
            self._vault.PutSecret(
                vault_pb.PutSecretRequest(
                    parent=parent,
                    secret_id=inference.key_secret(checkpoint),
                    key_id=public.key_id,
                    ciphertext=sealed,
                ),
                metadata=scope.metadata,
                timeout=self._timeout,
            )
        )

    async def _worker_jobs(
        self, scope: Scope, org: str, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[job_pb2.Job], str]:
        """The organization's inference worker jobs that have not ended, from one page of its jobs."""
        reply = await _forwarded(
            self._scheduler.ListJobs(
                sched_pb.ListJobsRequest(
                    parent=f"orgs/{org}",
                    page_size=page_size,
                    page_token=page_token,
                    states=sorted(inference.ACTIVE),
                ),
                metadata=scope.metadata,
                timeout=self._timeout,
            )
        )
        return [j for j in reply.jobs if inference.served_checkpoint(j)], reply.next_page_token

    async def _worker_resource(self, job: job_pb2.Job) -> pb.InferenceWorker:
        """The InferenceWorker of `job`, asking a ready worker's `GET /health` for its idle clock."""
        health: dict[str, Any] | None = None
        base_url = inference.endpoint_of(job)
        if base_url:
            try:
                timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
                async with self.http.get(base_url + "/health", timeout=timeout) as response:
                    answer = await response.json(content_type=None)
                    health = answer if response.status == 200 and isinstance(answer, dict) else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                health = None  # listed without its idle clock
        return inference.worker_resource(job, health)

    async def ListInferenceWorkers(
        self, request: pb.ListInferenceWorkersRequest, context: Context
    ) -> pb.ListInferenceWorkersResponse:
        scope = self._scope(request.parent, R.ERROR_REASON_ORG_NOT_FOUND)
        jobs, token = await self._worker_jobs(
            scope, _org(request.parent), request.page_size, request.page_token
        )
        workers = await asyncio.gather(*(self._worker_resource(job) for job in jobs))
        return pb.ListInferenceWorkersResponse(workers=workers, next_page_token=token)

    async def StopInferenceWorker(
        self, request: pb.StopInferenceWorkerRequest, context: Context
    ) -> pb.StopInferenceWorkerResponse:
        scope = self._scope(request.model, R.ERROR_REASON_JOB_NOT_FOUND)
        checkpoint = await self._checkpoints(scope).resolve(request.model)
        org = _org(request.model)
        stopped: list[pb.InferenceWorker] = []
        token = ""
        while True:
            jobs, token = await self._worker_jobs(scope, org, 1000, token)
            for job in jobs:
                served = inference.served_checkpoint(job)
                if served is None or served[0] != checkpoint.name:
                    continue
                stopped.append(await self._worker_resource(job))
                await _forwarded(
                    self._scheduler.CancelJob(
                        sched_pb.CancelJobRequest(name=job.name),
                        metadata=scope.metadata,
                        timeout=self._timeout,
                    )
                )
            if not token:
                break
        if not stopped:
            raise NotFound(
                f"no inference worker serves {checkpoint.name}",
                reason=R.ERROR_REASON_INFERENCE_WORKER_NOT_FOUND,
            )
        self._workers.forget(checkpoint.name)
        return pb.StopInferenceWorkerResponse(workers=stopped)

    async def post_json(
        self, worker: inference.Endpoint, route: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """POST to a worker; (status, JSON answer). Unreachable is UNAVAILABLE with a retry delay."""
        try:
            async with self.http.post(worker.base_url + route, json=body, headers=worker.headers) as response:
                answer = await response.json(content_type=None)
                return response.status, answer if isinstance(answer, dict) else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise Unavailable(
                f"the inference worker did not answer: {type(exc).__name__}",
                reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE,
                retry_after_s=inference.STARTING_RETRY_S,
            ) from None

    def scope_of(self, principal: Principal, name: str, reason: int) -> Scope:
        """`_scope` for callers authenticated outside gRPC (the HTTP endpoint)."""
        self._limiter.take(_limit_key(principal))
        if not principal.org or principal.org != _org(name):
            raise NotFound(f"{name} not found", reason=reason)
        return self._tokens.scope(principal)

    async def get_model(self, principal: Principal, model: str) -> checkpoint_pb2.Checkpoint:
        """The checkpoint a model id names, for `GET /v1/models/{id}` (NOT_FOUND as `Infer` answers it)."""
        scope = self.scope_of(principal, model, R.ERROR_REASON_JOB_NOT_FOUND)
        return await self._checkpoints(scope).resolve(model)

    async def list_models(self, principal: Principal) -> list[checkpoint_pb2.Checkpoint]:
        """The checkpoints served now and every checkpoint of the organization's newest 100 jobs, for
        `GET /v1/models`."""
        scope = self.scope_of(principal, f"orgs/{principal.org}", R.ERROR_REASON_ORG_NOT_FOUND)
        jobs = await _forwarded(
            self._scheduler.ListJobs(
                sched_pb.ListJobsRequest(parent=f"orgs/{principal.org}"),
                metadata=scope.metadata,
                timeout=self._timeout,
            )
        )
        found = self._workers.served(principal.org)
        for job in jobs.jobs:
            try:
                found.extend(await self._checkpoints(scope).all(job.name))
            except NotFound:  # a job whose log is gone
                continue
            except Forwarded as error:
                if error.code != "NOT_FOUND":
                    raise
        unique = {c.name: c for c in found}
        return sorted(unique.values(), key=lambda c: c.name)


def shares_port() -> bool:
    """Replicas may share the gateway's ports (`TANDEM_GATEWAY_REUSE_PORT`; read by `mesh.server`)."""
    return GatewaySettings().reuse_port


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    config = GatewaySettings()
    admin_key, admin_file = load_admin_key(config.admin_key, deps.settings.state_dir)
    db = await open_database(deps.settings.store_url_for("gateway"), "gateway", MIGRATIONS)
    orgs = Orgs(db, admin_key)
    deps.auth.authenticators.append(orgs.authenticate)
    servicer = GatewayServicer(deps, orgs, config)
    gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    if admin_file is not None:
        log.info("admin credential", extra={"path": str(admin_file)})
    on_stop: list[Callable[[], Awaitable[None]]] = [servicer.close, db.close]
    public_tls = bool(config.tls_cert_file or config.tls_key_file)
    if public_tls and not (config.tls_cert_file and config.tls_key_file):
        raise ValueError("TANDEM_GATEWAY_TLS_CERT_FILE and TANDEM_GATEWAY_TLS_KEY_FILE go together")
    if config.http_port >= 0:
        seed = load_signing_key(deps.settings.mesh_key, deps.settings.state_dir).encode()
        http = await openai_http.start(
            servicer,
            orgs,
            deps.settings.host,
            config.http_port,
            dashboard.stream_key(seed),
            tls=(config.tls_cert_file, config.tls_key_file) if public_tls else None,
            reuse_port=config.reuse_port,
        )
        servicer.openai_base_url = http.base_url
        on_stop.insert(0, http.stop)
        announce = [
            f"OpenAI-compatible endpoint (base_url, with an API key): {http.base_url}",
            f"Dashboard: {http.base_url.removesuffix('/v1')}/",
        ]
    else:
        announce = [
            "OpenAI-compatible endpoint and dashboard: off (TANDEM_GATEWAY_HTTP_PORT=8080 turns them on)"
        ]
    return Registration(
        service_names=[SERVICE_NAME],
        public_methods=PUBLIC_METHODS,
        on_stop=on_stop,
        server_credentials=_public_credentials(config) if public_tls else None,
        announce=announce,
    )


def _public_credentials(config: GatewaySettings) -> grpc.ServerCredentials:
    """Server-side TLS for clients outside the mesh: no client certificate is asked for (API keys are)."""
    key, chain = Path(config.tls_key_file).read_bytes(), Path(config.tls_cert_file).read_bytes()
    return grpc.ssl_server_credentials([(key, chain)])
