"""gRPC adapter of the vault: proto in, `Vault` call, proto out.

Who may call what:
- organization principals (user tokens scoped to an org, as the gateway issues for API keys) manage their
  own org's secrets; any other org is indistinguishable from an absent one (NOT_FOUND);
- mesh services are trusted for management calls (the gateway scopes users before forwarding);
- job tokens are accepted only by OpenSecrets, inside the request, and only for the secrets the job's spec
  declared; the services in `injection_services` may open secrets without one.
"""

from __future__ import annotations

from typing import Any

import grpc
from tandem.events.v1 import events_service_pb2_grpc
from tandem.vault.v1 import audit_pb2, org_key_pb2, secret_pb2, vault_service_pb2, vault_service_pb2_grpc

from mesh import paging
from mesh.errors import NotFound, PermissionDenied, R, TandemError, Unauthenticated
from mesh.identity import Principal, TokenVerifier
from mesh.interceptors import current_principal
from mesh.jobtokens import JobLiveness
from mesh.server import Deps, Registration
from mesh.settings import SettingsError
from mesh.store import open_database
from mesh.timestamps import stamp as _stamp
from services.vault import crypto
from services.vault.config import VaultSettings
from services.vault.forwarder import AuditForwarder
from services.vault.store import MIGRATIONS
from services.vault.vault import Actor, AuditRecord, PutResult, RotateResult, SecretMeta, Vault, secret_name

SERVICE_NAME = vault_service_pb2.DESCRIPTOR.services_by_name["VaultService"].full_name
pb = vault_service_pb2
Context = grpc.aio.ServicerContext[Any, Any]
ActorKind = audit_pb2.AuditEvent.Actor.Kind
_ACTOR_KINDS = {"user": ActorKind.KIND_API_KEY, "service": ActorKind.KIND_SERVICE, "job": ActorKind.KIND_JOB}


def _version_proto(org: str, secret_id: str, row: dict[str, Any]) -> secret_pb2.SecretVersion:
    return secret_pb2.SecretVersion(
        name=f"{secret_name(org, secret_id)}/versions/{row['version']}",
        version=int(row["version"]),
        state=int(row["state"]),  # type: ignore[arg-type]
        fingerprint=row["fingerprint"],
        key_id=row["key_id"],
        create_time=_stamp(float(row["create_time"])),
        disable_time=_stamp(row["disable_time"]),
    )


def _secret_proto(meta: SecretMeta, full: bool) -> secret_pb2.Secret:
    versions = [_version_proto(meta.org, meta.secret_id, v) for v in meta.versions]
    enabled = [v for v in versions if v.state == secret_pb2.SecretVersion.STATE_ENABLED]
    secret = secret_pb2.Secret(
        name=secret_name(meta.org, meta.secret_id),
        version_count=len(versions),
        create_time=_stamp(meta.create_time),
        update_time=_stamp(meta.update_time),
    )
    if enabled:
        secret.latest_version.CopyFrom(enabled[-1])
    if full:
        secret.versions.extend(versions)
    return secret


def _key_proto(row: dict[str, Any]) -> org_key_pb2.OrgKey:
    return org_key_pb2.OrgKey(
        name=f"orgs/{row['org']}/keys/{row['key_id']}",
        key_id=row["key_id"],
        alg=crypto.ALG,
        public_key=bytes(row["public_key"]),
        state=int(row["state"]),  # type: ignore[arg-type]
        create_time=_stamp(float(row["create_time"])),
        rotate_time=_stamp(row.get("rotate_time")),
        retire_time=_stamp(row.get("retire_time")),
    )


def _audit_proto(row: dict[str, Any]) -> audit_pb2.AuditEvent:
    return audit_pb2.AuditEvent(
        name=f"orgs/{row['org']}/auditEvents/{row['id']}",
        org=f"orgs/{row['org']}",
        actor=audit_pb2.AuditEvent.Actor(kind=int(row["actor_kind"]), id=row["actor_id"]),  # type: ignore[arg-type]
        action=int(row["action"]),  # type: ignore[arg-type]
        outcome=int(row["outcome"]),  # type: ignore[arg-type]
        reason=int(row["reason"]),  # type: ignore[arg-type]
        secret=row["secret"],
        version=int(row["version"]),
        fingerprint=row["fingerprint"],
        key_id=row["key_id"],
        request_id=row["request_id"],
        time=_stamp(float(row["time"])),
        message=row["message"],
    )


