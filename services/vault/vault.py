"""Organization-scoped secrets that plaintext never reaches at rest or on the wire. Domain code: no grpc.

Every change and its audit record commit in one transaction, so a change that cannot be audited does not
happen (fail closed: AUDIT_UNAVAILABLE). Refusals are audited in a transaction of their own before the
refusal is returned. Uploads, injections and refusals are transaction programs (`mesh.store.Program`), so on
SQLite concurrent calls share a commit (one fsync), each answered only once its own writes are committed.
Plaintext exists only in this process's memory, between opening a sealed value and sealing it again
(upload check, injection, rotation).
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
from mesh.store import Database, Execute, Executor, Fetch, Program, Row, run_on
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


@dataclass(frozen=True)
class _Upload:
    """One PutSecret call, as its transaction program receives it."""

    org: str
    secret_id: str
    key_id: str
    ciphertext: bytes
    actor: Actor
    body: bytes
    record: AuditRecord


PutResult = tuple[bool, dict[str, Any], "SecretMeta"]
RotateResult = tuple[dict[str, Any], list[dict[str, Any]], int]
T = TypeVar("T")

_AUDIT_COLUMNS = (
    "INSERT INTO vault_audit (org, time, actor_kind, actor_id, action, outcome, reason, secret,"
    " version, fingerprint, key_id, request_id, message) VALUES "
)
_AUDIT_ROW = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_AUDIT_INSERT = _AUDIT_COLUMNS + _AUDIT_ROW
_AUDIT_ROWS_PER_INSERT = 64  # 13 parameters a row: well under SQLite's oldest limit of 999 a statement


def _audit_row(record: AuditRecord, now: float | None = None) -> tuple[Any, ...]:
    return (
        record.org,
        time.time() if now is None else now,
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
    )


def _audit_unavailable() -> Unavailable:
    return Unavailable(
        "the audit log cannot be written, so the call was refused", reason=R.ERROR_REASON_AUDIT_UNAVAILABLE
    )


class _AuditStep:
    """The audit insert of a write program, remembering whether it is the statement that failed: a store
    failure there is AUDIT_UNAVAILABLE, anywhere else it is the store's own error."""

    def __init__(self) -> None:
        self.pending = False

    def insert(self, records: Sequence[AuditRecord]) -> Program[None]:
        """One multi-row INSERT for the records (an injection's N secrets): one statement, so one round
        trip on PostgreSQL, for up to 64 records."""
        self.pending = True
        now = time.time()
        for start in range(0, len(records), _AUDIT_ROWS_PER_INSERT):
            chunk = records[start : start + _AUDIT_ROWS_PER_INSERT]
            params = [value for record in chunk for value in _audit_row(record, now)]
            yield Execute(_AUDIT_COLUMNS + ", ".join([_AUDIT_ROW] * len(chunk)), params)
        self.pending = False


def _org_lock_id(org: str) -> int:
    return zlib.crc32(f"tandem.vault:{org}".encode())


async def _lock_org(tx: Executor, org: str) -> None:
    """Serialise key creation, rotation and uploads of one organization (PostgreSQL; SQLite's write
    transactions are serial already)."""
    if tx.dialect == "postgres":
        await tx.execute("SELECT pg_advisory_xact_lock(?)", (_org_lock_id(org),))


