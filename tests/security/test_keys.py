"""Keys that can be rotated: the mesh signing key (tokens of the old key verify until the stated cutoff, on a
mesh restarted onto the new key, and never after it) and the vault's master key (every organization key
re-wrapped, every secret still opens, and a rewrap cut short keeps the vault from starting until it is run
again)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from tandem.vault.v1 import vault_service_pb2 as pb
from tandem.vault.v1 import vault_service_pb2_grpc

from gateway.cli import main as cli
from mesh.clients import open_channel
from mesh.errors import Unauthenticated
from mesh.identity import RetiredKey, TokenSigner, TokenVerifier, load_signing_key, rotate_signing_key
from mesh.secrets import open_secrets, seal_for_upload
from mesh.settings import Settings, SettingsError
from services.vault.config import VaultSettings
from services.vault.rekey import pending, rewrap
from tests.support.mesh import mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(180)


def test_a_retired_key_verifies_until_its_cutoff_and_no_longer(tmp_path: Path) -> None:
    old = load_signing_key("", tmp_path)
    token = TokenSigner(old).issue("user", "alice", org="acme", ttl_s=86400)
    retired = rotate_signing_key(tmp_path, overlap_s=100)
    new = load_signing_key("", tmp_path)
    assert bytes(new.verify_key) != bytes(old.verify_key)
    verifier = TokenVerifier(new.verify_key, cache_size=0, retired=[retired])
    principal = verifier.verify(token)
    assert principal.subject == "alice" and principal.expires_at == retired.until  # cut to the cutoff
    assert verifier.verify(TokenSigner(new).issue("user", "bob", org="acme")).subject == "bob"
    with pytest.raises(Unauthenticated) as late:
        verifier.verify(token, now=retired.until + 60)
    assert late.value.reason_name == "CREDENTIALS_EXPIRED"
    stranger = TokenSigner(load_signing_key("11" * 32, tmp_path)).issue("user", "eve", org="acme")
    with pytest.raises(Unauthenticated) as unknown:
        TokenVerifier(new.verify_key, retired=[RetiredKey(old.verify_key, time.time() + 100)]).verify(
            stranger
        )
    assert unknown.value.reason_name == "INVALID_CREDENTIALS"


async def put_secret(settings: Settings, token: str) -> None:
    async with open_channel(settings.target("vault"), settings, token=token) as channel:
        vault = vault_service_pb2_grpc.VaultServiceStub(channel)
        key = await vault.GetPublicKey(pb.GetPublicKeyRequest(parent="orgs/acme"))
        await vault.PutSecret(
            pb.PutSecretRequest(
                parent="orgs/acme",
                secret_id="env-key",
                key_id=key.key_id,
                ciphertext=seal_for_upload(key.public_key, b"plain-value-42"),
            )
        )


async def opened(settings: Settings, signer: TokenSigner) -> dict[str, bytes]:
    token = signer.issue(
        "job", "orgs/acme/jobs/run", org="acme", extra={"secrets": ["orgs/acme/secrets/env-key"]}
    )
    async with open_channel(settings.target("vault"), settings, token=token) as channel:
        stub = vault_service_pb2_grpc.VaultServiceStub(channel)
        return await open_secrets(stub, ["orgs/acme/secrets/env-key"], token)


async def test_a_mesh_restarted_onto_a_new_key_accepts_the_old_keys_tokens(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    async with running_mesh(settings, services=["vault"]):
        old = TokenSigner(load_signing_key("", tmp_path))
        user = old.issue("user", "alice", org="acme", ttl_s=3600)
        await put_secret(settings, user)
    assert cli(["keys", "rotate-mesh-key", "--state-dir", str(tmp_path), "--overlap-s", "600"]) == 0
    async with running_mesh(settings, services=["vault"]):
        await put_secret(settings, user)  # issued before the rotation, still good until the cutoff
        new = TokenSigner(load_signing_key("", tmp_path))
        assert await opened(settings, new) == {"orgs/acme/secrets/env-key": b"plain-value-42"}


async def test_the_vault_master_key_is_rewrapped_and_a_cut_short_rewrap_is_finished(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    signer = TokenSigner(load_signing_key("", tmp_path))
    async with running_mesh(settings, services=["vault"]):
        await put_secret(settings, signer.issue("user", "alice", org="acme"))
    key_file = tmp_path / "vault-master.key"
    before = key_file.read_text()
    done = await rewrap(settings, VaultSettings())
    assert (done.org_keys, done.versions) == (1, 1) and key_file.read_text() != before
    async with running_mesh(settings, services=["vault"]):
        assert await opened(settings, signer) == {"orgs/acme/secrets/env-key": b"plain-value-42"}
    # Cut short after its new key was written: the vault refuses to start, and running again finishes it.
    pending(key_file).write_text("22" * 32)
    with pytest.raises(SettingsError, match="did not finish"):
        async with running_mesh(settings, services=["vault"]):
            pass
    assert await asyncio.to_thread(cli, ["keys", "rewrap-vault", "--state-dir", str(tmp_path)]) == 0
    assert key_file.read_text() == "22" * 32 and not pending(key_file).exists()
    async with running_mesh(settings, services=["vault"]):
        assert await opened(settings, signer) == {"orgs/acme/secrets/env-key": b"plain-value-42"}
