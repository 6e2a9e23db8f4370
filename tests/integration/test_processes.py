"""Tandem as a user runs it: `tandem up` (every service in one process) and `python -m services.<name>`
(one service per process), checked from outside with grpc health and reflection."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.processes import ROOT, mesh_env, run_service, stop, tandem_up

pytestmark = pytest.mark.timeout(120)

FULL_NAMES = {
    "gateway": "tandem.gateway.v1.GatewayService",
    "vault": "tandem.vault.v1.VaultService",
    "scheduler": "tandem.scheduler.v1.SchedulerService",
    "taskapp_proxy": "tandem.taskapp.v1.TaskAppService",
    "events": "tandem.events.v1.EventService",
}


def health_of(port: int, service: str = "", timeout: float = 5.0) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return int(reply.status)


def reflected(port: int) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        return {s.name for r in replies for s in r.list_services_response.service}


def test_tandem_up_serves_every_service_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    with tandem_up(tmp_path / "state") as (proc, ports):
        for name, port in ports.items():
            assert health_of(port) == health_pb2.HealthCheckResponse.SERVING
            assert health_of(port, FULL_NAMES[name]) == health_pb2.HealthCheckResponse.SERVING
            listed = reflected(port)
            assert FULL_NAMES[name] in listed
            assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed
        env, _ = mesh_env(tmp_path / "state")
        for name, port in ports.items():
            env[f"TANDEM_PORTS__{name.upper()}"] = str(port)
        status = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "status", "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        assert status.returncode == 0, status.stderr
        assert set(json.loads(status.stdout).values()) == {"SERVING"}
        code, out = stop(proc, signal.SIGINT)
    assert code == 0, out
    assert "Tandem stopped." in out
    assert "Traceback" not in out
    assert (tmp_path / "state" / "mesh.key").exists()
    assert (tmp_path / "state" / "logs" / "tandem.log").read_text().strip()


def test_tandem_up_stops_on_sigterm(tmp_path: Path) -> None:
    with tandem_up(tmp_path / "state") as (proc, _):
        code, out = stop(proc, signal.SIGTERM)
    assert code == 0, out


@pytest.mark.parametrize("service", ["events", "vault", "gateway"])
def test_one_service_alone(tmp_path: Path, service: str) -> None:
    proc, port = run_service(service, tmp_path / "state")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert (
                    health_of(port, FULL_NAMES[service], timeout=2) == health_pb2.HealthCheckResponse.SERVING
                )
                break
            except grpc.FutureTimeoutError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline
        code, out = stop(proc, signal.SIGTERM)
        assert code == 0, out
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert any(entry["message"] == "serving" for entry in lines)
        assert any(entry["message"] == "draining" for entry in lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_services_do_not_import_the_ml_stack() -> None:
    code = (
        "import sys, mesh.launcher, mesh.server, gateway.cli, gateway.servicer\n"
        "import services.vault.servicer, services.events.servicer, services.scheduler.servicer\n"
        "import services.taskapp_proxy.servicer\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == ""
