"""Weight tensors as the weight-sync protocol sees them (dtype names, manifests, checksums), and the CPU
transport that moves them from the trainer to the inference workers.

A manifest lists every tensor of an update as (name, dtype, shape) in a fixed order; the receiver checks it
against the model before anything moves. A checksum is the SHA-256 of a tensor's contiguous row-major bytes
in its own dtype (little-endian, as torch stores it on every platform we run on), so a trainer and a worker
that hold the same values produce the same hex string, whatever device each holds it on.

Transport. The bytes of an update travel by broadcast from the trainer (rank 0) to every worker rank of a
`TransferGroup`: a gloo process group with a `TCPStore` of its own, never torch.distributed's default
group, so a trainer that runs a training process group keeps it to itself. Rank 0 `listen`s (the OS picks
the port), hands the port to the workers (`InitWeightTransfer`), which `join`, and `connect`s; forming the
group blocks every rank until all have arrived. The control plane (gRPC:
`BeginWeightUpdate` carries the manifest and the bucket size, `FinishWeightUpdate` waits for the end) lives
in the worker; this module moves bytes only. One update, with the same manifest and bucket size on every
rank:

1. The trainer chooses the bucket size (`bucket_size_for`: its configured size, or a smaller one that
   splits a small model into `OVERLAP_BUCKETS` buckets) and announces it. Every rank computes
   `plan_buckets(manifest, bucket_size_bytes)`. The plan is a pure function of its arguments, so the ranks
   agree on it without exchanging it.
2. Rank 0 calls `send_packed` with the tensors in manifest order; every other rank calls `receive_packed`
   with a preallocated target per tensor (the engine's staging area). Both sides check their tensors
   against the plan before the first collective, so a geometry mistake is a ValueError, never a hang.
3. Bucket k is one broadcast of a flat uint8 buffer holding its tensors' bytes at 16-byte aligned offsets.
   The sender packs bucket k+1 into the second of two buffers while bucket k is on the wire; a receiver
   posts bucket k+1 before it unpacks bucket k. No copy is made where none is needed: a bucket of one
   contiguous tensor is broadcast from and into the tensor itself, and a receiver whose targets lie in one
   buffer at the plan's offsets (`staging_targets` allocates them so) receives the bucket in place. At most
   two broadcasts are in flight on a rank, as many as gloo's two worker threads run at once. The two
   staging buffers belong to the group and serve the next update too (twice the largest bucket per rank).
4. Every broadcast has a timeout, which gloo enforces itself (the wait has a backstop a little later). A
   failed, timed-out or cancelled broadcast raises `TransferError` naming the bucket, and the group is then
   unusable: a collective in flight cannot be recalled and the ranks no longer agree on what comes next.
   The caller closes the group and forms a new one.

`plan_per_tensor` makes one bucket per tensor: the same two calls then make one broadcast per tensor
straight from and into each tensor's memory (the contract's unpacked mode, `packed = false`).

Shortcuts: the collective is gloo over TCP, so tensors on a GPU are copied through host memory (the GPU
path is vLLM's NCCL engine); the store listens on every interface, like torch.distributed's own, and
authenticates nobody, so the port must only be reachable inside the job's network; each rank's gloo
device takes its address from `GLOO_SOCKET_IFNAME`, else from the machine's hostname.

Benchmark: `make bench-weights` (`.venv/bin/python benchmarks/weight_sync.py [--quick]`) sets this transport
beside one broadcast per tensor with a gRPC call each and beside one flat broadcast of the same bytes.
Tests: `tests/trainer/test_weights_transport.py` (real processes on loopback).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch

# Their own module: torch.distributed re-exports them without declaring it, which strict typing rejects.
from torch._C._distributed_c10d import BroadcastOptions, ProcessGroupGloo, TCPStore, Work

from trainer.inference.engine import TensorMeta

ALIGNMENT = 16  # byte offset of every tensor in a bucket: the widest element (complex128) views in place
MIN_BUCKET_BYTES = 1 << 20  # the contract's smallest bucket_size_bytes (BeginWeightUpdate)
# A model smaller than this many full buckets is split into about this many: packing bucket 2 overlaps
# sending bucket 1, and every further bucket adds a collective's fixed cost. On the 2-core VM (10M model,
# 2026-12-06, alternated) 2 gave 3 buckets at 0.71-0.94x the flat ceiling (mean 0.83, 8 runs), 8 gave
# 0.61-0.84x (mean 0.75, 7 runs).
OVERLAP_BUCKETS = 2
ROOT = 0  # the trainer's rank, the root of every broadcast
_WAIT_SLICE_S = 0.05  # how often a wait looks at the cancellation event
_BACKSTOP_S = 2.0  # the wait gives gloo this long past its own timeout before it gives up by itself


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """ "bfloat16" -> `torch.bfloat16`; ValueError for a name torch does not know as a dtype."""
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


# ---- bucket plans ------------------------------------------------------------------------------------


def meta_nbytes(meta: TensorMeta) -> int:
    """Bytes of the tensor `meta` describes; ValueError for an unknown dtype or a negative dimension."""
    if any(size < 0 for size in meta.shape):
        raise ValueError(f"{meta.name} has a negative dimension in shape {list(meta.shape)}")
    numel = 1
    for size in meta.shape:
        numel *= size
    return numel * dtype_of(meta.dtype).itemsize


class Placement(NamedTuple):
    """Where one tensor's bytes lie in its bucket."""

    meta: TensorMeta
    offset: int  # byte offset in the bucket, a multiple of ALIGNMENT
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """The tensors of one broadcast, in manifest order; `nbytes` is the broadcast's size in bytes (the
    tensors' bytes plus the alignment gaps between them)."""

    index: int
    entries: tuple[Placement, ...]
    nbytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def describe(self) -> str:
        first, last = self.entries[0].meta.name, self.entries[-1].meta.name
        names = first if len(self.entries) == 1 else f"{first} .. {last}, {len(self.entries)} tensors"
        return f"bucket {self.index} ({self.nbytes} bytes: {names})"


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def plan_buckets(manifest: Sequence[TensorMeta], bucket_size_bytes: int) -> list[Bucket]:
    """Consecutive tensors of `manifest`, in order, fill each bucket up to `bucket_size_bytes`; a tensor
    larger than that has a bucket of its own. Deterministic: every rank computes the same plan from the same
    arguments. ValueError for a size below 1, an unknown dtype or a name listed twice."""
    if bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes must be at least 1, not {bucket_size_bytes}")
    _check_unique(manifest)
    buckets: list[Bucket] = []
    entries: list[Placement] = []
    end = 0
    for meta in manifest:
        nbytes = meta_nbytes(meta)
        offset = _aligned(end) if nbytes else end  # an empty tensor is never viewed: it needs no alignment
        if entries and offset + nbytes > bucket_size_bytes:
            buckets.append(Bucket(len(buckets), tuple(entries), end))
            entries, offset = [], 0
        entries.append(Placement(meta, offset, nbytes))
        end = offset + nbytes
    if entries:
        buckets.append(Bucket(len(buckets), tuple(entries), end))
    return buckets


