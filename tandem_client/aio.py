"""`AsyncClient`: Tandem's public API (tandem.gateway.v1.GatewayService) for asyncio code.

    async with AsyncClient() as tandem:          # TANDEM_GATEWAY, TANDEM_API_KEY
        job = await tandem.create_job(rl_config_toml=Path("job.toml").read_text())
        async for event in tandem.watch_events(job.name):
            print(event.seq, event.type, event.message)

Every method is one gateway RPC with Python arguments; it returns the contract's own messages (typed by their
stubs). Unary calls always carry a deadline (`deadline_s`, per client or per call); failures raise
`mesh.status.RpcError` with `.code` and `.reason` (branch on those, never on the message). List methods
follow `next_page_token` to the end. Short ids are accepted where a resource name is expected: `run-1`
means `orgs/<your org>/jobs/run-1`, the organization being the one the API key belongs to.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message
from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2, metric_pb2
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc, org_pb2, server_info_pb2
from tandem.inference.v1 import generation_pb2
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.taskapp.v1 import task_app_pb2
from tandem.trainer.v1 import checkpoint_pb2, config_pb2
from tandem.vault.v1 import org_key_pb2, secret_pb2

from mesh.clients import open_channel
from mesh.secrets import seal_for_upload
from mesh.settings import Settings
from mesh.status import RpcError
from tandem_client.events import Cursor, OnReconnect, resume_events

GATEWAY_ENV = "TANDEM_GATEWAY"
API_KEY_ENV = "TANDEM_API_KEY"
TLS_ENV = "TANDEM_GATEWAY_TLS"  # "1": TLS with the system's roots
CA_FILE_ENV = "TANDEM_GATEWAY_CA_FILE"  # a PEM bundle the gateway's certificate chains to (implies TLS)
DEFAULT_GATEWAY = "127.0.0.1:50050"
DEFAULT_DEADLINE_S = 30.0
# Registering or checking a Task App runs its conformance checks (rollouts included) before answering.
CHECK_DEADLINE_S = 120.0
# Infer may wait for an inference worker to load the checkpoint on first use.
INFER_DEADLINE_S = 120.0
STALE_KEY_ID = "STALE_KEY_ID"
DEPENDENCY_UNAVAILABLE = "DEPENDENCY_UNAVAILABLE"

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


def _request_id(given: str | None) -> str:
    return given if given is not None else uuid.uuid4().hex


def tls_credentials(
    tls: bool | None = None, ca_file: str | Path | None = None
) -> grpc.ChannelCredentials | None:
    """The channel credentials for the gateway: None (plaintext, or the mesh's mTLS settings) unless TLS is
    asked for, by argument or by `TANDEM_GATEWAY_TLS` / `TANDEM_GATEWAY_CA_FILE`."""
    ca = ca_file or os.environ.get(CA_FILE_ENV, "")
    wanted = (
        tls if tls is not None else (os.environ.get(TLS_ENV, "").lower() in ("1", "true", "yes") or bool(ca))
    )
    if not wanted:
        return None
    try:
        roots = Path(ca).read_bytes() if ca else None
    except OSError as error:
        raise ValueError(f"cannot read the CA file {ca}: {error.strerror}") from None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


class AsyncClient:
    """A connection to one Tandem gateway, authenticated with one organization API key.

    `gateway` defaults to `TANDEM_GATEWAY`, then 127.0.0.1:50050; `api_key` to `TANDEM_API_KEY`. `org` is
    learnt from the key (GetOrg) on first need unless given. `tls` (default `TANDEM_GATEWAY_TLS`) speaks TLS
    to a gateway that serves it (`TANDEM_GATEWAY_TLS_CERT_FILE`, or an ingress in front), checked against
    the system's roots or `ca_file` (default `TANDEM_GATEWAY_CA_FILE`; giving one implies TLS). Use it as
    an async context manager, or call `close()`.
    """

    def __init__(
        self,
        gateway: str | None = None,
        api_key: str | None = None,
        *,
        org: str | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        settings: Settings | None = None,
        tls: bool | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        self.gateway = gateway or os.environ.get(GATEWAY_ENV) or DEFAULT_GATEWAY
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        self.deadline_s = deadline_s
        self._org = org.removeprefix("orgs/") if org else ""
        credentials = tls_credentials(tls, ca_file)
        self._channel = open_channel(self.gateway, settings or Settings(), token=key, credentials=credentials)
        self._stub = gateway_service_pb2_grpc.GatewayServiceStub(self._channel)  # the async stub, typed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        deadline_s: float | None,
        **kw: Any,
    ) -> Resp:
        return await method(request, timeout=deadline_s if deadline_s is not None else self.deadline_s, **kw)

    # ---- names ----------------------------------------------------------------------------------

    async def org(self) -> str:
        """The organization id the API key belongs to (asked once, then remembered)."""
        if not self._org:
            self._org = (await self.get_org()).name.removeprefix("orgs/")
        return self._org

    async def _parent(self) -> str:
        return f"orgs/{await self.org()}"

    async def _name(self, collection: str, value: str) -> str:
        """`run-1` -> `orgs/acme/jobs/run-1`; a full name passes unchanged."""
        if value.startswith("orgs/"):
            return value
        return f"{await self._parent()}/{collection}/{value}"

    async def job_name(self, job: str) -> str:
        return await self._name("jobs", job)

    async def _pages(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        field: str,
        deadline_s: float | None,
        limit: int | None = None,
    ) -> list[Any]:
        """Every item of a List RPC's `field`, following `next_page_token` (stopping once `limit` are in)."""
        items: list[Any] = []
        while True:
            reply: Any = await self._call(method, request, deadline_s)
            items.extend(getattr(reply, field))
            if not reply.next_page_token or (limit is not None and len(items) >= limit):
                return items[:limit] if limit is not None else items
            request.page_token = reply.next_page_token  # type: ignore[attr-defined]

    # ---- deployment and organizations -----------------------------------------------------------

    async def get_server_info(self, *, deadline_s: float | None = None) -> server_info_pb2.ServerInfo:
        """Version, topology and each service's health. Needs no API key."""
        reply = await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), deadline_s)
        return reply.server_info

    async def create_org(
        self,
        org_id: str,
        *,
        admin_credential: str,
        display_name: str = "",
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> pb.CreateOrgResponse:
        """Create an organization and its first API key (`.key`, shown only in this answer). Needs the
        deployment's admin credential, sent for this call instead of the client's API key."""
        request = pb.CreateOrgRequest(
            org_id=org_id, display_name=display_name, request_id=_request_id(request_id)
        )
        metadata = (("authorization", f"Bearer {admin_credential}"),)
        return await self._call(self._stub.CreateOrg, request, deadline_s, metadata=metadata)

    async def get_org(self, name: str = "", *, deadline_s: float | None = None) -> org_pb2.Org:
        """The caller's organization (or `name`, `orgs/{org}`)."""
        reply = await self._call(self._stub.GetOrg, pb.GetOrgRequest(name=name), deadline_s)
        return reply.org

    async def create_api_key(
        self,
        display_name: str = "",
        *,
        ttl_s: float | None = None,
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> pb.CreateApiKeyResponse:
        """A new API key of this organization; its plaintext is `.key`, returned only here."""
        request = pb.CreateApiKeyRequest(
            parent=await self._parent(), display_name=display_name, request_id=_request_id(request_id)
        )
        if ttl_s is not None:
            request.ttl.CopyFrom(_duration(ttl_s))
        return await self._call(self._stub.CreateApiKey, request, deadline_s)

    async def list_api_keys(
        self, *, show_inactive: bool = False, deadline_s: float | None = None
    ) -> list[org_pb2.ApiKey]:
        request = pb.ListApiKeysRequest(parent=await self._parent(), show_inactive=show_inactive)
        return await self._pages(self._stub.ListApiKeys, request, "api_keys", deadline_s)

    async def revoke_api_key(
        self, name: str, *, request_id: str | None = None, deadline_s: float | None = None
    ) -> org_pb2.ApiKey:
        request = pb.RevokeApiKeyRequest(
            name=await self._name("apiKeys", name), request_id=_request_id(request_id)
        )
        return (await self._call(self._stub.RevokeApiKey, request, deadline_s)).api_key

    # ---- secrets ------------------------------------------------------------------------------------

    async def get_public_key(self, *, deadline_s: float | None = None) -> org_key_pb2.OrgKey:
        reply = await self._call(
            self._stub.GetPublicKey, pb.GetPublicKeyRequest(parent=await self._parent()), deadline_s
        )
        return reply.key

    async def put_secret(
        self,
        secret_id: str,
        value: bytes | str,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> pb.PutSecretResponse:
        """Seal `value` to the organization's public key here, then upload the ciphertext: the value never
        leaves this process in plaintext. Re-seals once if the key rotated in between (STALE_KEY_ID)."""
        plaintext = value.encode() if isinstance(value, str) else value
        rid = _request_id(request_id)
        for attempt in range(2):
            key = await self.get_public_key(deadline_s=deadline_s)
            request = pb.PutSecretRequest(
                parent=await self._parent(),
                secret_id=secret_id,
                key_id=key.key_id,
                ciphertext=seal_for_upload(key.public_key, plaintext),
                request_id=rid if attempt == 0 else uuid.uuid4().hex,
            )
            try:
                return await self._call(self._stub.PutSecret, request, deadline_s)
            except RpcError as error:
                if error.reason != STALE_KEY_ID or attempt:
                    raise
        raise AssertionError("unreachable")

    async def list_secrets(self, *, deadline_s: float | None = None) -> list[secret_pb2.Secret]:
        """Metadata and fingerprints of every secret; never values."""
        request = pb.ListSecretsRequest(parent=await self._parent())
        return await self._pages(self._stub.ListSecrets, request, "secrets", deadline_s)

    async def delete_secret(
        self, secret: str, *, request_id: str | None = None, deadline_s: float | None = None
    ) -> None:
        request = pb.DeleteSecretRequest(
            name=await self._name("secrets", secret), request_id=_request_id(request_id)
        )
        await self._call(self._stub.DeleteSecret, request, deadline_s)

    # ---- Task Apps ----------------------------------------------------------------------------------

    async def register_task_app(
        self,
        task_app_id: str,
        base_url: str,
        *,
        secret: str = "",
        display_name: str = "",
        validate_only: bool = False,
        request_id: str | None = None,
        deadline_s: float = CHECK_DEADLINE_S,
    ) -> pb.RegisterTaskAppResponse:
        """Register the app at `base_url` after its checks pass; `secret` (an id or a full name) holds the
        environment key the proxy authenticates with. Refused with FAILED_PRECONDITION /
        TASK_APP_CHECK_FAILED when a check fails."""
        app = task_app_pb2.TaskApp(
            base_url=base_url,
            secret_name=await self._name("secrets", secret) if secret else "",
            display_name=display_name,
        )
        request = pb.RegisterTaskAppRequest(
            parent=await self._parent(),
            task_app_id=task_app_id,
            task_app=app,
            validate_only=validate_only,
            request_id=_request_id(request_id),
        )
        return await self._call(self._stub.RegisterTaskApp, request, deadline_s)

    async def check_task_app(
        self, task_app: str, *, deadline_s: float = CHECK_DEADLINE_S
    ) -> pb.CheckTaskAppResponse:
        request = pb.CheckTaskAppRequest(name=await self._name("taskApps", task_app))
        return await self._call(self._stub.CheckTaskApp, request, deadline_s)

    async def list_task_apps(self, *, deadline_s: float | None = None) -> list[task_app_pb2.TaskApp]:
        request = pb.ListTaskAppsRequest(parent=await self._parent())
        return await self._pages(self._stub.ListTaskApps, request, "task_apps", deadline_s)

    async def get_task_app(self, task_app: str, *, deadline_s: float | None = None) -> task_app_pb2.TaskApp:
        request = pb.GetTaskAppRequest(name=await self._name("taskApps", task_app))
        return (await self._call(self._stub.GetTaskApp, request, deadline_s)).task_app

    async def delete_task_app(
        self, task_app: str, *, request_id: str | None = None, deadline_s: float | None = None
    ) -> None:
        request = pb.DeleteTaskAppRequest(
            name=await self._name("taskApps", task_app), request_id=_request_id(request_id)
        )
        await self._call(self._stub.DeleteTaskApp, request, deadline_s)

    # ---- jobs ---------------------------------------------------------------------------------------

    async def create_job(
        self,
        *,
        rl_config_toml: str | None = None,
        spec: job_spec_pb2.JobSpec | None = None,
        job_id: str = "",
        validate_only: bool = False,
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> job_pb2.Job:
        """Submit a job: an online-RL TOML config (the gateway wraps it in a one-task job group) or a job
        group spec, exactly one of them. Returns the job once it is stored as PENDING."""
        if (rl_config_toml is None) == (spec is None):
            raise ValueError("pass exactly one of rl_config_toml and spec")
        request = pb.CreateJobRequest(
            parent=await self._parent(),
            job_id=job_id,
            validate_only=validate_only,
            request_id=_request_id(request_id),
        )
        if spec is not None:
            request.spec.CopyFrom(spec)
        else:
            request.rl_config_toml = rl_config_toml or ""
        return (await self._call(self._stub.CreateJob, request, deadline_s)).job

    async def create_rl_job(
        self,
        config: config_pb2.TrainerConfig,
        *,
        job_id: str = "",
        display_name: str = "",
        priority: int = 0,
        max_duration_s: float | None = None,
        validate_only: bool = False,
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> job_pb2.Job:
        """Submit an online-RL job from a typed TrainerConfig."""
        request = pb.CreateRlJobRequest(
            parent=await self._parent(),
            job_id=job_id,
            config=config,
            display_name=display_name,
            priority=priority,
            validate_only=validate_only,
            request_id=_request_id(request_id),
        )
        if max_duration_s is not None:
            request.max_duration.CopyFrom(_duration(max_duration_s))
        return (await self._call(self._stub.CreateRlJob, request, deadline_s)).job

    async def get_job(self, job: str, *, deadline_s: float | None = None) -> job_pb2.Job:
        request = pb.GetJobRequest(name=await self.job_name(job))
        return (await self._call(self._stub.GetJob, request, deadline_s)).job

    async def list_jobs(
        self,
        *,
        states: Iterable[job_pb2.Job.State.ValueType] = (),
        limit: int | None = None,
        deadline_s: float | None = None,
    ) -> list[job_pb2.Job]:
        """The organization's jobs, newest first (`states`: tandem.scheduler.v1.Job.State values)."""
        request = pb.ListJobsRequest(
            parent=await self._parent(),
            states=list(states),
        )
        return await self._pages(self._stub.ListJobs, request, "jobs", deadline_s, limit)

    async def cancel_job(
        self, job: str, *, reason: str = "", request_id: str | None = None, deadline_s: float | None = None
    ) -> job_pb2.Job:
        request = pb.CancelJobRequest(
            name=await self.job_name(job), reason=reason, request_id=_request_id(request_id)
        )
        return (await self._call(self._stub.CancelJob, request, deadline_s)).job

    async def stream_job_logs(
        self,
        job: str,
        *,
        task: str = "",
        rank: int = 0,
        offset: int = 0,
        tail_bytes: int = 0,
        follow: bool = False,
    ) -> AsyncIterator[pb.StreamJobLogsResponse]:
        """One task node's log in pieces; resume from a piece's `next_offset`. No deadline when following."""
        request = pb.StreamJobLogsRequest(
            job=await self.job_name(job),
            task=task,
            rank=rank,
            offset=offset,
            tail_bytes=tail_bytes,
            follow=follow,
        )
        async for reply in self._stub.StreamJobLogs(request, timeout=None if follow else self.deadline_s):
            yield reply

    # ---- events, metrics, checkpoints ---------------------------------------------------------------

    async def watch_events(
        self,
        job: str,
        *,
        after_seq: int = 0,
        types: Sequence[str] = (),
        min_level: types_pb2.Level.ValueType = types_pb2.LEVEL_UNSPECIFIED,
        end_when_terminal: bool = True,
        heartbeat_s: float | None = None,
        reconnect_for_s: float = 300.0,
        on_reconnect: OnReconnect | None = None,
        cursor: Cursor | None = None,
    ) -> AsyncIterator[event_pb2.Event]:
        """Each of the job's events after `after_seq`, once, in seq order: the retained history, then live.
        A dropped connection (the gateway restarting, a proxy cutting the stream) is resumed from the last
        seq seen, for up to `reconnect_for_s` seconds without progress; `on_reconnect(error, seq)` hears of
        each. Ends when the job is terminal (unless `end_when_terminal` is false). Pass a `Cursor` to read
        the position afterwards (`cursor.seq`, the `--after-seq` to resume a later watch from)."""
        name = await self.job_name(job)
        position = cursor if cursor is not None else Cursor()
        position.seq = max(position.seq, after_seq)

        def open_stream(seq: int) -> AsyncIterable[pb.SubscribeEventsResponse]:
            request = pb.SubscribeEventsRequest(
                job=name,
                after_seq=seq,
                types=list(types),
                min_level=min_level,
                end_when_terminal=end_when_terminal,
            )
            if heartbeat_s is not None:
                request.heartbeat_interval.CopyFrom(_duration(heartbeat_s))
            return self._stub.SubscribeEvents(request, timeout=None)  # a stream has no deadline

        async def log_pending() -> bool:
            try:
                await self.get_job(name)
            except RpcError as error:
                if error.code == grpc.StatusCode.NOT_FOUND:
                    return False
                raise
            return True

        async for event in resume_events(
            open_stream,
            position,
            reconnect_for_s=reconnect_for_s,
            on_reconnect=on_reconnect,
            log_pending=log_pending,
        ):
            yield event

    async def list_events(
        self,
        job: str,
        *,
        after_seq: int = 0,
        before_seq: int = 0,
        types: Sequence[str] = (),
        descending: bool = False,
        limit: int | None = None,
        deadline_s: float | None = None,
    ) -> list[event_pb2.Event]:
        request = pb.ListEventsRequest(
            job=await self.job_name(job),
            after_seq=after_seq,
            before_seq=before_seq,
            types=list(types),
            descending=descending,
        )
        return await self._pages(self._stub.ListEvents, request, "events", deadline_s, limit)

    async def list_metrics(
        self,
        job: str,
        *,
        names: Sequence[str] = (),
        start_step: int = 0,
        end_step: int | None = None,
        max_points: int = 0,
        deadline_s: float | None = None,
    ) -> dict[str, list[metric_pb2.MetricSeries.Point]]:
        """Each metric series of the job (`reward/mean`, `loss`, ...) as its points in step order."""
        request = pb.ListMetricsRequest(
            job=await self.job_name(job), names=list(names), start_step=start_step, max_points=max_points
        )
        if end_step is not None:
            request.end_step = end_step
        series: dict[str, list[metric_pb2.MetricSeries.Point]] = {}
        for page in await self._pages(self._stub.ListMetrics, request, "series", deadline_s):
            series.setdefault(page.name, []).extend(page.points)
        return series

    async def list_checkpoints(
        self, job: str, *, limit: int | None = None, deadline_s: float | None = None
    ) -> list[checkpoint_pb2.Checkpoint]:
        """The job's checkpoints, newest step first (also after its trainer has exited)."""
        request = pb.ListCheckpointsRequest(parent=await self.job_name(job))
        return await self._pages(self._stub.ListCheckpoints, request, "checkpoints", deadline_s, limit)

    async def infer(
        self,
        model: str,
        prompt: str | None = None,
        *,
        messages: Sequence[tuple[str, str]] | None = None,
        temperature: float | None = None,
        max_tokens: int = 0,
        seed: int | None = None,
        wait_s: float = 0.0,
        on_wait: Callable[[RpcError], None] | None = None,
        deadline_s: float = INFER_DEADLINE_S,
    ) -> pb.InferResponse:
        """One completion from a checkpoint: `model` is a checkpoint name, or a job (id or name), meaning
        its newest checkpoint (`.../checkpoints/latest`). Give a plain `prompt` or chat `messages` as
        (role, content) pairs. The gateway starts an inference worker for a checkpoint on first use and
        answers UNAVAILABLE / DEPENDENCY_UNAVAILABLE with a retry delay until it is loaded: with `wait_s`,
        this waits that long at most, asking again when told (`on_wait(error)` hears of each wait)."""
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt and messages")
        name = await self.job_name(model)
        if "/checkpoints/" not in name:
            name = f"{name}/checkpoints/latest"
        sampling = generation_pb2.SamplingParams(max_tokens=max_tokens)
        if temperature is not None:
            sampling.temperature = temperature
        if seed is not None:
            sampling.seed = seed
        request = pb.InferRequest(model=name, sampling=sampling)
        if prompt is not None:
            request.prompt = prompt
        else:
            request.messages.extend(
                generation_pb2.ChatMessage(role=role, content=content) for role, content in messages or ()
            )
        give_up = time.monotonic() + wait_s
        while True:
            try:
                return await self._call(self._stub.Infer, request, deadline_s)
            except RpcError as error:
                delay = error.retry_after_s
                if (
                    error.reason != DEPENDENCY_UNAVAILABLE
                    or delay is None
                    or time.monotonic() + delay > give_up
                ):
                    raise
                if on_wait is not None:
                    on_wait(error)
                await asyncio.sleep(delay)

    async def list_inference_workers(self, *, deadline_s: float | None = None) -> list[pb.InferenceWorker]:
        """The organization's running inference workers: the checkpoint each serves, its state, and how
        long it may stay idle before it exits."""
        request = pb.ListInferenceWorkersRequest(parent=await self._parent())
        return await self._pages(self._stub.ListInferenceWorkers, request, "workers", deadline_s)

    async def stop_inference_worker(
        self, model: str, *, deadline_s: float | None = None
    ) -> list[pb.InferenceWorker]:
        """Stop the worker serving a checkpoint now (`model` as for `infer`: a checkpoint name, or a job
        meaning its newest checkpoint); NOT_FOUND / INFERENCE_WORKER_NOT_FOUND when none serves it."""
        name = await self.job_name(model)
        if "/checkpoints/" not in name:
            name = f"{name}/checkpoints/latest"
        request = pb.StopInferenceWorkerRequest(model=name)
        return list((await self._call(self._stub.StopInferenceWorker, request, deadline_s)).workers)


def checkpoint_name(job: str, checkpoint: str) -> str:
    """`orgs/o/jobs/j` + `step-000080` -> `orgs/o/jobs/j/checkpoints/step-000080` (a full name passes)."""
    return checkpoint if checkpoint.startswith("orgs/") else f"{job}/checkpoints/{checkpoint}"


__all__ = ["API_KEY_ENV", "GATEWAY_ENV", "AsyncClient", "Cursor", "RpcError", "checkpoint_name"]
