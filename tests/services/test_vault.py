"""The vault against a real in-process server on both stores: sealed uploads, metadata-only reads, runtime
injection re-sealed to an ephemeral key, rotation, audit (fail closed), org isolation, and the promise
that plaintext never reaches the database or the logs."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import nacl.public
import psycopg
import pytest
from tandem.events.v1 import events_service_pb2, events_service_pb2_grpc
from tandem.vault.v1 import (
    audit_pb2,
    org_key_pb2,
    secret_pb2,
    vault_service_pb2_grpc,
)
from tandem.vault.v1 import (
    vault_service_pb2 as pb,
)

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.status import RpcError
from mesh.store import Program, Statement, open_database
from services.vault import crypto
from services.vault.store import MIGRATIONS
from services.vault.vault import Actor, ActorKind, Vault
from tests.support.mesh import Mesh, mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(60)
VALUE = b"sk-live-9f8e7d6c5b4a39281706f5e4d3c2b1a0"
ORG = "orgs/acme"
SECRET = "orgs/acme/secrets/env-key"


@pytest.fixture
async def mesh(tmp_path: Path, store_url: str) -> AsyncIterator[Mesh]:
    async with running_mesh(mesh_settings(tmp_path, store_url=store_url), services=["vault"]) as running:
        yield running


@pytest.fixture
def signer(mesh: Mesh) -> TokenSigner:
    return TokenSigner(load_signing_key("", mesh.settings.state_dir))


class Caller:
    def __init__(self, mesh: Mesh, token: str) -> None:
        self.channel = open_channel(mesh.address("vault"), mesh.settings, token=token)
        self.stub = vault_service_pb2_grpc.VaultServiceStub(self.channel)


@pytest.fixture
async def callers(
    mesh: Mesh, signer: TokenSigner
) -> AsyncIterator[dict[str, vault_service_pb2_grpc.VaultServiceStub]]:
    made = {
        "acme": Caller(mesh, signer.issue("user", "alice", org="acme")),
        "globex": Caller(mesh, signer.issue("user", "mallory", org="globex")),
        "proxy": Caller(mesh, signer.issue("service", "taskapp_proxy")),
        "events": Caller(mesh, signer.issue("service", "events")),
    }
    yield {name: c.stub for name, c in made.items()}
    for c in made.values():
        await c.channel.close()


async def upload(
    stub: vault_service_pb2_grpc.VaultServiceStub, secret_id: str, value: bytes, org: str = ORG, **extra: str
) -> pb.PutSecretResponse:
    key = await stub.GetPublicKey(pb.GetPublicKeyRequest(parent=org))
    sealed = nacl.public.SealedBox(nacl.public.PublicKey(key.public_key)).encrypt(value)
    return await stub.PutSecret(
        pb.PutSecretRequest(parent=org, secret_id=secret_id, key_id=key.key_id, ciphertext=sealed, **extra)
    )


async def open_with(
    stub: vault_service_pb2_grpc.VaultServiceStub, names: list[str], job_token: str = ""
) -> list[bytes]:
    ephemeral = nacl.public.PrivateKey.generate()
    reply = await stub.OpenSecrets(
        pb.OpenSecretsRequest(
            job_token=job_token, secrets=names, recipient_public_key=bytes(ephemeral.public_key)
        )
    )
    box = nacl.public.SealedBox(ephemeral)
    return [box.decrypt(s.sealed_value) for s in reply.secrets]


def job_token(
    signer: TokenSigner, secrets: list[str], org: str = "acme", ttl_s: float = 60, **kw: float
) -> str:
    return signer.issue(
        "job", f"orgs/{org}/jobs/run-1", org=org, ttl_s=ttl_s, extra={"secrets": secrets}, **kw
    )


async def test_upload_then_metadata_only(callers: dict[str, vault_service_pb2_grpc.VaultServiceStub]) -> None:
    acme = callers["acme"]
    first = await upload(acme, "env-key", VALUE)
    assert first.created and first.version.version == 1
    assert first.version.state == secret_pb2.SecretVersion.STATE_ENABLED
    again = await upload(acme, "env-key", VALUE)
    other = await upload(acme, "env-key", b"a different value")
    assert not again.created and again.version.version == 2
    assert again.version.fingerprint == first.version.fingerprint != other.version.fingerprint
    got = await acme.GetSecret(pb.GetSecretRequest(name=SECRET))
    assert got.secret.version_count == 3 and len(got.secret.versions) == 3
    assert got.secret.latest_version.version == 3
    assert VALUE not in got.SerializeToString()
    listed = await acme.ListSecrets(pb.ListSecretsRequest(parent=ORG))
    assert [s.name for s in listed.secrets] == [SECRET]


async def test_injection_reseals_to_the_callers_key(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub], signer: TokenSigner
) -> None:
    await upload(callers["acme"], "env-key", VALUE)
    await upload(callers["acme"], "other", b"other value")
    token = job_token(signer, [SECRET])
    assert await open_with(callers["events"], [SECRET], token) == [VALUE]
    assert await open_with(callers["proxy"], [SECRET, "orgs/acme/secrets/other"]) == [VALUE, b"other value"]


@pytest.mark.parametrize(
    ("case", "code", "reason"),
    [
        ("undeclared", grpc.StatusCode.PERMISSION_DENIED, "SECRET_NOT_DECLARED"),
        ("other-org-token", grpc.StatusCode.PERMISSION_DENIED, "SECRET_NOT_DECLARED"),
        ("expired", grpc.StatusCode.UNAUTHENTICATED, "CREDENTIALS_EXPIRED"),
        ("tampered", grpc.StatusCode.UNAUTHENTICATED, "INVALID_CREDENTIALS"),
        ("service-token-as-job", grpc.StatusCode.UNAUTHENTICATED, "INVALID_CREDENTIALS"),
        ("no-token", grpc.StatusCode.UNAUTHENTICATED, "MISSING_CREDENTIALS"),
        ("missing-secret", grpc.StatusCode.NOT_FOUND, "SECRET_NOT_FOUND"),
    ],
)
async def test_injection_refusals(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub],
    signer: TokenSigner,
    case: str,
    code: grpc.StatusCode,
    reason: str,
) -> None:
    await upload(callers["acme"], "env-key", VALUE)
    await upload(callers["acme"], "undeclared", b"not for this job")
    names = [SECRET]
    token = {
        "undeclared": job_token(signer, [SECRET]),
        "other-org-token": job_token(signer, [SECRET], org="globex"),
        "expired": job_token(signer, [SECRET], ttl_s=10, now=0.0),
        "tampered": job_token(signer, [SECRET])[:-3] + "AAA",
        "service-token-as-job": signer.issue("service", "scheduler"),
        "no-token": "",
        "missing-secret": job_token(signer, ["orgs/acme/secrets/ghost"]),
    }[case]
    if case == "undeclared":
        names = [SECRET, "orgs/acme/secrets/undeclared"]
    if case == "missing-secret":
        names = ["orgs/acme/secrets/ghost"]
    with pytest.raises(RpcError) as info:
        await open_with(callers["events"], names, token)
    assert (info.value.code, info.value.reason) == (code, reason)
    assert VALUE.decode()[:8] not in str(info.value)
    audit = (
        await callers["acme"].ListAuditEvents(
            pb.ListAuditEventsRequest(parent=ORG, actions=[audit_pb2.AuditEvent.ACTION_INJECT])
        )
        if case != "other-org-token"
        else None
    )
    if audit is not None:
        failed = audit_pb2.AuditEvent.OUTCOME_FAILED
        expected = failed if case == "missing-secret" else audit_pb2.AuditEvent.OUTCOME_DENIED
        assert audit.audit_events[0].outcome == expected


async def test_bad_uploads(callers: dict[str, vault_service_pb2_grpc.VaultServiceStub]) -> None:
    acme = callers["acme"]
    key = await acme.GetPublicKey(pb.GetPublicKeyRequest(parent=ORG))
    sealed = nacl.public.SealedBox(nacl.public.PublicKey(key.public_key)).encrypt(VALUE)
    globex_key = await callers["globex"].GetPublicKey(pb.GetPublicKeyRequest(parent="orgs/globex"))
    foreign = nacl.public.SealedBox(nacl.public.PublicKey(globex_key.public_key)).encrypt(VALUE)
    cases = [
        (
            pb.PutSecretRequest(parent=ORG, secret_id="a", key_id="kdeadbeef", ciphertext=sealed),
            "STALE_KEY_ID",
        ),
        (
            pb.PutSecretRequest(parent=ORG, secret_id="a", key_id=key.key_id, ciphertext=sealed[:-1]),
            "CIPHERTEXT_INVALID",
        ),
        (
            pb.PutSecretRequest(parent=ORG, secret_id="a", key_id=key.key_id, ciphertext=b"\x00" * 80),
            "CIPHERTEXT_INVALID",
        ),
        (
            pb.PutSecretRequest(parent=ORG, secret_id="a", key_id=key.key_id, ciphertext=foreign),
            "CIPHERTEXT_INVALID",
        ),
        (
            pb.PutSecretRequest(
                parent=ORG, secret_id="a'; DROP TABLE x;--", key_id=key.key_id, ciphertext=sealed
            ),
            "INVALID_ARGUMENT",
        ),
        (
            pb.PutSecretRequest(parent=ORG, secret_id="a", key_id=key.key_id, ciphertext=b"x" * 9000),
            "INVALID_ARGUMENT",
        ),
    ]
    for request, reason in cases:
        with pytest.raises(RpcError) as info:
            await acme.PutSecret(request)
        assert info.value.reason == reason, request.secret_id
    assert (await acme.ListSecrets(pb.ListSecretsRequest(parent=ORG))).secrets == []


async def test_other_orgs_cannot_see_or_touch_secrets(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub],
) -> None:
    await upload(callers["acme"], "env-key", VALUE)
    mallory = callers["globex"]
    with pytest.raises(RpcError) as existing:
        await mallory.GetSecret(pb.GetSecretRequest(name=SECRET))
    with pytest.raises(RpcError) as absent:
        await mallory.GetSecret(pb.GetSecretRequest(name="orgs/acme/secrets/nothing-here"))
    assert (existing.value.code, existing.value.reason) == (absent.value.code, absent.value.reason)
    assert existing.value.reason == "SECRET_NOT_FOUND"
    for call in (
        mallory.ListSecrets(pb.ListSecretsRequest(parent=ORG)),
        mallory.DeleteSecret(pb.DeleteSecretRequest(name=SECRET)),
        mallory.GetPublicKey(pb.GetPublicKeyRequest(parent=ORG)),
        mallory.ListAuditEvents(pb.ListAuditEventsRequest(parent=ORG)),
    ):
        with pytest.raises(RpcError) as info:
            await call
        assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert (await callers["acme"].GetSecret(pb.GetSecretRequest(name=SECRET))).secret.version_count == 1


async def test_rotation_reseals_and_retires(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub], signer: TokenSigner
) -> None:
    acme = callers["acme"]
    await upload(acme, "env-key", VALUE)
    old = await acme.GetPublicKey(pb.GetPublicKeyRequest(parent=ORG))
    rotated = await acme.RotateOrgKey(pb.RotateOrgKeyRequest(parent=ORG))
    assert rotated.resealed_version_count == 1
    assert rotated.new_key.key_id != old.key_id
    assert [k.state for k in rotated.previous_keys] == [org_key_pb2.OrgKey.STATE_RETIRED]
    stale = nacl.public.SealedBox(nacl.public.PublicKey(old.public_key)).encrypt(b"late")
    with pytest.raises(RpcError) as info:
        await acme.PutSecret(
            pb.PutSecretRequest(parent=ORG, secret_id="late", key_id=old.key_id, ciphertext=stale)
        )
    assert info.value.reason == "STALE_KEY_ID"
    assert await open_with(callers["events"], [SECRET], job_token(signer, [SECRET])) == [VALUE]
    keys = await acme.ListOrgKeys(pb.ListOrgKeysRequest(parent=ORG))
    assert sorted(k.state for k in keys.keys) == [
        org_key_pb2.OrgKey.STATE_ACTIVE,
        org_key_pb2.OrgKey.STATE_RETIRED,
    ]


async def test_concurrent_rotation_and_uploads(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub], signer: TokenSigner
) -> None:
    acme = callers["acme"]
    key = await acme.GetPublicKey(pb.GetPublicKeyRequest(parent=ORG))

    async def put(i: int) -> str:
        sealed = nacl.public.SealedBox(nacl.public.PublicKey(key.public_key)).encrypt(f"value-{i}".encode())
        try:
            await acme.PutSecret(
                pb.PutSecretRequest(parent=ORG, secret_id=f"s{i}", key_id=key.key_id, ciphertext=sealed)
            )
        except RpcError as error:
            return error.reason
        return "ok"

    outcomes = await asyncio.gather(
        *(put(i) for i in range(20)), acme.RotateOrgKey(pb.RotateOrgKeyRequest(parent=ORG))
    )
    results = outcomes[:20]
    assert set(results) <= {"ok", "STALE_KEY_ID"}
    stored = [f"orgs/acme/secrets/s{i}" for i, r in enumerate(results) if r == "ok"]
    if stored:
        values = await open_with(callers["events"], stored, job_token(signer, stored))
        assert values == [f"value-{name.rsplit('s', 1)[1]}".encode() for name in stored]


async def test_versions_can_be_disabled(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub], signer: TokenSigner
) -> None:
    acme = callers["acme"]
    await upload(acme, "env-key", b"old")
    await upload(acme, "env-key", b"new")
    token = job_token(signer, [SECRET])
    await acme.DisableSecretVersion(pb.DisableSecretVersionRequest(name=f"{SECRET}/versions/2"))
    assert await open_with(callers["events"], [SECRET], token) == [b"old"]
    await acme.DisableSecretVersion(pb.DisableSecretVersionRequest(name=f"{SECRET}/versions/1"))
    with pytest.raises(RpcError) as info:
        await open_with(callers["events"], [SECRET], token)
    assert info.value.reason == "SECRET_NOT_FOUND"
    await acme.EnableSecretVersion(pb.EnableSecretVersionRequest(name=f"{SECRET}/versions/2"))
    assert await open_with(callers["events"], [SECRET], token) == [b"new"]
    await acme.DeleteSecret(pb.DeleteSecretRequest(name=SECRET))
    with pytest.raises(RpcError):
        await acme.GetSecret(pb.GetSecretRequest(name=SECRET))


async def test_request_id_makes_uploads_idempotent(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub],
) -> None:
    acme = callers["acme"]
    key = await acme.GetPublicKey(pb.GetPublicKeyRequest(parent=ORG))
    sealed = nacl.public.SealedBox(nacl.public.PublicKey(key.public_key)).encrypt(VALUE)
    request = pb.PutSecretRequest(
        parent=ORG, secret_id="env-key", key_id=key.key_id, ciphertext=sealed, request_id="r-1"
    )
    first = await acme.PutSecret(request)
    retry = await acme.PutSecret(request)
    assert first == retry
    assert (await acme.GetSecret(pb.GetSecretRequest(name=SECRET))).secret.version_count == 1
    changed = pb.PutSecretRequest(
        parent=ORG, secret_id="other", key_id=key.key_id, ciphertext=sealed, request_id="r-1"
    )
    with pytest.raises(RpcError) as info:
        await acme.PutSecret(changed)
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_REUSED")


async def test_every_action_is_audited(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub], signer: TokenSigner
) -> None:
    acme = callers["acme"]
    await upload(acme, "env-key", VALUE)
    await acme.GetSecret(pb.GetSecretRequest(name=SECRET))
    await open_with(callers["events"], [SECRET], job_token(signer, [SECRET]))
    with pytest.raises(RpcError):
        await open_with(callers["events"], [SECRET], job_token(signer, []))
    await acme.RotateOrgKey(pb.RotateOrgKeyRequest(parent=ORG))
    events = (await acme.ListAuditEvents(pb.ListAuditEventsRequest(parent=ORG))).audit_events
    A = O = audit_pb2.AuditEvent  # noqa: E741 - short names keep the expected table readable
    seen = [(e.action, e.outcome) for e in reversed(events)]
    assert seen == [
        (A.ACTION_CREATE_KEY, O.OUTCOME_ALLOWED),
        (A.ACTION_UPLOAD, O.OUTCOME_ALLOWED),
        (A.ACTION_READ_METADATA, O.OUTCOME_ALLOWED),
        (A.ACTION_INJECT, O.OUTCOME_ALLOWED),
        (A.ACTION_INJECT, O.OUTCOME_DENIED),
        (A.ACTION_ROTATE, O.OUTCOME_ALLOWED),
    ]
    upload_event = events[-2]
    assert upload_event.fingerprint.startswith("b2-") and upload_event.actor.id == "alice"
    denied = events[1]
    assert denied.reason == 63  # SECRET_NOT_DECLARED
    paged = await acme.ListAuditEvents(pb.ListAuditEventsRequest(parent=ORG, page_size=4))
    rest = await acme.ListAuditEvents(
        pb.ListAuditEventsRequest(parent=ORG, page_size=4, page_token=paged.next_page_token)
    )
    assert [e.name for e in [*paged.audit_events, *rest.audit_events]] == [e.name for e in events]


async def test_audit_failure_fails_closed(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    async with running_mesh(settings, services=["vault"]) as mesh:
        signer = TokenSigner(load_signing_key("", settings.state_dir))
        caller = Caller(mesh, signer.issue("user", "alice", org="acme"))
        key = await caller.stub.GetPublicKey(pb.GetPublicKeyRequest(parent=ORG))
        with sqlite3.connect(settings.state_dir / "vault.db") as raw:
            raw.execute(
                "CREATE TRIGGER audit_down BEFORE INSERT ON vault_audit BEGIN SELECT RAISE(ABORT, 'disk'); END"
            )
        sealed = nacl.public.SealedBox(nacl.public.PublicKey(key.public_key)).encrypt(VALUE)
        with pytest.raises(RpcError) as info:
            await caller.stub.PutSecret(
                pb.PutSecretRequest(parent=ORG, secret_id="env-key", key_id=key.key_id, ciphertext=sealed)
            )
        assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAVAILABLE, "AUDIT_UNAVAILABLE")
        with sqlite3.connect(settings.state_dir / "vault.db") as raw:
            assert raw.execute("SELECT COUNT(*) FROM vault_versions").fetchone() == (0,)
        await caller.channel.close()


async def test_an_injection_that_cannot_be_audited_returns_nothing(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    async with running_mesh(settings, services=["vault"]) as mesh:
        signer = TokenSigner(load_signing_key("", settings.state_dir))
        owner = Caller(mesh, signer.issue("user", "alice", org="acme"))
        injector = Caller(mesh, signer.issue("service", "events"))
        await upload(owner.stub, "env-key", VALUE)
        with sqlite3.connect(settings.state_dir / "vault.db") as raw:
            raw.execute(
                "CREATE TRIGGER audit_down BEFORE INSERT ON vault_audit BEGIN SELECT RAISE(ABORT, 'disk'); END"
            )
        with pytest.raises(RpcError) as info:
            await open_with(injector.stub, [SECRET], job_token(signer, [SECRET]))
        assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAVAILABLE, "AUDIT_UNAVAILABLE")
        assert VALUE.decode()[:8] not in str(info.value)
        await owner.channel.close()
        await injector.channel.close()


async def test_concurrent_uploads_each_commit_with_their_audit_record_and_a_bad_one_fails_alone(
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub],
) -> None:
    acme = callers["acme"]
    key = await acme.GetPublicKey(pb.GetPublicKeyRequest(parent=ORG))
    box = nacl.public.SealedBox(nacl.public.PublicKey(key.public_key))
    ciphertexts = {f"s{i}": box.encrypt(b"value-%d" % i) for i in range(20)}
    ciphertexts["broken"] = b"\x00" * 80
    calls = [
        acme.PutSecret(pb.PutSecretRequest(parent=ORG, secret_id=name, key_id=key.key_id, ciphertext=sealed))
        for name, sealed in ciphertexts.items()
    ]
    answers = dict(zip(ciphertexts, await asyncio.gather(*calls, return_exceptions=True), strict=True))
    broken = answers.pop("broken")
    assert isinstance(broken, RpcError) and broken.reason == "CIPHERTEXT_INVALID"
    assert all(isinstance(a, pb.PutSecretResponse) and a.version.version == 1 for a in answers.values())
    opened = await open_with(callers["proxy"], [f"orgs/acme/secrets/s{i}" for i in range(20)])
    assert opened == [b"value-%d" % i for i in range(20)]
    audit = await acme.ListAuditEvents(
        pb.ListAuditEventsRequest(parent=ORG, actions=[audit_pb2.AuditEvent.ACTION_UPLOAD], page_size=100)
    )
    outcomes = {e.secret.rsplit("/", 1)[1]: e.outcome for e in audit.audit_events}
    assert len(audit.audit_events) == 21
    assert outcomes["broken"] == audit_pb2.AuditEvent.OUTCOME_FAILED
    assert all(outcomes[name] == audit_pb2.AuditEvent.OUTCOME_ALLOWED for name in answers)


async def test_plaintext_never_reaches_storage_or_logs(
    mesh: Mesh,
    callers: dict[str, vault_service_pb2_grpc.VaultServiceStub],
    signer: TokenSigner,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    acme = callers["acme"]
    await upload(acme, "env-key", VALUE)
    await open_with(callers["events"], [SECRET], job_token(signer, [SECRET]))
    await acme.RotateOrgKey(pb.RotateOrgKeyRequest(parent=ORG))
    with pytest.raises(RpcError):
        await open_with(callers["events"], [SECRET], job_token(signer, []))
    await open_with(callers["proxy"], [SECRET])
    url = mesh.settings.store_url
    if url.startswith("postgresql://"):
        with psycopg.connect(url) as conn:
            dump = b"".join(
                bytes(str(row), "utf-8") + b"".join(v for v in row if isinstance(v, bytes))
                for table in (
                    "vault_org_keys",
                    "vault_secrets",
                    "vault_versions",
                    "vault_audit",
                    "vault_requests",
                )
                for row in conn.execute(f"SELECT * FROM {table}").fetchall()  # noqa: S608
            )
    else:
        database = Path(url.removeprefix("sqlite:///"))
        dump = b"".join(p.read_bytes() for p in database.parent.glob(database.name + "*"))
        assert dump
    logs = caplog.text.encode() + b"".join(p.read_bytes() for p in mesh.settings.state_dir.rglob("*.log"))
    for prefix_length in (len(VALUE), 16, 8):
        assert VALUE[:prefix_length] not in dump
        assert VALUE[:prefix_length] not in logs
    assert VALUE.hex().encode()[:16] not in dump


async def test_audit_records_reach_the_events_service(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    async with running_mesh(settings, services=["events", "vault"]) as mesh:
        signer = TokenSigner(load_signing_key("", settings.state_dir))
        user = Caller(mesh, signer.issue("user", "alice", org="acme"))
        await upload(user.stub, "env-key", VALUE)
        token = job_token(signer, [SECRET])
        job = Caller(mesh, token)
        await open_with(job.stub, [SECRET], token)
        async with open_channel(
            mesh.address("events"), settings, token=signer.issue("service", "test")
        ) as ch:
            events = events_service_pb2_grpc.EventServiceStub(ch)

            async def types_of(job_name: str) -> list[str]:
                try:
                    listed = await events.ListEvents(events_service_pb2.ListEventsRequest(job=job_name))
                except RpcError:
                    return []
                return [e.type for e in listed.events]

            for _ in range(100):
                org_log, job_log = (
                    await types_of("orgs/acme/jobs/vault-audit"),
                    await types_of("orgs/acme/jobs/run-1"),
                )
                if len(org_log) >= 3 and job_log:
                    break
                await asyncio.sleep(0.1)
        assert org_log == ["secret.create_key", "secret.upload", "secret.inject"]
        assert job_log == ["secret.inject"]
        await user.channel.close()
        await job.channel.close()


async def test_job_tokens_cannot_manage_secrets(mesh: Mesh, signer: TokenSigner) -> None:
    job = Caller(mesh, job_token(signer, [SECRET]))
    try:
        # Refused by method before any resource is looked at, so its own org and another (or none) read alike.
        for parent in (ORG, "orgs/globex", "orgs/nobody"):
            with pytest.raises(RpcError) as refused:
                await job.stub.ListSecrets(pb.ListSecretsRequest(parent=parent))
            assert (refused.value.code, refused.value.reason) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "OUTSIDE_JOB_SCOPE",
            )
    finally:
        await job.channel.close()


async def test_a_deployment_value_limit_is_enforced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_VAULT_MAX_VALUE_BYTES", "16")
    settings = mesh_settings(tmp_path)
    async with running_mesh(settings, services=["vault"]) as mesh:
        caller = Caller(
            mesh, TokenSigner(load_signing_key("", settings.state_dir)).issue("user", "a", org="acme")
        )
        assert (await upload(caller.stub, "short", b"0123456789abcdef")).created
        with pytest.raises(RpcError) as info:
            await upload(caller.stub, "long", b"0123456789abcdef!")
        assert (info.value.code, info.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "SECRET_TOO_LARGE")
        await caller.channel.close()


async def test_an_injection_is_one_read_and_one_audit_insert_in_the_order_asked(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight secrets of two organizations, one with a newer disabled version: one SELECT per organization and
    one audit INSERT for the call; the values come back in the order asked, each the newest ENABLED one."""
    db = await open_database(store_url, "vault", MIGRATIONS)
    try:
        vault = Vault(db, crypto.MasterKey(bytes(range(32))))
        owner = Actor(ActorKind.KIND_API_KEY, "alice")
        names: list[str] = []
        for org in ("acme", "globex"):
            key = await vault.active_key(org, owner)
            for index in range(4):
                value = f"{org}-{index}".encode()
                sealed = crypto.seal(bytes(key["public_key"]), value)
                await vault.put_secret(org, f"s{index}", key["key_id"], sealed, owner, b"", lambda _: b"")
                names.append(f"orgs/{org}/secrets/s{index}")
            newer = crypto.seal(bytes(key["public_key"]), b"disabled")
            await vault.put_secret(org, "s0", key["key_id"], newer, owner, b"", lambda _: b"")
            await vault.set_version_state(org, "s0", 2, False, owner)
        statements: list[Statement] = []

        def recorded(program: Program[Any]) -> Program[Any]:
            try:
                statement = next(program)
                while True:
                    statements.append(statement)
                    statement = program.send((yield statement))
            except StopIteration as stop:
                return stop.value

        run = db.run
        monkeypatch.setattr(db, "run", lambda program: run(recorded(program)))
        recipient = nacl.public.PrivateKey.generate()
        asked = list(reversed(names))
        opened = await vault.open_secrets(
            asked, bytes(recipient.public_key), Actor(ActorKind.KIND_SERVICE, "taskapp_proxy"), None, None
        )
        box = nacl.public.SealedBox(recipient)
        assert [o.secret for o in opened] == asked
        assert [box.decrypt(o.sealed_value) for o in opened] == [
            n.replace("orgs/", "").replace("/secrets/s", "-").encode() for n in asked
        ]
        assert [o.version for o in opened] == [1] * 8
        reads = [s for s in statements if s.sql.startswith("SELECT")]
        writes = [s for s in statements if not s.sql.startswith("SELECT")]
        assert len(reads) == 2  # one per organization
        assert len(writes) == 1 and writes[0].sql.startswith("INSERT INTO vault_audit")
        audit = [*await vault.list_audit("acme", 0, 100), *await vault.list_audit("globex", 0, 100)]
        injected = [r for r in audit if r["action"] == audit_pb2.AuditEvent.ACTION_INJECT]
        assert sorted(r["secret"] for r in injected) == sorted(names)
    finally:
        await db.close()
