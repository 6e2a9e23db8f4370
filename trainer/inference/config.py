"""Settings of one inference worker (`TANDEM_WORKER_*`), beside the shared `mesh.settings.Settings`.

No torch and no grpc here: the scheduler builds these from a job spec, and tests build them directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_WORKER_", extra="forbid")

    model_path: Path = Field(..., description="Local Hugging Face model directory (config, safetensors).")
    tokenizer_path: Path | None = Field(None, description="Tokenizer directory; empty: the model directory.")
    model_id: str = Field("", description="The model id clients send; empty: the model directory's name.")
    engine: Literal["torch", "vllm"] = Field("torch", description="Generation engine.")
    device: str = Field("cpu", description="torch engine: `cpu` or `cuda:N`.")
    dtype: str = Field("", description="Served dtype (`bfloat16`, ...); empty: the checkpoint's.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vLLM engine: GPUs per worker.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM engine: share of GPU memory.")
    transfer_backend: Literal["auto", "nccl", "ipc", "gloo"] = Field(
        "auto",
        description="vLLM engine: how weights arrive; `auto` is `gloo` where vLLM runs on the CPU (Tandem's "
        "packed broadcast through vLLM's weight-transfer API) and `nccl` on GPUs; `ipc` when the trainer "
        "shares the worker's GPU.",
    )
    enforce_eager: bool = Field(
        False,
        description="vLLM engine: run the model eagerly, without torch.compile or CUDA graphs: a faster "
        "start (on 2 CPU cores about 12-23 s instead of 60 s with a cold compile cache), slower steps.",
    )
    max_model_len: int = Field(
        0, ge=0, le=1 << 24, description="vLLM engine: the context length served; 0: the model's."
    )
    max_lora_rank: int = Field(
        0,
        ge=0,
        le=512,
        description="vLLM engine: serve LoRA adapters up to this rank (vLLM's `enable_lora`; rounded up to a "
        "rank vLLM accepts), taking LoRA weight updates only; 0: whole-weight updates. A job in "
        '`[weights] mode = "lora"` sets it; a worker started on a saved adapter folder needs none.',
    )
    max_batch: int = Field(32, ge=1, le=4096, description="torch engine: most sequences per forward step.")
    http_host: str = Field("127.0.0.1", description="Interface of the OpenAI-compatible endpoint.")
    http_port: int = Field(0, ge=0, le=65535, description="Its port; 0 picks a free one.")
    openai_api_key: str = Field(
        "", description="When set, the OpenAI-compatible endpoint requires `Authorization: Bearer <key>`."
    )
    trace_idle_timeout_s: float = Field(
        600.0, gt=0, description="An open trace with no turn for this long is sealed as EXPIRED."
    )
    trace_retain: int = Field(10_000, ge=1, description="Sealed traces held for StreamTraces and GetTrace.")
    pause_queue_s: float = Field(
        120.0, gt=0, description="How long a generation request waits out a pause before UNAVAILABLE."
    )
    transfer_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait on the weight-transfer collective (join, each bucket)."
    )
    weight_version: int = Field(
        0,
        ge=0,
        description="The version the weights loaded at start are reported as until the first update: "
        "the training step of a served checkpoint (the gateway's checkpoint workers set it).",
    )
    idle_exit_s: float = Field(
        0.0,
        ge=0,
        description="Exit (status 0) after this long with no generation in flight or asked for; 0: never. "
        "The gateway's on-demand checkpoint workers use it to give their GPU back.",
    )
    ready_file: Path | None = Field(
        None, description="Where to write the worker's addresses as JSON once it serves (for launchers)."
    )
