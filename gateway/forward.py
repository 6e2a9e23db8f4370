"""How the gateway acts for a caller inside the mesh.

Every forwarded call carries a short-lived user token the gateway signs with the mesh key, scoped to the
caller's organization (`kind=user, org=<org>, sub=<api key name>`): the internal services authorize it
exactly as they authorize any organization principal, so a forwarded call can never reach another
organization even if the gateway's own check were wrong. Internal failures are passed through with their
code, reason and details unchanged, as the contract promises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message

from mesh.errors import R, TandemError
from mesh.identity import Principal, TokenSigner
from mesh.interceptors import AUTHORIZATION_KEY
from mesh.status import RpcError

FORWARD_TOKEN_TTL_S = 300.0
M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Scope:
    """The caller of one gateway call: its organization and the metadata its forwarded calls carry."""

    principal: Principal
    metadata: tuple[tuple[str, str], ...]

    @property
    def org(self) -> str:
        return self.principal.org


class ForwardTokens:
    """Signs (and reuses, until half their life is gone) the org-scoped tokens forwarded calls carry."""

    def __init__(self, signer: TokenSigner) -> None:
        self._signer = signer
        self._tokens: dict[tuple[str, str], tuple[str, float]] = {}

    def scope(self, principal: Principal) -> Scope:
        key = (principal.subject, principal.org)
        cached = self._tokens.get(key)
        now = time.time()
        if cached is None or cached[1] <= now:
            token = self._signer.issue(
                "user", principal.subject, org=principal.org, ttl_s=FORWARD_TOKEN_TTL_S
            )
            if len(self._tokens) > 10_000:
                self._tokens.clear()
            cached = self._tokens[key] = (token, now + FORWARD_TOKEN_TTL_S / 2)
        return Scope(principal, ((AUTHORIZATION_KEY, f"Bearer {cached[0]}"),))


class Forwarded(TandemError):
    """An internal service's failure, re-raised with its own code, reason and details (`Forwarded.of`)."""

    @classmethod
    def of(cls, error: RpcError) -> Forwarded:
        reason = R.ERROR_REASON_UNSPECIFIED
        if error.reason:
            try:
                reason = R.Value(f"ERROR_REASON_{error.reason}")
            except ValueError:
                reason = R.ERROR_REASON_UNSPECIFIED
        code = error.code.name
        if reason == R.ERROR_REASON_UNSPECIFIED:
            # No reason means the transport failed (unreachable, deadline) rather than the service.
            code = "DEADLINE_EXCEEDED" if code == "DEADLINE_EXCEEDED" else "UNAVAILABLE"
            reason = (
                R.ERROR_REASON_DEADLINE_EXCEEDED
                if code == "DEADLINE_EXCEEDED"
                else R.ERROR_REASON_DEPENDENCY_UNAVAILABLE
            )
        metadata = {k: v for k, v in error.metadata.items() if k != "request_id"}
        forwarded = cls(
            error.message,
            reason=reason,
            metadata=metadata,
            violations=error.violations,
            retry_after_s=error.retry_after_s,
        )
        forwarded.code = code
        return forwarded


def convert(message: Message, target: type[M]) -> M:
    """`message` read as `target`: the gateway's request and response messages keep the field numbers and
    types of the internal ones they forward to, so the wire bytes are the conversion."""
    return target.FromString(message.SerializeToString())
