"""The worker side of weight sync: a state machine over the transfer group and the engine's staging area.

    UNINITIALIZED --InitWeightTransfer--> READY --BeginWeightUpdate--> UPDATING --FinishWeightUpdate--> READY
                                                                       |  \\--AbortWeightUpdate--> READY
                                                                       \\--collective fails--> UNINITIALIZED

`begin` validates the manifest against the model and the bucket geometry before any byte moves, has the
engine allocate staging buffers, and starts the receive on a side thread (the collective blocks; the event
loop must not). `finish` waits for the receive with a deadline, then has the engine swap the staged tensors
in between two generation steps. Generation is paused for an update, except an in-flight one (`begin(...,
in_flight=True)`, engines with `in_flight_updates`: the torch engine), where it runs on while the buckets
arrive and the generations in flight continue with the new weights after the swap. The torch engine never
writes into the weights in service before that swap, so a failed or aborted update leaves the previous
version serving; the transfer group is unusable after a failed collective, so the state returns to
UNINITIALIZED and the trainer re-forms the group. Every wait is bounded: the join and each bucket by
`transfer_timeout_s`.

An engine with a transfer engine of its own (`remote_transfer`: vLLM, over NCCL, IPC or Tandem's gloo engine;
not a vLLM engine serving LoRA adapters, which stages and commits as the torch engine does) moves through
the same states, but it loads in place, so an update that fails once started (the receive
fails on its own, say the trainer died mid-broadcast; an abort; a failure in vLLM's engine core, raised as
an `EngineError`) goes to INCONSISTENT instead: the worker stays paused and refuses to resume until a new
group is joined (InitWeightTransfer keeps INCONSISTENT) and an update completes (FinishWeightUpdate: READY).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mesh.errors import Aborted, FailedPrecondition, FieldViolation, InvalidArgument, R
from trainer.inference import delta
from trainer.inference.engine import (
    Engine,
    EngineError,
    LoraMismatch,
    ManifestMismatch,
    RemoteTransfer,
    TensorMeta,
    remote_transfer,
)
from trainer.inference.weights import (
    Bucket,
    TransferError,
    TransferGroup,
    expected_bytes,
    manifest_problems,
    plan_buckets,
    plan_per_tensor,
    receive_packed,
    staging_targets,
)

log = logging.getLogger("tandem.weights")


class TransferState(enum.Enum):
    UNINITIALIZED = 1
    READY = 2
    UPDATING = 3
    INCONSISTENT = 4


@dataclass(frozen=True)
class GroupParams:
    backend: str
    host: str
    port: int
    world_size: int
    rank: int
    timeout_s: float


@dataclass
class Timings:
    prepare_s: float = 0.0
    receive_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    bytes_received: int = 0
    buckets_received: int = 0
    applied_checksum: str = ""  # a delta update: `delta.digest` of what it wrote, read back


@dataclass
class _Update:
    version: int
    buckets: list[Bucket]
    staged: Mapping[str, torch.Tensor]
    cancelled: threading.Event
    receive: asyncio.Future[None]
    began: float
    prepare_s: float
    received_at: list[float] = field(default_factory=list)
    # A delta update (WEIGHT_UPDATE_MODE_DELTA): the model's manifest and `changed_elements`; `staged` then
    # holds the wire tensors (`delta.wire_manifest`), which `finish` applies to the weights in service.
    delta: tuple[list[TensorMeta], list[int]] | None = None
    lora: bool = False  # a LoRA adapter's tensors (WEIGHT_UPDATE_MODE_LORA)


def _mismatch(exc: ManifestMismatch) -> InvalidArgument:
    return InvalidArgument(
        str(exc),
        reason=R.ERROR_REASON_WEIGHT_MANIFEST_MISMATCH,
        violations=[FieldViolation("manifest", problem) for problem in exc.problems],
    )


class WeightSync:
    """Where one worker stands in the weight-sync protocol; every method runs on the event loop."""

    def __init__(self, engine: Engine, timeout_s: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.state = TransferState.UNINITIALIZED
        self.params: GroupParams | None = None
        self._group: TransferGroup | None = None
        self._update: _Update | None = None
        self.last_timings: Timings | None = None
        self.last_update_time: float | None = None
        self._last_failure: tuple[int, str] | None = None  # (version, why) of the last failed receive
        self._remote = False  # the engine's own transfer engine moves the bytes (vLLM)
        # The version a delta update may start from: the one in service, when it came through an update
        # that completed here (0: none; the initial weights are never a base, see WeightInfo).
        self.delta_base = 0
        self._lock = asyncio.Lock()

    @property
    def pending_version(self) -> int:
        return self._update.version if self._update else 0

    # ---- the group ----------------------------------------------------------------------------

    async def init(self, params: GroupParams) -> list[int]:
        async with self._lock:
            if self.state is TransferState.UPDATING:
                raise FailedPrecondition(
                    f"version {self.pending_version} is being received; abort or finish it first",
                    reason=R.ERROR_REASON_WEIGHT_UPDATE_CONFLICT,
                )
            if remote_transfer(self.engine) is not None:  # vLLM: its own transfer engine, gloo included
                return await self._init_remote(params)
            if self.params == params and self._group is not None:
                return [params.rank]
            self._close_group()
            try:
                self._group = await asyncio.to_thread(
                    TransferGroup.join,
                    params.host,
                    params.port,
                    params.world_size,
                    params.rank,
                    params.timeout_s,
                )
            except (TransferError, RuntimeError, OSError, ValueError) as exc:
                self.state = TransferState.UNINITIALIZED
                raise Aborted(
                    f"joining the weight transfer group at {params.host}:{params.port} failed: {exc}",
                    reason=R.ERROR_REASON_WEIGHT_TRANSFER_FAILED,
                ) from None
            self.params = params
            if self.state is not TransferState.INCONSISTENT:
                self.state = TransferState.READY
            return [params.rank]

    async def _init_remote(self, params: GroupParams) -> list[int]:
        """vLLM's transfer engines: the engine joins (NCCL: the trainer's rendezvous) with its TP ranks."""
        engine = self.engine
        if not isinstance(engine, RemoteTransfer) or params.backend not in engine.transfer_backends:
            raise InvalidArgument(f"this worker's engine does not support the {params.backend} backend")
        ranks = [params.rank + i for i in range(engine.info.tensor_parallel_size)]
        init_info: dict[str, Any] = {}
        if params.backend in ("nccl", "gloo"):
            init_info.update(
                master_address=params.host,
                master_port=params.port,
                rank_offset=params.rank,
                world_size=params.world_size,
            )
        if params.backend == "nccl":
            init_info["packed"] = True
        if params.backend == "gloo":
            init_info["timeout_s"] = params.timeout_s
        try:
            # vLLM's engine core bounds the gloo join by timeout_s itself; the wait here is a backstop.
            await asyncio.wait_for(engine.join_transfer(init_info), timeout=params.timeout_s + 10)
        except (TimeoutError, EngineError, RuntimeError, OSError, ValueError) as exc:
            self.state = TransferState.UNINITIALIZED
            raise Aborted(
                f"joining the {params.backend} weight transfer failed: {exc or 'timed out'}",
                reason=R.ERROR_REASON_WEIGHT_TRANSFER_FAILED,
            ) from None
        self.params = params
        self._remote = True
        if self.state is not TransferState.INCONSISTENT:
            self.state = TransferState.READY
        return ranks

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None
        self.params = None

    # ---- one update ---------------------------------------------------------------------------

    async def begin(
        self,
        version: int,
        manifest: Sequence[TensorMeta],
        bucket_size: int,
        packed: bool,
        ipc_handles: bytes = b"",
        *,
        in_flight: bool = False,
        changed: Sequence[int] | None = None,
        base_version: int = 0,
        lora: Any | None = None,
    ) -> _Update:
        """Arm the receive of `version`. Generation must be paused unless `in_flight`, which only an engine
        with `in_flight_updates` takes: it keeps generating while the buckets arrive and `finish` swaps the
        weights in between two of its steps. With `changed` (one count per manifest entry) the update is a
        delta from `base_version` (trainer/inference/delta.py), which must be `delta_base`; with `lora` (a
        `LoraAdapterSpec`) the manifest is that adapter's tensors, served over the base weights."""
        async with self._lock:
            if self._update is not None and self._update.version == version:
                return self._update  # a repeated Begin for the version being received
            if self.state is TransferState.UPDATING:
                raise FailedPrecondition(
                    f"version {self.pending_version} is being received",
                    reason=R.ERROR_REASON_WEIGHT_UPDATE_CONFLICT,
                )
            if in_flight and not self.engine.in_flight_updates:
                raise FailedPrecondition(
                    f"the {self.engine.info.kind} engine loads weights in place, so it cannot take an "
                    "in-flight update; pause generation and update without in_flight",
                    reason=R.ERROR_REASON_IN_FLIGHT_UPDATE_UNSUPPORTED,
                )
            # What the engine can never take is refused first, whatever the transfer's state.
            if lora is not None and not self.engine.lora_updates:
                raise FailedPrecondition(
                    f"the {self.engine.info.kind} engine serves no LoRA adapter",
                    reason=R.ERROR_REASON_WEIGHT_UPDATE_MODE_UNSUPPORTED,
                )
            if lora is None and changed is None and not self.engine.full_updates:
                raise FailedPrecondition(
                    f"the {self.engine.info.kind} engine serves LoRA adapters over fixed base weights; "
                    "send a LORA update",
                    reason=R.ERROR_REASON_WEIGHT_UPDATE_MODE_UNSUPPORTED,
                )
            if self._group is None and not self._remote:
                raise FailedPrecondition(
                    "the weight transfer group is not initialized; call InitWeightTransfer",
                    reason=R.ERROR_REASON_WEIGHT_TRANSFER_NOT_INITIALIZED,
                )
            if version <= self.engine.weight_version:
                raise FailedPrecondition(
                    f"version {version} is not above the version in service, {self.engine.weight_version}",
                    reason=R.ERROR_REASON_WEIGHT_VERSION_REGRESSION,
                )
            if not in_flight and not self.engine.paused:
                raise FailedPrecondition(
                    "pause generation before a weight update", reason=R.ERROR_REASON_WEIGHT_UPDATE_CONFLICT
                )
            if changed is not None:
                self._check_delta(manifest, changed, base_version)
            began = time.perf_counter()
            if self._remote:
                return await self._begin_remote(
                    version, manifest, bucket_size, packed, ipc_handles, began, changed
                )
            if lora is None:
                buckets, staged = self._stage(manifest, changed, bucket_size, packed)
            else:
                staged = await self._stage_lora(manifest, lora)
                buckets = plan_buckets(manifest, bucket_size) if packed else plan_per_tensor(manifest)
            cancelled = threading.Event()
            group = self._group
            assert group is not None  # checked above for every engine that stages
            timeout = self.timeout_s
            update = _Update(
                version,
                buckets,
                staged,
                cancelled,
                asyncio.get_running_loop().create_future(),
                began,
                time.perf_counter() - began,
                delta=None if changed is None else (list(manifest), list(changed)),
                lora=lora is not None,
            )

            def receive() -> None:
                start = time.perf_counter()
                receive_packed(group, buckets, staged, timeout, cancelled)
                update.received_at.extend([start, time.perf_counter()])

            update.receive = asyncio.ensure_future(asyncio.to_thread(receive))
            update.receive.add_done_callback(lambda done: self._received(update, done))
            self._update = update
            self.state = TransferState.UPDATING
            return update

    def _stage(
        self, manifest: Sequence[TensorMeta], changed: Sequence[int] | None, bucket_size: int, packed: bool
    ) -> tuple[list[Bucket], Mapping[str, torch.Tensor]]:
        """The bucket plan of the update and the targets it is received into: the engine's staging buffers
        for a full update; for a delta, buffers of their own for the wire tensors, laid out as the plan."""
        wire: Sequence[TensorMeta] = manifest
        try:
            if changed is None:
                staged = self.engine.stage_update(manifest)
            else:
                problems = manifest_problems(manifest, self.engine.manifest())
                if problems:
                    raise ManifestMismatch(problems)
                wire = delta.wire_manifest(manifest, changed)
        except ManifestMismatch as exc:
            raise _mismatch(exc) from None
        buckets = plan_buckets(wire, bucket_size) if packed else plan_per_tensor(wire)
        return buckets, (staged if changed is None else staging_targets(buckets))

    async def _stage_lora(self, manifest: Sequence[TensorMeta], spec: Any) -> Mapping[str, torch.Tensor]:
        try:
            return await self.engine.stage_lora(manifest, spec)
        except ManifestMismatch as exc:
            raise _mismatch(exc) from None
        except LoraMismatch as exc:
            raise FailedPrecondition(str(exc), reason=R.ERROR_REASON_WEIGHT_UPDATE_MODE_UNSUPPORTED) from None

    def _check_delta(self, manifest: Sequence[TensorMeta], changed: Sequence[int], base_version: int) -> None:
        if not self.engine.delta_updates:
            raise FailedPrecondition(
                f"the {self.engine.info.kind} engine takes no delta weight update; send it whole (mode FULL)",
                reason=R.ERROR_REASON_WEIGHT_UPDATE_MODE_UNSUPPORTED,
            )
        if base_version != self.delta_base or not base_version:
            held = f"version {self.delta_base}" if self.delta_base else "no version a delta can apply to"
            raise FailedPrecondition(
                f"the delta applies to version {base_version}, and this worker holds {held}; "
                "send the update whole",
                reason=R.ERROR_REASON_WEIGHT_DELTA_BASE_MISMATCH,
            )
        try:
            delta.wire_manifest(manifest, changed)
        except ValueError as exc:
            raise InvalidArgument(
                str(exc),
                reason=R.ERROR_REASON_WEIGHT_MANIFEST_MISMATCH,
                violations=[FieldViolation("changed_elements", str(exc))],
            ) from None

    async def _begin_remote(
        self,
        version: int,
        manifest: Sequence[TensorMeta],
        bucket_size: int,
        packed: bool,
        ipc_handles: bytes,
        began: float,
        changed: Sequence[int] | None = None,
    ) -> _Update:
        """Start the update in the engine's own transfer engine; a delta (`changed`, checked by `begin`)
        goes to it as well (vLLM's gloo engine applies it to its host mirror of the last update)."""
        engine = self.engine
        assert isinstance(engine, RemoteTransfer)
        problems = manifest_problems(manifest, engine.manifest())
        if problems:
            raise InvalidArgument(
                str(ManifestMismatch(problems)),
                reason=R.ERROR_REASON_WEIGHT_MANIFEST_MISMATCH,
                violations=[FieldViolation("manifest", problem) for problem in problems],
            )
        try:
            await engine.start_update()
        except EngineError as exc:  # nothing was loaded yet: the version in service is intact
            raise Aborted(
                f"starting version {version} failed: {exc}", reason=R.ERROR_REASON_WEIGHT_TRANSFER_FAILED
            ) from None
        wire = manifest if changed is None else delta.wire_manifest(manifest, changed)
        update = _Update(
            version,
            plan_buckets(wire, bucket_size) if packed else plan_per_tensor(wire),
            {},
            threading.Event(),
            asyncio.get_running_loop().create_future(),
            began,
            time.perf_counter() - began,
            delta=None if changed is None else (list(manifest), list(changed)),
        )

        async def receive() -> None:
            start = time.perf_counter()
            await engine.receive_update(
                manifest,
                ipc_handles,
                bucket_size=bucket_size,
                packed=packed,
                changed=None if changed is None else list(changed),
            )
            update.received_at.extend([start, time.perf_counter()])

        update.receive = asyncio.ensure_future(receive())
        update.receive.add_done_callback(lambda done: self._received_remote(update, done))
        self._update = update
        self.state = TransferState.UPDATING
        return update

    def expected(self, update: _Update) -> tuple[int, int]:
        return expected_bytes(update.buckets), len(update.buckets)

    async def finish(self, version: int, wait_s: float | None) -> Timings:
        async with self._lock:
            update = self._update
            if update is None or update.version != version:
                if version == self.engine.weight_version and self.last_timings is not None:
                    return self.last_timings
                if self._last_failure is not None and self._last_failure[0] == version:
                    if self.state is TransferState.INCONSISTENT:
                        raise self._inconsistent(version, self._last_failure[1])
                    raise Aborted(
                        f"receiving version {version} failed: {self._last_failure[1]}; "
                        "the previous version stays in service",
                        reason=R.ERROR_REASON_WEIGHT_TRANSFER_FAILED,
                    )
                raise FailedPrecondition(
                    f"version {version} is neither being received nor in service",
                    reason=R.ERROR_REASON_WEIGHT_UPDATE_CONFLICT,
                )
            try:
                await asyncio.wait_for(asyncio.shield(update.receive), timeout=wait_s)
            except TimeoutError:
                # The caller's deadline, not the transfer's: the update stays armed for a repeated Finish.
                raise Aborted(
                    f"version {version} is still being received", reason=R.ERROR_REASON_WEIGHT_TRANSFER_FAILED
                ) from None
            except (TransferError, EngineError, RuntimeError, ValueError) as exc:
                if self._remote:  # vLLM loads in place: some tensors may already be the new ones
                    raise self._inconsistent(version, f"receiving version {version} failed: {exc}") from None
                self._fail_update(update)
                raise Aborted(
                    f"receiving version {version} failed: {exc}; the previous version stays in service",
                    reason=R.ERROR_REASON_WEIGHT_TRANSFER_FAILED,
                ) from None
            load_start = time.perf_counter()
            applied = await self._commit(update)
            # A delta applies to the base weights; after an adapter update they are not what is served.
            self.delta_base = version if self.engine.delta_updates and not update.lora else 0
            done = time.perf_counter()
            timings = Timings(
                prepare_s=update.prepare_s,
                receive_s=(update.received_at[1] - update.received_at[0]) if update.received_at else 0.0,
                load_s=done - load_start,
                total_s=done - update.began,
                bytes_received=expected_bytes(update.buckets),
                buckets_received=len(update.buckets),
                applied_checksum=applied,
            )
            self._update = None
            self.state = TransferState.READY
            self.last_timings = timings
            self.last_update_time = time.time()
            return timings

    async def _commit(self, update: _Update) -> str:
        """Put the received update into service in the engine; a delta's `applied_checksum`, else ""."""
        version = update.version
        if self._remote:
            assert isinstance(self.engine, RemoteTransfer)
            try:
                await self.engine.finish_update(version)
            except EngineError as exc:
                raise self._inconsistent(version, f"loading version {version} failed: {exc}") from None
        elif update.delta is not None:
            try:
                return await self.engine.commit_delta(version, *update.delta, update.staged)
            except ValueError as exc:  # checked before any element was written: nothing changed
                self._update = None
                self.state = TransferState.READY
                raise InvalidArgument(
                    f"version {version}: {exc}; the previous version stays in service",
                    reason=R.ERROR_REASON_WEIGHT_MANIFEST_MISMATCH,
                ) from None
        else:
            try:
                await self.engine.commit_update(version)
            except EngineError as exc:  # the engine refused what arrived; nothing in service changed
                self.engine.discard_update()
                self._update = None
                self.state = TransferState.READY
                raise Aborted(
                    f"loading version {version} failed: {exc}; the previous version stays in service",
                    reason=R.ERROR_REASON_WEIGHT_TRANSFER_FAILED,
                ) from None
        return ""

    async def abort(self, version: int) -> None:
        async with self._lock:
            update = self._update
            if update is None:
                return
            if update.version != version:
                raise FailedPrecondition(
                    f"version {update.version} is being received, not {version}",
                    reason=R.ERROR_REASON_WEIGHT_UPDATE_CONFLICT,
                )
            update.cancelled.set()
            if self._remote:  # loaded in place, and an NCCL receive cannot be interrupted
                self._update = None
                self.delta_base = 0  # what is loaded matches no version: no delta can start from it
                self.state = TransferState.INCONSISTENT
                return
            if not update.receive.done():
                # A collective cannot be interrupted from here. The group is retired now (the trainer
                # re-forms it) and closed once the receive thread returns, at the latest at its timeout.
                group = self._group
                self._group, self.params = None, None

                def retire(done: asyncio.Future[None]) -> None:
                    if not done.cancelled():
                        done.exception()  # retrieved: an aborted receive is expected to fail
                    if group is not None:
                        group.close()

                update.receive.add_done_callback(retire)
            self.engine.discard_update()
            self._update = None
            self.state = TransferState.READY if self._group is not None else TransferState.UNINITIALIZED

    def _inconsistent(self, version: int, why: str) -> Aborted:
        """An engine that loads in place failed part-way: what it holds matches no version. Its transfer
        engine dropped the group (a failed collective breaks it), so the next update re-forms it. Returns
        the error for the caller to raise."""
        log.warning("weight update v%d failed in the engine; the worker is INCONSISTENT: %s", version, why)
        self._last_failure = (version, why)
        self.delta_base = 0
        self._update = None
        self.params = None
        self.state = TransferState.INCONSISTENT
        return Aborted(
            f"{why}; the weights in service match no version (INCONSISTENT) until an update completes",
            reason=R.ERROR_REASON_WEIGHT_TRANSFER_FAILED,
        )

    def _received_remote(self, update: _Update, done: asyncio.Future[None]) -> None:
        """A receive inside the engine that failed on its own (the trainer died or stalled past the
        timeout) leaves the worker INCONSISTENT at once, whether or not a FinishWeightUpdate comes."""
        if done.cancelled() or done.exception() is None or self._update is not update:
            return
        self._inconsistent(update.version, f"receiving version {update.version} failed: {done.exception()}")

    def _received(self, update: _Update, done: asyncio.Future[None]) -> None:
        """A receive that failed on its own (the trainer died or stalled past the timeout) ends the update
        at once: the previous version keeps serving and the worker waits for a new group."""
        if done.cancelled() or done.exception() is None or update.cancelled.is_set():
            return
        log.warning("weight update v%d failed while receiving: %s", update.version, done.exception())
        self._last_failure = (update.version, str(done.exception()))
        self._fail_update(update)

    def _fail_update(self, update: _Update) -> None:
        if self._update is not update:
            return
        self.engine.discard_update()
        self._update = None
        self._close_group()
        self.state = TransferState.UNINITIALIZED

    async def close(self) -> None:
        if self._update is not None:
            self._update.cancelled.set()
        self._close_group()
