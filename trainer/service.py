"""gRPC adapter of the trainer's control surface, `tandem.trainer.v1.TrainerService`: proto in, a call on the
loop's `Control` or the checkpoint folder, proto out.

`serving` runs it in the trainer's process on `settings.host` (loopback; `TANDEM_PORTS__TRAINER`, 0: a port
the OS picks) behind the mesh interceptors, so every call carries a mesh token, and writes the address to
`<output>/trainer.json` while it serves, for the scheduler and the gateway to find.

Who may call: mesh services (service tokens, the gateway among them), and users and jobs of the job's own
organization (a job token only for its own job). A caller from another organization, or a request naming
another job, gets NOT_FOUND / JOB_NOT_FOUND: a trainer never confirms that some other job exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import timestamp_pb2
from tandem.common.v1 import types_pb2
from tandem.trainer.v1 import checkpoint_pb2, status_pb2, trainer_service_pb2, trainer_service_pb2_grpc

from mesh import paging
from mesh.errors import NotFound, PermissionDenied, R
from mesh.files import write_atomic
from mesh.interceptors import current_principal
from mesh.server import Deps, Registration, start_service
from mesh.settings import Settings
from trainer import checkpoints
from trainer.checkpoints import TRIGGERS, CheckpointInfo
from trainer.control import Control, State

pb = trainer_service_pb2
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TrainerService"].full_name
Context = grpc.aio.ServicerContext[Any, Any]
ADDRESS_FILE = "trainer.json"
CHECKPOINTS = "/checkpoints/"

STATES = {
    State.STARTING: status_pb2.TrainerStatus.STATE_STARTING,
    State.TRAINING: status_pb2.TrainerStatus.STATE_TRAINING,
    State.CHECKPOINTING: status_pb2.TrainerStatus.STATE_CHECKPOINTING,
    State.STOPPING: status_pb2.TrainerStatus.STATE_STOPPING,
    State.STOPPED: status_pb2.TrainerStatus.STATE_STOPPED,
    State.FAILED: status_pb2.TrainerStatus.STATE_FAILED,
}


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def checkpoint_proto(job: str, checkpoint: CheckpointInfo) -> checkpoint_pb2.Checkpoint:
    return checkpoint_pb2.Checkpoint(
        name=f"{job}{CHECKPOINTS}{checkpoint.id}",
        step=checkpoint.step,
        policy_version=types_pb2.PolicyVersion(job=job, weight_version=checkpoint.weight_version),
        uri=checkpoint.path.absolute().as_uri(),
        format=checkpoint_pb2.Checkpoint.FORMAT_HF_SAFETENSORS,
        metrics=dict(checkpoint.metrics),
        resumable=checkpoint.resumable,
        trigger=TRIGGERS[checkpoint.trigger]
        if checkpoint.trigger
        else checkpoint_pb2.Checkpoint.TRIGGER_UNSPECIFIED,
        size_bytes=checkpoint.size_bytes,
        create_time=_timestamp(checkpoint.create_time),
    )


def status_proto(job: str, control: Control) -> status_pb2.TrainerStatus:
    status = status_pb2.TrainerStatus(
        job=job,
        state=STATES[control.state],
        step=control.step,
        total_steps=control.total_steps,
        weight_version=control.weight_version,
        last_metrics=control.metrics,
        staleness=status_pb2.StalenessCounts(
            used=control.staleness["staleness/on_policy"],
            importance_corrected=control.staleness["staleness/corrected"],
            dropped=control.staleness["staleness/dropped"],
        ),
        error_message=control.error,
        start_time=_timestamp(control.start_time),
    )
    if control.last_checkpoint is not None:
        status.last_checkpoint = f"{job}{CHECKPOINTS}{control.last_checkpoint.id}"
    if control.update_time:
        status.update_time.CopyFrom(_timestamp(control.update_time))
    return status


class TrainerServicer(trainer_service_pb2_grpc.TrainerServiceServicer):
    """The control surface of one job's trainer."""

    def __init__(self, job: str, control: Control, checkpoint_root: Path) -> None:
        self._job = job
        self._control = control
        self._root = checkpoint_root

    async def setup(self, server: grpc.aio.Server, deps: Deps) -> Registration:
        trainer_service_pb2_grpc.add_TrainerServiceServicer_to_server(self, server)
        return Registration(service_names=[SERVICE_NAME])

    def _own(self, job: str) -> None:
        """The request names this trainer's job and the caller may see it."""
        principal = current_principal()
        visible = principal.kind == "service" or principal.org == job.split("/")[1]
        if not visible or job != self._job:
            raise NotFound(f"{job} is not a job this trainer runs", reason=R.ERROR_REASON_JOB_NOT_FOUND)
        if principal.kind == "job" and principal.subject != job:
            raise PermissionDenied("a job token may act only on its own job")

    async def GetTrainerStatus(
        self, request: pb.GetTrainerStatusRequest, context: Context
    ) -> pb.GetTrainerStatusResponse:
        self._own(request.job)
        return pb.GetTrainerStatusResponse(status=status_proto(self._job, self._control))

    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: Context
    ) -> pb.ListCheckpointsResponse:
        self._own(request.parent)
        size = paging.page_size(request.page_size)
        query = paging.fingerprint("checkpoints", request.parent)
        cursor = paging.decode(request.page_token, query)
        found = await asyncio.to_thread(checkpoints.list_all, self._root)
        if cursor is not None:  # keyed by step, so checkpoints saved between pages never shift one
            found = [c for c in found if c.step < cursor.last_number]
        page = found[:size]
        token = paging.encode(query, last_number=page[-1].step) if len(found) > size else ""
        return pb.ListCheckpointsResponse(
            checkpoints=[checkpoint_proto(self._job, c) for c in page], next_page_token=token
        )

    async def GetCheckpoint(
        self, request: pb.GetCheckpointRequest, context: Context
    ) -> pb.GetCheckpointResponse:
        job, _, checkpoint = request.name.rpartition(CHECKPOINTS)
        self._own(job)
        found = await asyncio.to_thread(checkpoints.find, self._root, checkpoint)
        if found is None:
            raise NotFound(f"{request.name} does not exist", reason=R.ERROR_REASON_CHECKPOINT_NOT_FOUND)
        return pb.GetCheckpointResponse(checkpoint=checkpoint_proto(self._job, found))

    async def SaveCheckpoint(
        self, request: pb.SaveCheckpointRequest, context: Context
    ) -> pb.SaveCheckpointResponse:
        self._own(request.job)
        saved = await self._control.save(request.request_id)
        return pb.SaveCheckpointResponse(checkpoint=checkpoint_proto(self._job, saved))

    async def StopTraining(
        self, request: pb.StopTrainingRequest, context: Context
    ) -> pb.StopTrainingResponse:
        self._own(request.job)
        self._control.stop(skip_checkpoint=request.skip_checkpoint, request_id=request.request_id)
        return pb.StopTrainingResponse(status=status_proto(self._job, self._control))


def _write_address(path: Path, document: dict[str, str]) -> None:
    write_atomic(path, json.dumps(document))  # readers see the whole file or none


@contextlib.asynccontextmanager
async def serving(control: Control, job: str, output_dir: Path, settings: Settings) -> AsyncIterator[str]:
    """Serve TrainerService for `job` while the block runs; yields its address (`host:port`)."""
    servicer = TrainerServicer(job, control, output_dir / "checkpoints")
    running = await start_service("trainer", settings, servicer.setup)
    found_at = output_dir / ADDRESS_FILE
    try:
        document = {"job": job, "service": SERVICE_NAME, "address": running.address}
        await asyncio.to_thread(_write_address, found_at, document)
        yield running.address
    finally:
        found_at.unlink(missing_ok=True)
        await running.stop(settings.drain_grace_s)
