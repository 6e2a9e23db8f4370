"""Schema of the taskapp-proxy: one row per registered Task App, the `TaskApp` resource serialized."""

from __future__ import annotations

from mesh.store import Migration

MIGRATIONS = [
    Migration.portable(
        1,
        "registered task apps",
        "CREATE TABLE task_apps (org TEXT NOT NULL, app_id TEXT NOT NULL, body {blob} NOT NULL,"
        " PRIMARY KEY (org, app_id))",
    )
]
