"""gRPC adapter of the events service: proto in, domain call, proto out.

Methods not overridden here answer UNIMPLEMENTED with reason NOT_IMPLEMENTED (the generated base class
raises NotImplementedError and the request interceptor maps it).
"""

from __future__ import annotations

import grpc
from tandem.events.v1 import events_service_pb2, events_service_pb2_grpc

from mesh.server import Deps, Registration

SERVICE_NAME = events_service_pb2.DESCRIPTOR.services_by_name["EventService"].full_name


class EventServiceServicer(events_service_pb2_grpc.EventServiceServicer):
    """Event stream: durable, ordered, resumable job events and metric series."""

    def __init__(self, deps: Deps) -> None:
        self._deps = deps


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    events_service_pb2_grpc.add_EventServiceServicer_to_server(EventServiceServicer(deps), server)  # type: ignore[abstract]  # methods not written yet answer UNIMPLEMENTED
    return Registration(service_names=[SERVICE_NAME])
