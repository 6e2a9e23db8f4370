"""A job's checkpoints, read from its `checkpoint.saved` events and its metric series in the events
service. Both outlive the trainer, so this works the same for a running job and a finished one.

Metrics of a checkpoint are the job's metric points at the checkpoint's step (the trainer publishes its
step metrics under the same step number).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tandem.events.v1 import events_service_pb2 as events_pb
from tandem.trainer.v1 import checkpoint_pb2

from mesh import paging
from mesh.errors import FieldViolation, NotFound, R

LATEST = "latest"
EVENT_TYPE = "checkpoint.saved"
EVENT_PAGE = 1000

ListEvents = Callable[[events_pb.ListEventsRequest], Awaitable[events_pb.ListEventsResponse]]
ListMetrics = Callable[[events_pb.ListMetricsRequest], Awaitable[events_pb.ListMetricsResponse]]


def violation(field: str, description: str) -> FieldViolation:
    return FieldViolation(field, description)


class CheckpointIndex:
    def __init__(self, list_events: ListEvents, list_metrics: ListMetrics) -> None:
        self._list_events = list_events
        self._list_metrics = list_metrics

    async def all(self, job: str) -> list[checkpoint_pb2.Checkpoint]:
        """Every checkpoint the job announced, newest step first (a name announced twice counts once, as
        its last announcement)."""
        by_name: dict[str, checkpoint_pb2.Checkpoint] = {}
        token = ""
        while True:
            page = await self._list_events(
                events_pb.ListEventsRequest(
                    job=job, types=[EVENT_TYPE], page_size=EVENT_PAGE, page_token=token
                )
            )
            for event in page.events:
                saved = event.checkpoint_saved
                if not saved.checkpoint:
                    continue
                found = checkpoint_pb2.Checkpoint(
                    name=saved.checkpoint,
                    step=saved.step,
                    uri=saved.uri,
                    format=checkpoint_pb2.Checkpoint.FORMAT_HF_SAFETENSORS,
                    size_bytes=saved.size_bytes,
                    trigger=saved.trigger,
                    resumable=saved.resumable,
                )
                found.policy_version.job = job
                found.policy_version.weight_version = saved.weight_version
                found.create_time.CopyFrom(event.time)
                by_name[saved.checkpoint] = found
            token = page.next_page_token
            if not token:
                break
        return sorted(by_name.values(), key=lambda c: (c.step, c.create_time.ToNanoseconds()), reverse=True)

    async def _attach_metrics(self, job: str, checkpoints: list[checkpoint_pb2.Checkpoint]) -> None:
        if not checkpoints:
            return
        steps = {c.step for c in checkpoints}
        values: dict[int, dict[str, float]] = {}
        token = ""
        while True:
            page = await self._list_metrics(
                events_pb.ListMetricsRequest(
                    job=job, start_step=min(steps), end_step=max(steps), page_size=1000, page_token=token
                )
            )
            for series in page.series:
                for point in series.points:
                    if point.step in steps:
                        values.setdefault(point.step, {})[series.name] = point.value
            token = page.next_page_token
            if not token:
                break
        for checkpoint in checkpoints:
            checkpoint.metrics.update(values.get(checkpoint.step, {}))

    async def page(
        self, job: str, page_size: int, page_token: str
    ) -> tuple[list[checkpoint_pb2.Checkpoint], str]:
        size = paging.page_size(page_size, default=50)
        query = paging.fingerprint("checkpoints", job)
        cursor = paging.decode(page_token, query)
        offset = cursor.last_number if cursor else 0
        every = await self.all(job)
        chosen = every[offset : offset + size]
        await self._attach_metrics(job, chosen)
        token = paging.encode(query, last_number=offset + size) if len(every) > offset + size else ""
        return chosen, token

    async def resolve(self, model: str) -> checkpoint_pb2.Checkpoint:
        """The checkpoint a model id names (`.../checkpoints/latest` is the newest step); NOT_FOUND with
        JOB_NOT_FOUND for a job without an event log, CHECKPOINT_NOT_FOUND for a checkpoint it never saved."""
        job, _, checkpoint_id = model.rpartition("/checkpoints/")
        every = await self.all(job)
        if checkpoint_id == LATEST and every:
            return every[0]
        for checkpoint in every:
            if checkpoint.name == model:
                return checkpoint
        raise NotFound(f"{model} not found", reason=R.ERROR_REASON_CHECKPOINT_NOT_FOUND)
