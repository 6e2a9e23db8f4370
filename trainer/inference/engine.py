"""The generation engine interface an inference worker drives, with its value types.

Two engines implement it and pass the same tests: `TorchEngine` (`trainer/inference/torch_engine.py`,
transformers on CPU or a small GPU) and `VllmEngine` (`trainer/inference/vllm_engine.py`, vLLM's AsyncLLM
in-process). The worker (`trainer/inference/worker.py`) owns everything around an engine: the gRPC and
OpenAI-compatible surfaces, traces, the weight-transfer group and the update state machine.

Weight updates go through the engine in three steps so a worker never serves half-updated weights:
`stage_update` gives the receiver a buffer for every tensor of the manifest (the torch engine allocates
staging copies; nothing in service changes), `commit_update` makes the staged tensors the weights in
service in one step between two generation steps, and `discard_update` drops the staging area, leaving
the previous version in service. Because nothing in service changes before the commit, an engine that
stages (`in_flight_updates`) can receive while it generates: an in-flight update, each token's
`TokenChunk.weight_version` naming the weights that sampled it.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]


class PauseMode(enum.Enum):
    """What happens to generations in flight when generation pauses (vLLM's modes)."""

    KEEP = "keep"  # freeze them where they are; they continue after resume, possibly with newer weights
    WAIT = "wait"  # admit nothing new; return once those in flight have finished
    ABORT = "abort"  # end them now with finish reason "abort" and their partial output


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings; the defaults are the contract's, not an engine's."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0  # 0: none (trainer/sampling.py defines the three truncations and their order)
    max_tokens: int = 0  # 0: up to the context length
    stop: tuple[str, ...] = ()  # strings that end generation (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()  # token ids that end generation (included, like EOS)
    seed: int | None = None
    top_logprobs: int = 0


@dataclass
class TokenChunk:
    """Tokens sampled since the previous chunk of one generation."""

    token_ids: list[int]
    logprobs: list[float]  # log-probability of each token under the sampling distribution
    text: str  # the text these tokens add
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked
    weight_version: int = 0  # the weights that sampled these tokens


@dataclass
class Finished:
    """The last item of one generation."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    weight_version: int  # the weights that sampled the first completion token
    last_weight_version: int  # the weights that sampled the last one (larger only across a KEEP pause)


Generation = AsyncIterator[TokenChunk | Finished]


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of the served weights, in Hugging Face checkpoint naming."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class EngineInfo:
    model: str  # the model id served (what OpenAI clients send as `model`)
    model_path: str
    tokenizer: str
    max_context_tokens: int
    kind: Literal["torch", "vllm"]
    engine_version: str
    tensor_parallel_size: int
    device: str
    dtype: str
    vocab_size: int = 0  # the token ids the model embeds, 0 to vocab_size - 1 (0: not known, not checked)


class Engine(abc.ABC):
    """One model in service. Every method is called from the worker's event loop."""

    info: EngineInfo
    # Whether a weight update may be staged while generation runs (an in-flight update): `commit_update` then
    # swaps the weights in between two generation steps and the generations in flight continue with them.
    # False for an engine that loads in place (vLLM), which must pause.
    in_flight_updates: bool = False
    # Whether the engine applies delta updates (WEIGHT_UPDATE_MODE_DELTA: `commit_delta`, or for a
    # `RemoteTransfer` engine `receive_update(changed=...)`).
    delta_updates: bool = False
    # Whether the engine serves a LoRA adapter over its base weights (WEIGHT_UPDATE_MODE_LORA, `stage_lora`).
    lora_updates: bool = False
    # Whether it takes whole-weight updates (WEIGHT_UPDATE_MODE_FULL); False for a vLLM engine serving LoRA
    # adapters, whose base weights are fixed.
    full_updates: bool = True

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights in service; 0 for the weights loaded at start unless
        `label_loaded_weights` named them."""

    @abc.abstractmethod
    def label_loaded_weights(self, version: int) -> None:
        """Report the weights loaded at start as `version` (a served checkpoint's training step), before
        any update; the weights themselves do not change."""

    @abc.abstractmethod
    def render(self, messages: Sequence[Mapping[str, str]], template_kwargs: Mapping[str, Any]) -> list[int]:
        """Chat messages -> prompt token ids, with the model's chat template and a generation prompt."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Plain text -> token ids, without special tokens (the completions endpoint's text prompts)."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str: ...

    @abc.abstractmethod
    def generate(self, prompt_token_ids: Sequence[int], sampling: Sampling) -> Generation:
        """Stream one generation: TokenChunks, then exactly one Finished. Concurrent generations are batched.
        Raises `PromptTooLong` (before anything is yielded) when the prompt leaves no room to generate."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode) -> tuple[int, int]:
        """Pause generation; returns (generations aborted, generations kept). New generations wait (KEEP,
        WAIT) until `resume`; WAIT returns once those in flight finished."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @property
    @abc.abstractmethod
    def paused(self) -> bool: ...

    @abc.abstractmethod
    def manifest(self) -> list[TensorMeta]:
        """The served tensors, in checkpoint naming and a stable order."""

    def tensor_names(self) -> set[str]:
        """Every tensor a checksum may name: the manifest's, and a served LoRA adapter's."""
        return {meta.name for meta in self.manifest()}

    @abc.abstractmethod
    def stage_update(self, manifest: Sequence[TensorMeta]) -> Mapping[str, torch.Tensor]:
        """Buffers the receiver writes each tensor of `manifest` into (contiguous, on the engine's device,
        in the manifest dtype); nothing in service changes. Raises `ManifestMismatch` when the manifest
        names a tensor the model lacks or gives another dtype or shape."""

    @abc.abstractmethod
    async def commit_update(self, version: int) -> None:
        """Make the staged tensors the weights in service, between two generation steps, and the version
        `version`."""

    async def commit_delta(
        self,
        version: int,
        manifest: Sequence[TensorMeta],
        changed: Sequence[int],
        wire: Mapping[str, torch.Tensor],
    ) -> str:
        """Apply a received delta (trainer/inference/delta.py: `changed` per manifest tensor, the wire tensors
        by their wire names) to the weights in service, between two generation steps, and serve them as
        `version`; return `delta.digest` of what it wrote, read back from the weights in service. ValueError,
        before any element is written, for an index outside its tensor."""
        raise EngineError(f"the {self.info.kind} engine takes no delta weight update")

    async def stage_lora(self, manifest: Sequence[TensorMeta], spec: Any) -> Mapping[str, torch.Tensor]:
        """`stage_update` for a LoRA adapter of `spec` (a `LoraAdapterSpec`), whose tensors `manifest` lists
        in peft's saved naming; the first adds an adapter to the model (serving the base until it is
        committed). `LoraMismatch` when the model already serves an adapter of another shape;
        `ManifestMismatch` when the manifest is not that adapter's."""
        raise EngineError(f"the {self.info.kind} engine serves no LoRA adapter")

    @abc.abstractmethod
    def discard_update(self) -> None:
        """Drop staged tensors; the weights in service are untouched."""

    @abc.abstractmethod
    async def checksums(self, names: Sequence[str]) -> list[tuple[str, str]]:
        """(name, lowercase hex SHA-256 of the tensor's contiguous bytes in its dtype) for `names`, or for
        every served tensor when `names` is empty, in manifest order."""

    @abc.abstractmethod
    async def close(self) -> None: ...


@runtime_checkable
class RemoteTransfer(Protocol):
    """An engine that receives weights through a transfer engine of its own (vLLM's NCCL or IPC engines)
    instead of staging buffers the worker fills. It loads in place: an update that fails after
    `start_update` leaves the weights matching no version until the next update completes."""

    transfer_backends: tuple[str, ...]  # "nccl", "ipc", "gloo"

    async def join_transfer(self, init_info: Mapping[str, Any]) -> None:
        """Join the trainer's transfer group (NCCL, gloo: the rendezvous; IPC: nothing to join)."""

    async def start_update(self) -> None: ...

    async def receive_update(
        self,
        manifest: Sequence[TensorMeta],
        ipc_handles: bytes = b"",
        *,
        bucket_size: int = 0,
        packed: bool = True,
        changed: Sequence[int] | None = None,
    ) -> None:
        """Blocks until every tensor of `manifest` is loaded (NCCL, gloo: while the trainer broadcasts; gloo
        plans its buckets from `bucket_size` and `packed` as the trainer does). With `changed` (only where
        the engine has `delta_updates`: gloo) the update is a delta: the buckets carry its wire tensors
        (trainer/inference/delta.py `wire_manifest`), applied to the weights of the last complete update."""

    async def finish_update(self, version: int) -> None: ...


def remote_transfer(engine: Engine) -> RemoteTransfer | None:
    """The engine as a `RemoteTransfer` when its own transfer engine receives its updates, else None: the
    worker's transfer group fills its staging buffers (the torch engine; a vLLM engine serving LoRA adapters,
    which lists no transfer backend of its own)."""
    if isinstance(engine, RemoteTransfer) and engine.transfer_backends:
        return engine
    return None


class EngineError(Exception):
    """A request the engine cannot serve as asked."""


class PromptTooLong(EngineError):
    def __init__(self, prompt_tokens: int, max_context_tokens: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens; the context holds {max_context_tokens}, "
            "leaving no room to generate"
        )
        self.prompt_tokens = prompt_tokens
        self.max_context_tokens = max_context_tokens


class ManifestMismatch(EngineError):
    """A weight-update manifest that disagrees with the model; `problems` names each disagreement."""

    def __init__(self, problems: Sequence[str]) -> None:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        super().__init__(f"the manifest disagrees with the model: {shown}")
        self.problems = list(problems)


class LoraMismatch(EngineError):
    """A LoRA update of another shape than the adapter the model serves."""


class ModelLoadError(EngineError):
    """The model directory is missing, incomplete, or its tokenizer does not fit the model; or a setting the
    engine needs is missing or refused (the message names the setting)."""


class EngineFailure(EngineError):
    """The engine itself failed while serving a call (vLLM: its engine-core process raised or died). `dead` is
    True when it can serve nothing more: the worker must be restarted."""

    def __init__(self, message: str, *, dead: bool = False) -> None:
        super().__init__(message)
        self.dead = dead


class WeightTransferFailed(EngineFailure):
    """A step of a weight update failed inside the engine (joining the group, receiving, loading). For an
    engine that loads in place, the weights in service may then match no version."""
