"""FSDP2 for the trainer ranks: sharding a policy, its optimizer state, and full tensors gathered a group at
a time (for weight sync, checkpoints and the ranks' final check). trainer/ranks.py drives it.

    shard(model)                    every decoder layer, then the root, `fully_shard` over the default group:
                                    each rank keeps 1/N of every weight (dim 0, torch.chunk's split) as a
                                    DTensor; a forward gathers one layer at a time; backward reduce-scatters
                                    the gradients, averaged over the ranks as DDP averages them
    shard_optimizer_state(...)      a whole (unsharded) optimizer state -> this rank's shard of it
    Gathering(groups)               an iterator of each group's full tensors, in order; every rank must run
                                    the same groups, since each DTensor's gather is a collective
    full_optimizer_state(opt)       the whole optimizer state, gathered tensor by tensor (a collective)
    write_hf_folder(...)            a Hugging Face folder, safetensors shard by shard from a Gathering

Only the tensors of the group being gathered (and those the consumer still holds) are whole at once, so rank
0's peak is a few groups, never the model: `Gathering.peak_bytes` measures it.

Shortcuts: one mesh over every rank (no hybrid sharding); weights and optimizer state stay in the dtype the
policy was loaded in (FSDP2's `MixedPrecisionPolicy` is where bf16 compute over fp32 shards goes, passed to
`shard`); the optimizer state is gathered whole into rank 0's host memory for a checkpoint (8 bytes a
parameter with AdamW) and travels whole in the setup message on resume, where torch.distributed.checkpoint
would keep it sharded; the reference model is not sharded.
"""

from __future__ import annotations

import copy
import json
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

