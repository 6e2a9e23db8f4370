"""The scheduler on a real in-process mesh (events, vault, scheduler) with the local backend running real
processes: the life of a job and its events, restarts with backoff, failure classes, cancellation of a
process tree, gang admission, priorities and preemption, idempotent CreateJob, refusals with their codes
and reasons, logs, job tokens and secrets opened inside a task."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import nacl.public
import pytest
from google.protobuf import duration_pb2
from tandem.events.v1 import events_service_pb2, events_service_pb2_grpc
from tandem.scheduler.v1 import job_pb2, job_spec_pb2, scheduler_service_pb2_grpc
from tandem.scheduler.v1 import scheduler_service_pb2 as pb
from tandem.taskapp.v1 import taskapp_service_pb2, taskapp_service_pb2_grpc
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.status import RpcError
from tests.support.mesh import Mesh, mesh_settings, running_mesh
from tests.support.postgres import free_port

pytestmark = pytest.mark.timeout(120)
ORG = "orgs/acme"
State = job_pb2.Job.State
TaskState = job_pb2.TaskStatus.State
TaskSpec = job_spec_pb2.TaskSpec


@pytest.fixture
async def mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store_url: str) -> AsyncIterator[Mesh]:
    """Every test runs on both stores (the vault and events share the database, as deployed)."""
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__GPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "8")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "16")
    monkeypatch.setenv("TANDEM_SCHEDULER_PREEMPTION", "true")
    monkeypatch.setenv("TANDEM_SCHEDULER_CANCEL_GRACE_S", "2")
    settings = mesh_settings(tmp_path, store_url="" if store_url.startswith("sqlite") else store_url)
    async with running_mesh(settings, services=["events", "vault", "taskapp_proxy", "scheduler"]) as running:
        yield running


class Clients:
    def __init__(self, mesh: Mesh, token: str) -> None:
        self.channel = open_channel(mesh.address("scheduler"), mesh.settings, token=token)
        self.scheduler = scheduler_service_pb2_grpc.SchedulerServiceStub(self.channel)
        self.events_channel = open_channel(mesh.address("events"), mesh.settings, token=token)
        self.events = events_service_pb2_grpc.EventServiceStub(self.events_channel)
        self.vault_channel = open_channel(mesh.address("vault"), mesh.settings, token=token)
        self.vault = vault_service_pb2_grpc.VaultServiceStub(self.vault_channel)
        self.proxy_channel = open_channel(mesh.address("taskapp_proxy"), mesh.settings, token=token)
        self.proxy = taskapp_service_pb2_grpc.TaskAppServiceStub(self.proxy_channel)

    async def close(self) -> None:
        for channel in (self.channel, self.events_channel, self.vault_channel, self.proxy_channel):
            await channel.close()


@pytest.fixture
def signer(mesh: Mesh) -> TokenSigner:
    return TokenSigner(load_signing_key("", mesh.settings.state_dir))


@pytest.fixture
async def acme(mesh: Mesh, signer: TokenSigner) -> AsyncIterator[Clients]:
    clients = Clients(mesh, signer.issue("user", "alice", org="acme", ttl_s=600))
    yield clients
    await clients.close()


@pytest.fixture
async def globex(mesh: Mesh, signer: TokenSigner) -> AsyncIterator[Clients]:
    clients = Clients(mesh, signer.issue("user", "mallory", org="globex", ttl_s=600))
    yield clients
    await clients.close()


def command(run: str, name: str = "main", gpus: str = "", **task: object) -> TaskSpec:
    spec = TaskSpec(name=name, kind=TaskSpec.KIND_COMMAND, run=run, **task)  # type: ignore[arg-type]
    if gpus:
        spec.resources.gpus = gpus
    return spec


def seconds(value: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(value * 1e9))
    return duration


async def create(
    clients: Clients, *tasks: TaskSpec, job_id: str = "", priority: int = 0, **spec: object
) -> job_pb2.Job:
    reply = await clients.scheduler.CreateJob(
        pb.CreateJobRequest(
            parent=ORG,
            job_id=job_id,
            spec=job_spec_pb2.JobSpec(display_name="test", tasks=list(tasks), priority=priority, **spec),  # type: ignore[arg-type]
        )
    )
    return reply.job


async def wait_for(clients: Clients, name: str, *states: int, within_s: float = 60.0) -> job_pb2.Job:
    deadline = time.monotonic() + within_s
    while True:
        job = (await clients.scheduler.GetJob(pb.GetJobRequest(name=name))).job
        if job.state in states:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{name} stayed {State.Name(job.state)}; wanted {[State.Name(s) for s in states]}"
            )
        await asyncio.sleep(0.05)


async def job_states(clients: Clients, name: str) -> list[str]:
    events = await events_of(clients, name)
    return [State.Name(e.job_state_changed.state) for e in events if e.type == "job.state_changed"]


async def events_of(clients: Clients, name: str) -> list[object]:
    deadline = time.monotonic() + 10
    while True:
        reply = await clients.events.ListEvents(
            events_service_pb2.ListEventsRequest(job=name, page_size=1000)
        )
        events = list(reply.events)
        if any(e.type == "job.state_changed" and e.job_state_changed.state in TERMINAL for e in events):
            return events
        if time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.1)


APP = Path(__file__).resolve().parents[3] / "examples" / "taskapps" / "single_turn.py"
DEMO = APP.parents[2] / "examples" / "jobs" / "demo.toml"
TERMINAL = (State.STATE_SUCCEEDED, State.STATE_FAILED, State.STATE_CANCELLED)


async def log_text(clients: Clients, name: str, task: str = "") -> str:
    chunks = [r.data async for r in clients.scheduler.StreamLogs(pb.StreamLogsRequest(job=name, task=task))]
    return b"".join(chunks).decode()


async def test_a_job_runs_to_success_with_its_events_in_order(acme: Clients) -> None:
    job = await create(
        acme,
        command('echo "hello from $TANDEM_TASK of $TANDEM_JOB on $TANDEM_NODE_RANK/$TANDEM_NUM_NODES"'),
        job_id="hello",
    )
    assert job.name == "orgs/acme/jobs/hello" and job.state == State.STATE_PENDING
    assert job.backend == job_spec_pb2.BACKEND_LOCAL and job.creator == "alice"
    done = await wait_for(acme, job.name, *TERMINAL)
    assert done.state == State.STATE_SUCCEEDED
    assert done.tasks[0].state == TaskState.STATE_SUCCEEDED and done.tasks[0].backend_handle.local.pid > 0
    assert done.start_time.seconds > 0 and done.end_time.seconds > 0
    assert await job_states(acme, job.name) == [
        "STATE_PENDING",
        "STATE_STARTING",
        "STATE_RUNNING",
        "STATE_SUCCEEDED",
    ]
    events = await events_of(acme, job.name)
    task_states = [
        TaskState.Name(e.task_state_changed.state) for e in events if e.type == "task.state_changed"
    ]  # type: ignore[attr-defined]
    assert task_states == ["STATE_STARTING", "STATE_RUNNING", "STATE_SUCCEEDED"]
    text = await log_text(acme, job.name)
    assert "[tandem] attempt 0" in text and "hello from main of orgs/acme/jobs/hello on 0/1" in text


async def test_a_failing_task_is_restarted_within_budget_after_backoff(acme: Clients) -> None:
    run = 'echo "restart=$TANDEM_RESTART_COUNT"; [ "$TANDEM_RESTART_COUNT" -ge 2 ]'
    recovery = job_spec_pb2.RecoveryPolicy(max_restarts_on_errors=2, initial_backoff=seconds(0.3))
    job = await create(acme, command(run), recovery=recovery)
    done = await wait_for(acme, job.name, *TERMINAL)
    assert done.state == State.STATE_SUCCEEDED and done.restart_count == 2
    assert done.tasks[0].restart_count == 2
    text = await log_text(acme, job.name)
    assert [line for line in text.splitlines() if line.startswith("restart=")] == [
        "restart=0",
        "restart=1",
        "restart=2",
    ]
    assert "[tandem] attempt 2" in text
    states = await job_states(acme, job.name)
    assert states.count("STATE_RECOVERING") == 2 and states[-1] == "STATE_SUCCEEDED"
    events = await events_of(acme, job.name)
    recovering = [
        e
        for e in events
        if e.type == "job.state_changed" and e.job_state_changed.state == State.STATE_RECOVERING
    ]  # type: ignore[attr-defined]
    assert recovering[0].job_state_changed.failure.failure_class == job_pb2.Failure.CLASS_USER  # type: ignore[attr-defined]
    # The backoff doubles: 0.3 s, then 0.6 s, measured between the failure and the next start.
    starts = [
        e
        for e in events
        if e.type == "job.state_changed" and e.job_state_changed.state == State.STATE_STARTING
    ]  # type: ignore[attr-defined]
    assert len(starts) == 3


async def test_an_exit_code_outside_the_recover_list_fails_the_job_as_user(acme: Clients) -> None:
    recovery = job_spec_pb2.RecoveryPolicy(recover_on_exit_codes=[42], initial_backoff=seconds(0.1))
    listed = await create(acme, command('[ "$TANDEM_RESTART_COUNT" -ge 1 ] || exit 42'), recovery=recovery)
    other = await create(acme, command("echo boom; exit 3"), recovery=recovery)
    ok = await wait_for(acme, listed.name, *TERMINAL)
    assert ok.state == State.STATE_SUCCEEDED and ok.restart_count == 1  # listed: outside the (zero) budget
    failed = await wait_for(acme, other.name, *TERMINAL)
    assert failed.state == State.STATE_FAILED
    assert failed.failure.failure_class == job_pb2.Failure.CLASS_USER and failed.failure.exit_code == 3
    assert failed.failure.task == "main" and "boom" in failed.failure.message
    assert failed.tasks[0].state == TaskState.STATE_FAILED


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie nobody reaped yet has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_failing_setup_is_a_precheck_failure_never_recovered(acme: Clients) -> None:
    recovery = job_spec_pb2.RecoveryPolicy(max_restarts_on_errors=3, initial_backoff=seconds(0.1))
    job = await create(acme, command("echo never", setup="echo preparing; exit 1"), recovery=recovery)
    done = await wait_for(acme, job.name, *TERMINAL)
    assert done.state == State.STATE_FAILED and done.restart_count == 0
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK
    assert "never" not in (await log_text(acme, job.name)).replace("echo never", "")


async def test_cancel_kills_the_process_tree(acme: Clients, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    job = await create(acme, command(f"sleep 300 & echo $! > {pidfile}; wait"))
    await wait_for(acme, job.name, State.STATE_RUNNING)
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    child = int(pidfile.read_text())
    reply = await acme.scheduler.CancelJob(pb.CancelJobRequest(name=job.name, reason="enough"))
    assert reply.job.state in (State.STATE_CANCELLING, State.STATE_CANCELLED)
    done = await wait_for(acme, job.name, *TERMINAL)
    assert done.state == State.STATE_CANCELLED and done.tasks[0].state == TaskState.STATE_CANCELLED
    assert not alive(child)
    again = await acme.scheduler.CancelJob(pb.CancelJobRequest(name=job.name))
    assert again.job.state == State.STATE_CANCELLED
    events = await events_of(acme, job.name)
    assert events[-1].job_state_changed.state == State.STATE_CANCELLED and "enough" in events[-1].message  # type: ignore[attr-defined]


async def test_a_pending_job_is_cancelled_at_once_and_a_finished_one_refuses(
    acme: Clients, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    blocker = await create(acme, command(f"while [ ! -e {gate} ]; do sleep 0.05; done", gpus="4"))
    await wait_for(acme, blocker.name, State.STATE_RUNNING)
    waiting = await create(acme, command("true", gpus="1"))
    await asyncio.sleep(0.5)
    assert (await wait_for(acme, waiting.name, State.STATE_PENDING)).state == State.STATE_PENDING
    cancelled = await acme.scheduler.CancelJob(pb.CancelJobRequest(name=waiting.name))
    assert cancelled.job.state == State.STATE_CANCELLED
    gate.touch()
    await wait_for(acme, blocker.name, State.STATE_SUCCEEDED)
    with pytest.raises(RpcError) as refused:
        await acme.scheduler.CancelJob(pb.CancelJobRequest(name=blocker.name))
    assert (refused.value.code, refused.value.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "JOB_STATE_CONFLICT",
    )


async def test_gang_admission_waits_until_the_whole_group_fits(acme: Clients, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    first = await create(
        acme,
        command(f'echo "gpus=$CUDA_VISIBLE_DEVICES"; while [ ! -e {gate} ]; do sleep 0.05; done', gpus="3"),
    )
    await wait_for(acme, first.name, State.STATE_RUNNING)
    group = await create(
        acme, command('echo "gpus=$CUDA_VISIBLE_DEVICES"', "a", gpus="1"), command("true", "b", gpus="1")
    )
    await asyncio.sleep(1.0)
    pending = await wait_for(acme, group.name, State.STATE_PENDING)
    assert [t.state for t in pending.tasks] == [TaskState.STATE_PENDING, TaskState.STATE_PENDING]
    gate.touch()
    done = await wait_for(acme, group.name, *TERMINAL)
    assert done.state == State.STATE_SUCCEEDED
    first_done = await wait_for(acme, first.name, *TERMINAL)
    assert len(first_done.tasks[0].nodes[0].gpu_indices) == 3
    assert "gpus=0,1,2" in await log_text(acme, first.name)
    assert done.start_time.ToNanoseconds() >= first_done.end_time.ToNanoseconds() - 10**9


async def test_priority_order_then_preemption_requeues_and_resumes(acme: Clients, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    blocker = await create(
        acme, command(f"while [ ! -e {gate} ]; do sleep 0.05; done", gpus="4"), priority=1000
    )
    await wait_for(acme, blocker.name, State.STATE_RUNNING)
    low = await create(acme, command("sleep 0.2", gpus="4"), priority=0)
    high = await create(acme, command("sleep 0.2", gpus="4"), priority=5)
    gate.touch()
    high_done = await wait_for(acme, high.name, *TERMINAL)
    low_done = await wait_for(acme, low.name, *TERMINAL)
    assert high_done.state == low_done.state == State.STATE_SUCCEEDED
    assert high_done.start_time.ToNanoseconds() < low_done.start_time.ToNanoseconds()  # priority first

    # The victim takes a second to stop; meanwhile nobody else is preempted for the same job.
    run = (
        'echo "restart=$TANDEM_RESTART_COUNT"; [ "$TANDEM_RESTART_COUNT" -ge 1 ] && exit 0; '
        "trap 'sleep 1; exit 143' TERM; sleep 300 & wait"
    )
    victim = await create(acme, command(run, gpus="3"), priority=1)
    bystander_gate = tmp_path / "bystander"
    bystander = await create(
        acme, command(f"while [ ! -e {bystander_gate} ]; do sleep 0.05; done", gpus="1"), priority=2
    )
    await wait_for(acme, victim.name, State.STATE_RUNNING)
    await wait_for(acme, bystander.name, State.STATE_RUNNING)
    urgent = await create(acme, command("true", gpus="1"), priority=9)
    assert (await wait_for(acme, urgent.name, *TERMINAL)).state == State.STATE_SUCCEEDED
    still = await wait_for(acme, bystander.name, State.STATE_RUNNING)
    assert still.restart_count == 0
    bystander_gate.touch()
    assert (await wait_for(acme, bystander.name, *TERMINAL)).state == State.STATE_SUCCEEDED
    resumed = await wait_for(acme, victim.name, *TERMINAL)
    assert resumed.state == State.STATE_SUCCEEDED and resumed.restart_count == 1
    assert resumed.tasks[0].restart_count == 1
    events = await events_of(acme, victim.name)
    recovering = [
        e
        for e in events
        if e.type == "job.state_changed" and e.job_state_changed.state == State.STATE_RECOVERING
    ]  # type: ignore[attr-defined]
    assert recovering[0].job_state_changed.failure.failure_class == job_pb2.Failure.CLASS_PREEMPTED  # type: ignore[attr-defined]
    assert "restart=1" in await log_text(acme, victim.name)


async def test_create_job_is_idempotent_per_request_id(acme: Clients) -> None:
    request = pb.CreateJobRequest(
        parent=ORG,
        spec=job_spec_pb2.JobSpec(display_name="Idem Potent!", tasks=[command("true")]),
        request_id="r-1",
    )
    first = (await acme.scheduler.CreateJob(request)).job
    second = (await acme.scheduler.CreateJob(request)).job
    assert first.name == second.name and first.name.startswith("orgs/acme/jobs/idem-potent-")
    assert second.request_id == "r-1"
    request.spec.tasks[0].run = "false"
    with pytest.raises(RpcError) as reused:
        await acme.scheduler.CreateJob(request)
    assert (reused.value.code, reused.value.reason) == (grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_REUSED")
    job_id = first.name.rsplit("/", 1)[1]
    with pytest.raises(RpcError) as taken:
        await acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id=job_id, spec=request.spec))
    assert (taken.value.code, taken.value.reason) == (grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS")
    checked = await acme.scheduler.CreateJob(
        pb.CreateJobRequest(parent=ORG, job_id="dry", spec=request.spec, validate_only=True)
    )
    assert checked.job.name == "orgs/acme/jobs/dry"
    with pytest.raises(RpcError) as missing:
        await acme.scheduler.GetJob(pb.GetJobRequest(name="orgs/acme/jobs/dry"))
    assert missing.value.reason == "JOB_NOT_FOUND"


async def expect(call: object, code: grpc.StatusCode, reason: str) -> RpcError:
    with pytest.raises(RpcError) as caught:
        await call  # type: ignore[misc]
    assert (caught.value.code, caught.value.reason) == (code, reason), caught.value
    return caught.value


async def test_refusals_carry_their_codes_and_reasons(acme: Clients, globex: Clients, mesh: Mesh) -> None:
    job = await create(acme, command("true"), job_id="mine")
    s = acme.scheduler
    await expect(
        globex.scheduler.GetJob(pb.GetJobRequest(name=job.name)), grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND"
    )
    await expect(
        globex.scheduler.CancelJob(pb.CancelJobRequest(name=job.name)),
        grpc.StatusCode.NOT_FOUND,
        "JOB_NOT_FOUND",
    )
    await expect(
        globex.scheduler.CreateJob(
            pb.CreateJobRequest(parent=ORG, spec=job_spec_pb2.JobSpec(tasks=[command("true")]))
        ),
        grpc.StatusCode.NOT_FOUND,
        "ORG_NOT_FOUND",
    )
    await expect(
        globex.scheduler.ListJobs(pb.ListJobsRequest(parent=ORG)), grpc.StatusCode.NOT_FOUND, "ORG_NOT_FOUND"
    )
    no_run = job_spec_pb2.JobSpec(  # a service is its run; a command task may have none
        tasks=[TaskSpec(name="x", kind=TaskSpec.KIND_SERVICE, service=job_spec_pb2.ServiceOptions(port=8080))]
    )
    error = await expect(
        s.CreateJob(pb.CreateJobRequest(parent=ORG, spec=no_run)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_JOB_SPEC",
    )
    assert any(v.field.startswith("spec.tasks[0]") for v in error.violations)
    huge = job_spec_pb2.JobSpec(tasks=[command("true", gpus="8")])
    await expect(
        s.CreateJob(pb.CreateJobRequest(parent=ORG, spec=huge)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "RESOURCES_UNSATISFIABLE",
    )
    slurm = job_spec_pb2.JobSpec(tasks=[command("true")], backend=job_spec_pb2.BACKEND_SLURM)
    await expect(
        s.CreateJob(pb.CreateJobRequest(parent=ORG, spec=slurm)),
        grpc.StatusCode.UNAVAILABLE,
        "BACKEND_UNAVAILABLE",
    )
    secret = job_spec_pb2.JobSpec(
        tasks=[command("true", secrets=[job_spec_pb2.SecretBinding(secret="nope")])]
    )
    error = await expect(
        s.CreateJob(pb.CreateJobRequest(parent=ORG, spec=secret)),
        grpc.StatusCode.NOT_FOUND,
        "SECRET_NOT_FOUND",
    )
    assert [v.field for v in error.violations] == ["spec.tasks[0].secrets[0].secret"]
    await expect(
        s.ListJobs(pb.ListJobsRequest(parent=ORG, page_token="garbage")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )
    await expect(
        s.StreamLogs(pb.StreamLogsRequest(job=job.name, task="other")).read(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )

    anonymous = open_channel(mesh.address("scheduler"), mesh.settings, token="")
    try:
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(anonymous)
        await expect(
            stub.GetJob(pb.GetJobRequest(name=job.name)),
            grpc.StatusCode.UNAUTHENTICATED,
            "MISSING_CREDENTIALS",
        )
    finally:
        await anonymous.close()
    channel = grpc.aio.insecure_channel(mesh.address("scheduler"))
    try:
        token = TokenSigner(load_signing_key("", mesh.settings.state_dir)).issue("user", "alice", org="acme")
        metadata = (("authorization", f"Bearer {token}"),)
        garbage = channel.unary_unary("/tandem.scheduler.v1.SchedulerService/GetJob")
        with pytest.raises(grpc.aio.AioRpcError) as malformed:
            await garbage(b"\xff\xff\xff", metadata=metadata, timeout=5)
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        big = pb.CreateJobRequest(
            parent=ORG,
            spec=job_spec_pb2.JobSpec(tasks=[command("x" * 60000, name=f"t{i}") for i in range(16)] * 5),
        )
        create_raw = channel.unary_unary("/tandem.scheduler.v1.SchedulerService/CreateJob")
        with pytest.raises(grpc.aio.AioRpcError) as oversized:
            await create_raw(big.SerializeToString(), metadata=metadata, timeout=5)
        assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await channel.close()


async def test_list_jobs_pages_newest_first_with_state_filters(acme: Clients) -> None:
    names = [(await create(acme, command("true"), job_id=f"list-{n}")).name for n in range(5)]
    for name in names:
        await wait_for(acme, name, *TERMINAL)
    first = await acme.scheduler.ListJobs(pb.ListJobsRequest(parent=ORG, page_size=2))
    second = await acme.scheduler.ListJobs(
        pb.ListJobsRequest(parent=ORG, page_size=2, page_token=first.next_page_token)
    )
    third = await acme.scheduler.ListJobs(
        pb.ListJobsRequest(parent=ORG, page_size=2, page_token=second.next_page_token)
    )
    assert [j.name for j in [*first.jobs, *second.jobs, *third.jobs]] == names[::-1]
    assert third.next_page_token == ""
    running = await acme.scheduler.ListJobs(pb.ListJobsRequest(parent=ORG, states=[State.STATE_RUNNING]))
    assert list(running.jobs) == []
    with pytest.raises(RpcError) as other_query:
        await acme.scheduler.ListJobs(
            pb.ListJobsRequest(
                parent=ORG, page_size=2, page_token=first.next_page_token, states=[State.STATE_SUCCEEDED]
            )
        )
    assert other_query.value.reason == "INVALID_PAGE_TOKEN"


async def test_stream_logs_tail_and_follow(acme: Clients, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    run = f"for i in 1 2 3; do echo line-$i; done; while [ ! -e {gate} ]; do sleep 0.05; done; echo last-line"
    job = await create(acme, command(run))
    await wait_for(acme, job.name, State.STATE_RUNNING)
    await asyncio.sleep(0.3)
    tail = [r async for r in acme.scheduler.StreamLogs(pb.StreamLogsRequest(job=job.name, tail_bytes=8))]
    assert b"".join(r.data for r in tail) == b"line-3\n" and not tail[-1].end_of_log
    follow = acme.scheduler.StreamLogs(pb.StreamLogsRequest(job=job.name, follow=True))
    received = b""
    async for piece in follow:
        received += piece.data
        if b"line-3" in received and not gate.exists():
            gate.touch()
        if piece.end_of_log:
            break
    assert received.endswith(b"last-line\n") and received.startswith(b"[tandem] attempt 0\nline-1")
    size = len(received)
    resumed = [
        r async for r in acme.scheduler.StreamLogs(pb.StreamLogsRequest(job=job.name, offset=size - 10))
    ]
    assert b"".join(r.data for r in resumed) == received[-10:] and resumed[-1].end_of_log
    with pytest.raises(RpcError) as ahead:
        async for _ in acme.scheduler.StreamLogs(pb.StreamLogsRequest(job=job.name, offset=size + 1)):
            pass
    assert ahead.value.reason == "CURSOR_AHEAD"


async def put_secret(clients: Clients, secret_id: str, value: bytes) -> None:
    key = await clients.vault.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent=ORG))
    sealed = nacl.public.SealedBox(nacl.public.PublicKey(key.public_key)).encrypt(value)
    await clients.vault.PutSecret(
        vault_service_pb2.PutSecretRequest(
            parent=ORG, secret_id=secret_id, key_id=key.key_id, ciphertext=sealed
        )
    )


async def test_job_token_refresh_and_secrets_opened_in_the_task(
    acme: Clients, tmp_path: Path, mesh: Mesh
) -> None:
    await put_secret(acme, "env-key", b"s3cret-value")
    tokenfile, gate = tmp_path / "token", tmp_path / "gate"
    run = (
        '[ "$ENV_KEY" = "s3cret-value" ] || exit 7; '
        f'echo "$TANDEM_JOB_TOKEN" > {tokenfile}; while [ ! -e {gate} ]; do sleep 0.05; done'
    )
    job = await create(acme, command(run, secrets=[job_spec_pb2.SecretBinding(secret="env-key")]))
    await wait_for(acme, job.name, State.STATE_RUNNING)
    deadline = time.monotonic() + 20
    while not tokenfile.exists() or not tokenfile.read_text().strip():
        current = (await acme.scheduler.GetJob(pb.GetJobRequest(name=job.name))).job
        assert current.state not in TERMINAL, current.failure.message
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    token = tokenfile.read_text().strip()
    verifier = TokenSigner(load_signing_key("", mesh.settings.state_dir)).verifier
    claims = verifier.verify(token).claims
    assert claims["sub"] == job.name and claims["ext"] == {
        "task": "main",
        "attempt": 0,
        "secrets": ["orgs/acme/secrets/env-key"],
        "task_apps": [],  # a command task plays no Task App
        "revocable": True,  # mesh/jobtokens.py: revoked when the attempt ends
    }
    refreshed = await acme.scheduler.RefreshJobToken(pb.RefreshJobTokenRequest(job_token=token))
    assert verifier.verify(refreshed.job_token).claims["ext"] == claims["ext"]
    assert refreshed.expire_time.seconds >= int(claims["exp"])
    await expect(
        acme.scheduler.RefreshJobToken(pb.RefreshJobTokenRequest(job_token="")),
        grpc.StatusCode.UNAUTHENTICATED,
        "MISSING_CREDENTIALS",
    )
    await expect(
        acme.scheduler.RefreshJobToken(pb.RefreshJobTokenRequest(job_token=token[:-3] + "abc")),
        grpc.StatusCode.UNAUTHENTICATED,
        "INVALID_CREDENTIALS",
    )
    gate.touch()
    assert (await wait_for(acme, job.name, *TERMINAL)).state == State.STATE_SUCCEEDED
    await expect(
        acme.scheduler.RefreshJobToken(pb.RefreshJobTokenRequest(job_token=token)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "JOB_STATE_CONFLICT",
    )
    if not mesh.settings.store_url:
        stored = (mesh.settings.state_dir / "scheduler.db").read_bytes()
        assert b"s3cret-value" not in stored


async def test_cluster_info_describes_the_local_backend(acme: Clients) -> None:
    info = await acme.scheduler.GetClusterInfo(pb.GetClusterInfoRequest(include_nodes=True))
    assert [(b.backend, b.available, b.is_default) for b in info.backends] == [
        (job_spec_pb2.BACKEND_LOCAL, True, True)
    ]
    assert len(info.nodes) == 1 and info.nodes[0].gpu_count == 4 and info.nodes[0].cpus == 8


async def test_a_managed_task_app_is_registered_when_ready_and_deleted_when_it_ends(
    acme: Clients, tmp_path: Path
) -> None:
    await put_secret(acme, "app-key", b"k-123456")
    app = APP
    serve = f'exec "{sys.executable}" -m gateway.cli taskapp serve {app} --port "$TANDEM_SERVICE_PORT"'
    service = TaskSpec(
        name="app",
        kind=TaskSpec.KIND_SERVICE,
        role=TaskSpec.ROLE_AUXILIARY,
        run=serve,
        secrets=[job_spec_pb2.SecretBinding(secret="app-key", env="ENVIRONMENT_API_KEY")],
        service=job_spec_pb2.ServiceOptions(
            port=free_port(),
            health_path="/health",
            register_task_app=job_spec_pb2.TaskAppRegistration(app_id="single", api_key_secret="app-key"),
        ),
    )
    gate = tmp_path / "gate"
    job = await create(acme, command(f"while [ ! -e {gate} ]; do sleep 0.05; done"), service)
    running = await wait_for(acme, job.name, State.STATE_RUNNING)
    assert running.tasks[1].endpoint.startswith("http://127.0.0.1:")
    name = "orgs/acme/taskApps/single"
    deadline = time.monotonic() + 30
    while True:
        try:
            got = await acme.proxy.GetTaskApp(taskapp_service_pb2.GetTaskAppRequest(name=name))
            break
        except RpcError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
    assert got.task_app.base_url == running.tasks[1].endpoint
    assert got.task_app.managing_job == job.name  # the scheduler's, so the app reads as managed
    taken = await expect(
        acme.scheduler.CreateJob(
            pb.CreateJobRequest(parent=ORG, spec=job_spec_pb2.JobSpec(tasks=[command("true"), service]))
        ),
        grpc.StatusCode.ALREADY_EXISTS,
        "ALREADY_EXISTS",
    )
    assert [v.field for v in taken.violations] == ["spec.tasks[1].service.register_task_app.app_id"]
    assert got.task_app.secret_name == "orgs/acme/secrets/app-key"
    gate.touch()
    done = await wait_for(acme, job.name, *TERMINAL)
    assert done.state == State.STATE_SUCCEEDED, done.failure.message
    assert [t.state for t in done.tasks] == [TaskState.STATE_SUCCEEDED, TaskState.STATE_STOPPED]
    await expect(
        acme.proxy.GetTaskApp(taskapp_service_pb2.GetTaskAppRequest(name=name)),
        grpc.StatusCode.NOT_FOUND,
        "TASK_APP_NOT_FOUND",
    )


async def test_a_restarted_online_rl_task_resumes_from_its_newest_checkpoint(acme: Clients) -> None:
    run = (
        'echo "resume=$TANDEM_RESUME_FROM restart=$TANDEM_RESTART_COUNT"; '
        '[ "$TANDEM_RESTART_COUNT" -ge 1 ] && exit 0; '
        'mkdir -p "$TANDEM_TRAINER_OUTPUT/checkpoints/step-000002" "$TANDEM_TRAINER_OUTPUT/checkpoints/step-000004"; '
        'mkdir -p "$TANDEM_TRAINER_OUTPUT/checkpoints/step-000006.partial"; exit 1'
    )
    task = TaskSpec(
        name="trainer",
        kind=TaskSpec.KIND_ONLINE_RL,
        run=run,
        online_rl=job_spec_pb2.OnlineRlOptions(config_toml=DEMO.read_text()),
    )
    recovery = job_spec_pb2.RecoveryPolicy(max_restarts_on_errors=1, initial_backoff=seconds(0.1))
    job = await create(acme, task, recovery=recovery)
    done = await wait_for(acme, job.name, *TERMINAL)
    assert done.state == State.STATE_SUCCEEDED, done.failure.message
    lines = [line for line in (await log_text(acme, job.name)).splitlines() if line.startswith("resume=")]
    assert lines[0] == "resume= restart=0"
    assert lines[1].startswith("resume=/") and lines[1].endswith("/output/checkpoints/step-000004 restart=1")
