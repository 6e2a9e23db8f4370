"""gRPC adapter of the vault service: proto in, domain call, proto out.

Methods not overridden here answer UNIMPLEMENTED with reason NOT_IMPLEMENTED (the generated base class
raises NotImplementedError and the request interceptor maps it).
"""

from __future__ import annotations

import grpc
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from mesh.server import Deps, Registration

SERVICE_NAME = vault_service_pb2.DESCRIPTOR.services_by_name["VaultService"].full_name


class VaultServiceServicer(vault_service_pb2_grpc.VaultServiceServicer):
    """Secret vault: organization-scoped, sealed-box credentials injected only at run time."""

    def __init__(self, deps: Deps) -> None:
        self._deps = deps


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    vault_service_pb2_grpc.add_VaultServiceServicer_to_server(VaultServiceServicer(deps), server)  # type: ignore[abstract]  # methods not written yet answer UNIMPLEMENTED
    return Registration(service_names=[SERVICE_NAME])
