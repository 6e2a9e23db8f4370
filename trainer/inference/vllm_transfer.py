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

Shortcuts: the receive targets are one staging copy of the whole update in host memory (what
`staging_targets` lays out), freed when the update ends; fine for the small models CPU workers serve.
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

from trainer.inference.engine import TensorMeta
from trainer.inference.weights import (
    Bucket,
    TransferGroup,
    plan_buckets,
    plan_per_tensor,
    receive_packed,
    staging_targets,
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
    """One update's manifest and the bucket geometry of `BeginWeightUpdate`."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_size_bytes: int
    packed: bool = True

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


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):  # type: ignore[misc, unused-ignore]
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self.timeout_s = 300.0

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
        manifest = update_info.manifest()
        buckets = (
            plan_buckets(manifest, update_info.bucket_size_bytes)
            if update_info.packed
            else plan_per_tensor(manifest)
        )
        targets = staging_targets(buckets)

        def load(bucket: Bucket) -> None:
            names = [entry.meta.name for entry in bucket.entries]
            model: Any = self.model  # a vLLM model: load_weights takes (name, tensor) pairs
            model.load_weights([(name, targets[name].to(self.device)) for name in names])

        try:
            with disable_mtp_completeness_check():
                receive_packed(group, buckets, targets, self.timeout_s, on_bucket=load)
        except BaseException:
            self.shutdown()  # a failed collective leaves the group unusable
            self.finish_weight_update()  # real tensors again, partly new: the worker reports INCONSISTENT
            raise

    def finish_weight_update(self) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: PLC0415
            VocabParallelEmbedding,
        )
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # noqa: PLC0415

        finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call, unused-ignore]
        # A tied LM head shares the embedding's weight but not its packed kernel: repack it from the new one.
        for module in self.model.modules():
            if isinstance(module, VocabParallelEmbedding):
                module.quant_method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