def _remember_statement(org: str, actor: Actor, method: str, body: bytes, response: bytes) -> tuple[str, Any]:
    return (
        "INSERT INTO vault_requests (org, request_id, method, fingerprint, response) VALUES (?, ?, ?, ?, ?)",
        (org, actor.request_id, method, hashlib.sha256(body).hexdigest(), response),
    )


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
            await tx.execute(_AUDIT_INSERT, _audit_row(record))
        except Exception as exc:
            raise _audit_unavailable() from exc

    async def _run_audited(self, make: Callable[[_AuditStep], Program[T]]) -> T:
        """Run a write program that audits through the step it is given, in one transaction (shared with
        other callers' programs on SQLite); its audit insert failing fails the call AUDIT_UNAVAILABLE."""
        step = _AuditStep()
        try:
            return await self.db.run(make(step))
        except TandemError:
            raise
        except Exception as exc:
            if step.pending:
                raise _audit_unavailable() from exc
            raise

    async def _write_audit(self, records: Sequence[AuditRecord]) -> None:
        await self._run_audited(lambda step: step.insert(records))

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
            await self._write_audit(records)
        except Unavailable as unavailable:
            return unavailable
        return error

    # ---- idempotency --------------------------------------------------------------------------

    async def _replayed(self, tx: Executor, org: str, actor: Actor, method: str, body: bytes) -> bytes | None:
        return await run_on(tx, self._replayed_program(org, actor, method, body))

    def _replayed_program(self, org: str, actor: Actor, method: str, body: bytes) -> Program[bytes | None]:
        if not actor.request_id:
            return None
        rows: list[Row] = yield Fetch(
            "SELECT method, fingerprint, response FROM vault_requests WHERE org = ? AND request_id = ?",
            (org, actor.request_id),
        )
        if not rows:
            return None
        row = rows[0]
        if row["method"] != method or row["fingerprint"] != hashlib.sha256(body).hexdigest():
            raise AlreadyExists(
                "request_id was already used for a different request", reason=R.ERROR_REASON_REQUEST_ID_REUSED
            )
        return bytes(row["response"])

    async def _remember(
        self, tx: Executor, org: str, actor: Actor, method: str, body: bytes, response: bytes
    ) -> None:
        if actor.request_id:
            await tx.execute(*_remember_statement(org, actor, method, body, response))

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
        the same transaction, so a retry after a lost answer never adds a second version). The check of the
        key, the crypto, the writes and the audit record are one transaction: one hand-off to the store."""
        record = AuditRecord(
            org, actor, Action.ACTION_UPLOAD, secret=secret_name(org, secret_id), key_id=key_id
        )
        upload = _Upload(org, secret_id, key_id, ciphertext, actor, body, record)
        result = await self._run_audited(lambda step: self._put_program(upload, step, encode))
        if isinstance(result, TandemError):
            raise result
        return result

    def _put_program(
        self, up: _Upload, step: _AuditStep, encode: Callable[[PutResult], bytes]
    ) -> Program[PutResult | bytes | TandemError]:
        """The upload's transaction. A refusal is returned, not raised, so that its audit record commits."""
        org, secret_id, record = up.org, up.secret_id, up.record
        replay = yield from self._replayed_program(org, up.actor, "PutSecret", up.body)
        if replay is not None:
            return replay
        if self.db.dialect == "postgres":  # serialise with rotation (SQLite's write transactions are serial)
            yield Execute("SELECT pg_advisory_xact_lock(?)", (_org_lock_id(org),))
        keys: list[Row] = yield Fetch(
            "SELECT public_key, private_box, state FROM vault_org_keys WHERE org = ? AND key_id = ?",
            (org, up.key_id),
        )
        checked = self._open_upload(keys[0] if keys else None, up)
        if isinstance(checked, TandemError):
            record.outcome, record.reason = Outcome.OUTCOME_FAILED, checked.reason
            yield from step.insert([record])
            return checked
        fingerprint, sealed = checked
        now = time.time()
        # A new secret (the common upload) is one INSERT that finds no row in the way; its version is 1 and
        # its metadata is what this program wrote, so nothing is read back. An existing one is updated and
        # its versions are read.
        created = bool(
            (
                yield Execute(
                    "INSERT INTO vault_secrets (org, secret_id, create_time, update_time) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (org, secret_id) DO NOTHING",
                    (org, secret_id, now, now),
                )
            )
        )
        version = 1
        if not created:
            yield Execute(
                "UPDATE vault_secrets SET update_time = ? WHERE org = ? AND secret_id = ?",
                (now, org, secret_id),
            )
            top: list[Row] = yield Fetch(
                "SELECT MAX(version) AS v FROM vault_versions WHERE org = ? AND secret_id = ?",
                (org, secret_id),
            )
            version = int(top[0]["v"] or 0) + 1 if top else 1
        yield Execute(
            "INSERT INTO vault_versions (org, secret_id, version, state, fingerprint, key_id, sealed, create_time)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (org, secret_id, version, VersionState.STATE_ENABLED, fingerprint, up.key_id, sealed, now),
        )
        record.version, record.fingerprint = version, fingerprint
        record.message = "created" if created else "new version"
        yield from step.insert([record])
        if created:
            row: dict[str, Any] = {
                "version": version,
                "state": VersionState.STATE_ENABLED,
                "fingerprint": fingerprint,
                "key_id": up.key_id,
                "create_time": now,
                "disable_time": None,
            }
            meta = SecretMeta(org, secret_id, now, now, [row])
        else:
            found = yield from self._meta_program(org, secret_id)
            assert found is not None
            meta = found
        result = (created, meta.versions[-1], meta)
        if up.actor.request_id:
            yield Execute(*_remember_statement(org, up.actor, "PutSecret", up.body, encode(result)))
        return result

    def _open_upload(self, key: Row | None, up: _Upload) -> tuple[str, bytes] | TandemError:
        """Check an upload against its key: (fingerprint, value sealed again), or why it is refused."""
        if key is None or key["state"] != KeyState.STATE_ACTIVE:
            return FailedPrecondition(
                "key_id is not the organization's active key; fetch the public key again and re-seal",
                reason=R.ERROR_REASON_STALE_KEY_ID,
            )
        public = bytes(key["public_key"])
        try:
            value = crypto.unseal(self.master.unwrap(bytes(key["private_box"])), up.ciphertext, public)
        except crypto.OpenFailed:
            return InvalidArgument(
                "ciphertext does not open with the named key", reason=R.ERROR_REASON_CIPHERTEXT_INVALID
            )
        if len(value) > self.max_value_bytes:
            return InvalidArgument(
                f"the value is larger than {self.max_value_bytes} bytes",
                reason=R.ERROR_REASON_SECRET_TOO_LARGE,
            )
        fingerprint = self.master.fingerprint(up.org, value)
        sealed = crypto.seal(public, value)
        del value
        return fingerprint, sealed

    # ---- metadata -----------------------------------------------------------------------------

    async def _meta(self, ex: Executor, org: str, secret_id: str) -> SecretMeta | None:
        return await run_on(ex, self._meta_program(org, secret_id))

    def _meta_program(self, org: str, secret_id: str) -> Program[SecretMeta | None]:
        rows: list[Row] = yield Fetch(
            "SELECT create_time, update_time FROM vault_secrets WHERE org = ? AND secret_id = ?",
            (org, secret_id),
        )
        if not rows:
            return None
        row = rows[0]
        versions: list[Row] = yield Fetch(
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
        await self._write_audit([record])
        return meta

    async def list_secrets(self, org: str, after: str, limit: int, actor: Actor) -> list[SecretMeta]:
        rows = await self.db.fetchall(
            "SELECT secret_id FROM vault_secrets WHERE org = ? AND secret_id > ? ORDER BY secret_id LIMIT ?",
            (org, after, limit),
        )
        metas = [m for r in rows if (m := await self._meta(self.db, org, r["secret_id"])) is not None]
        await self._write_audit(
            [AuditRecord(org, actor, Action.ACTION_READ_METADATA, message=f"listed {len(metas)} secrets")]
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
        result = await self._run_audited(lambda step: self._open_program(parsed, every, recipient, step))
        if isinstance(result, TandemError):
            raise result
        return result

    def _open_program(
        self,
        parsed: Sequence[tuple[str, str, str]],
        every: Sequence[AuditRecord],
        recipient: bytes,
        step: _AuditStep,
    ) -> Program[list[Opened] | TandemError]:
        """An injection's transaction: read the N secrets, re-seal them on the store's thread (libsodium
        runs without the GIL there, beside the event loop) and audit them in one insert. A refusal is
        returned, not raised, so that its audit records commit."""
        rows = yield from self._enabled_versions([(org, secret_id) for org, secret_id, _ in parsed])
        opened: list[Opened] = []
        failure: TandemError | None = None
        privates: dict[tuple[str, str], bytes] = {}  # this call's unwrapped org keys, dropped on return
        for (org, _, name), record, row in zip(parsed, every, rows, strict=True):
            if row is None or row["private_box"] is None:
                failure = NotFound(
                    f"{name} does not exist or has no enabled version", reason=R.ERROR_REASON_SECRET_NOT_FOUND
                )
                break
            try:
                private = privates.get((org, row["key_id"]))
                if private is None:
                    private = privates[(org, row["key_id"])] = self.master.unwrap(bytes(row["private_box"]))
                value = crypto.unseal(private, bytes(row["sealed"]), bytes(row["public_key"]))
            except crypto.OpenFailed:  # a stored value that does not open: wrong master key or damaged data
                failure = Internal("a stored secret could not be opened; check the vault's master key")
                break
            sealed = crypto.seal(recipient, value)
            del value
            record.version, record.fingerprint = int(row["version"]), row["fingerprint"]
            opened.append(Opened(name, int(row["version"]), row["fingerprint"], sealed))
        privates.clear()
        if failure is not None:
            opened.clear()
            for record in every:
                record.outcome, record.reason = Outcome.OUTCOME_FAILED, failure.reason
        yield from step.insert(every)
        return failure if failure is not None else opened

    def _enabled_versions(self, secrets: Sequence[tuple[str, str]]) -> Program[list[Row | None]]:
        """Each secret's newest ENABLED version with its key's wrapped private half (None where it has
        none): one SELECT per organization named, whatever the number of secrets."""
        by_org: dict[str, list[str]] = {}
        for org, secret_id in secrets:
            by_org.setdefault(org, []).append(secret_id)
        enabled = VersionState.STATE_ENABLED
        found: dict[tuple[str, str], Row] = {}
        for org, ids in by_org.items():
            placeholders = ", ".join("?" for _ in ids)  # the ids themselves are bound parameters
            rows: list[Row] = yield Fetch(
                f"SELECT v.secret_id, v.version, v.fingerprint, v.key_id, v.sealed, k.public_key,"  # noqa: S608
                " k.private_box FROM vault_versions v"
                " JOIN vault_org_keys k ON k.org = v.org AND k.key_id = v.key_id"
                f" WHERE v.org = ? AND v.secret_id IN ({placeholders}) AND v.state = ?"
                " AND v.version = (SELECT MAX(w.version) FROM vault_versions w"
                " WHERE w.org = v.org AND w.secret_id = v.secret_id AND w.state = ?)",
                (org, *ids, enabled, enabled),
            )
            found.update(((org, row["secret_id"]), row) for row in rows)
        return [found.get(key) for key in secrets]

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
