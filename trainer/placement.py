"""Placement: which GPU of one node runs what in an online-RL job. A pure function, no torch.

    plan(gpus=8, inference_gpus="auto", tensor_parallel=2, reference="none")
      -> inference replicas on GPUs (0,1) (2,3) (4,5), trainer ranks on 6 and 7

Rules, in order:
- `gpus == 0` is the CPU plan: one inference worker and one trainer rank on the CPU (tests, laptops, the
  demo), and the reference model, when asked for, on the CPU too.
- Inference replicas take whole tensor-parallel groups of consecutive GPUs from GPU 0; the trainer takes the
  GPUs after them (at least one); a reference model placed `own` takes the last GPU.
- `inference_gpus="auto"` gives training a quarter of the node (at least one GPU), the reference its GPU when
  `own`, and inference every remaining whole TP group; GPUs a TP group cannot use go to training.
- The reference model is `none` (no KL term), `stacked` (beside the inference engine on the first
  inference replica's first GPU, as the contract's REFERENCE_PLACEMENT_STACKED says) or `own` (a GPU of
  its own, taken from the training share).
Every refusal says what to change. The launcher applies a plan with CUDA_VISIBLE_DEVICES per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mesh.errors import InvalidArgument, R

ReferencePlacement = Literal["none", "stacked", "own"]


@dataclass(frozen=True)
class Plan:
    inference: tuple[tuple[int, ...], ...]  # per replica, its GPUs (empty tuple: on the CPU)
    trainer: tuple[int, ...]  # one trainer rank per GPU (empty tuple: one rank on the CPU)
    reference: tuple[int, ...] | None  # the reference model's GPUs; None: no reference model
    reference_stacked: bool  # the reference shares an inference replica's GPU

    @property
    def cpu(self) -> bool:
        return not self.trainer

    def visible_devices(self) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES per process: "inference-<i>", "trainer", "reference" (own GPU only)."""
        devices = {f"inference-{i}": ",".join(map(str, gpus)) for i, gpus in enumerate(self.inference)}
        devices["trainer"] = ",".join(map(str, self.trainer))
        if self.reference is not None and not self.reference_stacked:
            devices["reference"] = ",".join(map(str, self.reference))
        return devices


def _refuse(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason=R.ERROR_REASON_PLACEMENT_INVALID)


def _inference_gpus(gpus: int, inference_gpus: int | Literal["auto"], tensor_parallel: int, own: int) -> int:
    if inference_gpus == "auto":
        training = max(1, gpus // 4)
        inference = (gpus - training - own) // tensor_parallel * tensor_parallel
        if inference < tensor_parallel:
            needed = tensor_parallel + 1 + own
            raise _refuse(
                f"{gpus} GPUs cannot hold one inference replica of tensor_parallel = {tensor_parallel}, a trainer "
                f"GPU{' and a reference GPU' if own else ''}: it takes {needed}; lower tensor_parallel"
                + (" or stack the reference" if own else "")
            )
    else:
        inference = inference_gpus
        if inference < tensor_parallel or inference % tensor_parallel:
            raise _refuse(
                f"inference_gpus = {inference} must be a positive multiple of tensor_parallel = {tensor_parallel}"
            )
        if inference + 1 + own > gpus:
            raise _refuse(
                f"inference_gpus = {inference} leaves {gpus - inference} of {gpus} GPUs; the trainer needs one"
                + (" and the reference another" if own else "")
                + f": set inference_gpus to at most {(gpus - 1 - own) // tensor_parallel * tensor_parallel}"
            )
    return inference


def plan(
    gpus: int,
    inference_gpus: int | Literal["auto"] = "auto",
    tensor_parallel: int = 1,
    reference: ReferencePlacement = "none",
) -> Plan:
    if gpus < 0:
        raise _refuse(f"gpus must be 0 (CPU) or more, not {gpus}")
    if tensor_parallel < 1:
        raise _refuse(f"tensor_parallel must be at least 1, not {tensor_parallel}")
    if gpus == 0:
        if inference_gpus not in ("auto", 0):
            raise _refuse(f"inference_gpus = {inference_gpus} needs GPUs; this node has none (use auto)")
        if tensor_parallel != 1:
            raise _refuse("tensor_parallel > 1 needs GPUs; set it to 1 on a CPU node")
        return Plan(((),), (), () if reference != "none" else None, reference != "none")
    own = 1 if reference == "own" else 0
    inference = _inference_gpus(gpus, inference_gpus, tensor_parallel, own)
    replicas = tuple(
        tuple(range(start, start + tensor_parallel)) for start in range(0, inference, tensor_parallel)
    )
    trainer = tuple(range(inference, gpus - own))
    ref: tuple[int, ...] | None
    if reference == "none":
        ref = None
    elif reference == "own":
        ref = (gpus - 1,)
    else:
        ref = replicas[0][:1]
    return Plan(replicas, trainer, ref, reference == "stacked")