SHARD_BYTES = 2 * 1024**3  # a checkpoint's safetensors file, before the next one starts
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP shards one by one: those of the classes a Hugging Face model names as never to be
    split across devices (its decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def broadcast_module(model: torch.nn.Module) -> None:
    """Every rank: make this rank's parameters and buffers rank 0's (before sharding, as DDP does when it
    wraps)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def shard(model: torch.nn.Module, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Shard `model` in place over the default group: each decoder layer as one unit, the rest (embeddings,
    final norm, a head) with the root; between forwards and backwards only shards are held. The module
    keeps its class's behaviour; its parameters become DTensors, so an optimizer built before must be
    rebound (`rebind`)."""
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    # The root too reshards after its forward (FSDP2 keeps it whole until backward by default): a skipped
    # update runs no backward, and the weights must be shards again between updates either way.
    fully_shard(model, mp_policy=policy, reshard_after_forward=True)


def rebind(optimizer: torch.optim.Optimizer, model: torch.nn.Module, names: dict[int, str]) -> None:
    """Point `optimizer`'s parameter groups at `model`'s parameters of the same names (`names`: id of each
    parameter before `shard` -> its name), dropping its state (`load_state_dict` brings it back)."""
    params = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [params[names[id(p)]] for p in group["params"]]
    optimizer.state.clear()


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in its state dict's numbering."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def shard_optimizer_state(state: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """A whole optimizer state dict (`Optimizer.state_dict()` of the unsharded policy) with every tensor of
    a parameter's shape replaced by this rank's shard of it, split as the parameter is (no collective)."""
    sharded: dict[int, dict[str, Any]] = {}
    for index, values in state["state"].items():
        param = params[index]
        sharded[index] = {
            key: (
                distribute_tensor(
                    value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                )
                if isinstance(param, DTensor)
                and isinstance(value, torch.Tensor)
                and value.shape == param.shape
                else value
            )
            for key, value in values.items()
        }
    return {"state": sharded, "param_groups": state["param_groups"]}


def full_optimizer_state(optimizer: torch.optim.Optimizer, *, keep: bool = True) -> dict[str, Any]:
    """Every rank at once: the optimizer's whole state, each sharded tensor gathered (in index, then key,
    order) and moved to host memory; the same dict `state_dict()` gives unsharded. `keep=False` (the ranks
    that only take part) drops each tensor once gathered and returns an empty state."""
    state = optimizer.state_dict()
    whole: dict[int, dict[str, Any]] = {}
    for index in sorted(state["state"]):
        values = state["state"][index]
        kept: dict[str, Any] = {}
        for key in sorted(values):
            value = values[key]
            if isinstance(value, DTensor):
                with torch.no_grad():
                    value = value.full_tensor().cpu()
            if keep:
                kept[key] = value
        if keep:
            whole[index] = kept
    return {"state": whole, "param_groups": state["param_groups"]}


class Gathering:
    """Each group's tensors whole, one group per `next`, in order: a DTensor is gathered (a collective every
    rank runs for the same groups), any other tensor is given as it is. `finish` gathers the groups not
    taken yet, so a consumer that stops early (a failed broadcast) leaves every rank at the same point."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        self._groups = groups
        self._next = 0
        self.live_bytes = 0  # gathered bytes still referenced
        self.peak_bytes = 0  # the most gathered bytes referenced at once

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        return self

    def __next__(self) -> list[torch.Tensor]:
        if self._next >= len(self._groups):
            raise StopIteration
        group = self._groups[self._next]
        self._next += 1
        return [self._whole(t) for t in group]

    def _whole(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return tensor.detach()
        with torch.no_grad():
            full = tensor.full_tensor()
        size = full.numel() * full.element_size()
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(full, self._freed, size)
        return full

    def _freed(self, size: int) -> None:
        self.live_bytes -= size

    def finish(self) -> None:
        for _ in self:
            pass


def groups_by_size(named: Sequence[tuple[str, torch.Tensor]], limit: int) -> list[list[int]]:
    """Consecutive indices of `named` in groups of at most `limit` bytes (a larger tensor alone)."""
    groups: list[list[int]] = []
    size = 0
    for index, (_, tensor) in enumerate(named):
        nbytes = tensor.numel() * tensor.element_size()
        if not groups or (size + nbytes > limit and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += nbytes
    return groups


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def save_in_dtype(model: Any, path: Path, dtype: torch.dtype | None = None) -> None:
    """`model` (whole, on one rank) as a Hugging Face folder whose weights and config are in `dtype`, the
    model itself unchanged: its float32 master weights are cast once per tensor, so tied weights stay one
    tensor. None saves the parameters as they are."""
    if dtype is None:
        model.save_pretrained(path)
        return
    cast: dict[int, torch.Tensor] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key not in cast:
            cast[key] = tensor.detach().to(dtype)
        state[name] = cast[key]
    model.save_pretrained(path, state_dict=state)
    config = copy.deepcopy(model.config)
    config.dtype = dtype  # save_pretrained writes the dtype of the model's parameters
    config.save_pretrained(path)


def write_hf_folder(
    folder: Path,
    model: Any,
    named: Sequence[tuple[str, torch.Tensor]],
    groups: Sequence[Sequence[int]],
    tensors: Iterable[Sequence[torch.Tensor]],
    dtype: torch.dtype | None = None,
) -> None:
    """Write `model`'s config (and generation config) and its weights into `folder` as Hugging Face lays
    them out: one `model.safetensors`, or one file per group with `model.safetensors.index.json`, in `dtype`
    (None: the parameters'). `tensors` yields each group's whole tensors (a Gathering); each file is written
    before the next group is asked for."""
    config = copy.deepcopy(model.config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
    count = len(groups)
    files = (
        [WEIGHTS_FILE]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for file, group, whole in zip(files, groups, tensors, strict=True):
        names = [named[i][0] for i in group]
        save_file(
            {name: _cast(t, dtype).contiguous().cpu() for name, t in zip(names, whole, strict=True)},
            str(folder / file),
            metadata={"format": "pt"},
        )
        weight_map.update(dict.fromkeys(names, file))
        total += sum(t.numel() * t.element_size() for t in whole)
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
