"""Weight tensors as the weight-sync protocol sees them: dtype names, manifests and checksums.

A manifest lists every tensor of an update as (name, dtype, shape) in a fixed order; the receiver checks it
against the model before anything moves. A checksum is the SHA-256 of a tensor's contiguous row-major bytes
in its own dtype (little-endian, as torch stores it on every platform we run on), so a trainer and a worker
that hold the same values produce the same hex string, whatever device each holds it on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

from trainer.inference.engine import TensorMeta


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """"bfloat16" -> `torch.bfloat16`; ValueError for a name torch does not know as a dtype."""
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return found


def manifest_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in named]


def manifest_problems(manifest: Sequence[TensorMeta], served: Sequence[TensorMeta]) -> list[str]:
    """Every way `manifest` disagrees with the `served` tensors: unknown names, other dtypes or shapes,
    names given twice. An update may carry a subset of the served tensors."""
    known = {meta.name: meta for meta in served}
    problems: list[str] = []
    seen: set[str] = set()
    for meta in manifest:
        if meta.name in seen:
            problems.append(f"{meta.name} is listed twice")
            continue
        seen.add(meta.name)
        have = known.get(meta.name)
        if have is None:
            problems.append(f"{meta.name} is not a tensor of the model")
            continue
        if meta.dtype != have.dtype:
            problems.append(f"{meta.name} is {have.dtype} in the model, {meta.dtype} in the manifest")
        if tuple(meta.shape) != tuple(have.shape):
            problems.append(
                f"{meta.name} has shape {list(have.shape)} in the model, {list(meta.shape)} in the manifest"
            )
    return problems


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's contiguous bytes on the CPU, in its own dtype."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """Lowercase hex SHA-256 of the tensor's contiguous bytes in its dtype."""
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def checksum_digest(checksums: Sequence[tuple[str, str]]) -> str:
    """One SHA-256 over every (name, checksum) in order: equal digests mean equal weights."""
    digest = hashlib.sha256()
    for name, checksum in checksums:
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(checksum.encode())
        digest.update(b"\n")
    return digest.hexdigest()
