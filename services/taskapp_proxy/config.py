"""Settings of the taskapp-proxy alone (`TANDEM_TASKAPP_*`), beside the shared `mesh.settings.Settings`."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TaskAppProxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_TASKAPP_", extra="forbid")

    default_max_concurrency: int = Field(
        64, ge=1, le=4096, description="Concurrent rollouts per app by default."
    )
    default_rollout_timeout_s: float = Field(600.0, gt=0, description="Deadline of one rollout by default.")
    default_max_retries: int = Field(
        2, ge=0, le=10, description="Retries of unreachable/5xx answers by default."
    )
    breaker_failures: int = Field(5, ge=1, description="Consecutive failures that open an app's circuit.")
    breaker_open_s: float = Field(30.0, gt=0, description="How long an open circuit refuses before a trial.")
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="Largest rollout answer accepted.")
    key_cache_s: float = Field(
        60.0, ge=0, description="How long an app's key stays in memory after a vault read."
    )
    result_cache: int = Field(
        10_000, ge=0, description="Finished rollouts kept by correlation id for repeats."
    )
    check_on_register: bool = Field(
        True, description="Run the conformance kit before accepting a registration."
    )
