"""The mesh runtime against real in-process servers: health, reflection, the error model, authentication,
validation, size limits, request ids, deadlines, trace propagation and graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tandem.gateway.v1 import gateway_service_pb2, gateway_service_pb2_grpc, server_info_pb2
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from mesh.clients import ClientFactory, open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.server import Deps, Registration, start_service
from mesh.settings import Settings
from mesh.status import RpcError, rpc_error_from
from tests.support.mesh import Mesh, mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(60)

SERVICES = {
    "gateway": "tandem.gateway.v1.GatewayService",
    "vault": "tandem.vault.v1.VaultService",
    "scheduler": "tandem.scheduler.v1.SchedulerService",
    "taskapp_proxy": "tandem.taskapp.v1.TaskAppService",
    "events": "tandem.events.v1.EventService",
}
LIMIT = 64 * 1024


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with running_mesh(mesh_settings(tmp_path, max_message_bytes=LIMIT)) as running:
        yield running


def signer_of(mesh: Mesh) -> TokenSigner:
    return TokenSigner(load_signing_key("", mesh.settings.state_dir))


@contextlib.asynccontextmanager
async def vault_stub(mesh: Mesh, token: str = "") -> AsyncIterator[vault_service_pb2_grpc.VaultServiceStub]:
    async with open_channel(mesh.address("vault"), mesh.settings, token=token) as channel:
        yield vault_service_pb2_grpc.VaultServiceStub(channel)


async def call_put(mesh: Mesh, token: str, request: vault_service_pb2.PutSecretRequest) -> None:
    async with vault_stub(mesh, token) as stub:
        await stub.PutSecret(request)


def valid_put() -> vault_service_pb2.PutSecretRequest:
    return vault_service_pb2.PutSecretRequest(
        parent="orgs/acme", secret_id="env-key", key_id="k1", ciphertext=b"x" * 80
    )


async def test_every_service_is_serving_and_reflected(mesh: Mesh) -> None:
    for name, full_name in SERVICES.items():
        async with grpc.aio.insecure_channel(mesh.address(name)) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", full_name):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            listed = [s.name async for r in responses for s in r.list_services_response.service]
            assert full_name in listed
            assert "grpc.health.v1.Health" in listed


async def test_server_info_is_public_and_reports_every_service(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        reply = await stub.GetServerInfo(gateway_service_pb2.GetServerInfoRequest(), timeout=5)
    info = reply.server_info
    assert info.all_serving
    assert info.topology == server_info_pb2.ServerInfo.TOPOLOGY_SINGLE_PROCESS
    assert [s.component for s in info.services] == [
        "gateway",
        "vault",
        "scheduler",
        "taskapp-proxy",
        "events",
    ]
    assert [s.address for s in info.services][1:] == [
        mesh.address(n) for n in ("vault", "scheduler", "taskapp_proxy", "events")
    ]
    assert "tandem.gateway.v1" in info.api_packages


async def test_server_info_reports_an_unreachable_service(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    settings.targets.vault = "127.0.0.1:1"  # nothing listens there
    async with (
        running_mesh(settings, services=["gateway"]) as mesh,
        grpc.aio.insecure_channel(mesh.address("gateway")) as ch,
    ):
        reply = await gateway_service_pb2_grpc.GatewayServiceStub(ch).GetServerInfo(
            gateway_service_pb2.GetServerInfoRequest(), timeout=10
        )
    vault = reply.server_info.services[1]
    assert vault.component == "vault"
    assert vault.serving_status == server_info_pb2.ServiceStatus.SERVING_STATUS_UNREACHABLE
    assert vault.detail
    assert not reply.server_info.all_serving
    assert reply.server_info.topology == server_info_pb2.ServerInfo.TOPOLOGY_DISTRIBUTED


async def test_unknown_method_is_unimplemented(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address("vault")) as channel:
        call = channel.unary_unary("/tandem.vault.v1.VaultService/NoSuchMethod")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(b"", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_method_not_written_yet_answers_unimplemented_with_reason(tmp_path: Path) -> None:
    async def bare(server: grpc.aio.Server, deps: Deps) -> Registration:
        # The generated base class: every method is "not written yet".
        servicer = gateway_service_pb2_grpc.GatewayServiceServicer()
        gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        return Registration(service_names=["tandem.gateway.v1.GatewayService"])

    settings = mesh_settings(tmp_path)
    service = await start_service("gateway", settings, bare)
    token = TokenSigner(load_signing_key("", tmp_path)).issue("service", "test")
    try:
        async with open_channel(service.address, settings, token=token) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            with pytest.raises(RpcError) as info:
                await stub.GetOrg(gateway_service_pb2.GetOrgRequest(name="orgs/acme"))
    finally:
        await service.stop(0)
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert info.value.reason == "NOT_IMPLEMENTED"


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "MISSING_CREDENTIALS"),
        ("Bearer not-a-token", "INVALID_CREDENTIALS"),
        ("Basic dXNlcjpwYXNz", "INVALID_CREDENTIALS"),
        ("Bearer tdm1.e30.AAAA", "INVALID_CREDENTIALS"),
    ],
)
async def test_bad_credentials_are_unauthenticated(mesh: Mesh, header: str | None, reason: str) -> None:
    metadata = (("authorization", header),) if header else ()
    async with grpc.aio.insecure_channel(mesh.address("vault")) as channel:
        stub = vault_service_pb2_grpc.VaultServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PutSecret(valid_put(), metadata=metadata, timeout=5)
    error = rpc_error_from(info.value)
    assert error.code == grpc.StatusCode.UNAUTHENTICATED
    assert error.reason == reason
    if header:
        assert header.split(" ", 1)[1] not in error.message


async def test_token_from_another_mesh_key_is_rejected(mesh: Mesh, tmp_path: Path) -> None:
    foreign = TokenSigner(load_signing_key("", tmp_path / "elsewhere")).issue("service", "intruder")
    with pytest.raises(RpcError) as info:
        await call_put(mesh, foreign, valid_put())
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "INVALID_CREDENTIALS")


async def test_expired_token_is_rejected(mesh: Mesh) -> None:
    stale = signer_of(mesh).issue("service", "test", ttl_s=10, now=time.time() - 3600)
    with pytest.raises(RpcError) as info:
        await call_put(mesh, stale, valid_put())
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "CREDENTIALS_EXPIRED")


async def test_malformed_message_is_invalid_argument(mesh: Mesh) -> None:
    token = signer_of(mesh).issue("service", "test")
    async with grpc.aio.insecure_channel(mesh.address("vault")) as channel:
        call = channel.unary_unary("/tandem.vault.v1.VaultService/PutSecret")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(b"\xff\xff\xff\xff\x0f", metadata=(("authorization", f"Bearer {token}"),), timeout=5)
    error = rpc_error_from(info.value)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")


async def test_unauthenticated_caller_learns_nothing_about_the_request(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address("vault")) as channel:
        call = channel.unary_unary("/tandem.vault.v1.VaultService/PutSecret")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(b"\xff\xff\xff\xff\x0f", timeout=5)
    assert rpc_error_from(info.value).reason == "MISSING_CREDENTIALS"


async def test_oversized_message_gets_a_reason(mesh: Mesh) -> None:
    token = signer_of(mesh).issue("service", "test")
    big = vault_service_pb2.PutSecretRequest(
        parent="orgs/acme", secret_id="big", key_id="k1", ciphertext=b"x" * (LIMIT + 1)
    )
    with pytest.raises(RpcError) as info:
        await call_put(mesh, token, big)
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "MESSAGE_TOO_LARGE")
    assert info.value.metadata["limit_bytes"] == str(LIMIT)


async def test_far_oversized_message_is_refused_by_the_transport(mesh: Mesh) -> None:
    token = signer_of(mesh).issue("service", "test")
    huge = vault_service_pb2.PutSecretRequest(
        parent="orgs/acme", secret_id="big", key_id="k1", ciphertext=b"x" * (LIMIT * 3)
    )
    with pytest.raises(RpcError) as info:
        await call_put(mesh, token, huge)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_contract_rules_are_enforced_with_field_names(mesh: Mesh) -> None:
    token = signer_of(mesh).issue("service", "test")
    bad = vault_service_pb2.PutSecretRequest(
        parent="orgs/ACME!", secret_id="", key_id="k1", ciphertext=b"x" * 80
    )
    with pytest.raises(RpcError) as info:
        await call_put(mesh, token, bad)
    error = info.value
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    fields = {v.field for v in error.violations}
    assert {"parent", "secret_id"} <= fields


async def test_request_id_is_echoed_and_attached_to_errors(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address("vault")) as channel:
        stub = vault_service_pb2_grpc.VaultServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PutSecret(valid_put(), metadata=(("x-request-id", "req-123"),), timeout=5)
    assert ("x-request-id", "req-123") in tuple(info.value.trailing_metadata())
    assert rpc_error_from(info.value).request_id == "req-123"


async def _slow_setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    class Slow(vault_service_pb2_grpc.VaultServiceServicer):
        async def GetPublicKey(
            self, request: object, context: object
        ) -> vault_service_pb2.GetPublicKeyResponse:
            await asyncio.sleep(0.5)
            return vault_service_pb2.GetPublicKeyResponse()

    vault_service_pb2_grpc.add_VaultServiceServicer_to_server(Slow(), server)
    return Registration(service_names=["tandem.vault.v1.VaultService"])


async def test_client_factory_always_sets_a_deadline(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path, default_deadline_s=0.1)
    server = await start_service("vault", settings, setup=_slow_setup)
    settings.ports.vault = server.port
    clients = ClientFactory(settings, TokenSigner(load_signing_key("", tmp_path)), "test")
    try:
        stub = clients.stub(vault_service_pb2_grpc.VaultServiceStub, "vault")
        with pytest.raises(RpcError) as info:
            await stub.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent="orgs/acme"))
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        reply = await stub.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent="orgs/acme"), timeout=5)
        assert isinstance(reply, vault_service_pb2.GetPublicKeyResponse)
    finally:
        await clients.close()
        await server.stop(0)


async def test_drain_lets_in_flight_calls_finish_and_refuses_new_ones(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    server = await start_service("vault", settings, setup=_slow_setup)
    settings.ports.vault = server.port
    clients = ClientFactory(settings, TokenSigner(load_signing_key("", tmp_path)), "test")
    try:
        stub = clients.stub(vault_service_pb2_grpc.VaultServiceStub, "vault")
        request = vault_service_pb2.GetPublicKeyRequest(parent="orgs/acme")
        in_flight = asyncio.ensure_future(stub.GetPublicKey(request, timeout=5))
        await asyncio.sleep(0.1)
        stopping = asyncio.ensure_future(server.stop(grace=3))
        assert isinstance(await in_flight, vault_service_pb2.GetPublicKeyResponse)
        await stopping
        with pytest.raises(RpcError) as info:
            await stub.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent="orgs/acme"), timeout=1)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        await clients.close()


async def test_trace_context_crosses_the_call(mesh: Mesh) -> None:
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("caller") as parent:
        channel = open_channel(mesh.address("gateway"), mesh.settings)
        await gateway_service_pb2_grpc.GatewayServiceStub(channel).GetServerInfo(
            gateway_service_pb2.GetServerInfoRequest()
        )
        await channel.close()
    trace_id = parent.get_span_context().trace_id
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    names = {s.name for s in spans}
    assert "/tandem.gateway.v1.GatewayService/GetServerInfo" in names
    # The gateway's own health probes of the internal services join the same trace.
    assert any(s.name == "/grpc.health.v1.Health/Check" for s in spans)
    server_spans = [s for s in spans if s.kind == trace.SpanKind.SERVER]
    assert server_spans and all(s.parent is not None for s in server_spans)


def test_settings_reject_unknown_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="extra"):
        Settings(state_dir=tmp_path, no_such_setting=1)  # type: ignore[call-arg]