def bucket_size_for(
    manifest: Sequence[TensorMeta], max_bucket_bytes: int, buckets: int = OVERLAP_BUCKETS
) -> int:
    """The bucket size an update of `manifest` announces: `max_bucket_bytes`, or less for a model smaller
    than `buckets` such buckets, so that it still splits into about that many and packing bucket k+1
    overlaps sending bucket k (one bucket overlaps nothing: the whole model is packed before the first byte
    moves). Never below `MIN_BUCKET_BYTES`, nor below 1 where `max_bucket_bytes` already is. The trainer
    chooses it and sends it in BeginWeightUpdate; every rank then plans with it (`plan_buckets`)."""
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, not {buckets}")
    total = sum(meta_nbytes(meta) for meta in manifest)
    split = _aligned(-(-total // buckets))
    return max(min(max_bucket_bytes, split), min(max_bucket_bytes, MIN_BUCKET_BYTES), 1)


def plan_per_tensor(manifest: Sequence[TensorMeta]) -> list[Bucket]:
    """One bucket per tensor: one broadcast each, from and into the tensor itself (the unpacked mode)."""
    _check_unique(manifest)
    return [
        Bucket(index, (Placement(meta, 0, nbytes := meta_nbytes(meta)),), nbytes)
        for index, meta in enumerate(manifest)
    ]


def expected_bytes(buckets: Sequence[Bucket]) -> int:
    """The tensor bytes a plan moves (alignment gaps not counted)."""
    return sum(bucket.payload_bytes for bucket in buckets)


def _check_unique(manifest: Sequence[TensorMeta]) -> None:
    seen: set[str] = set()
    for meta in manifest:
        if meta.name in seen:
            raise ValueError(f"{meta.name} is listed twice in the manifest")
        seen.add(meta.name)


# ---- the group ---------------------------------------------------------------------------------------


class TransferError(RuntimeError):
    """A broadcast failed, timed out or was cancelled, or the group could not be formed. The group is
    unusable afterwards: close it and form a new one. `bucket` is the failed bucket's index, when there
    was one."""

    def __init__(self, message: str, bucket: int | None = None) -> None:
        super().__init__(message)
        self.bucket = bucket


def _timedelta(seconds: float) -> timedelta:
    if seconds <= 0:
        raise ValueError(f"a timeout must be positive, not {seconds}")
    return timedelta(seconds=seconds)


class GroupListener:
    """Rank 0's half of a group being formed: its store already listens on `port` (chosen by the OS), so the
    trainer can hand the port to the workers (`InitWeightTransfer`) before `connect` blocks for them."""

    def __init__(self, store: TCPStore, host: str, world_size: int, timeout_s: float) -> None:
        self._store: TCPStore | None = store
        self.host = host
        self.port = store.port
        self.world_size = world_size
        self.timeout_s = timeout_s

    def connect(self) -> TransferGroup:
        """Block until every rank joined (at most `timeout_s`) and return rank 0's group; TransferError when
        they did not all join in time. The listener is used up either way."""
        store, self._store = self._store, None
        if store is None:
            raise TransferError("this listener was already connected or closed")
        try:
            backend = ProcessGroupGloo(store, ROOT, self.world_size, _timedelta(self.timeout_s))
        except RuntimeError as exc:  # DistStoreError (a RuntimeError) when a rank is missing
            raise TransferError(f"the transfer group on port {self.port} did not form: {exc}") from exc
        return TransferGroup(
            backend, store, rank=ROOT, world_size=self.world_size, host=self.host, port=self.port
        )

    def close(self) -> None:
        """Stop listening without forming the group. A `connect` already under way is not interrupted: it
        fails when its timeout passes."""
        self._store = None


class TransferGroup:
    """The ranks an update is broadcast to: rank 0 (the trainer) and the workers' ranks 1..world_size-1.

    Form one with `listen` + `connect` (or `create`) on rank 0 and `join` on every other rank. Forming it
    blocks every rank until all of them arrived, up to `timeout_s`. The group is used by one thread at a
    time. Once a broadcast failed (`failure` says why) every later one raises TransferError at once.
    """

    def __init__(
        self,
        backend: ProcessGroupGloo,
        store: TCPStore,
        *,
        rank: int,
        world_size: int,
        host: str,
        port: int,
    ) -> None:
        self._backend: ProcessGroupGloo | None = backend
        self._store: TCPStore | None = store  # rank 0 serves it; the others keep their connection
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.port = port
        self.failure: str | None = None
        self._buffers: list[torch.Tensor] = []

    @classmethod
    def listen(cls, host: str, world_size: int, timeout_s: float) -> GroupListener:
        """Rank 0: start the group's store on a port the OS chooses, without waiting for anyone. `host` is
        the address the other ranks reach this process at; `timeout_s` bounds forming the group."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, not {world_size}")
        try:
            store = TCPStore(
                host, 0, world_size, is_master=True, timeout=_timedelta(timeout_s), wait_for_workers=False
            )
        except RuntimeError as exc:  # DistNetworkError, a RuntimeError, when it cannot listen
            raise TransferError(f"could not start the transfer group's store: {exc}") from exc
        return GroupListener(store, host, world_size, timeout_s)

    @classmethod
    def create(
        cls, host: str, world_size: int, timeout_s: float, on_listening: Callable[[int], None] | None = None
    ) -> TransferGroup:
        """Rank 0: `listen`, tell `on_listening` the port, then `connect` (blocks until all ranks joined)."""
        listener = cls.listen(host, world_size, timeout_s)
        try:
            if on_listening is not None:
                on_listening(listener.port)
            return listener.connect()
        finally:
            listener.close()

    @classmethod
    def join(cls, host: str, port: int, world_size: int, rank: int, timeout_s: float) -> TransferGroup:
        """Ranks 1..world_size-1: join rank 0's group at host:port; blocks until all ranks joined (at most
        `timeout_s`), TransferError when they did not."""
        if not 1 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a worker rank of a group of {world_size}")
        timeout = _timedelta(timeout_s)
        try:
            store = TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            backend = ProcessGroupGloo(store, rank, world_size, timeout)
        except RuntimeError as exc:  # DistStoreError (a RuntimeError) when a rank is missing
            raise TransferError(
                f"rank {rank} could not join the transfer group at {host}:{port}: {exc}"
            ) from exc
        return cls(backend, store, rank=rank, world_size=world_size, host=host, port=port)

    def broadcast(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Broadcast rank 0's `tensor` into every other rank's `tensor` (same byte size, contiguous, on the
        CPU) and return once it arrived; TransferError on failure or after `timeout_s`."""
        self.wait(self.start_broadcast(tensor, timeout_s), timeout_s, what="the broadcast")

    def start_broadcast(self, tensor: torch.Tensor, timeout_s: float) -> Work:
        """Post a broadcast and return its gloo Work without waiting; pass it to `wait`."""
        backend = self.ensure_usable()
        options = BroadcastOptions()
        options.rootRank = ROOT
        options.timeout = _timedelta(timeout_s)
        try:
            # torch's stubs declare broadcast on ProcessGroup only; the binding has it on every Backend.
            work: Work = backend.broadcast([tensor], options)  # type: ignore[attr-defined]
            return work
        except RuntimeError as exc:
            raise self._fail(f"could not post the broadcast: {exc}") from exc

    def wait(
        self,
        work: Work,
        timeout_s: float,
        *,
        what: str,
        cancelled: threading.Event | None = None,
        bucket: int | None = None,
    ) -> None:
        """Wait for a posted broadcast; TransferError naming `what` when it failed, when gloo's timeout (or
        the backstop just after it) passed, or when `cancelled` was set. Any of these breaks the group."""
        deadline = time.monotonic() + timeout_s + _BACKSTOP_S
        while True:
            try:
                work.wait(timeout=timedelta(seconds=_WAIT_SLICE_S))  # blocks in C++, without the GIL
                return
            except RuntimeError as exc:
                if work.is_completed():  # failed, or finished just as the slice ran out
                    try:
                        work.wait()
                        return
                    except RuntimeError as failure:
                        raise self._fail(f"{what}: {failure}", bucket) from exc
            if cancelled is not None and cancelled.is_set():
                raise self._fail(f"{what}: cancelled", bucket)
            if time.monotonic() >= deadline:
                raise self._fail(f"{what}: timed out after {timeout_s:g} s", bucket)

    def close(self) -> None:
        """Leave the group. Returns once this rank's collectives still in flight (after a failure) ended,
        at the latest when their timeout passed. Idempotent."""
        self._backend = None
        self._store = None
        self._buffers = []
        if self.failure is None:
            self.failure = "the group was closed"

    def __enter__(self) -> TransferGroup:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def staging_buffers(self, count: int, nbytes: int) -> list[torch.Tensor]:
        """`count` flat uint8 buffers of at least `nbytes` each, kept by the group for later updates."""
        while len(self._buffers) < count:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        for index in range(count):
            if self._buffers[index].numel() < nbytes:
                self._buffers[index] = torch.empty(0, dtype=torch.uint8)  # free it before the larger one
                self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffers[:count]

    def ensure_usable(self) -> ProcessGroupGloo:
        """The gloo backend; TransferError once the group failed or was closed."""
        if self._backend is None or self.failure is not None:
            raise TransferError(f"the transfer group is unusable ({self.failure}); form a new one")
        return self._backend

    def _fail(self, reason: str, bucket: int | None = None) -> TransferError:
        self.failure = reason
        return TransferError(reason, bucket)


# ---- sending and receiving ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferStats:
    """One side of one update, as that rank measured it."""

    bytes: int  # tensor bytes moved (alignment gaps not counted)
    buckets: int  # buckets in the plan (one broadcast each, none for a bucket of empty tensors)
    seconds: float  # the whole call
    copy_seconds: float  # packing (sender) or unpacking (receiver) on the calling thread
    wait_seconds: float  # blocked on broadcasts still in flight
    copied_bytes: int  # tensor bytes packed or unpacked; the rest went from or into the tensors themselves

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (a view, no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _direct(tensor: torch.Tensor, bucket: Bucket) -> bool:
    """Whether the bucket is broadcast straight from or into the tensor's memory."""
    return len(bucket.entries) == 1 and tensor.device.type == "cpu" and tensor.is_contiguous()


def _slot_view(buffer: torch.Tensor, entry: Placement) -> torch.Tensor:
    """The entry's bytes in a staging buffer, viewed as the tensor (aligned offsets make this a view)."""
    meta = entry.meta
    return buffer[entry.offset : entry.offset + entry.nbytes].view(dtype_of(meta.dtype)).view(meta.shape)


def _check_geometry(what: str, tensor: torch.Tensor, meta: TensorMeta) -> None:
    if tensor.dtype != dtype_of(meta.dtype):
        raise ValueError(f"{what} {meta.name} is {dtype_name(tensor.dtype)}, the plan says {meta.dtype}")
    if tuple(tensor.shape) != tuple(meta.shape):
        raise ValueError(
            f"{what} {meta.name} has shape {list(tensor.shape)}, the plan says {list(meta.shape)}"
        )


def send_packed(
    group: TransferGroup, tensors: Sequence[torch.Tensor], buckets: Sequence[Bucket], timeout_s: float
) -> TransferStats:
    """Rank 0: broadcast `tensors` (one per plan entry, in manifest order, any layout or device) bucket by
    bucket, packing bucket k+1 while bucket k is on the wire. `timeout_s` bounds each bucket's broadcast.
    ValueError before any collective when the tensors do not match the plan; TransferError when a broadcast
    failed (the group is then unusable)."""
    _check_sender(group)
    entries = [entry for bucket in buckets for entry in bucket.entries]
    if len(tensors) != len(entries):
        raise ValueError(f"the plan has {len(entries)} tensors, {len(tensors)} were given")
    for tensor, entry in zip(tensors, entries, strict=True):
        _check_geometry("tensor", tensor, entry.meta)
    sources: list[list[torch.Tensor]] = []
    position = 0
    for bucket in buckets:
        sources.append([t.detach() for t in tensors[position : position + len(bucket.entries)]])
        position += len(bucket.entries)
    packed = [
        b.nbytes for b, src in zip(buckets, sources, strict=True) if b.nbytes and not _direct(src[0], b)
    ]
    return send_buckets(group, sources, buckets, timeout_s, staging_bytes=max(packed, default=0))


def staging_bytes_for(buckets: Sequence[Bucket], on_cpu: bool) -> int:
    """The staging buffer `send_buckets` needs when every bucket's tensors will be contiguous and on the CPU
    (`on_cpu`: a bucket of one tensor is then broadcast from the tensor itself) or not."""
    return max((b.nbytes for b in buckets if b.nbytes and (len(b.entries) > 1 or not on_cpu)), default=0)


def send_buckets(
    group: TransferGroup,
    sources: Iterable[Sequence[torch.Tensor]],
    buckets: Sequence[Bucket],
    timeout_s: float,
    *,
    staging_bytes: int,
) -> TransferStats:
    """Rank 0: `send_packed` with each bucket's tensors taken from `sources` only when that bucket is next
    to pack, so a sharded trainer gathers whole tensors one bucket at a time (while the bucket before is on
    the wire). Each bucket's tensors are checked against the plan when they come: a mismatch raises
    ValueError mid-update, and the workers' receives then time out. `staging_bytes` sizes the two packing
    buffers (`staging_bytes_for`)."""
    _check_sender(group)
    start = time.perf_counter()
    copy_s = wait_s = 0.0
    in_flight: list[tuple[Bucket, Work]] = []
    packed_count = copied = 0
    taken = iter(sources)
    for bucket in buckets:
        source = next(taken, None)
        if source is None or len(source) != len(bucket.entries):
            raise ValueError(
                f"bucket {bucket.index} was given {len(source or ())} of its {len(bucket.entries)} tensors"
            )
        for tensor, entry in zip(source, bucket.entries, strict=True):
            _check_geometry("tensor", tensor, entry.meta)
        if not bucket.nbytes:
            continue  # only empty tensors: every rank skips it
        if len(in_flight) == 2:  # the bucket that used the buffer this one may take, or a direct one
            wait_s += _finish(group, *in_flight.pop(0), timeout_s, "sending")
        began = time.perf_counter()
        if _direct(source[0], bucket):
            flat = _as_bytes(source[0].detach())
        else:
            if bucket.nbytes > staging_bytes:
                raise ValueError(
                    f"bucket {bucket.index} needs {bucket.nbytes} staging bytes, {staging_bytes} given"
                )
            # One buffer for the first packed bucket, a second from the next on (the group keeps both).
            flat = group.staging_buffers(min(2, packed_count + 1), staging_bytes)[packed_count % 2]
            flat = flat[: bucket.nbytes]
            packed_count += 1
            for tensor, entry in zip(source, bucket.entries, strict=True):
                if entry.nbytes:
                    _slot_view(flat, entry).copy_(tensor.detach())
            copied += bucket.payload_bytes
        copy_s += time.perf_counter() - began
        in_flight.append((bucket, _start(group, flat, timeout_s, bucket)))
        del source
    for done, work in in_flight:
        wait_s += _finish(group, done, work, timeout_s, "sending")
    seconds = time.perf_counter() - start
    return TransferStats(expected_bytes(buckets), len(buckets), seconds, copy_s, wait_s, copied)


def _check_sender(group: TransferGroup) -> None:
    if group.rank != ROOT:
        raise ValueError(f"send_packed runs on rank {ROOT}, not on rank {group.rank}")
    group.ensure_usable()


def staging_targets(buckets: Sequence[Bucket]) -> dict[str, torch.Tensor]:
    """Receive targets for a plan, laid out as its buckets: one flat CPU buffer per bucket, each tensor a
    view at its offset. `receive_packed` receives into such targets without unpacking them."""
    targets: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
        for entry in bucket.entries:
            targets[entry.meta.name] = _slot_view(flat, entry)
    return targets


def _received_in_place(bucket: Bucket, targets: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The memory to receive the bucket straight into: its one contiguous CPU target, or the span of a
    storage that holds every target at the plan's offsets (as `staging_targets` lays them out); else None."""
    if _direct(targets[0], bucket):
        return _as_bytes(targets[0])
    holding = [
        (t, e.offset) for t, e in zip(targets, bucket.entries, strict=True) if e.nbytes
    ]  # empty: nothing
    first, first_offset = holding[0]
    if first.device.type != "cpu":
        return None
    storage = first.untyped_storage()
    start = first.data_ptr() - storage.data_ptr() - first_offset
    if start < 0 or start + bucket.nbytes > storage.nbytes():
        return None
    for target, offset in holding:
        same_storage = target.untyped_storage().data_ptr() == storage.data_ptr()
        if not same_storage or target.data_ptr() - storage.data_ptr() != start + offset:
            return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, start, (bucket.nbytes,), (1,))


def check_targets(buckets: Sequence[Bucket], targets: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming the first tensor of the plan whose target is missing, of another dtype or shape,
    or not contiguous."""
    for bucket in buckets:
        for entry in bucket.entries:
            target = targets.get(entry.meta.name)
            if target is None:
                raise ValueError(f"no target for {entry.meta.name}")
            _check_geometry("target", target, entry.meta)
            if not target.is_contiguous():
                raise ValueError(f"target {entry.meta.name} is not contiguous")


def receive_packed(
    group: TransferGroup,
    buckets: Sequence[Bucket],
    targets: Mapping[str, torch.Tensor],
    timeout_s: float,
    cancelled: threading.Event | None = None,
    on_bucket: Callable[[Bucket], None] | None = None,
) -> TransferStats:
    """Ranks >= 1: receive every bucket of the plan and copy each tensor's bytes into `targets[name]`
    (preallocated, contiguous, of the plan's dtype and shape), posting bucket k+1 before unpacking bucket k.
    `on_bucket(bucket)` runs once the bucket's tensors are in their targets, while the next bucket is on the
    wire (vLLM's gloo engine loads each bucket into the model there), and not for a bucket of empty tensors.
    `timeout_s` bounds each bucket's broadcast; setting `cancelled` abandons the update within ~50 ms.
    ValueError before any collective when a target does not fit; TransferError when a broadcast failed,
    timed out or was cancelled (the group is then unusable, and the targets partly written)."""
    if group.rank == ROOT:
        raise ValueError(f"receive_packed runs on the ranks after {ROOT}")
    group.ensure_usable()
    check_targets(buckets, targets)
    destinations = [[targets[entry.meta.name].detach() for entry in bucket.entries] for bucket in buckets]
    moving = [k for k, bucket in enumerate(buckets) if bucket.nbytes]  # buckets of empty tensors move nothing

    in_place = {k: _received_in_place(buckets[k], destinations[k]) for k in moving}

    start = time.perf_counter()
    copy_s = wait_s = 0.0
    staged = [buckets[k].nbytes for k in moving if in_place[k] is None]
    buffers = group.staging_buffers(min(2, len(staged)), max(staged, default=0))
    staged_count = copied = 0

    def post(k: int) -> tuple[Bucket, torch.Tensor | None, Work]:
        """Post bucket k's broadcast; the staging buffer to unpack afterwards, None when received in place."""
        nonlocal staged_count
        bucket, flat = buckets[k], in_place[k]
        if flat is not None:
            return bucket, None, _start(group, flat, timeout_s, bucket)
        staging = buffers[staged_count % 2][: bucket.nbytes]
        staged_count += 1
        return bucket, staging, _start(group, staging, timeout_s, bucket)

    in_flight = [post(k) for k in moving[:2]]
    for position, k in enumerate(moving):
        bucket, flat, work = in_flight.pop(0)
        wait_s += _finish(group, bucket, work, timeout_s, "receiving", cancelled)
        began = time.perf_counter()
        if flat is not None:
            for target, entry in zip(destinations[k], bucket.entries, strict=True):
                if entry.nbytes:
                    _as_bytes(target).copy_(flat[entry.offset : entry.offset + entry.nbytes])
            copied += bucket.payload_bytes
        copy_s += time.perf_counter() - began
        if on_bucket is not None:
            on_bucket(bucket)
        if position + 2 < len(moving):  # its buffer is free again: post the bucket after the next
            in_flight.append(post(moving[position + 2]))
    seconds = time.perf_counter() - start
    return TransferStats(expected_bytes(buckets), len(buckets), seconds, copy_s, wait_s, copied)


def _start(group: TransferGroup, flat: torch.Tensor, timeout_s: float, bucket: Bucket) -> Work:
    try:
        return group.start_broadcast(flat, timeout_s)
    except TransferError as exc:
        raise TransferError(f"{bucket.describe()}: {exc}", bucket.index) from exc


def _finish(
    group: TransferGroup,
    bucket: Bucket,
    work: Work,
    timeout_s: float,
    verb: str,
    cancelled: threading.Event | None = None,
) -> float:
    """Wait for one bucket's broadcast; the seconds spent waiting."""
    began = time.perf_counter()
    group.wait(work, timeout_s, what=f"{verb} {bucket.describe()}", cancelled=cancelled, bucket=bucket.index)
    return time.perf_counter() - began
