"""The trainer's side of weight sync: one `WeightPublisher` per job, rank 0 of the transfer group.

    connect():  GetWorkerInfo on every worker; open the group on a port the OS picks; InitWeightTransfer on
                every worker concurrently (worker i takes rank i + 1) while this process joins as rank 0.
    publish():  PauseGeneration(mode) -> BeginWeightUpdate(version, manifest, bucket size) on every worker
                -> the packed broadcast -> FinishWeightUpdate(version) -> ResumeGeneration, timed per phase,
                and a `weights.updated` event on the job's log. In flight (`in_flight=True`, `[weights]
                in_flight`): no pause and no resume; BeginWeightUpdate(in_flight) and the workers generate
                through the broadcast, each swapping the new weights in between two generation steps at
                FinishWeightUpdate. Only engines whose WorkerInfo has `in_flight_updates` (torch) take it.
    verify():   ComputeWeightChecksums on every worker against the trainer's own tensors.

In delta mode (`mode="delta"`, `[weights] mode = "delta"`) the publisher keeps a host copy of the last
weights it put into service (`_Base`) and sends only the elements that changed since then
(trainer/inference/delta.py), through the same buckets. It sends the update whole instead, and says why in
the report, when it holds no copy yet (the first update, or after a failed one), when a worker does not hold
the copy's version (GetWeightInfo `delta_base_weight_version`: a restarted worker), when a worker's engine
takes no delta (WorkerInfo `weight_update_modes`), every `full_every` updates, and when the delta would not be
smaller. Every update in delta mode is checked: after a whole one every tensor's checksum on every worker
against the copy's, after a delta each worker's `applied_checksum` (what it wrote, read back) against the
digest of the values sent.
Where a worker's engine takes no delta (vLLM on GPUs: NCCL, IPC) there is neither copy nor check: every
update goes whole, as in full mode, and says why.

The tensors are taken whole one bucket at a time through `gather` (a `Gather`): a sharded trainer (FSDP,
trainer/ranks.py) gathers each bucket's tensors from its ranks just before the bucket is packed and drops
them once it is on the wire, so rank 0 never holds the whole model; `local_groups`, the default, gives the
tensors as they are.

Every control call has a deadline and every worker's answer is checked: a worker that fails is named in the
`WeightSyncError`, never ignored. When an update fails, the publisher aborts it on every worker (each keeps
serving its previous version), drops the group, and the next `publish` re-forms it first, which is also how
a restarted worker rejoins with the current weights: after a re-forming `connect`, publish the current
weights again under a new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import grpc
import torch
from google.protobuf import duration_pb2
from tandem.events.v1 import event_pb2, events_service_pb2
from tandem.inference.v1 import inference_service_pb2 as pb
from tandem.inference.v1 import weights_pb2
from torch.distributed.tensor import DTensor

from mesh.status import RpcError, rpc_error_from
from trainer.inference import delta
from trainer.inference.engine import PauseMode
from trainer.inference.weights import (
    Bucket,
    GroupListener,
    TransferGroup,
    bucket_size_for,
    checksum_digest,
    expected_bytes,
    manifest_of,
    meta_nbytes,
    plan_buckets,
    send_buckets,
    staging_bytes_for,
    tensor_checksum,
)

Named = Sequence[tuple[str, torch.Tensor]]
# (named tensors, groups of their indices) -> a context whose value yields each group's tensors whole, in
# order; leaving it lets every rank finish the groups not taken (see trainer/ranks.py `Ranks.gathered`).
Gather = Callable[
    [Named, Sequence[Sequence[int]]], contextlib.AbstractContextManager[Iterable[Sequence[torch.Tensor]]]
]


@contextlib.contextmanager
def local_groups(named: Named, groups: Sequence[Sequence[int]]) -> Iterator[Iterable[Sequence[torch.Tensor]]]:
    """Each group's tensors as they are: every tensor is already whole in this process."""
    yield ([named[i][1].detach() for i in group] for group in groups)


def bucket_groups(buckets: Sequence[Bucket]) -> list[list[int]]:
    """Each bucket's tensors as indices into the manifest (buckets take consecutive tensors)."""
    groups, start = [], 0
    for bucket in buckets:
        groups.append(list(range(start, start + len(bucket.entries))))
        start += len(bucket.entries)
    return groups


