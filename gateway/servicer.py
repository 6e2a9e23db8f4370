"""gRPC adapter of the gateway, Tandem's public API.

Implemented so far: `GetServerInfo` (public). The other methods answer UNIMPLEMENTED with reason
NOT_IMPLEMENTED until the gateway issue fills them in.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import grpc
from google.protobuf import duration_pb2, timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.gateway.v1 import gateway_service_pb2, gateway_service_pb2_grpc, server_info_pb2

from mesh.server import Deps, Registration
from mesh.status import RpcError

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


class GatewayServicer(gateway_service_pb2_grpc.GatewayServiceServicer):
    """The public surface; every call is scoped to the caller's organization."""

    def __init__(self, deps: Deps) -> None:
        self._deps = deps
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
        )
        info.server_time.CopyFrom(timestamp_pb2.Timestamp(seconds=int(time.time())))
        info.start_time.CopyFrom(timestamp_pb2.Timestamp(seconds=int(self._started)))
        return gateway_service_pb2.GetServerInfoResponse(server_info=info)


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(deps), server)  # type: ignore[abstract]  # methods not written yet answer UNIMPLEMENTED
    return Registration(service_names=[SERVICE_NAME], public_methods=PUBLIC_METHODS)
