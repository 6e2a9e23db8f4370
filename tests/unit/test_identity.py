"""Signed identity tokens: round trip, tampering, expiry, wrong key, key file handling."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import nacl.signing
import pytest

from mesh.errors import Unauthenticated
from mesh.identity import TokenSigner, TokenVerifier, load_signing_key


@pytest.fixture
def signer() -> TokenSigner:
    return TokenSigner(nacl.signing.SigningKey.generate())


def test_round_trip_keeps_kind_subject_org(signer: TokenSigner) -> None:
    token = signer.issue("job", "orgs/acme/jobs/run-1", org="acme", ttl_s=60, extra={"secrets": ["env-key"]})
    principal = signer.verifier.verify(token)
    assert (principal.kind, principal.subject, principal.org) == ("job", "orgs/acme/jobs/run-1", "acme")
    assert principal.claims["ext"] == {"secrets": ["env-key"]}
    assert principal.expires_at > time.time()


def test_each_token_is_unique(signer: TokenSigner) -> None:
    assert signer.issue("service", "a") != signer.issue("service", "a")


@pytest.mark.parametrize("position", [5, 20, -3])
def test_any_changed_character_is_rejected(signer: TokenSigner, position: int) -> None:
    token = signer.issue("service", "vault", org="acme")
    flipped = "A" if token[position] != "A" else "B"
    tampered = token[:position] + flipped + token[position + 1 :]
    with pytest.raises(Unauthenticated) as info:
        signer.verifier.verify(tampered)
    assert info.value.reason_name == "INVALID_CREDENTIALS"


def test_claims_cannot_be_swapped_between_tokens(signer: TokenSigner) -> None:
    mine = signer.issue("job", "x", org="acme").split(".")
    theirs = signer.issue("job", "y", org="other").split(".")
    with pytest.raises(Unauthenticated):
        signer.verifier.verify(".".join([mine[0], theirs[1], mine[2]]))


def test_expired_token_is_rejected_after_the_skew_allowance(signer: TokenSigner) -> None:
    now = time.time()
    token = signer.issue("service", "vault", ttl_s=60, now=now - 100)
    with pytest.raises(Unauthenticated) as info:
        signer.verifier.verify(token, now=now)
    assert info.value.reason_name == "CREDENTIALS_EXPIRED"
    within_skew = signer.issue("service", "vault", ttl_s=60, now=now - 80)
    assert signer.verifier.verify(within_skew, now=now).subject == "vault"


def test_a_remembered_token_still_expires(signer: TokenSigner) -> None:
    verifier = TokenVerifier(signer.verifier._key)
    now = time.time()
    token = signer.issue("service", "vault", ttl_s=60, now=now)
    assert verifier.verify(token, now=now).subject == "vault"
    assert verifier.verify(token, now=now + 10).subject == "vault"  # from memory
    with pytest.raises(Unauthenticated) as info:
        verifier.verify(token, now=now + 60 + 31)
    assert info.value.reason_name == "CREDENTIALS_EXPIRED"


def test_a_failed_token_is_never_remembered_and_memory_is_bounded(signer: TokenSigner) -> None:
    verifier = TokenVerifier(signer.verifier._key, cache_size=2)
    token = signer.issue("service", "vault")
    tampered = token[:-3] + ("AAA" if not token.endswith("AAA") else "BBB")
    for _ in range(2):
        with pytest.raises(Unauthenticated):
            verifier.verify(tampered)
    tokens = [signer.issue("service", f"s{i}") for i in range(5)]
    assert [verifier.verify(t).subject for t in tokens] == [f"s{i}" for i in range(5)]
    assert len(verifier._verified) == 2
    assert tampered not in verifier._verified


def test_other_key_is_rejected(signer: TokenSigner) -> None:
    other = TokenVerifier(nacl.signing.SigningKey.generate().verify_key)
    with pytest.raises(Unauthenticated):
        other.verify(signer.issue("service", "vault"))


@pytest.mark.parametrize("garbage", ["", "tdm1", "tdm1..", "tdm2.a.b", "tdm1.!!!.???", "a.b.c.d"])
def test_garbage_is_rejected_without_echoing_it(signer: TokenSigner, garbage: str) -> None:
    with pytest.raises(Unauthenticated) as info:
        signer.verifier.verify(garbage)
    assert garbage not in info.value.message or garbage == ""


def test_key_file_is_created_private_and_reused(tmp_path: Path) -> None:
    first = load_signing_key("", tmp_path)
    mode = stat.S_IMODE((tmp_path / "mesh.key").stat().st_mode)
    assert mode == 0o600
    assert load_signing_key("", tmp_path).encode() == first.encode()
    explicit = load_signing_key("11" * 32, tmp_path)
    assert explicit.encode() == bytes.fromhex("11" * 32)