DIFF_THREADS = max(2, min(8, os.cpu_count() or 1))  # threads comparing a delta update with its base
DIFF_PIECE_ELEMENTS = 1 << 22  # a tensor is compared in pieces of at most this many elements
log = logging.getLogger("tandem.weights")
T = TypeVar("T")
PAUSE_MODES = {
    PauseMode.KEEP: weights_pb2.PAUSE_MODE_KEEP,
    PauseMode.WAIT: weights_pb2.PAUSE_MODE_WAIT,
    PauseMode.ABORT: weights_pb2.PAUSE_MODE_ABORT,
}


class WeightSyncError(Exception):
    """An update or a join failed; `failures` maps each failed worker (by index) to what it said."""

    def __init__(self, phase: str, failures: dict[int, str]) -> None:
        detail = "; ".join(f"worker {i}: {why}" for i, why in sorted(failures.items()))
        super().__init__(f"weight sync failed during {phase}: {detail}")
        self.phase = phase
        self.failures = failures


@dataclass
class UpdateReport:
    version: int
    workers: int
    bytes: int
    buckets: int
    pause_s: float
    begin_s: float
    transfer_s: float
    finish_s: float
    resume_s: float
    total_s: float
    in_flight: bool = False  # generation ran through the update: nothing was paused
    mode: str = "full"  # what went on the wire: "full", "delta" or "lora" (the adapter alone)
    full_bytes: int = 0  # what a full update of the same weights moves
    why_full: str = ""  # in delta mode, why this update went whole
    changed_tensors: int = 0  # delta: the tensors with any changed element
    diff_s: float = 0.0  # delta mode: comparing with the copy of the last update
    verify_s: float = 0.0  # delta mode: the checksums after the update


@dataclass
class _DeltaPlan:
    """One delta update: its base, `changed_elements`, and the wire tensors (names and tensors)."""

    base_version: int
    changed: list[int]
    manifest: list[Any]
    named: list[tuple[str, torch.Tensor]]
    bytes: int


