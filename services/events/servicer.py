"""gRPC adapter of the events service: proto in, `EventLog` call, proto out.

Who may do what: mesh services (service tokens) are trusted and may open new logs; a job token may publish
only to its own job and read its own organization; a caller scoped to an organization never learns that
another organization's job exists (NOT_FOUND, the same answer as for a job that does not exist).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import timestamp_pb2
from tandem.common.v1 import types_pb2
from tandem.events.v1 import (
    event_pb2,
    events_service_pb2,
    events_service_pb2_grpc,
    job_stream_pb2,
    metric_pb2,
)

from mesh import jobtokens, paging
from mesh.aio import wait_set
from mesh.errors import InvalidArgument, NotFound, OutOfRange, PermissionDenied, R
from mesh.interceptors import current_principal
from mesh.server import Deps, Registration
from mesh.store import Database, open_database
from services.events.config import EventsSettings
from services.events.log import (
    READ_BATCH,
    TERMINAL_STATES,
    Broker,
    EventLog,
    JobInfo,
    downsample,
    org_of,
    write_metrics,
)
from services.events.store import MIGRATIONS

SERVICE_NAME = events_service_pb2.DESCRIPTOR.services_by_name["EventService"].full_name
pb = events_service_pb2
Context = grpc.aio.ServicerContext[Any, Any]
DEFAULT_HEARTBEAT_S = 5.0
JOB_STATE_CHANGED = "job.state_changed"


def _heartbeat_s(requested: Any) -> float:
    seconds: float = requested.ToNanoseconds() / 1e9 if requested.ByteSize() else DEFAULT_HEARTBEAT_S
    return min(max(seconds, 0.05), 60.0)


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return stamp


def _matches(event: event_pb2.Event, types: Sequence[str], min_level: int) -> bool:
    if min_level and (event.level or types_pb2.LEVEL_INFO) < min_level:
        return False
    if not types:
        return True
    for pattern in types:
        if pattern.endswith(".*"):
            if event.type.startswith(pattern[:-1]):
                return True
        elif event.type == pattern:
            return True
    return False


def _info_proto(info: JobInfo, retained: int) -> job_stream_pb2.JobStreamInfo:
    proto = job_stream_pb2.JobStreamInfo(
        job=info.job,
        first_retained_seq=info.first_retained_seq,
        last_seq=info.last_seq,
        retained_event_count=retained,
        terminal=info.terminal,
        terminal_state=info.terminal_state,  # type: ignore[arg-type]
    )
    proto.create_time.FromNanoseconds(int(info.create_time * 1e9))
    if info.close_time:
        proto.close_time.FromNanoseconds(int(info.close_time * 1e9))
    return proto


SEQ_MAX = 2**62  # past any seq a log reaches; the store reads it as "no bound" and adds to it within BIGINT


class EventServiceServicer(events_service_pb2_grpc.EventServiceServicer):
    """Event stream: durable, ordered, resumable job events and metric series."""

    def __init__(self, log: EventLog) -> None:
        self._log = log

    # ---- authorization ------------------------------------------------------------------------

    def _check_org(self, org: str, missing: str) -> None:
        principal = current_principal()
        if principal.kind == "service":
            return
        if principal.org != org:
            raise NotFound(missing, reason=R.ERROR_REASON_JOB_NOT_FOUND)

    async def _visible(self, job: str) -> JobInfo:
        missing = f"{job} has no event log"
        jobtokens.check_own_job(current_principal(), job)  # a job reads its own events only, whatever exists
        self._check_org(org_of(job), missing)
        return await self._log.info(job)

    # ---- writes -------------------------------------------------------------------------------

    async def Publish(self, request: pb.PublishRequest, context: Context) -> pb.PublishResponse:
        principal = current_principal()
        if principal.kind == "job" and principal.subject != request.job:
            self._check_org(org_of(request.job), f"{request.job} has no event log")
            raise PermissionDenied("a job token may publish only to its own job")
        self._check_org(org_of(request.job), f"{request.job} has no event log")
        for index, event in enumerate(request.events):
            if (
                event.WhichOneof("core") == "job_state_changed"
                and event.job_state_changed.state in TERMINAL_STATES
            ):
                raise InvalidArgument(
                    f"events[{index}] carries a terminal state; close the log with CloseJobStream",
                    reason=R.ERROR_REASON_INVALID_ARGUMENT,
                )
        result = await self._log.publish(request.job, request.events, create=principal.kind == "service")
        return pb.PublishResponse(
            seqs=result.seqs, duplicate_count=result.duplicates, last_seq=result.last_seq
        )

    async def CloseJobStream(
        self, request: pb.CloseJobStreamRequest, context: Context
    ) -> pb.CloseJobStreamResponse:
        principal = current_principal()
        if principal.kind != "service":
            raise PermissionDenied("only the scheduler closes a job's log")
        state = request.state_changed.state
        if state not in TERMINAL_STATES:
            raise InvalidArgument("state_changed.state must be terminal (SUCCEEDED, FAILED or CANCELLED)")
        info = await self._log.info(request.job)
        if info.terminal:
            if info.terminal_state != state:
                raise InvalidArgument(
                    f"{request.job} was already closed with another state",
                    reason=R.ERROR_REASON_JOB_STATE_CONFLICT,
                )
            last = await self._log.read_stored(request.job, info.last_seq - 1, 1)
            return pb.CloseJobStreamResponse(event=last[0] if last else None)
        event = event_pb2.Event(type=JOB_STATE_CHANGED, level=types_pb2.LEVEL_INFO, message=request.message)
        event.job_state_changed.CopyFrom(request.state_changed)
        if request.request_id:
            event.producer_id, event.producer_seq = f"close:{request.request_id}", 1
        result = await self._log.publish(request.job, [event], create=False, close_state=state)
        stored = await self._log.read(request.job, result.seqs[0] - 1, 1)
        return pb.CloseJobStreamResponse(event=stored[0])

    async def PublishMetrics(
        self, request: pb.PublishMetricsRequest, context: Context
    ) -> pb.PublishMetricsResponse:
        await self._visible(request.job)
        written = await write_metrics(self._log.db, request.job, request.points)
        return pb.PublishMetricsResponse(written_count=written)

    async def CompactEvents(
        self, request: pb.CompactEventsRequest, context: Context
    ) -> pb.CompactEventsResponse:
        await self._visible(request.job)
        max_age = request.max_age.ToNanoseconds() / 1e9 if request.HasField("max_age") else None
        if not request.keep_last and max_age is None:
            raise InvalidArgument("set keep_last, max_age or both")
        removed, info = await self._log.compact(request.job, request.keep_last, max_age)
        return pb.CompactEventsResponse(
            removed_count=removed, first_retained_seq=info.first_retained_seq, last_seq=info.last_seq
        )

    # ---- reads --------------------------------------------------------------------------------

    async def GetJobStreamInfo(
        self, request: pb.GetJobStreamInfoRequest, context: Context
    ) -> pb.GetJobStreamInfoResponse:
        info = await self._visible(request.job)
        retained = await self._log.retained_count(request.job)
        return pb.GetJobStreamInfoResponse(info=_info_proto(info, retained))

    async def ListEvents(self, request: pb.ListEventsRequest, context: Context) -> pb.ListEventsResponse:
        info = await self._visible(request.job)
        size = paging.page_size(request.page_size)
        query = paging.fingerprint(
            request.job,
            request.after_seq,
            request.before_seq,
            tuple(request.types),
            request.min_level,
            request.descending,
        )
        cursor = paging.decode(request.page_token, query)
        # Seqs are dense from 1 and stored as 64-bit signed integers: a bound past that range bounds nothing.
        after_seq, before_seq = min(request.after_seq, SEQ_MAX), min(request.before_seq, SEQ_MAX)
        after, before = after_seq, before_seq
        if cursor is not None:
            if request.descending:
                before = cursor.last_number
            else:
                after = cursor.last_number
        found: list[event_pb2.Event] = []
        scanned_to = after if not request.descending else before
        newest = info.last_seq  # events committed while this page is read raise it: never below a listed seq
        exhausted = False
        while len(found) < size and not exhausted:
            batch = await self._log.read_stored(
                request.job,
                after if not request.descending else after_seq,
                READ_BATCH,
                before_seq=before if request.descending else before_seq,
                descending=request.descending,
            )
            exhausted = len(batch) < READ_BATCH
            for event in batch:
                scanned_to = event.seq
                newest = max(newest, event.seq)
                if request.descending:
                    before = event.seq
                else:
                    after = event.seq
                if _matches(event, request.types, request.min_level):
                    found.append(event)
                    if len(found) == size:
                        exhausted = exhausted and event is batch[-1]
                        break
        token = "" if exhausted else paging.encode(query, last_number=scanned_to)
        return pb.ListEventsResponse(
            events=found,
            next_page_token=token,
            first_retained_seq=info.first_retained_seq,
            last_seq=newest,
        )

    async def Subscribe(
        self, request: pb.SubscribeRequest, context: Context
    ) -> AsyncIterator[Any]:  # SubscribeResponse, or its bytes when shared (the mesh passes bytes through)
        job = request.job
        info = await self._visible(job)
        cursor = request.after_seq
        if cursor > info.last_seq:
            raise OutOfRange(
                f"after_seq {cursor} is past the newest event {info.last_seq}",
                reason=R.ERROR_REASON_CURSOR_AHEAD,
            )
        heartbeat = _heartbeat_s(request.heartbeat_interval)
        broker = self._log.broker
        types, min_level = tuple(request.types), request.min_level
        filtered = bool(types or min_level)
        first_retained = info.first_retained_seq
        while True:
            waiter = broker.waiter(job)  # before reading: a commit after this point sets it
            if cursor + 1 < first_retained:
                raise OutOfRange(
                    f"events after {cursor} were compacted; the oldest retained is {first_retained}",
                    reason=R.ERROR_REASON_CURSOR_COMPACTED,
                    metadata={"first_retained_seq": str(first_retained)},
                )
            batch = await self._log.read(job, cursor)
            if batch:
                if batch[0].seq != cursor + 1:  # compacted while this subscriber lagged
                    info = await self._log.info(job)
                    first_retained = max(info.first_retained_seq, batch[0].seq)
                    continue
                last = batch[-1].seq
                key = (job, cursor, last, types, min_level)
                hit, data = broker.serialized(key)
                if not hit:
                    selected = [e for e in batch if _matches(e, types, min_level)] if filtered else batch
                    data = (
                        pb.SubscribeResponse(
                            events=pb.EventBatch(events=selected, cursor=last)
                        ).SerializeToString()
                        if selected
                        else None
                    )
                    broker.remember(key, data)
                cursor = last
                if data is not None:
                    yield data
                continue
            known = broker.known(job)
            if known is None:  # this process knows nothing of the log any more: ask storage
                info = await self._log.info(job)
                known = broker.known(job)
                assert known is not None
            last_seq, terminal_state = known
            if last_seq > cursor:
                continue  # committed meanwhile (or only in storage): read again
            if request.end_when_terminal and terminal_state:
                state: Any = terminal_state
                yield pb.SubscribeResponse(end=pb.StreamEnd(terminal_seq=last_seq, terminal_state=state))
                return
            if not await wait_set(waiter, heartbeat):
                # Idle: refresh from storage (a NOTIFY lost while the listener reconnected is found here).
                info = await self._log.info(job)
                first_retained = info.first_retained_seq
                yield pb.SubscribeResponse(
                    heartbeat=pb.Heartbeat(cursor=cursor, last_seq=max(info.last_seq, cursor), time=_now())
                )

    async def SubscribeOrg(
        self, request: pb.SubscribeOrgRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeOrgResponse]:
        org = request.parent.split("/")[1]
        self._check_org(org, f"{request.parent} not found")
        cursors = {c.job: c.after_seq for c in request.cursors}
        start = request.start_time.ToNanoseconds() / 1e9 if request.HasField("start_time") else None
        heartbeat = _heartbeat_s(request.heartbeat_interval)
        while True:
            waiter = self._log.broker.org_waiter(org)
            progressed = False
            for info in await self._log.jobs_of(org):
                cursor = cursors.get(info.job, 0 if start is None else info.first_retained_seq - 1)
                if cursor + 1 < info.first_retained_seq:
                    yield pb.SubscribeOrgResponse(
                        gap=pb.CursorGap(
                            job=info.job, after_seq=cursor, first_retained_seq=info.first_retained_seq
                        )
                    )
                    cursor = info.first_retained_seq - 1
                batch = await self._log.read(info.job, cursor) if info.last_seq > cursor else []
                if batch and batch[0].seq != cursor + 1:
                    batch = await self._log.read_stored(info.job, cursor, READ_BATCH)
                if not batch:
                    cursors[info.job] = cursor
                    continue
                progressed = True
                cursors[info.job] = batch[-1].seq
                selected = [
                    e
                    for e in batch
                    if _matches(e, request.types, request.min_level)
                    and (start is None or e.receive_time.ToNanoseconds() / 1e9 >= start)
                ]
                job_cursor = [pb.JobCursor(job=info.job, after_seq=batch[-1].seq)]
                if selected:
                    yield pb.SubscribeOrgResponse(
                        events=pb.OrgEventBatch(events=selected, cursors=job_cursor)
                    )
            if progressed:
                continue
            if not await wait_set(waiter, heartbeat):
                yield pb.SubscribeOrgResponse(
                    heartbeat=pb.OrgHeartbeat(
                        time=_now(),
                        cursors=[pb.JobCursor(job=j, after_seq=s) for j, s in sorted(cursors.items())],
                    )
                )

    async def GetRetentionPolicy(
        self, request: pb.GetRetentionPolicyRequest, context: Context
    ) -> pb.GetRetentionPolicyResponse:
        org = request.name.split("/")[1]
        self._check_org(org, f"{request.name} not found")
        return pb.GetRetentionPolicyResponse(retention_policy=await self._log.policy(org))

    async def UpdateRetentionPolicy(
        self, request: pb.UpdateRetentionPolicyRequest, context: Context
    ) -> pb.UpdateRetentionPolicyResponse:
        incoming = request.retention_policy
        org = incoming.name.split("/")[1]
        self._check_org(org, f"{incoming.name} not found")
        policy = await self._log.policy(org)
        paths = list(request.update_mask.paths) or ["max_events_per_job", "max_age", "compact_live_jobs"]
        for path in paths:
            if path not in ("max_events_per_job", "max_age", "compact_live_jobs"):
                raise InvalidArgument(f"update_mask names {path!r}, which cannot be updated")
            if path == "max_age":
                policy.max_age.CopyFrom(incoming.max_age)
            else:
                setattr(policy, path, getattr(incoming, path))
        policy.update_time.CopyFrom(_now())
        await self._log.set_policy(org, policy)
        return pb.UpdateRetentionPolicyResponse(retention_policy=policy)

    async def ListMetrics(self, request: pb.ListMetricsRequest, context: Context) -> pb.ListMetricsResponse:
        await self._visible(request.job)
        size = paging.page_size(request.page_size, default=20, maximum=100)
        end = request.end_step if request.HasField("end_step") else 2**62
        query = paging.fingerprint(
            request.job, tuple(request.names), request.start_step, end, request.max_points
        )
        cursor = paging.decode(request.page_token, query)
        after_name = cursor.last_key if cursor else ""
        names_clause = ""
        params: list[Any] = [request.job, after_name]
        if request.names:
            names_clause = f" AND name IN ({', '.join('?' for _ in request.names)})"
            params.extend(request.names)
        rows = await self._log.db.fetchall(
            "SELECT DISTINCT name FROM metric_points WHERE job = ? AND name > ?"  # noqa: S608 - placeholders only
            f"{names_clause} ORDER BY name LIMIT ?",
            (*params, size + 1),
        )
        names = [r["name"] for r in rows]
        series: list[metric_pb2.MetricSeries] = []
        for name in names[:size]:
            points = await self._log.db.fetchall(
                "SELECT step, value, time FROM metric_points"
                " WHERE job = ? AND name = ? AND step >= ? AND step <= ? ORDER BY step",
                (request.job, name, request.start_step, end),
            )
            samples, reduced = downsample(
                [(int(p["step"]), float(p["value"]), float(p["time"])) for p in points], request.max_points
            )
            series.append(metric_pb2.MetricSeries(name=name, points=samples, downsampled=reduced))
        token = paging.encode(query, last_key=names[size - 1]) if len(names) > size else ""
        return pb.ListMetricsResponse(series=series, next_page_token=token)


async def open_log(db: Database, config: EventsSettings | None = None) -> EventLog:
    config = config or EventsSettings()
    log = EventLog(db, Broker(), max_group=config.max_group, retention_interval_s=config.retention_interval_s)
    await log.start()
    return log


async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
    db = await open_database(deps.settings.store_url_for("events"), "events", MIGRATIONS)
    log = await open_log(db)
    events_service_pb2_grpc.add_EventServiceServicer_to_server(EventServiceServicer(log), server)

    async def close() -> None:
        await log.stop()
        await db.close()

    return Registration(service_names=[SERVICE_NAME], on_stop=[close])


__all__ = ["EventServiceServicer", "setup"]
