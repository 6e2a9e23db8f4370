"""gRPC adapter of the scheduler service: proto in, domain call, proto out.

Methods not overridden here answer UNIMPLEMENTED with reason NOT_IMPLEMENTED (the generated base class
raises NotImplementedError and the request interceptor maps it).
"""

from __future__ import annotations

import grpc
from tandem.scheduler.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc

from mesh.server import Deps, Registration

SERVICE_NAME = scheduler_service_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


class SchedulerServiceServicer(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    """Scheduler: job groups, priorities, placement and recovery over local processes, Slurm, Kubernetes."""

    def __init__(self, deps: Deps) -> None:
        self._deps = deps


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServiceServicer(deps), server)  # type: ignore[abstract]  # methods not written yet answer UNIMPLEMENTED
    return Registration(service_names=[SERVICE_NAME])