class _Base:
    """The trainer's copy of the weights last put into service, for delta updates: host tensors in
    manifest order and dtype."""

    def __init__(self, version: int, manifest: Sequence[Any], tensors: list[torch.Tensor]) -> None:
        self.version, self.manifest, self.tensors = version, list(manifest), tensors


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def _why(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        converted = rpc_error_from(error)
        return f"{converted.code} {converted.reason}: {converted.message}"
    if isinstance(error, RpcError):
        return f"{error.code} {error.reason}: {error.message}"
    return f"{type(error).__name__}: {error}"


Backend = Literal["auto", "gloo", "nccl", "ipc"]
_BACKEND_NUMBERS = {
    "gloo": weights_pb2.WEIGHT_TRANSFER_BACKEND_GLOO,
    "nccl": weights_pb2.WEIGHT_TRANSFER_BACKEND_NCCL,
    "ipc": weights_pb2.WEIGHT_TRANSFER_BACKEND_IPC,
}


class _Transport:
    """How the bytes move: `listen` (the port the workers join, 0 for none), `connect` (blocks until
    they joined), per update `handles` (IPC only) and `send` (broadcasts only: each bucket's tensors whole,
    from `tensors`), `close`."""

    def __init__(self, host: str, world_size: int, timeout_s: float) -> None:
        self.host, self.world_size, self.timeout_s = host, world_size, timeout_s

    def listen(self) -> int:
        return 0

    def connect(self) -> None:
        return None

    def handles(self, named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
        return b""

    def send(
        self, named: Named, buckets: Sequence[Bucket], tensors: Iterable[Sequence[torch.Tensor]]
    ) -> tuple[int, int]:
        return expected_bytes(buckets), 0

    def close(self) -> None:
        return None


class _Gloo(_Transport):
    """Our packed broadcast over a gloo group of our own (CPU workers)."""

    _listener: GroupListener | None = None
    _group: TransferGroup | None = None

    def listen(self) -> int:
        self._listener = TransferGroup.listen(self.host, self.world_size, self.timeout_s)
        return self._listener.port

    def connect(self) -> None:
        assert self._listener is not None
        self._group = self._listener.connect()

    def send(
        self, named: Named, buckets: Sequence[Bucket], tensors: Iterable[Sequence[torch.Tensor]]
    ) -> tuple[int, int]:
        assert self._group is not None
        on_cpu = all(t.device.type == "cpu" for _, t in named)  # then whole tensors are too, contiguous
        staging = staging_bytes_for(buckets, on_cpu)
        stats = send_buckets(self._group, tensors, buckets, self.timeout_s, staging_bytes=staging)
        return stats.bytes, stats.buckets

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._group is not None:
            self._group.close()
        self._listener = self._group = None


class _Nccl(_Transport):  # needs GPUs and the gpu extra: tests/gpu
    """vLLM's packed NCCL broadcast: the trainer is rank 0 of vLLM's stateless group."""

    _port = 0
    _group: Any = None

    def listen(self) -> int:
        with socket.socket() as probe:  # a free port now; the rendezvous binds it a moment later
            probe.bind((self.host, 0))
            self._port = int(probe.getsockname()[1])
        return self._port

    def connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init  # noqa: PLC0415

        self._group = trainer_init(
            {"master_address": self.host, "master_port": self._port, "world_size": self.world_size}
        )

    def send(
        self, named: Named, buckets: Sequence[Bucket], tensors: Iterable[Sequence[torch.Tensor]]
    ) -> tuple[int, int]:
        from vllm.distributed.weight_transfer.packed_tensor import (  # noqa: PLC0415
            packed_nccl_broadcast_producer,
        )

        whole = (
            (entry.meta.name, tensor)
            for bucket, group in zip(buckets, tensors, strict=True)
            for entry, tensor in zip(bucket.entries, group, strict=True)
        )
        packed_nccl_broadcast_producer(
            iterator=whole, group=self._group, src=0, post_iter_func=lambda item: item[1]
        )
        return expected_bytes(buckets), len(buckets)


class _Ipc(_Transport):  # needs a GPU and the gpu extra: tests/gpu
    """CUDA IPC: the worker maps the trainer's tensors; the handles ride in BeginWeightUpdate."""

    _kept: list[torch.Tensor] | None = None

    def handles(self, named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
        import pickle  # noqa: PLC0415

        from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

        if any(isinstance(tensor, DTensor) for _, tensor in named):
            raise ValueError("CUDA IPC maps the trainer's own tensors, and FSDP's are shards: use nccl")
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        self._kept = [tensor.detach().contiguous() for _, tensor in named]  # alive until the next update
        return pickle.dumps([{uuid: reduce_tensor(tensor)[1]} for tensor in self._kept])  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._kept = None


_TRANSPORTS: dict[str, type[_Transport]] = {"gloo": _Gloo, "nccl": _Nccl, "ipc": _Ipc}


def _common_backend(offered: Sequence[Sequence[weights_pb2.WeightTransferBackend.ValueType]]) -> Backend:
    """The first backend, in the order gloo, nccl, ipc, that every worker offers; WeightSyncError if none."""
    for name in ("gloo", "nccl", "ipc"):
        if all(_BACKEND_NUMBERS[name] in backends for backends in offered):
            return name
    raise WeightSyncError(
        "GetWorkerInfo",
        {
            index: "no transfer backend in common with the other workers; this one offers "
            + ", ".join(weights_pb2.WeightTransferBackend.Name(b) for b in backends)
            for index, backends in enumerate(offered)
        },
    )


class WeightPublisher:
    def __init__(
        self,
        workers: Sequence[Any],
        *,
        host: str = "127.0.0.1",
        bucket_size_bytes: int = 32 * 1024 * 1024,
        transfer_timeout_s: float = 300.0,
        rpc_timeout_s: float = 60.0,
        events: Any | None = None,
        job: str = "",
        backend: Backend = "gloo",
        gather: Gather = local_groups,
        mode: Literal["full", "delta", "lora"] = "full",
        full_every: int = 20,
        lora: weights_pb2.LoraAdapterSpec | None = None,
    ) -> None:
        """`workers`: an `InferenceServiceStub` per worker; `events`: an `EventServiceStub` for the job's
        `weights.updated` events (with `job`), or None; `backend`: `gloo` (CPU workers, torch or vLLM),
        `nccl` (GPU workers on other GPUs, through vLLM), `ipc` (vLLM workers on the trainer's GPU) or `auto`:
        the first of those every worker offers (GetWorkerInfo), chosen at the first `connect`;
        `bucket_size_bytes`: the largest bucket (a model smaller than 8 of them goes in about 8 smaller ones,
        of at least 1 MiB, so that packing and sending overlap: `bucket_size_for`); `gather`: how a bucket's
        tensors are made whole (the trainer ranks' `gathered` under FSDP); `mode`: `full` sends every tensor
        whole, `delta` only the changed elements (see the module's doc), with a whole update every
        `full_every`, `lora` a LoRA adapter's tensors (the `named` of each `publish`), of the shape `lora`,
        which every worker serves over its base weights (trainer/lora.py)."""
        if mode not in ("full", "delta", "lora"):
            raise ValueError(f"mode must be full, delta or lora, not {mode!r}")
        if (mode == "lora") != (lora is not None):
            raise ValueError("a LoRA adapter's shape (lora) goes with mode lora, and only with it")
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, not {full_every}")
        self.workers = list(workers)
        self.host = host
        self.bucket_size = bucket_size_bytes
        self.transfer_timeout_s = transfer_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._events = events
        self._job = job
        self.backend = backend
        self._gather = gather
        self._transport: _Transport | None = None
        self._in_flight_updates: list[bool] = []  # per worker, from GetWorkerInfo at `connect`
        self.mode = mode
        self.lora = lora
        self._lora_updates: list[bool] = []  # per worker, from GetWorkerInfo at `connect`
        self.full_every = full_every
        self._delta_updates: list[bool] = []  # per worker, from GetWorkerInfo at `connect`
        self._base: _Base | None = None  # delta mode: the weights last put into service
        self._since_full = 0  # delta updates since the last whole one

    @property
    def connected(self) -> bool:
        return self._transport is not None

    async def _all(self, phase: str, calls: Sequence[Awaitable[T]]) -> list[T]:
        results = await asyncio.gather(*calls, return_exceptions=True)
        failures = {i: _why(r) for i, r in enumerate(results) if isinstance(r, BaseException)}
        if failures:
            raise WeightSyncError(phase, failures)
        return [r for r in results if not isinstance(r, BaseException)]

    async def connect(self) -> None:
        """(Re-)form the transfer group with every worker: worker i takes the ranks after the trainer's and
        the ranks of the workers before it (one per tensor-parallel GPU)."""
        self.close()
        infos = await self._all(
            "GetWorkerInfo",
            [w.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=self.rpc_timeout_s) for w in self.workers],
        )
        self._in_flight_updates = [i.worker_info.in_flight_updates for i in infos]
        self._delta_updates = [
            weights_pb2.WEIGHT_UPDATE_MODE_DELTA in i.worker_info.weight_update_modes for i in infos
        ]
        self._lora_updates = [
            weights_pb2.WEIGHT_UPDATE_MODE_LORA in i.worker_info.weight_update_modes for i in infos
        ]
        if self.mode == "lora" and not all(self._lora_updates):
            unable = {
                i: "its engine serves no LoRA adapter"
                for i, able in enumerate(self._lora_updates)
                if not able
            }
            raise WeightSyncError("GetWorkerInfo", unable)
        # Each worker's ranks in the group; a worker older than `weight_transfer_ranks` took one per TP rank.
        sizes = [
            i.worker_info.weight_transfer_ranks or max(i.worker_info.tensor_parallel_size, 1) for i in infos
        ]
        offsets = [1 + sum(sizes[:index]) for index in range(len(sizes))]
        world = 1 + sum(sizes)
        if self.backend == "auto":
            self.backend = _common_backend([list(i.worker_info.weight_transfer_backends) for i in infos])
        transport = _TRANSPORTS[self.backend](self.host, world, self.transfer_timeout_s)
        port = await asyncio.to_thread(transport.listen)
        requests = [
            pb.InitWeightTransferRequest(
                backend=_BACKEND_NUMBERS[self.backend],
                master_address=self.host if port else "",
                master_port=port,
                world_size=world,
                rank_offset=offset,
            )
            for offset in offsets
        ]
        for request in requests:
            request.timeout.FromNanoseconds(int(self.transfer_timeout_s * 1e9))
        joining = asyncio.ensure_future(asyncio.to_thread(transport.connect))
        try:
            await self._all(
                "InitWeightTransfer",
                [
                    w.InitWeightTransfer(r, timeout=self.transfer_timeout_s + self.rpc_timeout_s)
                    for w, r in zip(self.workers, requests, strict=True)
                ],
            )
            await joining
        except BaseException:
            transport.close()
            joining.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        self._transport = transport

    async def publish(
        self,
        version: int,
        named: Sequence[tuple[str, torch.Tensor]],
        mode: PauseMode = PauseMode.KEEP,
        *,
        in_flight: bool = False,
    ) -> UpdateReport:
        """Put `named` tensors (checkpoint names, in a fixed order) into service on every worker as
        `version`, pausing generation in `mode` for the update, or, `in_flight`, without pausing (the report's
        `pause_s` and `resume_s` are then 0). Raises WeightSyncError naming the workers that failed; the
        update is then aborted. In flight, a worker whose engine loads in place (vLLM) is refused before
        anything moves."""
        if self._transport is None:
            await self.connect()
        transport = self._transport
        assert transport is not None
        if in_flight:
            self._check_in_flight()
        manifest = manifest_of(named)
        full_bytes = sum(meta_nbytes(m) for m in manifest)
        t0 = time.perf_counter()
        plan, why_full = await self._plan(named, manifest, full_bytes)
        diff_s = time.perf_counter() - t0
        wire = manifest if plan is None else plan.manifest
        bucket_size = bucket_size_for(wire, self.bucket_size)
        buckets = plan_buckets(wire, bucket_size)
        begin = self._begin_request(version, manifest, bucket_size, plan, in_flight)
        begin.ipc_handles = transport.handles(named)
        deltas = self._deltas_possible()
        keep: list[torch.Tensor] | None = [] if deltas and plan is None else None
        try:
            if not in_flight:
                pause = pb.PauseGenerationRequest(mode=PAUSE_MODES[mode])
                await self._all(
                    "PauseGeneration",
                    [w.PauseGeneration(pause, timeout=self.rpc_timeout_s) for w in self.workers],
                )
            t1 = time.perf_counter()
            await self._all(
                "BeginWeightUpdate",
                [w.BeginWeightUpdate(begin, timeout=self.rpc_timeout_s) for w in self.workers],
            )
            t2 = time.perf_counter()
            try:
                if plan is None:
                    stats = await asyncio.to_thread(self._send, transport, named, buckets, keep)
                else:
                    stats = await asyncio.to_thread(self._send_delta, transport, plan, buckets)
            except Exception as exc:
                raise WeightSyncError("broadcast", {-1: f"{type(exc).__name__}: {exc}"}) from exc
            t3 = time.perf_counter()
            finish = pb.FinishWeightUpdateRequest(weight_version=version)
            finished = await self._all(
                "FinishWeightUpdate",
                [
                    w.FinishWeightUpdate(finish, timeout=self.transfer_timeout_s + self.rpc_timeout_s)
                    for w in self.workers
                ],
            )
            t4 = time.perf_counter()
        except WeightSyncError:
            self._base = None  # what the workers hold is no longer known for certain: the next goes whole
            await self._abort(version, resume=not in_flight)
            raise
        if not in_flight:
            await self._all(
                "ResumeGeneration",
                [
                    w.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=self.rpc_timeout_s)
                    for w in self.workers
                ],
            )
        t5 = time.perf_counter()
        verify_s = (
            await self._settle(version, manifest, plan, keep, [f.applied_checksum for f in finished])
            if deltas
            else 0.0
        )
        report = UpdateReport(
            version=version,
            workers=len(self.workers),
            bytes=stats[0],
            buckets=stats[1],
            pause_s=0.0 if in_flight else t1 - t0,
            begin_s=t2 - t1,
            transfer_s=t3 - t2,
            finish_s=t4 - t3,
            resume_s=0.0 if in_flight else t5 - t4,
            total_s=t5 - t0,
            in_flight=in_flight,
            mode="delta" if plan is not None else ("lora" if self.lora is not None else "full"),
            full_bytes=full_bytes,
            why_full=why_full,
            changed_tensors=len(manifest) if plan is None else sum(1 for c in plan.changed if c),
            diff_s=diff_s,
            verify_s=verify_s,
        )
        await self._publish_event(report)
        return report

    def _begin_request(
        self,
        version: int,
        manifest: Sequence[Any],
        bucket_size: int,
        plan: _DeltaPlan | None,
        in_flight: bool,
    ) -> pb.BeginWeightUpdateRequest:
        begin = pb.BeginWeightUpdateRequest(
            weight_version=version,
            manifest=[
                weights_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape)) for m in manifest
            ],
            bucket_size_bytes=bucket_size,
            packed=True,
            in_flight=in_flight,
        )
        if self.lora is not None:
            begin.mode = weights_pb2.WEIGHT_UPDATE_MODE_LORA
            begin.lora.CopyFrom(self.lora)
        if plan is not None:
            begin.mode = weights_pb2.WEIGHT_UPDATE_MODE_DELTA
            begin.base_weight_version = plan.base_version
            begin.changed_elements.extend(plan.changed)
        return begin

    def _check_in_flight(self) -> None:
        unable = {
            index: "its engine loads weights in place (vLLM) and takes no in-flight update; "
            "publish with the pause instead ([weights] in_flight = false)"
            for index, able in enumerate(self._in_flight_updates)
            if not able
        }
        if unable:
            raise WeightSyncError("GetWorkerInfo", unable)

    def _send(
        self, transport: _Transport, named: Named, buckets: Sequence[Bucket], keep: list[torch.Tensor] | None
    ) -> tuple[int, int]:
        """Send every tensor whole; with `keep`, also append a host copy of each to it (delta mode's base)."""
        with self._gather(named, bucket_groups(buckets)) as tensors:
            if keep is None:
                return transport.send(named, buckets, tensors)

            def kept() -> Iterator[Sequence[torch.Tensor]]:
                for group in tensors:
                    keep.extend(t.detach().to("cpu", copy=True).contiguous() for t in group)
                    yield group

            return transport.send(named, buckets, kept())

    def _send_delta(
        self, transport: _Transport, plan: _DeltaPlan, buckets: Sequence[Bucket]
    ) -> tuple[int, int]:
        with local_groups(plan.named, bucket_groups(buckets)) as tensors:
            return transport.send(plan.named, buckets, tensors)

    async def _plan(
        self, named: Named, manifest: Sequence[Any], full_bytes: int
    ) -> tuple[_DeltaPlan | None, str]:
        """In delta mode, the delta to send, or None and why the update goes whole; (None, "") in full mode."""
        if self.mode != "delta":
            return None, ""
        why_full = await self._why_full(manifest)
        if why_full:
            return None, why_full
        plan = await asyncio.to_thread(self._diff, named, manifest)
        if plan.bytes >= full_bytes:
            return None, "the delta would not be smaller"
        return plan, ""

    def _deltas_possible(self) -> bool:
        """Delta mode with workers that all take deltas: only then is a base kept and checked. A worker whose
        engine takes none (vLLM over NCCL or IPC, whose checksums are in vLLM's own naming) gets every
        update whole, as in full mode."""
        return self.mode == "delta" and self.backend != "ipc" and all(self._delta_updates)

    async def _why_full(self, manifest: Sequence[Any]) -> str:
        """In delta mode, why this update must go whole; "" when a delta can go."""
        if self.backend == "ipc":
            return "the ipc backend moves no bytes"
        unable = [str(i) for i, able in enumerate(self._delta_updates) if not able]
        if unable:
            return f"the engine of worker {', '.join(unable)} takes no delta"
        base = self._base
        if base is None:
            return "no earlier update to start from"
        if base.manifest != list(manifest):
            return "the tensors differ from the last update's"
        if self._since_full + 1 >= self.full_every:
            return f"every {self.full_every} updates one goes whole"
        infos = await self._all(
            "GetWeightInfo",
            [w.GetWeightInfo(pb.GetWeightInfoRequest(), timeout=self.rpc_timeout_s) for w in self.workers],
        )
        behind = [
            f"worker {i} holds v{info.weight_info.delta_base_weight_version}"
            for i, info in enumerate(infos)
            if info.weight_info.delta_base_weight_version != base.version
        ]
        if behind:
            return f"{'; '.join(behind)}, not v{base.version}"
        return ""

    def _diff(self, named: Named, manifest: Sequence[Any]) -> _DeltaPlan:
        """Each tensor against the base, made whole a bucket at a time; a bucket's tensors are compared on
        several threads, a large tensor in pieces (the compare releases the GIL: `delta.changed_positions`)."""
        base = self._base
        assert base is not None
        groups = bucket_groups(plan_buckets(manifest, bucket_size_for(manifest, self.bucket_size)))
        parts: list[delta.TensorDelta] = []
        pairs = zip(manifest, base.tensors, strict=True)
        with self._gather(named, groups) as tensors, ThreadPoolExecutor(DIFF_THREADS) as pool:
            for group in tensors:
                news = [new.detach().to("cpu").contiguous() for new in group]
                olds = [next(pairs) for _ in news]
                found = [  # a large tensor (an embedding) in pieces, so that every thread has work
                    [
                        pool.submit(delta.changed_positions, base, new, start, stop)
                        for start, stop in delta.pieces(new.numel(), DIFF_PIECE_ELEMENTS)
                    ]
                    for (_, base), new in zip(olds, news, strict=True)
                ]
                encoded = [
                    pool.submit(delta.diff, meta, base, new, torch.cat([job.result() for job in jobs]))
                    for (meta, base), new, jobs in zip(olds, news, found, strict=True)
                ]
                parts.extend(job.result() for job in encoded)
        if next(pairs, None) is not None:
            raise ValueError("the update holds fewer tensors than its manifest")
        changed = [p.changed for p in parts]
        wire_meta = delta.wire_manifest(manifest, changed)
        wire_tensors = [t for p in parts for t in p.wire]
        return _DeltaPlan(
            base.version,
            changed,
            wire_meta,
            [(m.name, t) for m, t in zip(wire_meta, wire_tensors, strict=True)],
            sum(meta_nbytes(m) for m in wire_meta),
        )

    async def _settle(
        self,
        version: int,
        manifest: Sequence[Any],
        plan: _DeltaPlan | None,
        keep: list[torch.Tensor] | None,
        applied: Sequence[str],
    ) -> float:
        """Delta mode, after an update: bring the base to `version` and prove the workers hold it. After a
        whole update every tensor's checksum on every worker is compared with the copy's; after a delta each
        worker's `applied_checksum` (what it wrote, read back) with the digest of the values sent. The
        seconds the check took; WeightSyncError, and no base kept, when a worker differs."""
        start = time.perf_counter()
        try:
            if plan is None:
                assert keep is not None
                self._base, self._since_full = _Base(version, manifest, keep), 0
                await self._check([(meta.name, tensor) for meta, tensor in zip(manifest, keep, strict=True)])
                return time.perf_counter() - start
            base = self._base
            assert base is not None
            parts = delta.wire_tensors(manifest, plan.changed, dict(plan.named))
            expected = delta.digest(tensors[-1] for _, _, tensors in parts)
            differ = {
                i: f"what it wrote for v{version} does not read back as sent ({len(parts)} tensors changed)"
                for i, got in enumerate(applied)
                if got and got != expected
            }
            if differ:
                raise WeightSyncError("verification", differ)
            position = {meta.name: i for i, meta in enumerate(manifest)}
            for meta, count, tensors in parts:
                delta.apply(base.tensors[position[meta.name]], meta, count, tensors)
            base.version = version
            self._since_full += 1
            # An engine that reads nothing back (vLLM's, which loads inside its engine core): the checksums of
            # the tensors the delta touched, against the copy's.
            silent = [i for i, got in enumerate(applied) if not got]
            if silent:
                touched = [(meta.name, base.tensors[position[meta.name]]) for meta, _, _ in parts]
                await self._check(touched, only=silent)
        except WeightSyncError:
            self._base = None
            raise
        return time.perf_counter() - start

    async def _abort(self, version: int, *, resume: bool = True) -> None:
        """Best effort on every worker: abort the update and resume generation (unless `resume` is False: an
        in-flight update paused nothing), so each keeps serving its previous version. The group is dropped
        and re-formed by the next `publish`."""
        self.close()
        abort = pb.AbortWeightUpdateRequest(weight_version=version)
        phases = ["AbortWeightUpdate", "ResumeGeneration"] if resume else ["AbortWeightUpdate"]
        for phase in phases:
            calls = [
                w.AbortWeightUpdate(abort, timeout=self.rpc_timeout_s)
                if phase == "AbortWeightUpdate"
                else w.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=self.rpc_timeout_s)
                for w in self.workers
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            for index, result in enumerate(results):
                if isinstance(result, BaseException):
                    log.warning(
                        "%s failed on worker %d after a failed update: %s", phase, index, _why(result)
                    )

    async def verify(self, named: Sequence[tuple[str, torch.Tensor]]) -> str:
        """Prove every worker serves exactly `named`: each tensor's checksum on every worker equals the
        trainer's. Returns the digest of the trainer's checksums; raises WeightSyncError naming each worker
        that differs and its first differing tensors."""
        return await self._check(named, gather=True)

    async def _check(self, named: Named, *, gather: bool = False, only: Sequence[int] = ()) -> str:
        """`verify` for `named`, made whole through `gather` or, without it, as they are (host copies); on
        the workers of index `only`, or on every one."""
        if not named:
            return checksum_digest([])
        if gather:
            expected = await asyncio.to_thread(self._checksums, named)
        else:
            expected = await asyncio.to_thread(lambda: {n: tensor_checksum(t) for n, t in named})
        request = pb.ComputeWeightChecksumsRequest(
            algorithm=weights_pb2.CHECKSUM_ALGORITHM_SHA256, names=list(expected)
        )
        chosen = list(only) or list(range(len(self.workers)))
        try:
            answers = await self._all(
                "ComputeWeightChecksums",
                [
                    self.workers[i].ComputeWeightChecksums(request, timeout=self.transfer_timeout_s)
                    for i in chosen
                ],
            )
        except WeightSyncError as exc:  # named by the workers' own indices, not their places in `chosen`
            raise WeightSyncError(exc.phase, {chosen[i]: why for i, why in exc.failures.items()}) from None
        differ: dict[int, str] = {}
        for index, answer in zip(chosen, answers, strict=True):
            held = {c.name: c.checksum for c in answer.checksums}
            wrong = [name for name, checksum in expected.items() if held.get(name) != checksum]
            if wrong:
                differ[index] = (
                    f"{len(wrong)} of {len(expected)} tensors differ at version {answer.weight_version}, "
                    f"first {', '.join(wrong[:3])}"
                )
        if differ:
            raise WeightSyncError("verification", differ)
        return checksum_digest(list(expected.items()))

    def _checksums(self, named: Named) -> dict[str, str]:
        """Every tensor's checksum, the tensors made whole a bucket at a time."""
        manifest = manifest_of(named)
        groups = bucket_groups(plan_buckets(manifest, bucket_size_for(manifest, self.bucket_size)))
        with self._gather(named, groups) as tensors:
            whole = itertools.chain.from_iterable(tensors)
            return {name: tensor_checksum(t) for (name, _), t in zip(named, whole, strict=True)}

    async def _publish_event(self, report: UpdateReport) -> None:
        if self._events is None or not self._job:
            return
        event = event_pb2.Event(
            type="weights.updated",
            message=(
                f"weights v{report.version} on {report.workers} workers: {report.bytes / 1e6:.1f} MB "
                f"in {report.total_s:.3f} s"
            ),
        )
        updated = event.weights_updated
        updated.weight_version = report.version
        updated.num_workers = report.workers
        updated.bytes_transferred = report.bytes
        updated.transport = self.backend
        updated.begin_duration.CopyFrom(_duration(report.begin_s))
        updated.transfer_duration.CopyFrom(_duration(report.transfer_s))
        updated.finish_duration.CopyFrom(_duration(report.finish_s))
        updated.total_duration.CopyFrom(_duration(report.total_s))
        updated.paused_duration.CopyFrom(_duration(0.0 if report.in_flight else report.total_s))
        updated.mode = report.mode
        updated.full_bytes = report.full_bytes
        event.payload.update(
            {
                "pause_s": report.pause_s,
                "resume_s": report.resume_s,
                "buckets": report.buckets,
                "in_flight": report.in_flight,
                **({"why_full": report.why_full} if report.why_full else {}),
                **({"changed_tensors": report.changed_tensors} if report.mode == "delta" else {}),
            }
        )
        try:
            await self._events.Publish(
                events_service_pb2.PublishRequest(job=self._job, events=[event]), timeout=self.rpc_timeout_s
            )
        except Exception:  # the update is in service; a lost progress event must not undo it
            log.warning("could not publish weights.updated for v%d", report.version, exc_info=True)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._transport = None
