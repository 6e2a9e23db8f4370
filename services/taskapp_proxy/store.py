"""Schema of the taskapp-proxy: one row per registered Task App, the `TaskApp` resource serialized."""

from __future__ import annotations

from mesh.store import Migration

MIGRATIONS = [
    Migration(
        1,
        "registered task apps",
        dialect_sql={
            "sqlite": "CREATE TABLE task_apps (org TEXT NOT NULL, app_id TEXT NOT NULL, body BLOB NOT NULL,"
            " PRIMARY KEY (org, app_id))",
            "postgres": "CREATE TABLE task_apps (org TEXT NOT NULL, app_id TEXT NOT NULL, body BYTEA NOT NULL,"
            " PRIMARY KEY (org, app_id))",
        },
    )
]
