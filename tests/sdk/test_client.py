"""The SDK against a real in-process mesh behind the real gateway: both client forms, organization API
keys, sealed secret uploads, typed errors, and watching a job's events through the gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from tandem.events.v1 import event_pb2, events_service_pb2_grpc
from tandem.events.v1 import events_service_pb2 as events_pb
from tandem.scheduler.v1 import job_pb2

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.status import RpcError
from tandem_client import AsyncClient, Client, Cursor
from tests.support.mesh import Mesh, mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with running_mesh(mesh_settings(tmp_path)) as running:
        yield running


def admin_key(mesh: Mesh) -> str:
    return (mesh.settings.state_dir / "admin.key").read_text().strip()


async def new_org(mesh: Mesh, org: str = "acme") -> str:
    """A fresh organization; returns its first API key."""
    async with AsyncClient(mesh.address("gateway"), api_key="") as anonymous:
        created = await anonymous.create_org(org, admin_credential=admin_key(mesh), display_name="Acme")
    assert created.org.name == f"orgs/{org}"
    assert created.key.startswith("tdm_")
    return created.key


async def test_server_info_needs_no_key_in_either_form(mesh: Mesh) -> None:
    async with AsyncClient(mesh.address("gateway"), api_key="") as client:
        info = await client.get_server_info()
    assert "tandem.gateway.v1" in info.api_packages
    assert info.services[0].component == "gateway"

    def blocking() -> str:
        with Client(mesh.address("gateway"), api_key="") as client:
            return client.get_server_info().version

    assert await asyncio.to_thread(blocking) == info.version


async def test_the_gateway_and_key_come_from_the_environment(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = await new_org(mesh)
    monkeypatch.setenv("TANDEM_GATEWAY", mesh.address("gateway"))
    monkeypatch.setenv("TANDEM_API_KEY", key)
    async with AsyncClient() as client:
        assert client.gateway == mesh.address("gateway")
        assert (await client.get_org()).name == "orgs/acme"
        assert await client.org() == "acme"


async def test_errors_are_typed(mesh: Mesh) -> None:
    async with AsyncClient(mesh.address("gateway"), api_key="") as anonymous:
        with pytest.raises(RpcError) as missing:
            await anonymous.get_org()
    assert (missing.value.code, missing.value.reason) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "MISSING_CREDENTIALS",
    )
    async with AsyncClient(mesh.address("gateway"), api_key="tdm_000000000000_nope") as wrong:
        with pytest.raises(RpcError) as invalid:
            await wrong.get_org()
    assert invalid.value.reason == "INVALID_CREDENTIALS"
    async with AsyncClient(mesh.address("gateway"), api_key=await new_org(mesh)) as client:
        with pytest.raises(RpcError) as absent:
            await client.get_job("no-such-job")
        assert (absent.value.code, absent.value.reason) == (grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND")
        with pytest.raises(RpcError) as bad:
            await client.put_secret("Not A Valid Id", b"value")
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert any(v.field == "secret_id" for v in bad.value.violations)
    async with AsyncClient("127.0.0.1:1", api_key="x", deadline_s=2) as nowhere:
        with pytest.raises(RpcError) as down:
            await nowhere.get_server_info()
    assert down.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_secrets_are_sealed_here_and_listed_without_values(mesh: Mesh) -> None:
    async with AsyncClient(mesh.address("gateway"), api_key=await new_org(mesh)) as client:
        first = await client.put_secret("env-key", b"s3cret-value")
        again = await client.put_secret("env-key", "another value")
        secrets = await client.list_secrets()
    assert first.created and not again.created
    assert (first.version.version, again.version.version) == (1, 2)
    assert [s.name for s in secrets] == ["orgs/acme/secrets/env-key"]
    assert secrets[0].version_count == 2
    assert b"s3cret" not in secrets[0].SerializeToString()


async def test_api_keys_can_be_created_listed_and_revoked(mesh: Mesh) -> None:
    async with AsyncClient(mesh.address("gateway"), api_key=await new_org(mesh)) as client:
        created = await client.create_api_key("ci")
        names = [k.name for k in await client.list_api_keys()]
        assert created.api_key.name in names
        async with AsyncClient(mesh.address("gateway"), api_key=created.key) as ci:
            assert await ci.org() == "acme"
            await client.revoke_api_key(created.api_key.name)
            with pytest.raises(RpcError) as revoked:
                await ci.get_org()
        assert revoked.value.reason == "INVALID_CREDENTIALS"


async def test_the_blocking_client_watches_events_through_the_gateway(mesh: Mesh) -> None:
    key = await new_org(mesh)
    job = "orgs/acme/jobs/watched"
    token = TokenSigner(load_signing_key("", mesh.settings.state_dir)).issue("service", "scheduler")
    async with open_channel(mesh.address("events"), mesh.settings, token=token) as channel:
        events = events_service_pb2_grpc.EventServiceStub(channel)
        await events.Publish(
            events_pb.PublishRequest(
                job=job, events=[event_pb2.Event(type="log", message=f"{i}") for i in range(3)]
            )
        )

        def watch(after_seq: int) -> list[int]:
            with Client(mesh.address("gateway"), api_key=key) as client:
                cursor = Cursor()
                seqs = [e.seq for e in client.watch_events("watched", after_seq=after_seq, cursor=cursor)]
                assert cursor.seq == 4
                return seqs

        watcher = asyncio.create_task(asyncio.to_thread(watch, 1))
        await asyncio.sleep(0.5)
        await events.CloseJobStream(
            events_pb.CloseJobStreamRequest(
                job=job, state_changed=event_pb2.JobStateChanged(state=job_pb2.Job.STATE_SUCCEEDED)
            )
        )
        assert await asyncio.wait_for(watcher, 30) == [2, 3, 4]
