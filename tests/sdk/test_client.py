"""The SDK against a real in-process mesh behind the real gateway: both client forms, organization API
keys, sealed secret uploads, typed errors, and watching a job's events through the gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import tandem
from tandem.events.v1 import event_pb2, events_service_pb2_grpc
from tandem.events.v1 import events_service_pb2 as events_pb
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.status import RpcError
from tandem_client import AsyncClient, Client, Cursor
from tests.support.mesh import Mesh, mesh_settings, running_mesh
from tests.support.taskapps import example_app_in_thread

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]
APP_KEY = "env-key-value-0123456789"


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


async def test_the_sdk_is_tandem_client(mesh: Mesh) -> None:
    assert (tandem.Client, tandem.AsyncClient, tandem.RpcError) == (Client, AsyncClient, RpcError)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = tandem.Nope  # type: ignore[attr-defined]
    async with tandem.AsyncClient(mesh.address("gateway"), api_key="") as client:
        assert "tandem.gateway.v1" in (await client.get_server_info()).api_packages


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


async def test_task_apps_jobs_checkpoints_and_infer(mesh: Mesh) -> None:
    async with AsyncClient(mesh.address("gateway"), api_key=await new_org(mesh)) as client:
        await client.put_secret("app-key", APP_KEY)
        with example_app_in_thread(APP_KEY) as url:
            checked = await client.register_task_app("single-turn", url, secret="app-key", validate_only=True)
            assert checked.check_results and all(r.passed for r in checked.check_results)
            assert await client.list_task_apps() == []
            registered = await client.register_task_app("single-turn", url, secret="app-key")
            assert registered.task_app.name == "orgs/acme/taskApps/single-turn"
            assert [a.name for a in await client.list_task_apps()] == [registered.task_app.name]
            assert (await client.get_task_app("single-turn")).secret_name == "orgs/acme/secrets/app-key"
            assert (await client.check_task_app("single-turn")).all_passed
            await client.delete_task_app("single-turn")
            assert await client.list_task_apps() == []

        spec = job_spec_pb2.JobSpec(
            display_name="sleeper",
            tasks=[
                job_spec_pb2.TaskSpec(name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="sleep 30")
            ],
        )
        job = await client.create_job(spec=spec, job_id="sleeper")
        assert job.name == "orgs/acme/jobs/sleeper"
        assert [j.name for j in await client.list_jobs()] == [job.name]
        assert (await client.get_job("sleeper")).name == job.name
        cancelled = await client.cancel_job("sleeper", reason="test")
        assert cancelled.state in (job_pb2.Job.STATE_CANCELLING, job_pb2.Job.STATE_CANCELLED)
        states = [
            e.job_state_changed.state
            async for e in client.watch_events("sleeper")
            if e.type == "job.state_changed"
        ]
        assert states[-1] == job_pb2.Job.STATE_CANCELLED
        assert await client.list_checkpoints("sleeper") == []
        assert [e.seq for e in await client.list_events("sleeper", limit=2)] == [1, 2]
        with pytest.raises(RpcError) as no_checkpoint:
            await client.infer("sleeper", "hello", wait_s=5)
        assert no_checkpoint.value.reason == "CHECKPOINT_NOT_FOUND"
        with pytest.raises(ValueError, match="exactly one"):
            await client.create_job(job_id="x")


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_infer_waits_for_the_worker_the_gateway_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.models import build_tiny_model  # noqa: PLC0415 - the checkpoint a trainer would have saved

    model = build_tiny_model(tmp_path / "step-3", vocab_size=300, hidden_size=32, layers=1, heads=2)
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    async with running_mesh(mesh_settings(tmp_path / "state")) as mesh:
        key = await new_org(mesh)
        token = TokenSigner(load_signing_key("", mesh.settings.state_dir)).issue("service", "trainer")
        async with open_channel(mesh.address("events"), mesh.settings, token=token) as channel:
            event = event_pb2.Event(type="checkpoint.saved", message="step 3")
            event.checkpoint_saved.checkpoint = "orgs/acme/jobs/rl/checkpoints/step-3"
            event.checkpoint_saved.step = 3
            event.checkpoint_saved.uri = model.as_uri()
            stub = events_service_pb2_grpc.EventServiceStub(channel)
            await stub.Publish(events_pb.PublishRequest(job="orgs/acme/jobs/rl", events=[event]))
        waits: list[RpcError] = []
        async with AsyncClient(mesh.address("gateway"), api_key=key) as client:
            assert [c.step for c in await client.list_checkpoints("rl")] == [3]
            answer = await client.infer(
                "rl", "hello", max_tokens=3, temperature=0.0, wait_s=300, on_wait=waits.append
            )
            running = await client.list_inference_workers()
            stopped = await client.stop_inference_worker("rl")
            assert await client.list_inference_workers() == []
    assert [(w.checkpoint, w.step) for w in running] == [("orgs/acme/jobs/rl/checkpoints/step-3", 3)]
    assert [w.job for w in stopped] == [w.job for w in running]
    assert answer.policy_version.weight_version == 3
    assert answer.model == "orgs/acme/jobs/rl/checkpoints/step-3"
    assert 1 <= answer.completion_tokens <= 3
    assert waits and all(w.reason == "DEPENDENCY_UNAVAILABLE" for w in waits)


async def test_the_blocking_client_runs_a_job_and_reads_its_log(mesh: Mesh) -> None:
    key = await new_org(mesh)

    def blocking() -> tuple[list[str], bytes]:
        with Client(mesh.address("gateway"), api_key=key) as client:
            task = job_spec_pb2.TaskSpec(
                name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="echo hello-sdk"
            )
            job = client.create_job(spec=job_spec_pb2.JobSpec(tasks=[task]), job_id="echo")
            types = [e.type for e in client.watch_events("echo")]
            log = b"".join(piece.data for piece in client.stream_job_logs(job.name, task="main"))
            return types, log

    types, log = await asyncio.to_thread(blocking)
    assert types[0] == "job.state_changed" and types[-1] == "job.state_changed"
    assert b"hello-sdk" in log
