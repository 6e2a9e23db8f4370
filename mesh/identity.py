"""Signed identity tokens: who is calling, on whose behalf, until when.

Services sign a short-lived token for every call they make to another service; the scheduler signs job
tokens for the processes it launches (the vault accepts those for runtime secret injection). A token is
`tdm1.<claims>.<signature>`: base64url JSON claims and an Ed25519 signature (PyNaCl) over them. Verifying
needs only the public key, so a deployment may hand the signing seed to the issuers alone.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import nacl.exceptions
import nacl.signing

from mesh.errors import R, Unauthenticated

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


class TokenVerifier:
    """Checks a token's signature and expiry and returns its principal.

    A caller presents the same token on every call until it expires, so the principal of a token whose
    signature checked out is remembered (bounded, least recently used first out) and only its expiry is
    checked again: a signature check costs far more than the rest of a small request's authentication."""

    def __init__(self, verify_key: nacl.signing.VerifyKey, cache_size: int = VERIFIED_CACHE_SIZE) -> None:
        self._key = verify_key
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

    def _check_signature(self, token: str) -> Principal:
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            raise Unauthenticated(
                "credentials are not a Tandem token", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            )
        try:
            self._key.verify(f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2]))
            claims = json.loads(_unb64(parts[1]))
        except (nacl.exceptions.BadSignatureError, ValueError, TypeError):
            raise Unauthenticated(
                "credentials failed verification", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            ) from None
        if not isinstance(claims, dict) or claims.get("kind") not in ("service", "job", "user"):
            raise Unauthenticated(
                "credentials carry no known kind", reason=R.ERROR_REASON_INVALID_CREDENTIALS
            )
        try:
            expires_at = float(claims.get("exp", 0))
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
