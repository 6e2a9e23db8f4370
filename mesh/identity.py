"""Signed identity tokens: who is calling, on whose behalf, until when.

Services sign a short-lived token for every call they make to another service; the scheduler signs job
tokens for the processes it launches (the vault accepts those for runtime secret injection). A token is
`tdm1.<claims>.<signature>`: base64url JSON claims and an Ed25519 signature (PyNaCl) over them. Verifying
needs only the public key, so a deployment may hand the signing seed to the issuers alone.

**Rotation** (`rotate_signing_key`, `tandem keys rotate-mesh-key`): a new seed replaces `mesh.key`, and the
old key's public half goes to `mesh.key.retired` with a cutoff. Verifiers accept a token signed by a retired
key until its cutoff (and never past it, whatever the token's own expiry says), so services restarted one at
a time onto the new key keep accepting every token issued before: no call fails during the rotation. The
cutoff defaults to an hour and a half, past the longest token life (job tokens: an hour).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import nacl.exceptions
import nacl.signing

from mesh.errors import R, Unauthenticated
from mesh.files import write_atomic

PREFIX = "tdm1"
CLOCK_SKEW_S = 30.0
VERIFIED_CACHE_SIZE = 4096  # tokens whose signature checked out, remembered per verifier
PrincipalKind = Literal["service", "job", "user"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. `org` is empty for mesh services acting on their own behalf."""

    kind: PrincipalKind
    subject: str
    org: str = ""
    token_id: str = ""
    expires_at: float = 0.0
    claims: dict[str, Any] = field(default_factory=dict, compare=False)


