"""Schema of the gateway: organizations, their API keys (only a SHA-256 of each key is stored, never the
key), and the answers of mutations that carried a `request_id`, so a retry gets the first answer."""

from __future__ import annotations

from mesh.store import Migration

_TABLES = """
    CREATE TABLE gateway_orgs (
        org TEXT PRIMARY KEY, display_name TEXT NOT NULL, create_time DOUBLE PRECISION NOT NULL);
    CREATE TABLE gateway_api_keys (
        key_id TEXT PRIMARY KEY, org TEXT NOT NULL, display_name TEXT NOT NULL, key_prefix TEXT NOT NULL,
        key_hash TEXT NOT NULL, creator TEXT NOT NULL, create_time DOUBLE PRECISION NOT NULL,
        expire_time DOUBLE PRECISION, revoke_time DOUBLE PRECISION, last_use_time DOUBLE PRECISION);
    CREATE INDEX gateway_api_keys_org ON gateway_api_keys (org, create_time);
    CREATE TABLE gateway_requests (
        org TEXT NOT NULL, request_id TEXT NOT NULL, method TEXT NOT NULL, fingerprint TEXT NOT NULL,
        response {blob} NOT NULL, PRIMARY KEY (org, request_id, method))
"""

MIGRATIONS = [Migration.portable(1, "organizations, API keys, request ids", _TABLES)]
