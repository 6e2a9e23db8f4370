"""Re-wrapping the vault's master key: `tandem keys rewrap-vault` (or `python -m services.vault.rekey`).

The master key encrypts every organization's private keys at rest and keys the fingerprints of secret
versions. A new one is made, written beside the old as `<key file>.new` (0600), then one transaction
re-wraps every stored private key under it and recomputes every version's fingerprint (each value opened in
memory only, as a key rotation does), and last the new file replaces the old. The vault must be stopped
meanwhile (it holds the master key in memory): it refuses to start while a `.new` file is there, so a rewrap
that was cut short is never half used; running the command again finishes it, whichever side of the commit
it stopped on. Audit records keep the fingerprints they were written with.

Only a key kept in a file (the default, or `TANDEM_VAULT_MASTER_KEY_FILE`) can be re-wrapped here; a key
given in `TANDEM_VAULT_MASTER_KEY` is the deployment's to replace.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from mesh.settings import Settings
from mesh.store import open_database
from services.vault import crypto
from services.vault.config import VaultSettings
from services.vault.store import MIGRATIONS


@dataclass(frozen=True)
class Rewrapped:
    key_file: Path
    org_keys: int
    versions: int


def key_file_of(settings: Settings, config: VaultSettings) -> Path:
    if config.master_key:
        raise ValueError("the master key is given in TANDEM_VAULT_MASTER_KEY: replace it there, not here")
    return config.master_key_file or settings.state_dir / "vault-master.key"


def pending(key_file: Path) -> Path:
    return key_file.with_name(key_file.name + ".new")


async def rewrap(settings: Settings, config: VaultSettings) -> Rewrapped:
    key_file = key_file_of(settings, config)
    old = crypto.MasterKey(bytes.fromhex(key_file.read_text().strip()))
    new_file = pending(key_file)
    if new_file.exists():
        new = crypto.MasterKey(bytes.fromhex(new_file.read_text().strip()))
    else:
        fd = os.open(new_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            key = secrets.token_bytes(32)
            handle.write(key.hex())
            handle.flush()
            os.fsync(handle.fileno())
        new = crypto.MasterKey(key)
    db = await open_database(settings.store_url_for("vault"), "vault", MIGRATIONS)
    org_keys = versions = 0
    try:
        async with db.transaction() as tx:
            rows = await tx.fetchall(
                "SELECT org, key_id, private_box FROM vault_org_keys WHERE private_box IS NOT NULL"
            )
            privates: dict[tuple[str, str], bytes] = {}
            for row in rows:
                boxed = bytes(row["private_box"])
                try:
                    private = old.unwrap(boxed)
                except crypto.OpenFailed:  # re-wrapped already, by a run cut short after its commit
                    private = new.unwrap(boxed)
                privates[(row["org"], row["key_id"])] = private
                await tx.execute(
                    "UPDATE vault_org_keys SET private_box = ? WHERE org = ? AND key_id = ?",
                    (new.wrap(private), row["org"], row["key_id"]),
                )
            for version in await tx.fetchall(
                "SELECT org, secret_id, version, key_id, sealed FROM vault_versions"
            ):
                opener = privates.get((version["org"], version["key_id"]))
                if opener is None:
                    continue
                value = crypto.unseal(opener, bytes(version["sealed"]))
                await tx.execute(
                    "UPDATE vault_versions SET fingerprint = ? WHERE org = ? AND secret_id = ? AND version = ?",
                    (
                        new.fingerprint(version["org"], value),
                        version["org"],
                        version["secret_id"],
                        version["version"],
                    ),
                )
                del value
                versions += 1
            org_keys = len(privates)
            privates.clear()
    finally:
        await db.close()
    os.replace(new_file, key_file)
    return Rewrapped(key_file, org_keys, versions)


def main() -> int:
    done = asyncio.run(rewrap(Settings(), VaultSettings()))
    print(
        f"re-wrapped {done.org_keys} organization keys and {done.versions} secret versions"
        f" under a new master key in {done.key_file}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
