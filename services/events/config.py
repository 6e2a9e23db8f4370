"""Settings of the events service alone (`TANDEM_EVENTS_*`), beside the shared `mesh.settings.Settings`."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class EventsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_EVENTS_", extra="forbid")

    retention_interval_s: float = Field(
        60.0, gt=0, description="How often the organizations' retention policies are applied to their logs."
    )
    max_group: int = Field(
        256, ge=1, description="Most publish calls committed together in one transaction (group commit)."
    )
