"""Tandem's packed gloo broadcast as a vLLM weight-transfer engine, so CPU workers running vLLM receive weights
through vLLM's own API (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`) exactly as GPU workers do with vLLM's NCCL engine; only the transport differs.

vLLM builds its transfer engine inside its engine-core process (a separate process under `AsyncLLM`), from
`WeightTransferEngineFactory`, whose registry there knows only vLLM's own engines. `register` adds this one
under the backend name `BACKEND`; it runs in every vLLM process through the `vllm.general_plugins` entry
point this package declares (pyproject.toml), so installing Tandem (`pip install -e .`) is what makes the
backend exist. `VllmEngine` selects it for `TANDEM_WORKER_TRANSFER_BACKEND=gloo` (the default on CPU).

The protocol is the one of `trainer/inference/weights.py`: the trainer (rank 0, `WeightPublisher` with the
gloo backend) forms a `TransferGroup`; each vLLM worker rank joins it at `rank_offset` + its rank in vLLM's
world (`init_transfer_engine`); per update both sides compute the same bucket plan from the manifest and the
bucket size of `BeginWeightUpdate`, and `receive_packed` receives the buckets. Loading follows vLLM's NCCL
engine: `start_weight_update` begins vLLM's layerwise reload (each layer's checkpoint tensors are buffered
until the layer is complete, then processed into vLLM's kernel layout and copied into the tensors in service),
each bucket is handed to `model.load_weights` as soon as it arrived, and `finish_weight_update` finalizes the
reload. Weights are loaded in place: an update that fails part-way leaves some layers new and some old.

Three things differ from the NCCL engine on a CPU:

- the base class's `update_weights` ends in `torch.accelerator.synchronize()`, which raises where there is no
  accelerator; here it synchronizes only when there is one;
- vLLM's CPU backend repacks linear weights into oneDNN kernels and leaves empty parameters behind, so a plain
  `load_weights` would fail on their shapes; the layerwise reload is what restores the checkpoint layout first;
- with tied embeddings the LM head shares the embedding's weight but keeps a kernel of its own packed from
  the old values, and the reload never processes it (no tensor of the checkpoint belongs to it), so after the
  reload every embedding layer's post-load step runs again, which repacks the LM head from the new weight.

A receive that fails (the trainer died or stalled past the timeout) finalizes the reload before raising, so
the model holds real tensors again (partly new) and the next update starts from a clean state; the transfer
group is closed, and the trainer forms a new one.

Delta updates (WEIGHT_UPDATE_MODE_DELTA, trainer/inference/delta.py). The engine keeps a host mirror of the
last complete update: its tensors in checkpoint naming and the manifest's dtype, exactly the trainer's bytes.
A full update's receive targets already are such a copy, so they are kept instead of freed: the memory cost
is one copy of the model in the manifest dtype in the engine-core process's host memory, for as long as the
engine lives. A delta update (`GlooUpdateInfo.changed`, the `changed_elements` of BeginWeightUpdate, so that
both sides plan the same buckets from `delta.wire_manifest`) receives only the wire tensors, checks them
against the mirror (`delta.check`, every tensor before any is written), applies them to it (`delta.apply`)
and then loads every mirror tensor through the same layerwise reload as a full update: the reload processes
whole layers, and loading all of them is what keeps a delta's result the one of a full update of the same
weights. The mirror is dropped when an update starts and set again only when it completed
(`finish_weight_update`), so a worker that failed part-way, like one that just started, has no mirror and
takes only a full update (the worker's `WeightSync.delta_base` says the same to the trainer).

The mirror is also what the worker's checksums answer for in checkpoint naming (`mirror_checksums`, reached
through the worker extension `TandemWorkerExtension`): on a CPU vLLM's own parameters cannot prove an update
(see `VllmEngine.checksums`), the mirror proves bit for bit what the last update loaded.

Shortcuts: the receive targets are one staging copy of the whole update in host memory (what
`staging_targets` lays out), kept as the mirror; each tensor is copied once more as it is handed to
`load_weights`, so that what vLLM keeps or rewrites while it loads never aliases the mirror; fine for the
small models CPU workers serve.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from trainer.inference import delta
from trainer.inference.engine import TensorMeta
from trainer.inference.weights import (
    Bucket,
    TransferGroup,
    manifest_problems,
    plan_buckets,
    plan_per_tensor,
    receive_packed,
    staging_targets,
    tensor_checksum,
)

BACKEND = "tandem-gloo"  # the name in vLLM's registry; "gloo" is left to vLLM should it ever ship one


def register() -> None:
    """The `vllm.general_plugins` entry point: add the engine to vLLM's factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: PLC0415

    # ValueError: already registered, as vLLM may run the plugins of a process more than once.
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


