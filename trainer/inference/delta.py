"""Sparse delta weight updates (`[weights] mode = "delta"`, WEIGHT_UPDATE_MODE_DELTA): only the elements that
changed since the version the workers hold move, as indices and values, through the same packed buckets as a
full update.

Between two RL steps most low-precision weights do not change at all: an Adam step at lr 1e-6 moves a bf16
weight of magnitude 0.02 by far less than half its last place, so the value the trainer casts for serving is
bit-identical to the one it sent before. Comparing the new tensors with a copy of the last ones sent, bit for
bit, finds the few that did change.

Per manifest tensor the trainer picks one of three encodings, announced to the workers as
`changed_elements` in BeginWeightUpdate (both sides derive the wire manifest from it, `wire_manifest`):

    0                  unchanged: nothing moves
    its element count  dense: the tensor whole, as in a full update (the sparse form would not be smaller)
    k in between       sparse: k indices (int32, int64 for a tensor of 2^31 elements or more), strictly
                       increasing, into its row-major elements, then the k new values in its dtype

A tensor is sparse when k * (index bytes + value bytes) < element count * value bytes, else dense. The
comparison is on the bits (each tensor viewed as integers of its item size), so -0.0 and +0.0 differ and a NaN
equals itself: after the workers apply a delta they hold exactly the trainer's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.inference.engine import TensorMeta
from trainer.inference.weights import dtype_of, meta_nbytes

INDEX_SUFFIX = "#index"  # wire names: never a checkpoint name ("#" is outside the manifest's pattern)
VALUE_SUFFIX = "#value"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def numel_of(meta: TensorMeta) -> int:
    numel = 1
    for size in meta.shape:
        numel *= size
    return numel


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def is_sparse(meta: TensorMeta, changed: int) -> bool:
    """Whether `changed` elements of the tensor move as indices and values (else: not at all, or whole)."""
    return 0 < changed < numel_of(meta)


def encoding_for(meta: TensorMeta, changed: int) -> int:
    """The `changed_elements` entry for a tensor of which `changed` elements differ: 0, `changed` (sparse)
    or the element count (dense) when the sparse form would not be smaller."""
    numel = numel_of(meta)
    if changed <= 0:
        return 0
    item = dtype_of(meta.dtype).itemsize
    sparse = changed * (index_dtype(numel).itemsize + item)
    return changed if sparse < numel * item else numel


def wire_manifest(manifest: Sequence[TensorMeta], changed: Sequence[int]) -> list[TensorMeta]:
    """The tensors a delta update broadcasts, in order, from the model's manifest and `changed_elements`;
    ValueError when they do not fit together (a count per tensor, none above its element count)."""
    if len(changed) != len(manifest):
        raise ValueError(f"changed_elements has {len(changed)} entries for {len(manifest)} manifest tensors")
    wire: list[TensorMeta] = []
    for meta, count in zip(manifest, changed, strict=True):
        numel = numel_of(meta)
        if count > numel:
            raise ValueError(f"changed_elements says {count} for {meta.name}, which has {numel} elements")
        if count == 0:
            continue
        if count == numel:
            wire.append(meta)
            continue
        wire.append(
            TensorMeta(meta.name + INDEX_SUFFIX, str(index_dtype(numel)).removeprefix("torch."), (count,))
        )
        wire.append(TensorMeta(meta.name + VALUE_SUFFIX, meta.dtype, (count,)))
    return wire


def wire_bytes(manifest: Sequence[TensorMeta], changed: Sequence[int]) -> int:
    return sum(meta_nbytes(meta) for meta in wire_manifest(manifest, changed))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return flat.view(_BITS[flat.element_size()])


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's part of a delta: `changed` as announced, and the tensors that go on the wire for it
    (none, the tensor itself, or its indices and values)."""

    changed: int
    wire: tuple[torch.Tensor, ...]


def diff(meta: TensorMeta, base: torch.Tensor, new: torch.Tensor) -> TensorDelta:
    """The delta that turns `base` into `new` (same dtype and shape, on one device), bit for bit."""
    if base.dtype != new.dtype or base.shape != new.shape:
        raise ValueError(
            f"{meta.name}: the base is {base.dtype} {list(base.shape)}, the new tensor {new.dtype} {list(new.shape)}"
        )
    where = torch.ne(_bits(base), _bits(new)).nonzero().view(-1)
    changed = encoding_for(meta, int(where.numel()))
    if changed == 0:
        return TensorDelta(0, ())
    if not is_sparse(meta, changed):
        return TensorDelta(changed, (new.detach(),))
    values = new.detach().reshape(-1).index_select(0, where)
    return TensorDelta(changed, (where.to(index_dtype(numel_of(meta))), values))


def check(target: torch.Tensor, meta: TensorMeta, changed: int, wire: Sequence[torch.Tensor]) -> None:
    """ValueError when one tensor's received delta does not fit `target`: an index out of its range or not
    strictly increasing (each element written once), or a size that disagrees with `changed`."""
    if not is_sparse(meta, changed):
        if changed and (len(wire) != 1 or wire[0].numel() != target.numel()):
            raise ValueError(f"{meta.name}: a dense delta needs the tensor whole")
        return
    indices, values = wire
    if indices.numel() != changed or values.numel() != changed:
        raise ValueError(
            f"{meta.name}: the delta has {indices.numel()} indices and {values.numel()} values, not {changed}"
        )
    if int(indices[0]) < 0 or int(indices[-1]) >= target.numel():
        raise ValueError(f"{meta.name}: a delta index is outside its {target.numel()} elements")
    if changed > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"{meta.name}: the delta's indices are not strictly increasing")


def apply(target: torch.Tensor, meta: TensorMeta, changed: int, wire: Sequence[torch.Tensor]) -> None:
    """Write one tensor's delta (`check`ed) into `target`, the weights held at the base version, in place."""
    if changed == 0:
        return
    if not is_sparse(meta, changed):
        (whole,) = wire
        target.copy_(whole.view(target.shape))
        return
    indices, values = wire
    index = indices.to(device=target.device, dtype=torch.int64)
    source = values.to(device=target.device)
    if target.is_contiguous():
        target.view(-1).index_copy_(0, index, source)
    else:  # a strided target: write through a contiguous copy
        dense = target.contiguous().view(-1)
        dense.index_copy_(0, index, source)
        target.copy_(dense.view(target.shape))


def wire_tensors(
    manifest: Sequence[TensorMeta], changed: Sequence[int], staged: dict[str, torch.Tensor]
) -> list[tuple[TensorMeta, int, list[torch.Tensor]]]:
    """Per manifest tensor that the delta touches: (meta, changed, its wire tensors) from the received
    wire targets `staged` (named as `wire_manifest` names them)."""
    out: list[tuple[TensorMeta, int, list[torch.Tensor]]] = []
    for meta, count in zip(manifest, changed, strict=True):
        if count == 0:
            continue
        if is_sparse(meta, count):
            out.append((meta, count, [staged[meta.name + INDEX_SUFFIX], staged[meta.name + VALUE_SUFFIX]]))
        else:
            out.append((meta, count, [staged[meta.name]]))
    return out
