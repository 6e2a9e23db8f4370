"""Organizations, their API keys, and the deployment's admin credential.

A key reads `tdm_<id>_<secret>`: `id` is 12 lowercase hex digits (the last segment of
`orgs/{org}/apiKeys/{id}`), `secret` 43 URL-safe base64 characters (256 random bits). Only the SHA-256 of
the whole key is stored; a presented key is looked up by its id and its hash compared in constant time.
A plain hash suffices (no slow KDF) because the secret is random, not a password.

The admin credential (`tdm_admin_<secret>`) exists only to create organizations. It is read from the
`admin_key` setting or `state_dir/admin.key`, which the first start creates with mode 0600.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from mesh import paging
from mesh.errors import AlreadyExists, NotFound, R, Unauthenticated
from mesh.identity import Principal
from mesh.store import Database, Executor, IntegrityError, Row

KEY_PREFIX = "tdm_"
ADMIN_PREFIX = "tdm_admin_"
ADMIN_SUBJECT = "admin"
ADMIN_KEY_FILE = "admin.key"
LAST_USE_RESOLUTION_S = 60.0  # ApiKey.last_use_time is kept "to the minute"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _new_secret() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


@dataclass(frozen=True)
class OrgRow:
    org: str
    display_name: str
    create_time: float


@dataclass(frozen=True)
class KeyRow:
    key_id: str
    org: str
    display_name: str
    key_prefix: str
    creator: str
    create_time: float
    expire_time: float | None
    revoke_time: float | None
    last_use_time: float | None

    @property
    def name(self) -> str:
        return f"orgs/{self.org}/apiKeys/{self.key_id}"

    def expired(self, now: float) -> bool:
        return self.expire_time is not None and self.expire_time <= now


_KEY_COLUMNS = (
    "key_id, org, display_name, key_prefix, creator, create_time, expire_time, revoke_time, last_use_time"
)


def _key_row(row: Row) -> KeyRow:
    return KeyRow(**{k: row[k] for k in _KEY_COLUMNS.split(", ")})


def admin_principal() -> Principal:
    return Principal(kind="user", subject=ADMIN_SUBJECT, claims={"admin": True})


def is_admin(principal: Principal | None) -> bool:
    return principal is not None and principal.kind == "user" and bool(principal.claims.get("admin"))


def load_admin_key(explicit: str, state_dir: Path) -> tuple[str, Path | None]:
    """The admin credential and the file it lives in (None when given by setting); created on first use."""
    if explicit:
        return explicit, None
    path = state_dir / ADMIN_KEY_FILE
    if path.exists():
        return path.read_text().strip(), path
    state_dir.mkdir(parents=True, exist_ok=True)
    key = ADMIN_PREFIX + _new_secret()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another gateway process of this mesh wrote it first
        time.sleep(0.05)
        return path.read_text().strip(), path
    with os.fdopen(fd, "w") as handle:
        handle.write(key + "\n")
    return key, path


class Orgs:
    """Organizations and API keys over the gateway's store."""

    def __init__(self, db: Database, admin_key: str) -> None:
        self._db = db
        self._admin_hash = digest(admin_key) if admin_key else ""
        self._last_use: dict[str, float] = {}

    # ---- authentication -----------------------------------------------------------------------

    async def authenticate_bearer(self, authorization: str) -> Principal:
        """The principal of an HTTP `Authorization: Bearer <key>` header (the gateway's HTTP endpoints);
        UNAUTHENTICATED when it is missing or not a key this gateway knows."""
        scheme, _, credential = authorization.partition(" ")
        if not credential:
            raise Unauthenticated("this call requires an API key", reason=R.ERROR_REASON_MISSING_CREDENTIALS)
        principal = await self.authenticate(credential) if scheme.lower() == "bearer" else None
        if principal is None:
            raise Unauthenticated("credentials are not recognised", reason=R.ERROR_REASON_INVALID_CREDENTIALS)
        return principal

    async def authenticate(self, credential: str) -> Principal | None:
        """The principal of an API key or the admin credential; None for anything that is neither (the
        next authenticator may know it). A wrong, revoked or expired key raises UNAUTHENTICATED."""
        if not credential.startswith(KEY_PREFIX):
            return None
        if credential.startswith(ADMIN_PREFIX):
            if self._admin_hash and hmac.compare_digest(digest(credential), self._admin_hash):
                return admin_principal()
            raise Unauthenticated("credentials are not valid", reason=R.ERROR_REASON_INVALID_CREDENTIALS)
        key_id = credential[len(KEY_PREFIX) :].partition("_")[0]
        row = await self._db.fetchone(
            f"SELECT {_KEY_COLUMNS}, key_hash FROM gateway_api_keys WHERE key_id = ?",  # noqa: S608 - constant columns
            (key_id,),
        )
        if row is None or not hmac.compare_digest(str(row["key_hash"]), digest(credential)):
            raise Unauthenticated("credentials are not valid", reason=R.ERROR_REASON_INVALID_CREDENTIALS)
        key = _key_row(row)
        now = time.time()
        if key.revoke_time is not None:
            raise Unauthenticated("this API key was revoked", reason=R.ERROR_REASON_INVALID_CREDENTIALS)
        if key.expired(now):
            raise Unauthenticated("this API key has expired", reason=R.ERROR_REASON_CREDENTIALS_EXPIRED)
        await self._touch(key, now)
        return Principal(
            kind="user",
            subject=key.name,
            org=key.org,
            token_id=key.key_id,
            expires_at=key.expire_time or 0.0,
        )

    async def _touch(self, key: KeyRow, now: float) -> None:
        """Record the use at most once a minute per key (a write per call would serialize every call)."""
        last = self._last_use.get(key.key_id, key.last_use_time or 0.0)
        if now - last < LAST_USE_RESOLUTION_S:
            return
        self._last_use[key.key_id] = now
        await self._db.execute(
            "UPDATE gateway_api_keys SET last_use_time = ? WHERE key_id = ?",
            (float(int(now // 60) * 60), key.key_id),
        )

    # ---- organizations ------------------------------------------------------------------------

    async def create_org(self, org: str, display_name: str, creator: str) -> tuple[OrgRow, KeyRow, str]:
        now = time.time()
        try:
            async with self._db.transaction() as tx:
                await tx.execute(
                    "INSERT INTO gateway_orgs (org, display_name, create_time) VALUES (?, ?, ?)",
                    (org, display_name, now),
                )
                key, plaintext = await self._insert_key(tx, org, "first key", creator, now, None)
        except IntegrityError:
            raise AlreadyExists(f"orgs/{org} already exists", reason=R.ERROR_REASON_ALREADY_EXISTS) from None
        return OrgRow(org, display_name, now), key, plaintext

    async def get_org(self, org: str) -> OrgRow:
        row = await self._db.fetchone(
            "SELECT org, display_name, create_time FROM gateway_orgs WHERE org = ?", (org,)
        )
        if row is None:
            raise NotFound(f"orgs/{org} not found", reason=R.ERROR_REASON_ORG_NOT_FOUND)
        return OrgRow(str(row["org"]), str(row["display_name"]), float(row["create_time"]))

    # ---- keys ---------------------------------------------------------------------------------

    async def _insert_key(
        self, tx: Executor, org: str, display_name: str, creator: str, now: float, ttl_s: float | None
    ) -> tuple[KeyRow, str]:
        key_id = secrets.token_hex(6)
        plaintext = f"{KEY_PREFIX}{key_id}_{_new_secret()}"
        row = KeyRow(
            key_id=key_id,
            org=org,
            display_name=display_name,
            key_prefix=plaintext[: len(KEY_PREFIX) + 8],
            creator=creator,
            create_time=now,
            expire_time=now + ttl_s if ttl_s else None,
            revoke_time=None,
            last_use_time=None,
        )
        await tx.execute(
            "INSERT INTO gateway_api_keys (key_id, org, display_name, key_prefix, key_hash, creator,"
            " create_time, expire_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (key_id, org, display_name, row.key_prefix, digest(plaintext), creator, now, row.expire_time),
        )
        return row, plaintext

    async def create_key(
        self, org: str, display_name: str, creator: str, ttl_s: float | None
    ) -> tuple[KeyRow, str]:
        await self.get_org(org)
        async with self._db.transaction() as tx:
            return await self._insert_key(tx, org, display_name, creator, time.time(), ttl_s)

    async def get_key(self, org: str, key_id: str) -> KeyRow:
        row = await self._db.fetchone(
            f"SELECT {_KEY_COLUMNS} FROM gateway_api_keys WHERE org = ? AND key_id = ?",  # noqa: S608 - constant columns
            (org, key_id),
        )
        if row is None:
            raise NotFound(f"orgs/{org}/apiKeys/{key_id} not found", reason=R.ERROR_REASON_ORG_NOT_FOUND)
        return _key_row(row)

    async def list_keys(
        self, org: str, page_size: int, page_token: str, show_inactive: bool
    ) -> tuple[list[KeyRow], str]:
        await self.get_org(org)
        size = paging.page_size(page_size, default=100)
        query = paging.fingerprint("api-keys", org, show_inactive)
        cursor = paging.decode(page_token, query)
        offset = cursor.last_number if cursor else 0
        rows = await self._db.fetchall(
            f"SELECT {_KEY_COLUMNS} FROM gateway_api_keys WHERE org = ? ORDER BY create_time DESC, key_id DESC",  # noqa: S608 - constant columns
            (org,),
        )
        now = time.time()
        keys = [
            k for k in map(_key_row, rows) if show_inactive or (k.revoke_time is None and not k.expired(now))
        ]
        page = keys[offset : offset + size]
        token = paging.encode(query, last_number=offset + size) if len(keys) > offset + size else ""
        return page, token

    async def revoke_key(self, org: str, key_id: str) -> KeyRow:
        key = await self.get_key(org, key_id)
        if key.revoke_time is None:
            await self._db.execute(
                "UPDATE gateway_api_keys SET revoke_time = ? WHERE key_id = ? AND revoke_time IS NULL",
                (time.time(), key_id),
            )
            key = await self.get_key(org, key_id)
        return key

    # ---- idempotent retries -------------------------------------------------------------------

    async def find_request(self, org: str, request_id: str, method: str, fingerprint: str) -> bytes | None:
        """The stored answer of an earlier call with this request id; REQUEST_ID_REUSED if it differed."""
        if not request_id:
            return None
        row = await self._db.fetchone(
            "SELECT fingerprint, response FROM gateway_requests WHERE org = ? AND request_id = ?"
            " AND method = ?",
            (org, request_id, method),
        )
        if row is None:
            return None
        if row["fingerprint"] != fingerprint:
            raise AlreadyExists(
                "request_id was used for a different request", reason=R.ERROR_REASON_REQUEST_ID_REUSED
            )
        return bytes(row["response"])

    async def remember_request(
        self, org: str, request_id: str, method: str, fingerprint: str, response: bytes
    ) -> None:
        if not request_id:
            return
        with contextlib.suppress(IntegrityError):  # a concurrent retry stored the same answer first
            await self._db.execute(
                "INSERT INTO gateway_requests (org, request_id, method, fingerprint, response)"
                " VALUES (?, ?, ?, ?, ?)",
                (org, request_id, method, fingerprint, response),
            )
