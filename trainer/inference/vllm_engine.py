"""`VllmEngine`: vLLM's `AsyncLLM` in-process behind the `Engine` interface, for GPU workers.

Requires the `gpu` extra (vLLM 0.33, which pins torch 2.14). Written against vLLM 0.33's own RL API:

- generation: `AsyncLLM.generate` with `RequestOutputKind.DELTA` and `logprobs_mode="processed_logprobs"`,
  so each token's log-prob is the one of the distribution it was sampled from (after temperature and
  top-p), as the contract requires; `logprobs=k` returns the sampled token's log-prob plus the top k.
- pause: `pause_generation(mode="keep" | "wait" | "abort")` and `resume_generation()`.
- weights: vLLM receives them with its own weight-transfer engine, not through staging buffers, so this
  engine implements `RemoteTransfer` instead of `stage_update`/`commit_update`: `init_weight_transfer_engine`
  (NCCL: the trainer's TCPStore rendezvous; IPC: nothing to join), `start_weight_update`, `update_weights`
  (NCCL: blocks while the trainer broadcasts packed buckets; IPC: maps the trainer's CUDA memory from the
  handles) and `finish_weight_update(weight_version)`. vLLM loads in place, so an update that fails after
  it started leaves the weights INCONSISTENT until the next one completes.
- checksums: `compute_weight_checksums()` hashes vLLM's own parameters (fused, per tensor-parallel rank,
  in vLLM's naming), so they prove two vLLM workers hold the same weights, for example a worker updated by
  the trainer against one loaded from the trainer's checkpoint; they are not comparable with the trainer's
  Hugging Face tensors, which `manifest()` lists from the checkpoint's safetensors headers.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.inference.engine import (
    Engine,
    EngineError,
    EngineInfo,
    Finished,
    FinishReason,
    Generation,
    ModelLoadError,
    PauseMode,
    PromptTooLong,
    Sampling,
    TensorMeta,
    TokenChunk,
)

FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def checkpoint_manifest(model_dir: Path) -> list[TensorMeta]:
    """The checkpoint's tensors from its safetensors headers, without loading any data."""
    from safetensors import safe_open  # noqa: PLC0415

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} holds no .safetensors weights")
    manifest: list[TensorMeta] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor_slice = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype(), tensor_slice.get_dtype().lower())
                manifest.append(TensorMeta(name, dtype, tuple(tensor_slice.get_shape())))
    return manifest


