"""`mesh.secrets`: a job process opens its declared secrets through the vault and injects them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tandem.vault.v1 import vault_service_pb2 as pb
from tandem.vault.v1 import vault_service_pb2_grpc

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.secrets import inject_env, open_secrets, seal_for_upload
from mesh.status import RpcError
from tests.support.mesh import mesh_settings, running_mesh


async def test_a_job_opens_and_injects_its_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = mesh_settings(tmp_path)
    async with running_mesh(settings, services=["vault"]) as mesh:
        signer = TokenSigner(load_signing_key("", settings.state_dir))
        async with open_channel(
            mesh.address("vault"), settings, token=signer.issue("user", "alice", org="acme")
        ) as ch:
            admin = vault_service_pb2_grpc.VaultServiceStub(ch)
            key = await admin.GetPublicKey(pb.GetPublicKeyRequest(parent="orgs/acme"))
            await admin.PutSecret(
                pb.PutSecretRequest(
                    parent="orgs/acme",
                    secret_id="env-key",
                    key_id=key.key_id,
                    ciphertext=seal_for_upload(key.public_key, b"env-secret-123"),
                )
            )
        token = signer.issue(
            "job", "orgs/acme/jobs/run", org="acme", extra={"secrets": ["orgs/acme/secrets/env-key"]}
        )
        monkeypatch.setenv("TANDEM_JOB_TOKEN", token)
        monkeypatch.delenv("ENV_API_KEY", raising=False)
        async with open_channel(
            mesh.address("vault"), settings, token=signer.issue("service", "job-runtime")
        ) as ch:
            vault = vault_service_pb2_grpc.VaultServiceStub(ch)
            assert await open_secrets(vault, ["orgs/acme/secrets/env-key"]) == {
                "orgs/acme/secrets/env-key": b"env-secret-123"
            }
            assert await inject_env(vault, {"ENV_API_KEY": "orgs/acme/secrets/env-key"}) == ["ENV_API_KEY"]
            assert os.environ["ENV_API_KEY"] == "env-secret-123"
            with pytest.raises(RpcError) as info:
                await open_secrets(vault, ["orgs/acme/secrets/env-key"], job_token="")
            assert info.value.reason == "MISSING_CREDENTIALS"
