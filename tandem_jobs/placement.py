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

Memory, when the caller gives the model's parameter count and the GPUs' memory (`Memory`): a plan is refused,
with the arithmetic in the message, when one GPU cannot hold what the plan puts on it. Per GPU, in GB
(10^9 bytes), with P parameters:
- a training GPU: P x 16 B (fp32 master weights 4 + fp32 gradients 4 + AdamW's two fp32 moments 8), divided
  by the training GPUs under FSDP, whole under DDP;
- an inference GPU: the replica's share of the bf16 weights, P x 2 B / tensor_parallel, and with a reference
  `stacked` on it (the first replica's first GPU) the reference's bf16 weights, P x 2 B, too; a reference
  `own` GPU holds P x 2 B.
Each must fit in the GPU's memory less `MARGIN` of it: activations under the micro-batch token budget,
FSDP's gathered layer (and the next, prefetched) with its gradient, the CUDA context and the collectives'
buffers on a training GPU; the KV cache's minimum on an inference GPU. An 8B model (8.03e9 parameters) on
2 training H100s of 80 GB: 128.5 GB a GPU under DDP is refused, 64.2 GB under FSDP fits in 80 - 12 = 68 GB.
`parameters_of` counts the parameters from a model folder's config.json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mesh.errors import InvalidArgument, R

ReferencePlacement = Literal["none", "stacked", "own"]
Sharding = Literal["ddp", "fsdp"]
GB = 1e9
TRAINING_BYTES = 16  # a parameter's fp32 master weight 4 + fp32 gradient 4 + AdamW's two fp32 moments 8
SERVING_BYTES = 2  # a parameter in bf16: the inference replicas' weights and the reference model's
# Of each GPU's memory, what the state above may not take. What it has to cover on a training GPU of an
# 8B Llama (32 layers of 218M parameters), by arithmetic, not measured on a GPU: one gathered layer in fp32
# is 0.87 GB, with the next prefetched and their unsharded gradients about 3.5 GB; activations of an
# 8k-token micro-batch with checkpointing at layer boundaries, 8192 x 4096 x 2 B x 32 = 2.1 GB plus one
# layer's recompute; the CUDA context and NCCL buffers about 1-2 GB. 15% of an 80 GB GPU (12 GB) covers that.
MARGIN = 0.15


@dataclass(frozen=True)
class Memory:
    """What the planner checks a plan's memory against: the policy's parameters, each GPU's memory in
    bytes, and how the trainer ranks hold the training state."""

    parameters: int
    gpu_bytes: float
    sharding: Sharding = "ddp"


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
    memory: Memory | None = None,
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
    placed = Plan(replicas, trainer, ref, reference == "stacked")
    if memory is not None:
        check_memory(placed, tensor_parallel, memory)
    return placed


def _gb(value: float) -> str:
    return f"{value / GB:.1f} GB"


def training_bytes_per_gpu(parameters: int, training_gpus: int, sharding: Sharding) -> float:
    """The training state one training GPU holds: 16 B a parameter, divided by the GPUs under FSDP."""
    return parameters * TRAINING_BYTES / (training_gpus if sharding == "fsdp" else 1)


def check_memory(placed: Plan, tensor_parallel: int, memory: Memory) -> None:
    """Refuse a GPU plan in which a GPU cannot hold what it is given (module docstring), saying what to
    change, with the arithmetic."""
    if placed.cpu:
        return
    p, usable = memory.parameters, memory.gpu_bytes * (1 - MARGIN)
    limit = (
        f"each GPU has {_gb(memory.gpu_bytes)} less the {MARGIN:.0%} margin for activations and buffers "
        f"({_gb(memory.gpu_bytes * MARGIN)}) = {_gb(usable)}"
    )
    training = len(placed.trainer)
    held = training_bytes_per_gpu(p, training, memory.sharding)
    if held > usable:
        state = f"{p:.3g} parameters x {TRAINING_BYTES} B (fp32 weights 4 + gradients 4 + AdamW 8)"
        needed = math.ceil(p * TRAINING_BYTES / usable)
        if memory.sharding == "fsdp":
            spread = f"{state} / {training} training GPU{'s' * (training > 1)} (FSDP) = {_gb(held)} a GPU"
            advice = f"give training at least {needed} GPUs (fewer inference_gpus)"
        else:
            spread = f"{state} = {_gb(held)} on each training GPU (DDP: every rank holds all of it)"
            sharded = training_bytes_per_gpu(p, training, "fsdp")
            advice = (
                f'set [topology] sharding = "SHARDING_FSDP" ({_gb(sharded)} a GPU over {training})'
                if sharded <= usable
                else f'set [topology] sharding = "SHARDING_FSDP" and give training at least {needed} GPUs'
            )
        raise _refuse(f"the training state does not fit: {spread}, and {limit}: {advice}")
    weights = p * SERVING_BYTES
    replica = weights / tensor_parallel
    first = replica + (weights if placed.reference_stacked else 0.0)
    if first > usable:
        parts = f"{p:.3g} parameters x {SERVING_BYTES} B / tensor_parallel {tensor_parallel} = {_gb(replica)}"
        if placed.reference_stacked:
            parts += f", plus the stacked reference's {_gb(weights)}, = {_gb(first)}"
        advice = "raise tensor_parallel" + (
            " or give the reference its own GPU" if placed.reference_stacked else ""
        )
        raise _refuse(f"an inference GPU does not hold its weights: {parts}, and {limit}: {advice}")
    if placed.reference is not None and not placed.reference_stacked and weights > usable:
        raise _refuse(
            f"the reference GPU does not hold the reference: {p:.3g} parameters x {SERVING_BYTES} B = "
            f"{_gb(weights)}, and {limit}: set kl_coef = 0 (no reference) or use larger GPUs"
        )


def parameters_of(config: Mapping[str, Any]) -> int:
    """The parameter count of a dense decoder (Llama, Qwen2, Qwen3, Mistral shapes) from its Hugging Face
    config.json: embeddings (twice unless tied), and per layer the attention projections (with the biases
    Qwen2 and `attention_bias` add, and Qwen3's per-head q/k norms), the SwiGLU MLP and two RMSNorms; then
    the final norm. ValueError for a mixture of experts or a config without these shapes."""
    if any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError("a mixture-of-experts config: set [topology] model_parameters")
    try:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        inner, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            "config.json lacks hidden_size, num_hidden_layers, intermediate_size, vocab_size or "
            "num_attention_heads: set [topology] model_parameters"
        ) from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    if config.get("model_type") == "qwen2":
        attention += q + 2 * kv  # Qwen2's q, k and v projections have biases
    elif config.get("attention_bias"):
        attention += q + 2 * kv + hidden  # Llama's attention_bias: all four projections
    if config.get("model_type") == "qwen3":
        attention += 2 * head_dim  # RMSNorm over each head's queries and keys
    mlp = 3 * hidden * inner + (2 * inner + hidden if config.get("mlp_bias") else 0)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)  # these classes: untied
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden


def read_parameters(model_dir: Path) -> int:
    """`parameters_of` the config.json in a Hugging Face model folder."""
    document = json.loads((model_dir / "config.json").read_text())
    if not isinstance(document, dict):
        raise ValueError(f"{model_dir / 'config.json'} is not a JSON object")
    return parameters_of(document)
