"""Typed settings for every Tandem process.

Values come, highest priority first, from constructor arguments, `TANDEM_*` environment variables
(nested fields with `__`, e.g. `TANDEM_PORTS__VAULT=6001`), a TOML file named by `TANDEM_CONFIG`, and the
defaults below. `tandem up` needs none of them: everything lives under `state_dir` on loopback.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

SERVICE_NAMES = ("gateway", "vault", "scheduler", "taskapp_proxy", "events")


class Ports(BaseModel):
    """The port each service listens on; 0 picks a free port at start (tests use this)."""

    gateway: int = Field(50050, ge=0, le=65535, description="Public API, the only port users need.")
    vault: int = Field(50051, ge=0, le=65535, description="Secret vault.")
    scheduler: int = Field(50052, ge=0, le=65535, description="Job scheduler.")
    taskapp_proxy: int = Field(50053, ge=0, le=65535, description="Task App proxy.")
    events: int = Field(50054, ge=0, le=65535, description="Event stream.")
    inference: int = Field(
        0,
        ge=0,
        le=65535,
        description="An inference worker (one per process, several per node): 0 picks a free port.",
    )
    trainer: int = Field(
        0, ge=0, le=65535, description="A job's trainer (TrainerService, one per job): 0 picks a free port."
    )


class Targets(BaseModel):
    """Where clients reach each service (`host:port`); empty means `host` and the port from `ports`."""

    gateway: str = ""
    vault: str = ""
    scheduler: str = ""
    taskapp_proxy: str = ""
    events: str = ""


class Tls(BaseModel):
    """mTLS between services. All three files set turns it on; none set means plaintext on loopback."""

    cert_file: Path | None = Field(None, description="PEM certificate this process presents.")
    key_file: Path | None = Field(None, description="PEM private key for cert_file.")
    ca_file: Path | None = Field(None, description="PEM CA bundle that peer certificates must chain to.")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file and self.key_file and self.ca_file)

    @model_validator(mode="after")
    def _all_or_none(self) -> Tls:
        """A partial setup is an error, never a silently plaintext mesh; a named file must exist."""
        names = ("cert_file", "key_file", "ca_file")
        given = [n for n in names if getattr(self, n)]
        if given and len(given) < len(names):
            missing = ", ".join(n for n in names if n not in given)
            raise ValueError(
                f"cert_file, key_file and ca_file go together (all three for mTLS, none for plaintext); "
                f"{missing} not set"
            )
        for name in given:
            path: Path = getattr(self, name)
            if not path.is_file():
                raise ValueError(f"{name} names {path}, which is not a file")
        return self


class SettingsError(ValueError):
    """A setting that cannot be used; the message names it."""


def config_path(value: str) -> Path:
    """`TANDEM_CONFIG`'s file, which must exist and be TOML: a missing file is an error, never ignored."""
    path = Path(value)
    if not path.is_file():
        raise SettingsError(f"TANDEM_CONFIG names {value}, which is not a file")
    try:
        tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise SettingsError(f"TANDEM_CONFIG names {value}, which is not readable TOML: {error}") from None
    return path


def settings_problem(error: Exception) -> str | None:
    """One line per bad setting of a settings error, naming each setting; None for other errors."""
    if isinstance(error, SettingsError):
        return str(error)
    if isinstance(error, ValidationError):
        lines = []
        for item in error.errors():
            where = ".".join(str(part) for part in item["loc"]) or "(the whole configuration)"
            message = str(item["msg"]).removeprefix("Value error, ")
            lines.append(f"setting {where} of {error.title}: {message}")
        return "; ".join(lines)
    return None


class Settings(BaseSettings):
    """Settings shared by every service; each field is documented for `tandem up --help-settings`."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    state_dir: Path = Field(Path(".tandem"), description="Folder for SQLite files, keys, logs and traces.")
    host: str = Field("127.0.0.1", description="Interface the services bind to.")
    ports: Ports = Field(default_factory=Ports)
    targets: Targets = Field(default_factory=Targets)
    store_url: str = Field(
        "",
        description="Database URL. Empty: one SQLite file per service in state_dir. "
        "`postgresql://user:pass@host/db` for the scale-out store; `sqlite:///path.db` for an explicit file.",
    )
    mesh_key: str = Field(
        "",
        description="Hex seed of the Ed25519 key that signs service and job tokens. Empty: read or create "
        "state_dir/mesh.key. In deployments, mount it from a secret.",
    )
    max_message_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request or response a service accepts."
    )
    default_deadline_s: float = Field(10.0, gt=0, description="Deadline for unary calls that set none.")
    drain_grace_s: float = Field(5.0, ge=0, description="How long in-flight calls may finish on SIGTERM.")
    keepalive_s: float = Field(30.0, gt=0, description="HTTP/2 keepalive ping interval on long streams.")
    tls: Tls = Field(default_factory=Tls)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = Field("json", description="json for machines, text for people.")
    otlp_endpoint: str = Field("", description="OTLP/gRPC collector for spans; empty writes trace_file.")
    trace_file: Path | None = Field(None, description="JSON-lines span file; default state_dir/traces.jsonl.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("TANDEM_CONFIG")
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_path(config_file)))
        return tuple(sources)

    def port(self, service: str) -> int:
        return int(getattr(self.ports, service))

    def target(self, service: str) -> str:
        explicit: str = getattr(self.targets, service)
        return explicit or f"{self.host}:{self.port(service)}"

    def store_url_for(self, service: str) -> str:
        if self.store_url:
            return self.store_url
        return f"sqlite:///{self.state_dir / (service + '.db')}"

    @property
    def trace_path(self) -> Path:
        return self.trace_file or self.state_dir / "traces.jsonl"
