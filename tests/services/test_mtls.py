"""mTLS between services: with cert files set, a service accepts only peers whose certificate chains to the
configured CA; the typed clients present theirs. Certificates are made on the spot with the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.clients import open_channel
from mesh.server import start_service
from mesh.settings import Tls
from mesh.status import RpcError
from tests.support.mesh import mesh_settings

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(folder: Path) -> dict[str, Path]:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=tandem-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=folder,
    )
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=folder,
        )
        (folder / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
            cwd=folder,
        )
    return {n: folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


async def test_mtls_accepts_mesh_peers_and_refuses_others(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    server_settings = mesh_settings(
        tmp_path, tls=Tls(cert_file=pki["server.pem"], key_file=pki["server.key"], ca_file=pki["ca.pem"])
    )
    server = await start_service("events", server_settings)
    target = f"127.0.0.1:{server.port}"
    try:
        client_settings = mesh_settings(
            tmp_path, tls=Tls(cert_file=pki["client.pem"], key_file=pki["client.key"], ca_file=pki["ca.pem"])
        )
        async with open_channel(target, client_settings) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        async with open_channel(target, mesh_settings(tmp_path)) as plaintext:
            with pytest.raises(RpcError) as info:
                await health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE

        no_client_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca.pem"].read_bytes())
        async with grpc.aio.secure_channel(target, no_client_cert) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