class VaultServiceServicer(vault_service_pb2_grpc.VaultServiceServicer):
    """Secret vault: organization-scoped, sealed-box credentials injected only at run time."""

    def __init__(
        self,
        vault: Vault,
        verifier: TokenVerifier,
        injection_services: list[str],
        liveness: JobLiveness | None = None,
    ) -> None:
        self._vault = vault
        self._verifier = verifier
        self._injectors = set(injection_services)
        self._liveness = liveness

    # ---- who is calling -----------------------------------------------------------------------

    def _actor(self, principal: Principal, request_id: str = "") -> Actor:
        return Actor(
            _ACTOR_KINDS.get(principal.kind, ActorKind.KIND_UNSPECIFIED), principal.subject, request_id
        )

    async def _member(self, org: str, request_id: str = "", what: str = "") -> Actor:
        """The acting principal if it may manage `org`; otherwise an audited refusal that reads exactly
        like an absent organization or secret."""
        principal = current_principal()
        actor = self._actor(principal, request_id)
        if principal.kind == "service" or (principal.kind == "user" and principal.org == org):
            return actor
        if principal.kind == "job" and principal.org == org:
            raise await self._vault.refuse(
                AuditRecord(org, actor, audit_pb2.AuditEvent.ACTION_READ_METADATA, secret=what),
                PermissionDenied("job tokens may only open declared secrets (OpenSecrets)"),
            )
        reason = R.ERROR_REASON_SECRET_NOT_FOUND if what else R.ERROR_REASON_ORG_NOT_FOUND
        raise await self._vault.refuse(
            AuditRecord(org, actor, audit_pb2.AuditEvent.ACTION_READ_METADATA, secret=what),
            NotFound(f"{what or 'orgs/' + org} not found", reason=reason),
        )

    # ---- keys ---------------------------------------------------------------------------------

    async def GetPublicKey(
        self, request: pb.GetPublicKeyRequest, context: Context
    ) -> pb.GetPublicKeyResponse:
        org = request.parent.split("/")[1]
        key = await self._vault.active_key(org, await self._member(org))
        return pb.GetPublicKeyResponse(
            key_id=key["key_id"],
            alg=crypto.ALG,
            public_key=bytes(key["public_key"]),
            create_time=_stamp(float(key["create_time"])),
        )

    async def ListOrgKeys(self, request: pb.ListOrgKeysRequest, context: Context) -> pb.ListOrgKeysResponse:
        org = request.parent.split("/")[1]
        await self._member(org)
        query = paging.fingerprint("keys", org)
        cursor = paging.decode(request.page_token, query)
        start = cursor.last_number if cursor else 0
        size = paging.page_size(request.page_size)
        rows = await self._vault.list_keys(org)
        page = rows[start : start + size]
        token = paging.encode(query, last_number=start + size) if start + size < len(rows) else ""
        return pb.ListOrgKeysResponse(keys=[_key_proto(r) for r in page], next_page_token=token)

    async def RotateOrgKey(
        self, request: pb.RotateOrgKeyRequest, context: Context
    ) -> pb.RotateOrgKeyResponse:
        org = request.parent.split("/")[1]
        actor = await self._member(org, request.request_id)

        def encode(result: RotateResult) -> bytes:
            new, previous, count = result
            return pb.RotateOrgKeyResponse(
                new_key=_key_proto(new),
                previous_keys=[_key_proto(k) for k in previous],
                resealed_version_count=count,
            ).SerializeToString()

        result = await self._vault.rotate(org, actor, request.SerializeToString(), encode)
        return pb.RotateOrgKeyResponse.FromString(result if isinstance(result, bytes) else encode(result))

    # ---- secrets ------------------------------------------------------------------------------

    async def PutSecret(self, request: pb.PutSecretRequest, context: Context) -> pb.PutSecretResponse:
        org = request.parent.split("/")[1]
        actor = await self._member(org, request.request_id)

        def response(result: PutResult) -> pb.PutSecretResponse:
            created, version, meta = result
            return pb.PutSecretResponse(
                created=created,
                version=_version_proto(org, request.secret_id, version),
                secret=_secret_proto(meta, full=False),
            )

        result = await self._vault.put_secret(
            org,
            request.secret_id,
            request.key_id,
            request.ciphertext,
            actor,
            # The body fingerprints a request_id's first call; without a request_id nothing reads it.
            request.SerializeToString() if request.request_id else b"",
            lambda result: response(result).SerializeToString(),
        )
        if isinstance(result, bytes):  # the recorded answer to an earlier call with this request_id
            return pb.PutSecretResponse.FromString(result)
        return response(result)

    async def GetSecret(self, request: pb.GetSecretRequest, context: Context) -> pb.GetSecretResponse:
        _, org, _, secret_id = request.name.split("/")
        principal = current_principal()
        visible = principal.kind == "service" or (principal.kind == "user" and principal.org == org)
        if principal.kind == "job" and principal.org == org:
            await self._member(org, what=request.name)  # raises the audited PERMISSION_DENIED
        meta = await self._vault.get_secret(org, secret_id, self._actor(principal), visible=visible)
        full = request.view != secret_pb2.SECRET_VIEW_BASIC
        return pb.GetSecretResponse(secret=_secret_proto(meta, full=full))

    async def ListSecrets(self, request: pb.ListSecretsRequest, context: Context) -> pb.ListSecretsResponse:
        org = request.parent.split("/")[1]
        actor = await self._member(org)
        size = paging.page_size(request.page_size, default=100)
        query = paging.fingerprint("secrets", org, request.view)
        cursor = paging.decode(request.page_token, query)
        metas = await self._vault.list_secrets(org, cursor.last_key if cursor else "", size + 1, actor)
        full = request.view == secret_pb2.SECRET_VIEW_FULL
        token = paging.encode(query, last_key=metas[size - 1].secret_id) if len(metas) > size else ""
        return pb.ListSecretsResponse(
            secrets=[_secret_proto(m, full) for m in metas[:size]], next_page_token=token
        )

    async def DeleteSecret(
        self, request: pb.DeleteSecretRequest, context: Context
    ) -> pb.DeleteSecretResponse:
        _, org, _, secret_id = request.name.split("/")
        actor = await self._member(org, request.request_id, what=request.name)
        await self._vault.delete_secret(org, secret_id, actor, request.SerializeToString())
        return pb.DeleteSecretResponse()

    async def _set_state(self, name: str, request_id: str, enabled: bool) -> secret_pb2.SecretVersion:
        _, org, _, secret_id, _, version = name.split("/")
        actor = await self._member(org, request_id, what=secret_name(org, secret_id))
        row = await self._vault.set_version_state(org, secret_id, int(version), enabled, actor)
        return _version_proto(org, secret_id, row)

    async def DisableSecretVersion(
        self, request: pb.DisableSecretVersionRequest, context: Context
    ) -> pb.DisableSecretVersionResponse:
        return pb.DisableSecretVersionResponse(
            version=await self._set_state(request.name, request.request_id, False)
        )

    async def EnableSecretVersion(
        self, request: pb.EnableSecretVersionRequest, context: Context
    ) -> pb.EnableSecretVersionResponse:
        return pb.EnableSecretVersionResponse(
            version=await self._set_state(request.name, request.request_id, True)
        )

    # ---- runtime injection --------------------------------------------------------------------

    async def OpenSecrets(self, request: pb.OpenSecretsRequest, context: Context) -> pb.OpenSecretsResponse:
        caller = current_principal()
        first_org = request.secrets[0].split("/")[1]
        if request.job_token:
            try:
                job = self._verifier.verify(request.job_token)
                if job.kind != "job":
                    raise Unauthenticated(
                        "job_token is not a job token", reason=R.ERROR_REASON_INVALID_CREDENTIALS
                    )
                if self._liveness is not None:  # an ended job's token opens nothing
                    await self._liveness.check(job)
            except TandemError as error:
                unknown = Actor(ActorKind.KIND_UNAUTHENTICATED, "job-token")
                record = AuditRecord(
                    first_org, unknown, audit_pb2.AuditEvent.ACTION_INJECT, secret=request.secrets[0]
                )
                raise await self._vault.refuse(record, error) from None
            declared = list(job.claims.get("ext", {}).get("secrets", []))
            actor = Actor(ActorKind.KIND_JOB, f"{job.subject}#{job.token_id}")
            opened = await self._vault.open_secrets(
                request.secrets, request.recipient_public_key, actor, job.org, declared
            )
        elif caller.kind == "service" and caller.subject in self._injectors:
            actor = Actor(ActorKind.KIND_SERVICE, caller.subject)
            opened = await self._vault.open_secrets(
                request.secrets, request.recipient_public_key, actor, None, None
            )
        else:
            record = AuditRecord(
                first_org, self._actor(caller), audit_pb2.AuditEvent.ACTION_INJECT, secret=request.secrets[0]
            )
            raise await self._vault.refuse(
                record,
                Unauthenticated(
                    "OpenSecrets needs the job's token", reason=R.ERROR_REASON_MISSING_CREDENTIALS
                ),
            )
        return pb.OpenSecretsResponse(
            secrets=[
                pb.OpenSecretsResponse.SealedSecret(
                    secret=o.secret, version=o.version, fingerprint=o.fingerprint, sealed_value=o.sealed_value
                )
                for o in opened
            ]
        )

    # ---- audit --------------------------------------------------------------------------------

    async def ListAuditEvents(
        self, request: pb.ListAuditEventsRequest, context: Context
    ) -> pb.ListAuditEventsResponse:
        org = request.parent.split("/")[1]
        await self._member(org)
        size = paging.page_size(request.page_size)
        query = paging.fingerprint(
            "audit",
            org,
            request.secret,
            tuple(request.actions),
            tuple(request.outcomes),
            request.since.ToNanoseconds(),
            request.until.ToNanoseconds(),
        )
        cursor = paging.decode(request.page_token, query)
        rows = await self._vault.list_audit(
            org,
            cursor.last_number if cursor else 0,
            size + 1,
            secret=request.secret,
            actions=list(request.actions),
            outcomes=list(request.outcomes),
            since=request.since.ToNanoseconds() / 1e9 if request.HasField("since") else None,
            until=request.until.ToNanoseconds() / 1e9 if request.HasField("until") else None,
        )
        token = paging.encode(query, last_number=int(rows[size - 1]["id"])) if len(rows) > size else ""
        return pb.ListAuditEventsResponse(
            audit_events=[_audit_proto(r) for r in rows[:size]], next_page_token=token
        )


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    config = VaultSettings()
    key_file = config.master_key_file or deps.settings.state_dir / "vault-master.key"
    if not config.master_key and (key_file.with_name(key_file.name + ".new")).exists():
        raise SettingsError(
            f"a master key rewrap of {key_file} did not finish: run `tandem keys rewrap-vault` again"
        )
    master = crypto.load_master_key(config.master_key, config.master_key_file, deps.settings.state_dir)
    db = await open_database(deps.settings.store_url_for("vault"), "vault", MIGRATIONS)
    vault = Vault(db, master, config.max_value_bytes)
    servicer = VaultServiceServicer(vault, deps.verifier, config.injection_services, deps.auth.liveness)
    vault_service_pb2_grpc.add_VaultServiceServicer_to_server(servicer, server)
    events = deps.clients.stub(events_service_pb2_grpc.EventServiceStub, "events")
    forwarder = AuditForwarder(db, events.Publish)
    if config.forward_audit:
        await forwarder.start()
    return Registration(service_names=[SERVICE_NAME], on_stop=[forwarder.stop, db.close])
