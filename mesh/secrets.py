"""Secrets for processes, through the vault's runtime injection.

A job task holds only its job token (`TANDEM_JOB_TOKEN`, minted by the scheduler). `open_secrets` makes a
fresh X25519 key pair for the one call, asks the vault to re-seal the requested secrets to it, and opens
them here: the plaintext never crosses the wire and is never written to disk. `inject_env` puts them into
this process's environment for code that reads keys from there. `seal_for_upload` is the client half of
an upload: it seals a value to the organization's public key before it leaves the machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import nacl.public
from tandem.vault.v1 import vault_service_pb2

JOB_TOKEN_ENV = "TANDEM_JOB_TOKEN"  # noqa: S105 - the name of the variable, not a token


def seal_for_upload(public_key: bytes, value: bytes) -> bytes:
    """The ciphertext to send in PutSecret: `value` sealed to the org key (libsodium sealed box)."""
    return bytes(nacl.public.SealedBox(nacl.public.PublicKey(public_key)).encrypt(value))


async def open_secrets(vault: Any, names: Sequence[str], job_token: str | None = None) -> dict[str, bytes]:
    """Open secrets by runtime injection. `vault` is a VaultService stub; the job token defaults to
    `TANDEM_JOB_TOKEN`. Raises the vault's typed errors (SECRET_NOT_DECLARED, CREDENTIALS_EXPIRED, ...)."""
    token = job_token if job_token is not None else os.environ.get(JOB_TOKEN_ENV, "")
    ephemeral = nacl.public.PrivateKey.generate()
    reply = await vault.OpenSecrets(
        vault_service_pb2.OpenSecretsRequest(
            job_token=token, secrets=list(names), recipient_public_key=bytes(ephemeral.public_key)
        )
    )
    box = nacl.public.SealedBox(ephemeral)
    return {sealed.secret: bytes(box.decrypt(sealed.sealed_value)) for sealed in reply.secrets}


async def inject_env(vault: Any, variables: Mapping[str, str], job_token: str | None = None) -> list[str]:
    """Set each environment variable to the value of its secret, e.g.
    `{"ENV_API_KEY": "orgs/acme/secrets/env-key"}`; returns the variables set (never the values)."""
    values = await open_secrets(vault, sorted(set(variables.values())), job_token)
    for variable, name in variables.items():
        os.environ[variable] = values[name].decode()
    return sorted(variables)
