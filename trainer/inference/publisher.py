"""The trainer's side of weight sync: one `WeightPublisher` per job, rank 0 of the transfer group.

    connect():  GetWorkerInfo on every worker; open the group on a port the OS picks; InitWeightTransfer on
                every worker concurrently (worker i takes rank i + 1) while this process joins as rank 0.
    publish():  PauseGeneration(mode) -> BeginWeightUpdate(version, manifest, bucket size) on every worker
                -> the packed broadcast -> FinishWeightUpdate(version) -> ResumeGeneration, timed per phase,
                and a `weights.updated` event on the job's log.
    verify():   ComputeWeightChecksums on every worker against the trainer's own tensors.

Every control call has a deadline and every worker's answer is checked: a worker that fails is named in the
`WeightSyncError`, never ignored. When an update fails, the publisher aborts it on every worker (each keeps
serving its previous version), drops the group, and the next `publish` re-forms it first, which is also how
a restarted worker rejoins with the current weights: after a re-forming `connect`, publish the current
weights again under a new version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch
from google.protobuf import duration_pb2
from tandem.events.v1 import event_pb2, events_service_pb2
from tandem.inference.v1 import inference_service_pb2 as pb
from tandem.inference.v1 import weights_pb2

from mesh.status import RpcError, rpc_error_from
from trainer.inference.engine import PauseMode
from trainer.inference.weights import (
    TransferGroup,
    checksum_digest,
    manifest_of,
    plan_buckets,
    send_packed,
    tensor_checksum,
)

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
    ) -> None:
        """`workers`: an `InferenceServiceStub` per worker; `events`: an `EventServiceStub` for the job's
        `weights.updated` events (with `job`), or None."""
        self.workers = list(workers)
        self.host = host
        self.bucket_size = bucket_size_bytes
        self.transfer_timeout_s = transfer_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._events = events
        self._job = job
        self._group: TransferGroup | None = None

    @property
    def connected(self) -> bool:
        return self._group is not None

    async def _all(self, phase: str, calls: Sequence[Awaitable[T]]) -> list[T]:
        results = await asyncio.gather(*calls, return_exceptions=True)
        failures = {i: _why(r) for i, r in enumerate(results) if isinstance(r, BaseException)}
        if failures:
            raise WeightSyncError(phase, failures)
        return [r for r in results if not isinstance(r, BaseException)]

    async def connect(self) -> None:
        """(Re-)form the transfer group with every worker."""
        self.close()
        await self._all(
            "GetWorkerInfo",
            [w.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=self.rpc_timeout_s) for w in self.workers],
        )
        world = len(self.workers) + 1
        listener = await asyncio.to_thread(TransferGroup.listen, self.host, world, self.transfer_timeout_s)
        request = [
            pb.InitWeightTransferRequest(
                backend=weights_pb2.WEIGHT_TRANSFER_BACKEND_GLOO,
                master_address=self.host,
                master_port=listener.port,
                world_size=world,
                rank_offset=rank,
            )
            for rank in range(1, world)
        ]
        for r in request:
            r.timeout.FromNanoseconds(int(self.transfer_timeout_s * 1e9))
        joining = asyncio.ensure_future(asyncio.to_thread(listener.connect))
        try:
            await self._all(
                "InitWeightTransfer",
                [
                    w.InitWeightTransfer(r, timeout=self.transfer_timeout_s + self.rpc_timeout_s)
                    for w, r in zip(self.workers, request, strict=True)
                ],
            )
        except BaseException:
            listener.close()
            joining.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        self._group = await joining

    async def publish(
        self, version: int, named: Sequence[tuple[str, torch.Tensor]], mode: PauseMode = PauseMode.KEEP
    ) -> UpdateReport:
        """Put `named` tensors (checkpoint names, in a fixed order) into service on every worker as
        `version`. Raises WeightSyncError naming the workers that failed; the update is then aborted."""
        if self._group is None:
            await self.connect()
        group = self._group
        assert group is not None
        manifest = manifest_of(named)
        buckets = plan_buckets(manifest, self.bucket_size)
        t0 = time.perf_counter()
        begin = pb.BeginWeightUpdateRequest(
            weight_version=version,
            manifest=[
                weights_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape)) for m in manifest
            ],
            bucket_size_bytes=self.bucket_size,
            packed=True,
        )
        try:
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
            tensors = [t for _, t in named]
            try:
                stats = await asyncio.to_thread(send_packed, group, tensors, buckets, self.transfer_timeout_s)
            except Exception as exc:
                raise WeightSyncError("broadcast", {-1: f"{type(exc).__name__}: {exc}"}) from exc
            t3 = time.perf_counter()
            finish = pb.FinishWeightUpdateRequest(weight_version=version)
            await self._all(
                "FinishWeightUpdate",
                [
                    w.FinishWeightUpdate(finish, timeout=self.transfer_timeout_s + self.rpc_timeout_s)
                    for w in self.workers
                ],
            )
            t4 = time.perf_counter()
        except WeightSyncError:
            await self._abort(version)
            raise
        await self._all(
            "ResumeGeneration",
            [
                w.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=self.rpc_timeout_s)
                for w in self.workers
            ],
        )
        t5 = time.perf_counter()
        report = UpdateReport(
            version=version,
            workers=len(self.workers),
            bytes=stats.bytes,
            buckets=stats.buckets,
            pause_s=t1 - t0,
            begin_s=t2 - t1,
            transfer_s=t3 - t2,
            finish_s=t4 - t3,
            resume_s=t5 - t4,
            total_s=t5 - t0,
        )
        await self._publish_event(report)
        return report

    async def _abort(self, version: int) -> None:
        """Best effort on every worker: abort the update and resume generation, so each keeps serving its
        previous version. The group is dropped and re-formed by the next `publish`."""
        self.close()
        for phase, calls in (
            (
                "AbortWeightUpdate",
                [
                    w.AbortWeightUpdate(
                        pb.AbortWeightUpdateRequest(weight_version=version), timeout=self.rpc_timeout_s
                    )
                    for w in self.workers
                ],
            ),
            (
                "ResumeGeneration",
                [
                    w.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=self.rpc_timeout_s)
                    for w in self.workers
                ],
            ),
        ):
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
        expected = {name: tensor_checksum(t) for name, t in named}
        request = pb.ComputeWeightChecksumsRequest(
            algorithm=weights_pb2.CHECKSUM_ALGORITHM_SHA256, names=list(expected)
        )
        answers = await self._all(
            "ComputeWeightChecksums",
            [w.ComputeWeightChecksums(request, timeout=self.transfer_timeout_s) for w in self.workers],
        )
        differ: dict[int, str] = {}
        for index, answer in enumerate(answers):
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
        updated.transport = "gloo"
        updated.begin_duration.CopyFrom(_duration(report.begin_s))
        updated.transfer_duration.CopyFrom(_duration(report.transfer_s))
        updated.finish_duration.CopyFrom(_duration(report.finish_s))
        updated.total_duration.CopyFrom(_duration(report.total_s))
        updated.paused_duration.CopyFrom(_duration(report.total_s))
        event.payload.update(
            {"pause_s": report.pause_s, "resume_s": report.resume_s, "buckets": report.buckets}
        )
        try:
            await self._events.Publish(
                events_service_pb2.PublishRequest(job=self._job, events=[event]), timeout=self.rpc_timeout_s
            )
        except Exception:  # the update is in service; a lost progress event must not undo it
            log.warning("could not publish weights.updated for v%d", report.version, exc_info=True)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None
