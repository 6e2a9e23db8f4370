"""Settings of the vault alone (`TANDEM_VAULT_*`), beside the shared `mesh.settings.Settings`."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class VaultSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_VAULT_", extra="forbid")

    master_key: str = Field(
        "",
        description="Hex of the 32-byte master key that encrypts the org private keys at rest. Never stored "
        "in the database. Empty: read master_key_file.",
    )
    master_key_file: Path | None = Field(
        None,
        description="File holding the hex master key (mounted from a secret in deployments). Default "
        "state_dir/vault-master.key, generated 0600 on first start when neither is set.",
    )
    max_value_bytes: int = Field(8192, ge=1, le=8192, description="Largest secret value accepted.")
    injection_services: list[str] = Field(
        default_factory=lambda: ["taskapp_proxy"],
        description="Mesh services allowed to open secrets without a job token (Task App key checks).",
    )
    forward_audit: bool = Field(
        True,
        description="Copy audit records to the events service (`orgs/{org}/jobs/vault-audit`, job logs).",
    )
