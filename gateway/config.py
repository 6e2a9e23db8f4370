"""Settings of the gateway alone (`TANDEM_GATEWAY_*`), beside the shared `mesh.settings.Settings`."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_GATEWAY_", extra="forbid")

    admin_key: str = Field(
        "",
        description="The deployment's admin credential (`tdm_admin_...`), the only one CreateOrg accepts. "
        "Empty: read state_dir/admin.key, created 0600 on first start. In deployments, mount it from a secret.",
    )
    rate_per_s: float = Field(
        50.0, gt=0, description="Calls per second each organization may make, sustained (token bucket)."
    )
    rate_burst: float = Field(
        100.0, ge=1, description="Calls an organization may make at once (bucket size)."
    )
    forward_timeout_s: float = Field(
        30.0, gt=0, description="Deadline of each unary call forwarded to an internal service."
    )
    infer_timeout_s: float = Field(
        300.0, gt=0, description="Longest an Infer call or an HTTP completion may wait on its worker."
    )
    infer_idle_s: float = Field(
        900.0,
        ge=0,
        description="An on-demand checkpoint worker with no generation for this long stops and gives its "
        "GPU back; the next call for that checkpoint starts a new one. 0: workers run until cancelled.",
    )
    tls_cert_file: str = Field(
        "",
        description="PEM certificate (chain) of the gateway's public endpoints; with `tls_key_file` the gRPC "
        "port and the HTTP endpoint serve TLS to clients without a client certificate. Empty: the mesh's "
        "settings (mTLS when TANDEM_TLS__* are set, else plaintext).",
    )
    tls_key_file: str = Field("", description="PEM private key of `tls_cert_file`.")
    reuse_port: bool = Field(
        False,
        description="Let several gateway processes listen on the same gRPC and HTTP ports (SO_REUSEPORT, "
        "Linux): the kernel hands each new connection to one of them. Every replica needs it, the same mesh "
        "key, admin credential and store. Off: a second process on the port fails to start.",
    )
    http_port: int = Field(
        -1,
        ge=-1,
        le=65535,
        description="Port of the OpenAI-compatible HTTP endpoint; 0 picks a free one, -1 disables it.",
    )