class TokenSigner:
    """Issues tokens with the mesh signing key."""

    def __init__(self, signing_key: nacl.signing.SigningKey) -> None:
        self._key = signing_key

    @property
    def verifier(self) -> TokenVerifier:
        return TokenVerifier(self._key.verify_key)

    def issue(
        self,
        kind: PrincipalKind,
        subject: str,
        *,
        org: str = "",
        ttl_s: float = 300.0,
        extra: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> str:
        issued = time.time() if now is None else now
        claims: dict[str, Any] = {
            "kind": kind,
            "sub": subject,
            "org": org,
            "iat": int(issued),
            "exp": issued + ttl_s,
            "jti": secrets.token_hex(8),
        }
        if extra:
            claims["ext"] = extra
        body = _b64(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
        signature = self._key.sign(f"{PREFIX}.{body}".encode()).signature
        return f"{PREFIX}.{body}.{_b64(signature)}"


RETIRED_FILE = "mesh.key.retired"  # JSON lines: {"verify_key": hex, "until": unix seconds}
ROTATION_OVERLAP_S = 5400.0


@dataclass(frozen=True)
class RetiredKey:
    """A signing key that was rotated out: tokens it signed verify until `until`."""

    verify_key: nacl.signing.VerifyKey
    until: float


def load_retired_keys(state_dir: Path, now: float | None = None) -> list[RetiredKey]:
    """The retired keys of `state_dir` whose cutoff has not passed."""
    path = state_dir / RETIRED_FILE
    if not path.exists():
        return []
    current = time.time() if now is None else now
    keys = []
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            if float(entry["until"]) > current:
                keys.append(
                    RetiredKey(
                        nacl.signing.VerifyKey(bytes.fromhex(entry["verify_key"])), float(entry["until"])
                    )
                )
    return keys


def rotate_signing_key(state_dir: Path, overlap_s: float = ROTATION_OVERLAP_S) -> RetiredKey:
    """A new `mesh.key`; the old key's public half retired until now + `overlap_s` (expired entries are
    dropped). The new seed is written beside and renamed into place, so a reader sees the old or the new."""
    old = load_signing_key("", state_dir)
    retired = RetiredKey(old.verify_key, time.time() + overlap_s)
    kept = [k for k in load_retired_keys(state_dir) if bytes(k.verify_key) != bytes(old.verify_key)]
    lines = [
        json.dumps({"verify_key": bytes(k.verify_key).hex(), "until": k.until}) for k in [*kept, retired]
    ]
    _write_private(state_dir / RETIRED_FILE, "\n".join(lines) + "\n")
    _write_private(state_dir / "mesh.key", secrets.token_bytes(32).hex())
    return retired


def _write_private(path: Path, text: str) -> None:
    write_atomic(path, text, mode=0o600, sync=True)


class TokenVerifier:
    """Checks a token's signature and expiry and returns its principal.

    A caller presents the same token on every call until it expires, so the principal of a token whose
    signature checked out is remembered (bounded, least recently used first out) and only its expiry is
    checked again: a signature check costs far more than the rest of a small request's authentication."""

    def __init__(
        self,
        verify_key: nacl.signing.VerifyKey,
        cache_size: int = VERIFIED_CACHE_SIZE,
        retired: Sequence[RetiredKey] = (),
    ) -> None:
        self._key = verify_key
        self._retired = list(retired)
        self._cache_size = cache_size
        self._verified: OrderedDict[str, Principal] = OrderedDict()

    def verify(self, token: str, *, now: float | None = None) -> Principal:
        current = time.time() if now is None else now
        principal = self._verified.get(token)
        if principal is None:
            principal = self._check_signature(token)
            if self._cache_size:
                self._verified[token] = principal
                if len(self._verified) > self._cache_size:
                    self._verified.popitem(last=False)
        else:
            self._verified.move_to_end(token)
        if principal.expires_at + CLOCK_SKEW_S < current:
            self._verified.pop(token, None)
            raise Unauthenticated("credentials have expired", reason=R.ERROR_REASON_CREDENTIALS_EXPIRED)
        return principal

    def _signed_until(self, message: bytes, signature: str) -> float | None:
        """Until when the key that signed `message` is trusted (the current key: forever); None: no key did."""
        if _signed(self._key, message, signature):
            return float("inf")
        for retired in self._retired:
            if retired.until > time.time() and _signed(retired.verify_key, message, signature):
                return retired.until
        return None

    def _check_signature(self, token: str) -> Principal:
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            raise Unauthenticated(
                "credentials are not a Tandem token", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            )
        cutoff = self._signed_until(f"{parts[0]}.{parts[1]}".encode(), parts[2])
        try:
            claims = json.loads(_unb64(parts[1]))
        except (ValueError, TypeError):
            claims = None
        if cutoff is None or claims is None:
            raise Unauthenticated(
                "credentials failed verification", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            ) from None
        if not isinstance(claims, dict) or claims.get("kind") not in ("service", "job", "user"):
            raise Unauthenticated(
                "credentials carry no known kind", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            )
        try:
            expires_at = min(float(claims.get("exp", 0)), cutoff)  # a retired key's tokens end at its cutoff
        except (TypeError, ValueError):
            raise Unauthenticated(
                "credentials carry no valid expiry", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            ) from None
        return Principal(
            kind=claims["kind"],
            subject=str(claims.get("sub", "")),
            org=str(claims.get("org", "")),
            token_id=str(claims.get("jti", "")),
            expires_at=expires_at,
            claims=claims,
        )


def _signed(key: nacl.signing.VerifyKey, message: bytes, signature: str) -> bool:
    try:
        key.verify(message, _unb64(signature))
    except (nacl.exceptions.BadSignatureError, ValueError, TypeError):
        return False
    return True


def load_signing_key(seed_hex: str, state_dir: Path) -> nacl.signing.SigningKey:
    """The mesh key from an explicit hex seed, else from state_dir/mesh.key (created 0600 on first use)."""
    if seed_hex:
        return nacl.signing.SigningKey(bytes.fromhex(seed_hex))
    path = state_dir / "mesh.key"
    if path.exists():
        return nacl.signing.SigningKey(bytes.fromhex(path.read_text().strip()))
    state_dir.mkdir(parents=True, exist_ok=True)
    seed = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process of the mesh created it first
        time.sleep(0.05)
        return nacl.signing.SigningKey(bytes.fromhex(path.read_text().strip()))
    with os.fdopen(fd, "w") as handle:
        handle.write(seed.hex())
    return nacl.signing.SigningKey(seed)
