"""LoRA updates into vLLM (`[weights] mode = "lora"` with `engine = "vllm"`): each update is a new adapter
version that vLLM loads at run time beside the one in service.

A vLLM worker started with `TANDEM_WORKER_MAX_LORA_RANK` (or on a saved adapter folder) runs vLLM with
`enable_lora`. It takes LoRA updates only, and receives them as the torch engine does: the worker itself joins
the trainer's gloo transfer group and fills host buffers (`stage`), not vLLM's weight-transfer engine, since
vLLM's transfer engines load base weights in place and know nothing of adapters. `commit` writes the
received tensors as a peft adapter folder (`adapter_config.json` + `adapter_model.safetensors`, the files
`vllm serve --lora-modules` loads) and has vLLM load it with `add_lora` under a fresh adapter id; requests
admitted from then on carry it. A request keeps the adapter it was admitted with to its end (across a KEEP
pause too), so each token's weight version is the request's; an adapter that is no longer current is removed
from vLLM (`remove_lora`) and its folder deleted once the last request using it finished. Nothing in service
changes before `commit` returns, so a failed update leaves the previous adapter serving.

The first update of a worker probes vLLM with an adapter of the update's shape whose B matrices are zero (the
base's output), so a shape vLLM cannot serve on this model (a module its LoRA layers do not cover, a rank above
`max_lora_rank`) is refused before a byte moves. Checksums of the adapter's tensors are those of the host
copies vLLM loaded the current adapter from, in the trainer's naming and bytes: `WeightPublisher.verify`
compares them with the trainer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import lora
from trainer.inference.engine import LoraMismatch, ManifestMismatch, TensorMeta, WeightTransferFailed
from trainer.inference.weights import dtype_name, dtype_of, manifest_problems, tensor_checksum

# vLLM's accepted `max_lora_rank` values (vllm/config/lora.py, 0.32); a setting is rounded up to the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`; ValueError above 512."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}, not {rank}")


@dataclass(frozen=True)
class LoraPlan:
    """How a vLLM engine serves LoRA adapters (`lora_plan`)."""

    base: str  # the model directory vLLM loads, absolute
    max_rank: int  # the largest rank an update may have
    vllm_rank: int  # vLLM's `max_lora_rank`: `max_rank` rounded up to a rank vLLM accepts
    saved: Path | None = None  # a saved adapter folder served from the start
    spec: Any | None = None  # its LoraAdapterSpec


def lora_plan(model_path: Path, max_lora_rank: int) -> LoraPlan | None:
    """LoRA mode for a worker on `model_path` with `TANDEM_WORKER_MAX_LORA_RANK=max_lora_rank`: None (whole
    weights) unless the setting is above 0 or `model_path` is a saved adapter folder (`adapter_config.json`
    and no `config.json`), whose base model is then served with it. ValueError naming what is wrong."""
    saved: tuple[Path, Any] | None = None
    base = model_path
    if (model_path / lora.ADAPTER_CONFIG).is_file() and not (model_path / "config.json").exists():
        base_dir, spec = lora.read_adapter(model_path)
        saved, base = (model_path, spec), Path(base_dir)
        max_lora_rank = max(max_lora_rank, spec.rank)
    if not max_lora_rank:
        return None
    try:
        rank = vllm_max_rank(max_lora_rank)
    except ValueError as exc:
        raise ValueError(f"TANDEM_WORKER_MAX_LORA_RANK={max_lora_rank}: {exc}") from None
    return LoraPlan(
        str(base.resolve()),
        max_lora_rank,
        rank,
        saved[0] if saved else None,
        saved[1] if saved else None,
    )


def adapter_manifest(base: Sequence[TensorMeta], spec: Any, dtype: str) -> list[TensorMeta]:
    """The tensors of an adapter of `spec` (a `LoraAdapterSpec` whose target modules are module names, as the
    trainer resolves them) over a checkpoint holding `base`, in peft's saved naming and `dtype`: for each 2-D
    `<module>.weight` of shape (out, in) whose module peft selects (its name, or its last part, is a target),
    `lora_A` (rank, in) and `lora_B` (out, rank). Empty when the targets select nothing."""
    targets = set(spec.target_modules)
    found: list[TensorMeta] = []
    for meta in base:
        if not meta.name.endswith(".weight") or len(meta.shape) != 2:
            continue
        module = meta.name.removesuffix(".weight")
        if module not in targets and module.rsplit(".", 1)[-1] not in targets:
            continue
        out_features, in_features = meta.shape
        found.append(
            TensorMeta(f"{lora.SAVED_PREFIX}{module}.lora_A.weight", dtype, (spec.rank, in_features))
        )
        found.append(
            TensorMeta(f"{lora.SAVED_PREFIX}{module}.lora_B.weight", dtype, (out_features, spec.rank))
        )
    return found


@dataclass
class _Adapter:
    """One adapter version loaded into vLLM."""

    request: Any  # vLLM's LoRARequest
    folder: Path
    version: int
    tensors: dict[str, torch.Tensor]  # the host copies it was written from
    users: int = 0  # requests admitted with it and not yet finished


class VllmAdapters:
    """The adapters one vLLM engine serves: the current one, and older ones still used by requests."""

    def __init__(
        self, llm: Any, base_model: str, base_manifest: Sequence[TensorMeta], dtype: str, max_rank: int
    ):
        self._llm = llm
        self._base_model = base_model
        self._base_manifest = list(base_manifest)
        self.dtype = dtype  # the served dtype: the adapter's tensors arrive in it, as the torch engine's do
        self.max_rank = max_rank
        self.spec: Any | None = None  # the shape every update must have, fixed by the first
        self._manifest: list[TensorMeta] = []
        self.current: _Adapter | None = None
        self._retired: list[_Adapter] = []
        self._staged: dict[str, torch.Tensor] | None = None
        self._next_id = 1
        self._removals: set[asyncio.Future[None]] = set()
        self._root = Path(tempfile.mkdtemp(prefix="tandem-vllm-lora-"))

    # ---- names and checksums ----------------------------------------------------------------------

    def names(self) -> set[str]:
        return {meta.name for meta in self._manifest}

    def checksums(self, names: Sequence[str]) -> list[tuple[str, str]]:
        """The current adapter's tensors of `names` (all when empty), in manifest order; those of the
        base's zero-B probe while no update completed."""
        held = self.current.tensors if self.current is not None else {}
        wanted = set(names)
        return [
            (meta.name, tensor_checksum(held[meta.name]))
            for meta in self._manifest
            if meta.name in held and (not wanted or meta.name in wanted)
        ]

    # ---- one update ---------------------------------------------------------------------------------

    async def stage(
        self, manifest: Sequence[TensorMeta], spec: Any, serving: int
    ) -> Mapping[str, torch.Tensor]:
        """Host buffers for the update's tensors; the first update fixes the adapter's shape and probes vLLM
        with it (the probe then serves version `serving`: the base's output). LoraMismatch for a shape this
        worker cannot serve or another than the first's; ManifestMismatch for tensors not that adapter's."""
        if self.spec is None:
            await self._adopt(spec, serving)
        elif not lora.same_shape(self.spec, spec):
            raise LoraMismatch(
                f"the model serves an adapter of {lora.describe(self.spec)}, not {lora.describe(spec)}"
            )
        problems = manifest_problems(manifest, self._manifest)
        if problems:
            raise ManifestMismatch(problems)
        self._staged = {meta.name: torch.empty(meta.shape, dtype=dtype_of(meta.dtype)) for meta in manifest}
        return dict(self._staged)

    async def _adopt(self, spec: Any, serving: int) -> None:
        described = lora.describe(spec)
        if "all-linear" in spec.target_modules:
            raise LoraMismatch(
                f"the adapter ({described}) names peft's all-linear: send the module names it resolved to"
            )
        if spec.rank > self.max_rank:
            raise LoraMismatch(
                f"the adapter's rank {spec.rank} is above this worker's vLLM max_lora_rank {self.max_rank} "
                "(TANDEM_WORKER_MAX_LORA_RANK)"
            )
        manifest = adapter_manifest(self._base_manifest, spec, self.dtype)
        if not manifest:
            raise LoraMismatch(f"the adapter ({described}) selects no 2-D weight of the model")
        zeros = {meta.name: torch.zeros(meta.shape, dtype=dtype_of(meta.dtype)) for meta in manifest}
        try:
            probe = await self._load(spec, zeros, serving)
        except WeightTransferFailed as exc:
            raise LoraMismatch(f"vLLM cannot serve an adapter of {described} on this model: {exc}") from None
        self.spec, self._manifest, self.current = spec, manifest, probe

    async def commit(self, version: int) -> None:
        """Load the staged adapter into vLLM and make it the current one, serving `version`; the one it
        replaces goes once no request uses it. WeightTransferFailed when vLLM refuses it: the previous
        adapter stays current."""
        staged, self._staged = self._staged, None
        if staged is None or self.spec is None:
            raise WeightTransferFailed("no LoRA update is staged")
        held = dict(self.current.tensors) if self.current is not None else {}
        adapter = await self._load(self.spec, {**held, **staged}, version)
        previous, self.current = self.current, adapter
        if previous is not None:
            self._retired.append(previous)
            await self.release_unused()

    def discard(self) -> None:
        self._staged = None

    async def load_folder(self, folder: Path, spec: Any, version: int) -> None:
        """Serve the saved adapter at `folder` (a worker started on a checkpoint's adapter) as `version`."""
        from safetensors.torch import load_file  # noqa: PLC0415

        manifest = adapter_manifest(self._base_manifest, spec, self.dtype)
        saved = {
            name: tensor.to(dtype_of(self.dtype))
            for name, tensor in load_file(str(folder / lora.ADAPTER_WEIGHTS)).items()
        }
        held = [TensorMeta(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in saved.items()]
        problems = manifest_problems(held, manifest) + [
            f"{meta.name} is missing" for meta in manifest if meta.name not in saved
        ]
        if problems:
            raise ManifestMismatch(problems)
        self.spec, self._manifest = spec, manifest
        self.current = await self._load(spec, saved, version)

    async def _load(self, spec: Any, tensors: dict[str, torch.Tensor], version: int) -> _Adapter:
        from vllm.lora.request import LoRARequest  # noqa: PLC0415

        lora_id = self._next_id
        self._next_id += 1
        folder = self._root / f"v{version}-{lora_id}"
        await asyncio.to_thread(lora.write_spec_adapter, folder, spec, self._base_model, tensors)
        request = LoRARequest(
            lora_name=f"tandem-v{version}-{lora_id}", lora_int_id=lora_id, lora_path=str(folder)
        )
        try:
            added = await self._llm.add_lora(request)
        except Exception as exc:  # vLLM's engine core refused the adapter (a module, a shape, the rank)
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightTransferFailed(f"loading the LoRA adapter: {type(exc).__name__}: {exc}") from None
        if added is False:
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightTransferFailed("loading the LoRA adapter: vLLM did not add it")
        return _Adapter(request, folder, version, tensors)

    # ---- requests ------------------------------------------------------------------------------------

    def admit(self) -> _Adapter | None:
        """The adapter a request admitted now runs with (None: the base), counted as in use."""
        adapter = self.current
        if adapter is not None:
            adapter.users += 1
        return adapter

    def done(self, adapter: _Adapter | None) -> None:
        """A request admitted with `adapter` finished; the last user of a retired adapter removes it."""
        if adapter is None:
            return
        adapter.users -= 1
        if adapter.users == 0 and adapter in self._retired:
            task = asyncio.ensure_future(self.release_unused())
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def release_unused(self) -> None:
        """Remove from vLLM, and delete, every adapter that is neither current nor in use."""
        for adapter in [a for a in self._retired if a.users == 0]:
            self._retired.remove(adapter)
            with contextlib.suppress(Exception):  # a dead engine core: its adapters went with it
                await self._llm.remove_lora(adapter.request.lora_int_id)
            shutil.rmtree(adapter.folder, ignore_errors=True)

    @property
    def loaded(self) -> int:
        """Adapters vLLM holds for this engine: the current one and those still in use."""
        return len(self._retired) + (self.current is not None)

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
