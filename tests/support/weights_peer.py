"""Ranks of a weight-transfer group in processes of their own, for tests/trainer/test_weights_transport.py.

Each function is the body of one spawned process (`multiprocessing.get_context("spawn")`): it joins or forms
the group, runs its rounds with the real transport, and reports to the test through a queue. Tensor values
come from `make_tensors(manifest, seed)`, so a sender in another process and the test agree on them without
shipping tensors around.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any, Literal

import torch

from trainer.inference.engine import TensorMeta
from trainer.inference.weights import (
    Bucket,
    TransferError,
    TransferGroup,
    dtype_of,
    plan_buckets,
    plan_per_tensor,
    receive_packed,
    send_packed,
    staging_targets,
    tensor_checksum,
)

HOST = "127.0.0.1"
Layout = Literal["separate", "laid_out"]


@dataclass(frozen=True)
class Round:
    """One update: the manifest, its plan (bucket size in bytes, or 0 for one bucket per tensor) and the
    seed of the sender's values."""

    manifest: tuple[TensorMeta, ...]
    bucket_size: int
    seed: int

    def plan(self) -> list[Bucket]:
        return (
            plan_buckets(self.manifest, self.bucket_size)
            if self.bucket_size
            else plan_per_tensor(self.manifest)
        )


@dataclass(frozen=True)
class Outcome:
    """What a rank reports for one round: checksums in manifest order, or the error it raised."""

    rank: int
    round: int
    checksums: tuple[tuple[str, str], ...] = ()
    error: str = ""  # the exception's class name
    message: str = ""
    bucket: int | None = None


def make_tensors(manifest: Sequence[TensorMeta], seed: int) -> list[torch.Tensor]:
    """Deterministic values for every tensor of `manifest` (random bits, so every byte pattern occurs)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: list[torch.Tensor] = []
    for meta in manifest:
        dtype = dtype_of(meta.dtype)
        numel = 1
        for size in meta.shape:
            numel *= size
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
        tensors.append(raw.view(dtype).reshape(meta.shape))
    return tensors


def _targets(rnd: Round, layout: Layout) -> dict[str, torch.Tensor]:
    if layout == "laid_out":
        targets = staging_targets(rnd.plan())
        for tensor in targets.values():
            tensor.zero_()
        return targets
    return {meta.name: torch.zeros(meta.shape, dtype=dtype_of(meta.dtype)) for meta in rnd.manifest}


def _failure(rank: int, index: int, exc: BaseException) -> Outcome:
    bucket = exc.bucket if isinstance(exc, TransferError) else None
    message = str(exc) if isinstance(exc, TransferError | ValueError) else traceback.format_exc()
    return Outcome(rank, index, error=type(exc).__name__, message=message, bucket=bucket)


def receiver(
    port: int, world_size: int, rank: int, rounds: Sequence[Round], layout: Layout, out: Queue[Outcome]
) -> None:
    """Join the group as `rank` and receive every round, reporting each round's checksums; stop at the first
    error, after reporting it."""
    try:
        group = TransferGroup.join(HOST, port, world_size, rank, timeout_s=60)
    except Exception as exc:
        out.put(_failure(rank, -1, exc))
        return
    with group:
        for index, rnd in enumerate(rounds):
            targets = _targets(rnd, layout)
            try:
                receive_packed(group, rnd.plan(), targets, timeout_s=5)
            except Exception as exc:
                out.put(_failure(rank, index, exc))
                return
            checksums = tuple((meta.name, tensor_checksum(targets[meta.name])) for meta in rnd.manifest)
            out.put(Outcome(rank, index, checksums))


def receiver_that_dies(port: int, world_size: int, rank: int, rnd: Round, out: Queue[Outcome]) -> None:
    """Join, receive the round's first bucket only, then die (SIGKILL) while the sender goes on."""
    group = TransferGroup.join(HOST, port, world_size, rank, timeout_s=60)
    receive_packed(group, rnd.plan()[:1], _targets(rnd, "separate"), timeout_s=5)
    out.put(Outcome(rank, 0))
    out.close()
    out.join_thread()  # the report is in the pipe before the process dies
    os.kill(os.getpid(), signal.SIGKILL)


def sender_that_dies(world_size: int, rnd: Round, ports: Queue[int]) -> None:
    """Form the group as rank 0, send the round's first bucket only, then die (SIGKILL) mid-update."""
    listener = TransferGroup.listen(HOST, world_size, timeout_s=60)
    ports.put(listener.port)
    group = listener.connect()
    first = rnd.plan()[0]
    send_packed(group, make_tensors(rnd.manifest, rnd.seed)[: len(first.entries)], [first], timeout_s=5)
    os.kill(os.getpid(), signal.SIGKILL)


def publisher_that_dies(
    addresses: Sequence[str], mesh_key: str, model_dir: str, version: int, bucket_size: int, sent: Queue[int]
) -> None:
    """The trainer's side of one update into real inference workers, by the contract's RPCs: form the group
    (InitWeightTransfer), pause, BeginWeightUpdate, broadcast the first bucket only, report it on `sent` and
    wait to be killed: a trainer that dies mid-broadcast."""
    import asyncio  # noqa: PLC0415

    asyncio.run(_first_bucket_only(addresses, mesh_key, model_dir, version, bucket_size))
    sent.put(version)
    time.sleep(3600)


async def _first_bucket_only(
    addresses: Sequence[str], mesh_key: str, model_dir: str, version: int, bucket_size: int
) -> None:
    import asyncio  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from safetensors.torch import load_file  # noqa: PLC0415
    from tandem.inference.v1 import inference_service_pb2 as pb  # noqa: PLC0415
    from tandem.inference.v1 import weights_pb2  # noqa: PLC0415

    from tests.support.workers import stub_at  # noqa: PLC0415
    from trainer.inference.weights import manifest_of  # noqa: PLC0415

    named = [(n, t + 0.5) for n, t in load_file(str(Path(model_dir) / "model.safetensors")).items()]
    opened = [stub_at(address, mesh_key) for address in addresses]
    stubs: list[Any] = [stub for _, stub in opened]  # grpc.aio stubs, typed as the blocking ones
    world = 1 + len(stubs)
    listener = TransferGroup.listen(HOST, world, timeout_s=60)
    joining = asyncio.ensure_future(asyncio.to_thread(listener.connect))
    init = [
        pb.InitWeightTransferRequest(
            backend=weights_pb2.WEIGHT_TRANSFER_BACKEND_GLOO,
            master_address=HOST,
            master_port=listener.port,
            world_size=world,
            rank_offset=1 + index,
        )
        for index in range(len(stubs))
    ]
    await asyncio.gather(*(s.InitWeightTransfer(r, timeout=120) for s, r in zip(stubs, init, strict=True)))
    group = await joining
    pause = pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_KEEP)
    await asyncio.gather(*(s.PauseGeneration(pause, timeout=60) for s in stubs))
    manifest = manifest_of(named)
    begin = pb.BeginWeightUpdateRequest(
        weight_version=version,
        manifest=[weights_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape)) for m in manifest],
        bucket_size_bytes=bucket_size,
        packed=True,
    )
    await asyncio.gather(*(s.BeginWeightUpdate(begin, timeout=60) for s in stubs))
    first = plan_buckets(manifest, bucket_size)[0]
    tensors = [tensor for _, tensor in named[: len(first.entries)]]
    await asyncio.to_thread(send_packed, group, tensors, [first], 60)
