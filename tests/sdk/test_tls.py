"""A gateway serving TLS to clients without a mesh certificate (`TANDEM_GATEWAY_TLS_CERT_FILE` / `_KEY_FILE`),
and the SDK speaking TLS to it (`ca_file=`, or `TANDEM_GATEWAY_CA_FILE`). Certificates are made on the spot
with the openssl CLI, as in the mTLS test."""

from __future__ import annotations

import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest

from mesh.status import RpcError
from tandem_client import AsyncClient
from tests.services.test_mtls import make_pki
from tests.support.mesh import Mesh, mesh_settings, running_mesh

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "pki"
    folder.mkdir()
    return make_pki(folder)


@pytest.fixture
async def mesh(tmp_path: Path, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Mesh]:
    monkeypatch.setenv("TANDEM_GATEWAY_TLS_CERT_FILE", str(pki["server.pem"]))
    monkeypatch.setenv("TANDEM_GATEWAY_TLS_KEY_FILE", str(pki["server.key"]))
    monkeypatch.setenv("TANDEM_GATEWAY_HTTP_PORT", "0")
    async with running_mesh(mesh_settings(tmp_path / "state")) as running:
        yield running


async def test_the_sdk_speaks_tls_to_a_gateway_that_serves_it(
    mesh: Mesh, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = mesh.address("gateway")
    async with AsyncClient(gateway, api_key="", ca_file=pki["ca.pem"]) as client:
        info = await client.get_server_info()
    assert "tandem.gateway.v1" in info.api_packages
    assert info.openai_base_url.startswith("https://")

    async with AsyncClient(gateway, api_key="", tls=False) as plaintext:
        with pytest.raises(RpcError) as refused:
            await plaintext.get_server_info()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE

    async with AsyncClient(gateway, api_key="", tls=True) as system_roots:  # the test CA is not among them
        with pytest.raises(RpcError) as untrusted:
            await system_roots.get_server_info()
    assert untrusted.value.code == grpc.StatusCode.UNAVAILABLE

    monkeypatch.setenv("TANDEM_GATEWAY_CA_FILE", str(pki["ca.pem"]))
    async with AsyncClient(gateway, api_key="") as from_environment:
        assert (await from_environment.get_server_info()).version == info.version

    trusted = ssl.create_default_context(cafile=pki["ca.pem"])
    async with httpx.AsyncClient(verify=trusted) as http:  # the HTTP endpoint is HTTPS too
        answer = await http.get(info.openai_base_url + "/models")
    assert answer.status_code == 401


def test_a_missing_ca_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the CA file"):
        AsyncClient("127.0.0.1:1", api_key="", ca_file=tmp_path / "nope.pem")