# The ignores: vLLM's base classes are Any where vLLM is absent (the default environment's type check).
@dataclass
class GlooInitInfo(WeightTransferInitInfo):  # type: ignore[misc, unused-ignore]
    """Where the trainer's transfer group listens and which ranks this worker takes."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc, unused-ignore]
    """One update's manifest and the bucket geometry of `BeginWeightUpdate`; for a delta update its
    `changed_elements` (one count per manifest tensor), from which the wire tensors and their buckets follow."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_size_bytes: int
    packed: bool = True
    changed: list[int] | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )
        if self.packed and self.bucket_size_bytes < 1:
            raise ValueError(f"bucket_size_bytes must be at least 1, not {self.bucket_size_bytes}")

    def manifest(self) -> list[TensorMeta]:
        return [
            TensorMeta(name, dtype, tuple(shape))
            for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]

    def wire(self) -> list[TensorMeta]:
        """The tensors on the wire: the manifest, or a delta's (ValueError when `changed` does not fit)."""
        manifest = self.manifest()
        return manifest if self.changed is None else delta.wire_manifest(manifest, self.changed)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):  # type: ignore[misc, unused-ignore]
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self.timeout_s = 300.0
        # The last complete update's tensors (checkpoint names, manifest order and dtype): a delta's base.
        self.mirror: dict[str, torch.Tensor] = {}
        self._loaded: dict[str, torch.Tensor] | None = None  # this update's, the mirror once it finished

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group  # noqa: PLC0415

        self.shutdown()
        rank = init_info.rank_offset + get_world_group().rank
        self.timeout_s = init_info.timeout_s
        self.group = TransferGroup.join(
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            rank,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # noqa: PLC0415

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (  # noqa: PLC0415
            disable_mtp_completeness_check,
        )

        group = self.group
        if group is None:
            raise RuntimeError(
                "the gloo weight transfer is not initialized: call init_weight_transfer_engine"
            )
        base, self.mirror, self._loaded = self.mirror, {}, None  # no base until this update completes
        model: Any = self.model  # a vLLM model: load_weights takes (name, tensor) pairs

        def copies(names: list[str], tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
            return [(name, tensors[name].to(self.device, copy=True)) for name in names]

        try:
            manifest = update_info.manifest()
            if update_info.changed is not None:
                problems = manifest_problems(manifest, [_meta(name, t) for name, t in base.items()])
                if not base or problems:
                    raise ValueError(
                        "a delta update needs the weights of the last complete update, and this worker holds "
                        + ("none" if not base else "others: " + "; ".join(problems[:3]))
                    )
            wire = update_info.wire()
            buckets = (
                plan_buckets(wire, update_info.bucket_size_bytes)
                if update_info.packed
                else plan_per_tensor(wire)
            )
            targets = staging_targets(buckets)

            def load(bucket: Bucket) -> None:
                model.load_weights(copies([entry.meta.name for entry in bucket.entries], targets))

            with disable_mtp_completeness_check():
                if update_info.changed is None:
                    receive_packed(group, buckets, targets, self.timeout_s, on_bucket=load)
                    loaded = {meta.name: targets[meta.name] for meta in manifest}
                else:
                    receive_packed(group, buckets, targets, self.timeout_s)
                    touched = delta.wire_tensors(manifest, update_info.changed, targets)
                    for meta, count, tensors in touched:  # all of them before any element is written
                        delta.check(base[meta.name], meta, count, tensors)
                    for meta, count, tensors in touched:
                        delta.apply(base[meta.name], meta, count, tensors)
                    # Every tensor: the layerwise reload processes whole layers, as after a full update.
                    model.load_weights(copies([meta.name for meta in manifest], base))
                    loaded = base
        except BaseException:
            self.shutdown()  # a failed collective leaves the group unusable
            self.finish_weight_update()  # real tensors again, partly new: the worker reports INCONSISTENT
            raise
        self._loaded = loaded

    def finish_weight_update(self) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: PLC0415
            VocabParallelEmbedding,
        )
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # noqa: PLC0415

        loaded, self._loaded = self._loaded, None
        finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call, unused-ignore]
        # A tied LM head shares the embedding's weight but not its packed kernel: repack it from the new one.
        for module in self.model.modules():
            if isinstance(module, VocabParallelEmbedding):
                module.quant_method.process_weights_after_loading(module)
        self.mirror = loaded or {}  # a complete update: the base of the next delta

    def mirror_checksums(self, names: list[str]) -> dict[str, str]:
        """The mirror's checksums (`tensor_checksum`) of `names`, or of every mirror tensor when empty;
        nothing without a mirror."""
        wanted = names or list(self.mirror)
        return {name: tensor_checksum(self.mirror[name]) for name in wanted if name in self.mirror}

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None


def _meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


class TandemWorkerExtension:
    """Methods vLLM adds to its worker class (`worker_extension_cls`, set by `VllmEngine` for the gloo
    backend), reached with `collective_rpc` by name; vLLM refuses a name its worker already has."""

    def tandem_mirror_checksums(self, names: list[str]) -> dict[str, str]:
        """This rank's gloo engine's `mirror_checksums`; nothing when the engine is another."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, GlooWeightTransferEngine):
            return {}
        return engine.mirror_checksums(list(names))
