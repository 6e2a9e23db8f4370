"""The vault's cryptography, all from libsodium through PyNaCl.

- Org key pairs are X25519 (`PrivateKey`); clients seal to the public half with `SealedBox`
  (`crypto_box_seal`: an ephemeral key pair per message, so a sealed value cannot be attributed or replayed
  into another org's key).
- Org private keys rest encrypted under the master key with `SecretBox` (XSalsa20-Poly1305): envelope
  encryption. The master key lives outside the database.
- Fingerprints are keyed BLAKE2b over the value, with a key derived per organization from the master key, so
  a fingerprint reveals nothing about the value and cannot be correlated across organizations.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import nacl.bindings
import nacl.encoding
import nacl.exceptions
import nacl.hash
import nacl.public
import nacl.secret

ALG = "libsodium.sealedbox.v1"
SEAL_OVERHEAD = 48  # crypto_box_seal: 32-byte ephemeral public key + 16-byte tag


class OpenFailed(Exception):
    """The ciphertext does not open with that key (wrong key, truncated, tampered)."""


def new_key_pair() -> tuple[bytes, bytes]:
    """(private, public) raw 32-byte halves of a fresh X25519 key pair."""
    private = nacl.public.PrivateKey.generate()
    return bytes(private), bytes(private.public_key)


def new_key_id() -> str:
    return "k" + secrets.token_hex(8)


def seal(public_key: bytes, value: bytes) -> bytes:
    """`crypto_box_seal` called directly: what `SealedBox(PublicKey(...)).encrypt` calls, less the two
    wrapper objects built per value (an injection seals one value per secret)."""
    return nacl.bindings.crypto_box_seal(value, public_key)


def unseal(private_key: bytes, sealed: bytes, public_key: bytes | None = None) -> bytes:
    """Open a sealed value. Given the key pair's stored public half, libsodium opens it without deriving
    that half again from the private one (one X25519 multiplication fewer); a public half that does not
    belong to the private one opens nothing."""
    try:
        if public_key is None:
            return nacl.public.SealedBox(nacl.public.PrivateKey(private_key)).decrypt(sealed)
        return nacl.bindings.crypto_box_seal_open(sealed, public_key, private_key)
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise OpenFailed from None


class MasterKey:
    """Wraps org private keys for rest and derives per-org fingerprint keys."""

    def __init__(self, key: bytes) -> None:
        if len(key) != nacl.secret.SecretBox.KEY_SIZE:
            raise ValueError("the vault master key must be 32 bytes (64 hex characters)")
        self._box = nacl.secret.SecretBox(key)
        self._key = key

    def wrap(self, private_key: bytes) -> bytes:
        return bytes(self._box.encrypt(private_key))

    def unwrap(self, boxed: bytes) -> bytes:
        try:
            return self._box.decrypt(boxed)
        except nacl.exceptions.CryptoError:
            raise OpenFailed from None

    def fingerprint(self, org: str, value: bytes) -> str:
        org_key = nacl.hash.blake2b(
            b"tandem.vault.fingerprint:" + org.encode(),
            key=self._key,
            digest_size=32,
            encoder=nacl.encoding.RawEncoder,
        )
        digest = nacl.hash.blake2b(value, key=org_key, digest_size=16, encoder=nacl.encoding.HexEncoder)
        return "b2-" + digest.decode()


def load_master_key(hex_key: str, key_file: Path | None, state_dir: Path) -> MasterKey:
    """From the environment, else the key file, else state_dir/vault-master.key (created 0600 once)."""
    if hex_key:
        return MasterKey(bytes.fromhex(hex_key))
    path = key_file or state_dir / "vault-master.key"
    if path.exists():
        return MasterKey(bytes.fromhex(path.read_text().strip()))
    if key_file is not None:
        raise FileNotFoundError(f"vault master key file {path} does not exist")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return MasterKey(bytes.fromhex(path.read_text().strip()))
    with os.fdopen(fd, "w") as handle:
        handle.write(key.hex())
    return MasterKey(key)
