"""Gateway replicas: two `python -m gateway` processes on one gRPC port and one HTTP port
(`TANDEM_GATEWAY_REUSE_PORT`), in front of the same internal services and state folder, serve the same
organizations and keys: an organization and a key made through one are used through the other, each
connection lands on one of them and both take some. Without the setting a second process on the port fails
to start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc
from tandem.scheduler.v1 import job_spec_pb2

from tests.support.mesh import Mesh, mesh_settings, running_mesh
from tests.support.postgres import free_port

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
INTERNAL = ("events", "vault", "taskapp_proxy", "scheduler")
START_TIMEOUT_S = 60.0
Stub = gateway_service_pb2_grpc.GatewayServiceStub


def replica_env(mesh: Mesh, grpc_port: int, http_port: int, reuse: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        {
            "TANDEM_STATE_DIR": str(mesh.settings.state_dir),
            "TANDEM_LOG_LEVEL": "INFO",  # one line per call, with its request id
            "TANDEM_PORTS__GATEWAY": str(grpc_port),
            "TANDEM_GATEWAY_HTTP_PORT": str(http_port),
            "TANDEM_GATEWAY_REUSE_PORT": "1" if reuse else "0",
        }
    )
    for name in INTERNAL:
        env[f"TANDEM_PORTS__{name.upper()}"] = str(mesh.services[name].port)
    return env


@contextlib.contextmanager
def replica(log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def logged(log: Path) -> str:
    return log.read_text(errors="replace")


async def serving(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the replica logged that it serves (both its ports are bound by then)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while '"serving"' not in logged(log):
        assert proc.poll() is None, logged(log)
        assert time.monotonic() < deadline, logged(log)
        await asyncio.sleep(0.1)


def connection(port: int) -> grpc.aio.Channel:
    # A subchannel pool of its own: a new TCP connection, which the kernel may hand to either replica.
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


def bearer(key: str, request_id: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"), ("x-request-id", request_id))


async def test_two_replicas_on_one_port_serve_the_same_orgs_and_keys(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    async with running_mesh(mesh_settings(tmp_path / "state"), services=INTERNAL) as mesh:
        env = replica_env(mesh, grpc_port, http_port, reuse=True)
        logs = [tmp_path / "gateway-1.log", tmp_path / "gateway-2.log"]
        with replica(logs[0], env) as first, replica(logs[1], env) as second:
            await serving(first, logs[0])
            await serving(second, logs[1])
            admin = (mesh.settings.state_dir / "admin.key").read_text().strip()
            calls: list[str] = []  # request ids, one connection each
            key = ""
            for n in range(64):
                channel = connection(grpc_port)
                stub = Stub(channel)
                rid = f"replica-test-{n:02d}"
                if n == 0:
                    made = await stub.CreateOrg(
                        pb.CreateOrgRequest(org_id="acme"), metadata=bearer(admin, rid)
                    )
                    key = made.key
                elif n == 1:  # a second key, made through whichever replica, works through both
                    made_key = await stub.CreateApiKey(
                        pb.CreateApiKeyRequest(parent="orgs/acme", display_name="ci"),
                        metadata=bearer(key, rid),
                    )
                    key = made_key.key
                elif n == 2:
                    spec = job_spec_pb2.JobSpec(
                        tasks=[
                            job_spec_pb2.TaskSpec(
                                name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="true"
                            )
                        ]
                    )
                    request = pb.CreateJobRequest(parent="orgs/acme", job_id="shared", spec=spec)
                    await stub.CreateJob(request, metadata=bearer(key, rid))
                else:
                    org = (await stub.GetOrg(pb.GetOrgRequest(), metadata=bearer(key, rid))).org
                    assert org.name == "orgs/acme"
                    jobs = await stub.ListJobs(
                        pb.ListJobsRequest(parent="orgs/acme"), metadata=bearer(key, rid)
                    )
                    assert [j.name for j in jobs.jobs] == ["orgs/acme/jobs/shared"]
                await channel.close()
                calls.append(rid)
                seen = [{r for r in calls if r in logged(log)} for log in logs]
                if n >= 8 and all(seen):
                    break
            seen = [{r for r in calls if r in logged(log)} for log in logs]
            assert all(seen), f"one replica took every connection: {seen}"
            assert seen[0] | seen[1] == set(calls) and not seen[0] & seen[1]

            # The HTTP endpoint shares its port too; a fresh connection each time, answered by either.
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as client:
                for _ in range(8):
                    answer = await client.get(
                        "/api/v1/session",
                        headers={"Authorization": f"Bearer {key}", "Connection": "close"},
                    )
                    assert answer.status_code == 200, answer.text
                    assert "orgs/acme" in answer.text
            assert first.poll() is None and second.poll() is None


async def test_without_the_setting_a_second_gateway_on_the_port_fails_to_start(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    async with running_mesh(mesh_settings(tmp_path / "state"), services=INTERNAL) as mesh:
        logs = [tmp_path / "gateway-1.log", tmp_path / "gateway-2.log"]
        with replica(logs[0], replica_env(mesh, grpc_port, http_port, reuse=False)) as first:
            await serving(first, logs[0])
            env = replica_env(mesh, grpc_port, free_port(), reuse=False)
            with replica(logs[1], env) as second:
                code = await asyncio.to_thread(second.wait, 60)
            assert code != 0, logged(logs[1])
            assert "bind" in logged(logs[1]).lower(), logged(logs[1])
            assert first.poll() is None