_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class VllmEngine(Engine):
    def __init__(self, llm: Any, tokenizer: Any, info: EngineInfo, manifest: list[TensorMeta]) -> None:
        self._llm = llm
        self._tokenizer = tokenizer
        self.info = info
        self._manifest = manifest
        self._version = 0
        self._paused = False
        self._in_flight: set[str] = set()
        self.transfer_backends: tuple[str, ...] = ("nccl",)

    @classmethod
    async def load(
        cls,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        model_id: str | None = None,
        transfer_backend: str = "nccl",
        max_model_len: int | None = None,
    ) -> VllmEngine:
        import vllm  # noqa: PLC0415
        from transformers import AutoTokenizer  # noqa: PLC0415
        from vllm.config.weight_transfer import WeightTransferConfig  # noqa: PLC0415
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

        directory = Path(model_path)
        if not (directory / "config.json").is_file():
            raise ModelLoadError(f"{model_path} is not a Hugging Face model directory (no config.json)")
        manifest = checkpoint_manifest(directory)
        tokenizer_dir = tokenizer_path or model_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load the tokenizer from {tokenizer_dir}: {exc}") from None
        args = AsyncEngineArgs(
            model=model_path,
            tokenizer=tokenizer_dir,
            dtype=dtype or "auto",
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            weight_transfer_config=WeightTransferConfig(backend=transfer_backend),
            enable_log_requests=False,
        )
        try:
            llm = AsyncLLM.from_engine_args(args)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"vLLM could not load {model_path}: {exc}") from None
        config = json.loads((directory / "config.json").read_text())
        context = int(llm.model_config.max_model_len)
        devices = ",".join(f"cuda:{i}" for i in range(tensor_parallel_size))
        info = EngineInfo(
            model=model_id or directory.name,
            model_path=model_path,
            tokenizer=tokenizer_dir,
            max_context_tokens=context,
            kind="vllm",
            engine_version=vllm.__version__,
            tensor_parallel_size=tensor_parallel_size,
            device=devices,
            dtype=str(llm.model_config.dtype).removeprefix("torch.") or str(config.get("torch_dtype", "")),
        )
        engine = cls(llm, tokenizer, info, manifest)
        engine.transfer_backends = (transfer_backend,)
        return engine

    # ---- text ---------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def label_loaded_weights(self, version: int) -> None:
        self._version = version

    def render(self, messages: Sequence[Mapping[str, str]], template_kwargs: Mapping[str, Any]) -> list[int]:
        ids = self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **dict(template_kwargs)
        )
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompt_token_ids: Sequence[int], sampling: Sampling) -> Generation:
        context = self.info.max_context_tokens
        if len(prompt_token_ids) >= context:
            raise PromptTooLong(len(prompt_token_ids), context)
        if (
            sampling.top_logprobs > 20
            or not 0 < sampling.top_p <= 1
            or sampling.temperature < 0
            or sampling.top_k < 0
            or not 0 <= sampling.min_p <= 1
        ):
            raise EngineError("sampling settings out of range")
        return self._stream(list(prompt_token_ids), sampling)

    async def _stream(self, prompt: list[int], sampling: Sampling) -> AsyncIterator[TokenChunk | Finished]:
        from vllm import SamplingParams, TokensPrompt  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        room = self.info.max_context_tokens - len(prompt)
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or -1,  # vLLM's "every token"
            min_p=sampling.min_p,
            max_tokens=min(sampling.max_tokens or room, room),
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            seed=sampling.seed,
            logprobs=sampling.top_logprobs,
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = secrets.token_hex(12)
        self._in_flight.add(request_id)
        produced = 0
        first_version = last_version = self._version
        stream = self._llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id)
        try:
            async for output in stream:
                completion = output.outputs[0]
                tokens = [int(t) for t in completion.token_ids]
                if tokens:
                    version = self._version
                    if not produced:
                        first_version = version
                    last_version = version
                    produced += len(tokens)
                    logprobs, tops = _logprobs(tokens, completion.logprobs, sampling.top_logprobs)
                    yield TokenChunk(tokens, logprobs, completion.text, tops, version)
                if output.finished:
                    spans = completion.weight_versions or []
                    if spans:  # vLLM's own record of which weights sampled which tokens
                        first_version = _version_number(spans[0].version, first_version)
                        last_version = _version_number(spans[-1].version, last_version)
                    reason = FINISH_REASONS.get(str(completion.finish_reason), "stop")
                    yield Finished(reason, len(prompt), produced, first_version, last_version)
                    return
            yield Finished("abort", len(prompt), produced, first_version, last_version)
        finally:
            self._in_flight.discard(request_id)
            await stream.aclose()  # a caller that stops listening aborts the request in vLLM

    # ---- pause --------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self, mode: PauseMode) -> tuple[int, int]:
        in_flight = len(self._in_flight)
        await self._llm.pause_generation(mode=mode.value)
        self._paused = True
        if mode is PauseMode.ABORT:
            return in_flight, 0
        if mode is PauseMode.KEEP:
            return 0, in_flight
        return 0, 0

    async def resume(self) -> None:
        await self._llm.resume_generation()
        self._paused = False

    # ---- weights ------------------------------------------------------------------------------

    def manifest(self) -> list[TensorMeta]:
        return list(self._manifest)

    def stage_update(self, manifest: Sequence[TensorMeta]) -> Mapping[str, torch.Tensor]:
        raise EngineError("the vLLM engine receives weights through its weight-transfer engine (NCCL or IPC)")

    async def commit_update(self, version: int) -> None:
        raise EngineError("the vLLM engine receives weights through its weight-transfer engine (NCCL or IPC)")

    def discard_update(self) -> None:
        return None

    async def join_transfer(self, init_info: Mapping[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest  # noqa: PLC0415

        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info)))

    async def start_update(self) -> None:
        await self._llm.start_weight_update()

    async def receive_update(self, manifest: Sequence[TensorMeta], ipc_handles: bytes = b"") -> None:
        """Blocks until vLLM loaded every tensor: NCCL while the trainer broadcasts; IPC from the handles.

        IPC handles arrive pickled from the trainer over the authenticated control plane (a mesh token of
        the job); unpickling them here is what vLLM's own HTTP route does with `ipc_handles_pickled`."""
        import pickle  # noqa: PLC0415

        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest  # noqa: PLC0415

        info: dict[str, Any] = {
            "names": [m.name for m in manifest],
            "dtype_names": [m.dtype for m in manifest],
            "shapes": [list(m.shape) for m in manifest],
        }
        if ipc_handles:
            info["ipc_handles"] = pickle.loads(ipc_handles)  # noqa: S301 - the job's own trainer, authenticated
        await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def finish_update(self, version: int) -> None:
        await self._llm.finish_weight_update(weight_version=str(version))
        self._version = version

    async def checksums(self, names: Sequence[str]) -> list[tuple[str, str]]:
        merged: dict[str, str] = {}
        for part in await self._llm.compute_weight_checksums():
            merged.update(part)
        wanted = set(names)
        return sorted((n, c) for n, c in merged.items() if not wanted or n in wanted)

    async def close(self) -> None:
        await asyncio.to_thread(self._llm.shutdown)


def _version_number(label: str, fallback: int) -> int:
    try:
        return int(label)
    except ValueError:
        return fallback


def _logprobs(
    tokens: list[int], entries: Sequence[Mapping[int, Any]] | None, top: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The sampled tokens' log-probs and, when asked, the top candidates per position (most likely first)."""
    if not entries:
        return [float("nan")] * len(tokens), []
    values: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for token, entry in zip(tokens, entries, strict=False):
        values.append(float(entry[token].logprob) if token in entry else float("nan"))
        if top:
            ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
            tops.append([(int(t), float(lp.logprob)) for t, lp in ranked if lp.rank and lp.rank <= top][:top])
    return values, tops
