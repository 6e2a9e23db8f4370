"""Organization-scoped secrets that plaintext never reaches at rest or on the wire. Domain code: no grpc.

Every change and its audit record commit in one transaction, so a change that cannot be audited does not
happen (fail closed: AUDIT_UNAVAILABLE). Refusals are audited in a transaction of their own before the
refusal is returned. Plaintext exists only in this process's memory, between opening a sealed value and
sealing it again (upload check, injection, rotation).
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.vault.v1 import audit_pb2, org_key_pb2, secret_pb2

from mesh.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    R,
    TandemError,
    Unavailable,
)
from mesh.store import Database, Executor
from services.vault import crypto

Action = audit_pb2.AuditEvent.Action
Outcome = audit_pb2.AuditEvent.Outcome
ActorKind = audit_pb2.AuditEvent.Actor.Kind
KeyState = org_key_pb2.OrgKey
VersionState = secret_pb2.SecretVersion


@dataclass(frozen=True)
class Actor:
    """Who acts, as the audit log records it."""

    kind: int
    id: str
    request_id: str = ""


@dataclass
class AuditRecord:
    org: str
    actor: Actor
    action: int
    outcome: int = Outcome.OUTCOME_ALLOWED
    reason: int = 0
    secret: str = ""
    version: int = 0
    fingerprint: str = ""
    key_id: str = ""
    message: str = ""


@dataclass
class Opened:
    """One injected secret: its name, version, fingerprint and the value sealed to the recipient."""

    secret: str
    version: int
    fingerprint: str
    sealed_value: bytes


@dataclass
class SecretMeta:
    org: str
    secret_id: str
    create_time: float
    update_time: float
    versions: list[dict[str, Any]] = field(default_factory=list)


PutResult = tuple[bool, dict[str, Any], "SecretMeta"]
RotateResult = tuple[dict[str, Any], list[dict[str, Any]], int]


async def _lock_org(tx: Executor, org: str) -> None:
    """Serialise key creation, rotation and uploads of one organization (PostgreSQL; SQLite's write
    transactions are serial already)."""
    if tx.dialect == "postgres":
        await tx.execute("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(f"tandem.vault:{org}".encode()),))


def secret_name(org: str, secret_id: str) -> str:
    return f"orgs/{org}/secrets/{secret_id}"


class Vault:
    def __init__(self, db: Database, master: crypto.MasterKey, max_value_bytes: int = 8192) -> None:
        self.db = db
        self.master = master
        self.max_value_bytes = max_value_bytes

    # ---- audit --------------------------------------------------------------------------------

    async def _audit(self, tx: Executor, record: AuditRecord) -> None:
        try:
            await tx.execute(
                "INSERT INTO vault_audit (org, time, actor_kind, actor_id, action, outcome, reason, secret,"
                " version, fingerprint, key_id, request_id, message) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.org,
                    time.time(),
                    record.actor.kind,
                    record.actor.id,
                    record.action,
                    record.outcome,
                    record.reason,
                    record.secret,
                    record.version,
                    record.fingerprint,
                    record.key_id,
                    record.actor.request_id,
                    record.message,
                ),
            )
        except Exception as exc:
            raise Unavailable(
                "the audit log cannot be written, so the call was refused",
                reason=R.ERROR_REASON_AUDIT_UNAVAILABLE,
            ) from exc

    async def refuse(
        self, record: AuditRecord | Sequence[AuditRecord], error: TandemError, *, failed: bool = False
    ) -> TandemError:
        """Audit a refusal, then hand back the error to raise (AUDIT_UNAVAILABLE if it cannot be audited).
        `failed` marks an entitled caller whose call failed (stale key, bad ciphertext, unknown secret)
        rather than a caller who was denied."""
        records = [record] if isinstance(record, AuditRecord) else list(record)
        for item in records:
            item.outcome = Outcome.OUTCOME_FAILED if failed else Outcome.OUTCOME_DENIED
            item.reason = error.reason
        try:
            async with self.db.transaction() as tx:
                for item in records:
                    await self._audit(tx, item)
        except Unavailable as unavailable:
            return unavailable
        return error

    # ---- idempotency --------------------------------------------------------------------------

    async def _replayed(self, tx: Executor, org: str, actor: Actor, method: str, body: bytes) -> bytes | None:
        if not actor.request_id:
            return None
        row = await tx.fetchone(
            "SELECT method, fingerprint, response FROM vault_requests WHERE org = ? AND request_id = ?",
            (org, actor.request_id),
        )
        if row is None:
            return None
        if row["method"] != method or row["fingerprint"] != hashlib.sha256(body).hexdigest():
            raise AlreadyExists(
                "request_id was already used for a different request", reason=R.ERROR_REASON_REQUEST_ID_REUSED
            )
        return bytes(row["response"])

    async def _remember(
        self, tx: Executor, org: str, actor: Actor, method: str, body: bytes, response: bytes
    ) -> None:
        if actor.request_id:
            await tx.execute(
                "INSERT INTO vault_requests (org, request_id, method, fingerprint, response) VALUES (?, ?, ?, ?, ?)",
                (org, actor.request_id, method, hashlib.sha256(body).hexdigest(), response),
            )

    # ---- org keys -----------------------------------------------------------------------------

    async def active_key(self, org: str, actor: Actor) -> dict[str, Any]:
        """The org's ACTIVE key pair row; generated (and audited as CREATE_KEY) on first use."""
        row = await self.db.fetchone(
            "SELECT * FROM vault_org_keys WHERE org = ? AND state = ?", (org, KeyState.STATE_ACTIVE)
        )
        if row is not None:
            return row
        async with self.db.transaction() as tx:
            await _lock_org(tx, org)
            row = await tx.fetchone(
                "SELECT * FROM vault_org_keys WHERE org = ? AND state = ?", (org, KeyState.STATE_ACTIVE)
            )
            if row is not None:
                return row
            created = await self._create_key(tx, org)
            await self._audit(tx, AuditRecord(org, actor, Action.ACTION_CREATE_KEY, key_id=created["key_id"]))
            return created

    async def _create_key(self, tx: Executor, org: str) -> dict[str, Any]:
        private, public = crypto.new_key_pair()
        key_id = crypto.new_key_id()
        now = time.time()
        await tx.execute(
            "INSERT INTO vault_org_keys (org, key_id, public_key, private_box, state, create_time)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (org, key_id, public, self.master.wrap(private), KeyState.STATE_ACTIVE, now),
        )
        return {
            "org": org,
            "key_id": key_id,
            "public_key": public,
            "state": KeyState.STATE_ACTIVE,
            "create_time": now,
        }

    async def list_keys(self, org: str) -> list[dict[str, Any]]:
        return await self.db.fetchall(
            "SELECT org, key_id, public_key, state, create_time, rotate_time, retire_time FROM vault_org_keys"
            " WHERE org = ? ORDER BY create_time DESC, key_id",
            (org,),
        )

    # ---- upload -------------------------------------------------------------------------------

    async def put_secret(
        self,
        org: str,
        secret_id: str,
        key_id: str,
        ciphertext: bytes,
        actor: Actor,
        body: bytes,
        encode: Callable[[PutResult], bytes],
    ) -> PutResult | bytes:
        """Store a sealed value as the secret's next version. Returns (created, version, secret), or the
        response bytes recorded for an earlier call with the same request_id (`encode` makes them, inside
        the same transaction, so a retry after a lost answer never adds a second version)."""
        name = secret_name(org, secret_id)
        record = AuditRecord(org, actor, Action.ACTION_UPLOAD, secret=name, key_id=key_id)
        async with self.db.transaction() as tx:
            replay = await self._replayed(tx, org, actor, "PutSecret", body)
            if replay is not None:
                return replay
            key = await tx.fetchone(
                "SELECT * FROM vault_org_keys WHERE org = ? AND key_id = ?", (org, key_id)
            )
        if key is None or key["state"] != KeyState.STATE_ACTIVE:
            raise await self.refuse(
                record,
                FailedPrecondition(
                    "key_id is not the organization's active key; fetch the public key again and re-seal",
                    reason=R.ERROR_REASON_STALE_KEY_ID,
                ),
                failed=True,
            )
        try:
            value = crypto.unseal(self.master.unwrap(bytes(key["private_box"])), ciphertext)
        except crypto.OpenFailed:
            raise await self.refuse(
                record,
                InvalidArgument(
                    "ciphertext does not open with the named key", reason=R.ERROR_REASON_CIPHERTEXT_INVALID
                ),
                failed=True,
            ) from None
        if len(value) > self.max_value_bytes:
            raise await self.refuse(
                record,
                InvalidArgument(
                    f"the value is larger than {self.max_value_bytes} bytes",
                    reason=R.ERROR_REASON_SECRET_TOO_LARGE,
                ),
                failed=True,
            )
        fingerprint = self.master.fingerprint(org, value)
        resealed = crypto.seal(bytes(key["public_key"]), value)
        del value
        now = time.time()
        async with self.db.transaction() as tx:
            replay = await self._replayed(tx, org, actor, "PutSecret", body)
            if replay is not None:
                return replay
            await _lock_org(tx, org)
            current = await tx.fetchone(
                "SELECT state FROM vault_org_keys WHERE org = ? AND key_id = ?", (org, key_id)
            )
            if current is None or current["state"] != KeyState.STATE_ACTIVE:  # rotated while we checked
                stale = FailedPrecondition(
                    "key_id was rotated during the upload; fetch the public key again and re-seal",
                    reason=R.ERROR_REASON_STALE_KEY_ID,
                )
                record.outcome, record.reason = Outcome.OUTCOME_FAILED, stale.reason
                await self._audit(tx, record)
                raise stale
            existing = await tx.fetchone(
                "SELECT create_time FROM vault_secrets WHERE org = ? AND secret_id = ?", (org, secret_id)
            )
            created = existing is None
            if created:
                await tx.execute(
                    "INSERT INTO vault_secrets (org, secret_id, create_time, update_time) VALUES (?, ?, ?, ?)",
                    (org, secret_id, now, now),
                )
            else:
                await tx.execute(
                    "UPDATE vault_secrets SET update_time = ? WHERE org = ? AND secret_id = ?",
                    (now, org, secret_id),
                )
            row = await tx.fetchone(
                "SELECT MAX(version) AS v FROM vault_versions WHERE org = ? AND secret_id = ?",
                (org, secret_id),
            )
            version = int(row["v"] or 0) + 1 if row else 1
            await tx.execute(
                "INSERT INTO vault_versions (org, secret_id, version, state, fingerprint, key_id, sealed, create_time)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (org, secret_id, version, VersionState.STATE_ENABLED, fingerprint, key_id, resealed, now),
            )
            record.version, record.fingerprint = version, fingerprint
            record.message = "created" if created else "new version"
            await self._audit(tx, record)
            meta = await self._meta(tx, org, secret_id)
            assert meta is not None
            result = (created, meta.versions[-1], meta)
            await self._remember(tx, org, actor, "PutSecret", body, encode(result))
        return result

    # ---- metadata -----------------------------------------------------------------------------

    async def _meta(self, ex: Executor, org: str, secret_id: str) -> SecretMeta | None:
        row = await ex.fetchone(
            "SELECT create_time, update_time FROM vault_secrets WHERE org = ? AND secret_id = ?",
            (org, secret_id),
        )
        if row is None:
            return None
        versions = await ex.fetchall(
            "SELECT version, state, fingerprint, key_id, create_time, disable_time FROM vault_versions"
            " WHERE org = ? AND secret_id = ? ORDER BY version",
            (org, secret_id),
        )
        return SecretMeta(org, secret_id, float(row["create_time"]), float(row["update_time"]), versions)

    async def get_secret(self, org: str, secret_id: str, actor: Actor, visible: bool = True) -> SecretMeta:
        """Metadata of one secret, audited as READ_METADATA. `visible=False` (another org's caller) takes
        the same path and answers exactly as for a secret that does not exist."""
        name = secret_name(org, secret_id)
        meta = await self._meta(self.db, org, secret_id)
        record = AuditRecord(org, actor, Action.ACTION_READ_METADATA, secret=name)
        if meta is None or not visible:
            missing = NotFound(f"{name} not found", reason=R.ERROR_REASON_SECRET_NOT_FOUND)
            raise await self.refuse(record, missing, failed=visible)
        async with self.db.transaction() as tx:
            await self._audit(tx, record)
        return meta

    async def list_secrets(self, org: str, after: str, limit: int, actor: Actor) -> list[SecretMeta]:
        rows = await self.db.fetchall(
            "SELECT secret_id FROM vault_secrets WHERE org = ? AND secret_id > ? ORDER BY secret_id LIMIT ?",
            (org, after, limit),
        )
        metas = [m for r in rows if (m := await self._meta(self.db, org, r["secret_id"])) is not None]
        async with self.db.transaction() as tx:
            await self._audit(
                tx,
                AuditRecord(org, actor, Action.ACTION_READ_METADATA, message=f"listed {len(metas)} secrets"),
            )
        return metas

    # ---- changes ------------------------------------------------------------------------------

    async def delete_secret(self, org: str, secret_id: str, actor: Actor, body: bytes) -> None:
        name = secret_name(org, secret_id)
        record = AuditRecord(org, actor, Action.ACTION_DELETE, secret=name)
        async with self.db.transaction() as tx:
            if await self._replayed(tx, org, actor, "DeleteSecret", body) is not None:
                return
            deleted = await tx.execute(
                "DELETE FROM vault_secrets WHERE org = ? AND secret_id = ?", (org, secret_id)
            )
            if deleted:
                await tx.execute(
                    "DELETE FROM vault_versions WHERE org = ? AND secret_id = ?", (org, secret_id)
                )
                await self._audit(tx, record)
                await self._remember(tx, org, actor, "DeleteSecret", body, b"")
                return
        missing = NotFound(f"{name} not found", reason=R.ERROR_REASON_SECRET_NOT_FOUND)
        raise await self.refuse(record, missing, failed=True)

    async def set_version_state(
        self, org: str, secret_id: str, version: int, enabled: bool, actor: Actor
    ) -> dict[str, Any]:
        name = secret_name(org, secret_id)
        action = Action.ACTION_ENABLE_VERSION if enabled else Action.ACTION_DISABLE_VERSION
        record = AuditRecord(org, actor, action, secret=name, version=version)
        state = VersionState.STATE_ENABLED if enabled else VersionState.STATE_DISABLED
        async with self.db.transaction() as tx:
            row = await tx.fetchone(
                "SELECT state, fingerprint FROM vault_versions WHERE org = ? AND secret_id = ? AND version = ?",
                (org, secret_id, version),
            )
            if row is not None:
                if row["state"] != state:
                    await tx.execute(
                        "UPDATE vault_versions SET state = ?, disable_time = ? WHERE org = ? AND secret_id = ?"
                        " AND version = ?",
                        (state, None if enabled else time.time(), org, secret_id, version),
                    )
                record.fingerprint = row["fingerprint"]
                await self._audit(tx, record)
                meta = await self._meta(tx, org, secret_id)
                assert meta is not None
                return next(v for v in meta.versions if int(v["version"]) == version)
        missing = NotFound(f"{name}/versions/{version} not found", reason=R.ERROR_REASON_SECRET_NOT_FOUND)
        raise await self.refuse(record, missing, failed=True)

    # ---- runtime injection --------------------------------------------------------------------

    async def open_secrets(
        self,
        names: Sequence[str],
        recipient: bytes,
        actor: Actor,
        token_org: str | None,
        declared: Sequence[str] | None,
    ) -> list[Opened]:
        """Re-seal each secret's newest ENABLED version to `recipient`. `token_org`/`declared` come from a
        job token; both None means a trusted mesh service. All or nothing; every secret is audited."""
        parsed = [(n.split("/")[1], n.split("/")[3], n) for n in names]
        if len(set(names)) != len(names):
            raise InvalidArgument("secrets must be distinct")
        every = [AuditRecord(org, actor, Action.ACTION_INJECT, secret=name) for org, _, name in parsed]
        for org, _, name in parsed:
            if token_org is not None and (org != token_org or declared is None or name not in declared):
                raise await self.refuse(
                    every,
                    PermissionDenied(
                        f"{name} is not declared by this job's spec",
                        reason=R.ERROR_REASON_SECRET_NOT_DECLARED,
                    ),
                )
        opened: list[Opened] = []
        for (org, secret_id, name), record in zip(parsed, every, strict=True):
            row = await self.db.fetchone(
                "SELECT v.version, v.fingerprint, v.sealed, k.private_box FROM vault_versions v"
                " JOIN vault_org_keys k ON k.org = v.org AND k.key_id = v.key_id"
                " WHERE v.org = ? AND v.secret_id = ? AND v.state = ? ORDER BY v.version DESC LIMIT 1",
                (org, secret_id, VersionState.STATE_ENABLED),
            )
            if row is None or row["private_box"] is None:
                raise await self.refuse(
                    every,
                    NotFound(
                        f"{name} does not exist or has no enabled version",
                        reason=R.ERROR_REASON_SECRET_NOT_FOUND,
                    ),
                    failed=True,
                )
            try:
                value = crypto.unseal(self.master.unwrap(bytes(row["private_box"])), bytes(row["sealed"]))
            except crypto.OpenFailed:  # a stored value that does not open: wrong master key or damaged data
                raise await self.refuse(
                    every,
                    Internal("a stored secret could not be opened; check the vault's master key"),
                    failed=True,
                ) from None
            sealed = crypto.seal(recipient, value)
            del value
            record.version, record.fingerprint = int(row["version"]), row["fingerprint"]
            opened.append(Opened(name, int(row["version"]), row["fingerprint"], sealed))
        records = every
        async with self.db.transaction() as tx:
            for record in records:
                await self._audit(tx, record)
        return opened

    # ---- rotation -----------------------------------------------------------------------------

    async def rotate(
        self, org: str, actor: Actor, body: bytes, encode: Callable[[RotateResult], bytes]
    ) -> RotateResult | bytes:
        """New ACTIVE key; every version re-sealed to it; older keys RETIRED with their private halves
        destroyed. One transaction: a crash rolls the whole rotation back, never half of it."""
        async with self.db.transaction() as tx:
            replay = await self._replayed(tx, org, actor, "RotateOrgKey", body)
            if replay is not None:
                return replay
            await _lock_org(tx, org)
            old_keys = await tx.fetchall(
                "SELECT * FROM vault_org_keys WHERE org = ? AND state != ?", (org, KeyState.STATE_RETIRED)
            )
            now = time.time()
            await tx.execute(
                "UPDATE vault_org_keys SET state = ?, rotate_time = ? WHERE org = ? AND state = ?",
                (KeyState.STATE_DECRYPT_ONLY, now, org, KeyState.STATE_ACTIVE),
            )
            new = await self._create_key(tx, org)
            privates = {
                k["key_id"]: self.master.unwrap(bytes(k["private_box"])) for k in old_keys if k["private_box"]
            }
            versions = await tx.fetchall(
                "SELECT secret_id, version, key_id, sealed FROM vault_versions WHERE org = ?", (org,)
            )
            for version in versions:
                value = crypto.unseal(privates[version["key_id"]], bytes(version["sealed"]))
                await tx.execute(
                    "UPDATE vault_versions SET sealed = ?, key_id = ? WHERE org = ? AND secret_id = ? AND version = ?",
                    (
                        crypto.seal(bytes(new["public_key"]), value),
                        new["key_id"],
                        org,
                        version["secret_id"],
                        version["version"],
                    ),
                )
                del value
            privates.clear()
            await tx.execute(
                "UPDATE vault_org_keys SET state = ?, private_box = NULL, retire_time = ?"
                " WHERE org = ? AND key_id != ? AND state != ?",
                (KeyState.STATE_RETIRED, now, org, new["key_id"], KeyState.STATE_RETIRED),
            )
            await self._audit(
                tx,
                AuditRecord(
                    org,
                    actor,
                    Action.ACTION_ROTATE,
                    key_id=new["key_id"],
                    message=f"re-sealed {len(versions)} versions",
                ),
            )
            previous = await tx.fetchall(
                "SELECT org, key_id, public_key, state, create_time, rotate_time, retire_time FROM vault_org_keys"
                " WHERE org = ? AND key_id != ? ORDER BY create_time DESC",
                (org, new["key_id"]),
            )
            result = (new, previous, len(versions))
            await self._remember(tx, org, actor, "RotateOrgKey", body, encode(result))
            return result

    # ---- audit reads --------------------------------------------------------------------------

    async def list_audit(
        self,
        org: str,
        before_id: int,
        limit: int,
        secret: str = "",
        actions: Sequence[int] = (),
        outcomes: Sequence[int] = (),
        since: float | None = None,
        until: float | None = None,
    ) -> list[dict[str, Any]]:
        clauses = ["org = ?", "id < ?"]
        params: list[Any] = [org, before_id or 2**62]
        if secret:
            clauses.append("secret = ?")
            params.append(secret)
        if actions:
            clauses.append(f"action IN ({', '.join('?' for _ in actions)})")
            params.extend(actions)
        if outcomes:
            clauses.append(f"outcome IN ({', '.join('?' for _ in outcomes)})")
            params.extend(outcomes)
        if since is not None:
            clauses.append("time >= ?")
            params.append(since)
        if until is not None:
            clauses.append("time < ?")
            params.append(until)
        return await self.db.fetchall(
            f"SELECT * FROM vault_audit WHERE {' AND '.join(clauses)} ORDER BY id DESC LIMIT ?",  # noqa: S608
            (*params, limit),
        )
