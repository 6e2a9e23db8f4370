"""Open a task's vault secrets inside the task, then run its command: the in-task half of the secret handoff.

    python -m services.scheduler.backends.task_secrets bash -euo pipefail -c '<the task's script>'

A backend that cannot open secrets for the task itself (Kubernetes: the scheduler never writes a value into
a pod spec or a Kubernetes Secret) starts the task through this module. It reads `TANDEM_SECRETS`
(`ENV=secret-name,OTHER=other-name`: variable names and vault secret names, never values), opens them with
the task's `TANDEM_JOB_TOKEN` through the vault's runtime path (`mesh.secrets.open_secrets`: a fresh key
pair per call, values sealed to it), puts each value into the environment and replaces itself with the
command. The values live only in this process's memory and the command's environment. The vault is found
through the usual settings (`TANDEM_TARGETS__VAULT`, TLS files).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping, Sequence

SECRETS_ENV = "TANDEM_SECRETS"  # the name of the variable; its value names secrets, never holds one


def format_secrets(secret_env: Mapping[str, str]) -> str:
    """`TANDEM_SECRETS`'s value for `{ENV: secret name}`, sorted so the same mapping gives the same text."""
    return ",".join(f"{env}={name}" for env, name in sorted(secret_env.items()))


def parse_secrets(text: str) -> dict[str, str]:
    """The `{ENV: secret name}` mapping written by `format_secrets`; raises ValueError on a malformed item."""
    variables: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        env, sep, name = item.partition("=")
        if not sep or not env or not name:
            raise ValueError(f"{SECRETS_ENV}: expected ENV=secret-name, got {item!r}")
        variables[env] = name
    return variables


async def inject(variables: Mapping[str, str]) -> None:
    """Open `{ENV: secret name}` from the vault with this process's job token into its environment."""
    from tandem.vault.v1 import vault_service_pb2_grpc  # noqa: PLC0415 - only when there are secrets

    from mesh.clients import open_channel  # noqa: PLC0415
    from mesh.secrets import JOB_TOKEN_ENV, inject_env  # noqa: PLC0415
    from mesh.settings import Settings  # noqa: PLC0415

    settings = Settings()
    token = os.environ.get(JOB_TOKEN_ENV, "")
    async with open_channel(settings.target("vault"), settings, token=token) as channel:
        await inject_env(vault_service_pb2_grpc.VaultServiceStub(channel), variables, token)


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m services.scheduler.backends.task_secrets COMMAND [ARG...]", file=sys.stderr)
        return 2
    variables = parse_secrets(os.environ.get(SECRETS_ENV, ""))
    if variables:
        asyncio.run(inject(variables))
    os.environ.pop(SECRETS_ENV, None)
    os.execvp(argv[0], list(argv))  # noqa: S606 - the task's own command, by design


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
