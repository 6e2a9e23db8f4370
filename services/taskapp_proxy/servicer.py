"""gRPC adapter of the taskapp_proxy service: proto in, domain call, proto out.

Methods not overridden here answer UNIMPLEMENTED with reason NOT_IMPLEMENTED (the generated base class
raises NotImplementedError and the request interceptor maps it).
"""

from __future__ import annotations

import grpc
from tandem.taskapp.v1 import taskapp_service_pb2, taskapp_service_pb2_grpc

from mesh.server import Deps, Registration

SERVICE_NAME = taskapp_service_pb2.DESCRIPTOR.services_by_name["TaskAppService"].full_name


class TaskAppServiceServicer(taskapp_service_pb2_grpc.TaskAppServiceServicer):
    """Task App proxy: registered Task Apps and authenticated rollout calls to them."""

    def __init__(self, deps: Deps) -> None:
        self._deps = deps


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    taskapp_service_pb2_grpc.add_TaskAppServiceServicer_to_server(TaskAppServiceServicer(deps), server)  # type: ignore[abstract]  # methods not written yet answer UNIMPLEMENTED
    return Registration(service_names=[SERVICE_NAME])
