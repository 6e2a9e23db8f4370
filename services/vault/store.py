"""Schema of the vault. Only ciphertext is stored: secret values sealed to their org key, org private keys
encrypted under the master key (which is never stored here), fingerprints keyed per organization."""

from __future__ import annotations

from mesh.store import Migration

_TABLES = """
    CREATE TABLE vault_org_keys (
        org TEXT NOT NULL, key_id TEXT NOT NULL, public_key {blob} NOT NULL, private_box {blob},
        state INTEGER NOT NULL, create_time DOUBLE PRECISION NOT NULL, rotate_time DOUBLE PRECISION,
        retire_time DOUBLE PRECISION, PRIMARY KEY (org, key_id));
    CREATE TABLE vault_secrets (
        org TEXT NOT NULL, secret_id TEXT NOT NULL, create_time DOUBLE PRECISION NOT NULL,
        update_time DOUBLE PRECISION NOT NULL, PRIMARY KEY (org, secret_id));
    CREATE TABLE vault_versions (
        org TEXT NOT NULL, secret_id TEXT NOT NULL, version INTEGER NOT NULL, state INTEGER NOT NULL,
        fingerprint TEXT NOT NULL, key_id TEXT NOT NULL, sealed {blob} NOT NULL,
        create_time DOUBLE PRECISION NOT NULL, disable_time DOUBLE PRECISION,
        PRIMARY KEY (org, secret_id, version));
    CREATE TABLE vault_audit (
        id {serial} PRIMARY KEY, org TEXT NOT NULL, time DOUBLE PRECISION NOT NULL, actor_kind INTEGER NOT NULL,
        actor_id TEXT NOT NULL, action INTEGER NOT NULL, outcome INTEGER NOT NULL, reason INTEGER NOT NULL,
        secret TEXT NOT NULL, version INTEGER NOT NULL, fingerprint TEXT NOT NULL, key_id TEXT NOT NULL,
        request_id TEXT NOT NULL, message TEXT NOT NULL);
    CREATE INDEX vault_audit_org ON vault_audit (org, id);
    CREATE TABLE vault_requests (
        org TEXT NOT NULL, request_id TEXT NOT NULL, method TEXT NOT NULL, fingerprint TEXT NOT NULL,
        response {blob} NOT NULL, PRIMARY KEY (org, request_id))
"""

MIGRATIONS = [
    Migration.portable(1, "org keys, secrets, versions, audit log, request ids", _TABLES),
    Migration(
        2,
        "audit forwarding cursor",
        "CREATE TABLE vault_forward_cursor (name TEXT PRIMARY KEY, last_id BIGINT NOT NULL)",
    ),
]
