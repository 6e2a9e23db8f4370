"""The scheduler as its own process (`python -m services.scheduler`), SIGKILLed in the middle of a storm of
CreateJob calls with request ids, started again and SIGKILLed again while it reattaches and launches, then
started a third time on the same state: resubmitting the same requests finds each job exactly once, and
every attempt that was launched before a kill is reattached, never started a second time."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import nacl.signing
import pytest
from tandem.scheduler.v1 import job_pb2, job_spec_pb2, scheduler_service_pb2_grpc
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from mesh.clients import open_channel
from mesh.identity import TokenSigner
from mesh.settings import Settings
from mesh.status import RpcError
from tests.support.mesh import kill_tasks_under
from tests.support.postgres import free_port

pytestmark = pytest.mark.timeout(180)
JOBS = 24
State = job_pb2.Job.State


@contextmanager
def scheduler_process(env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.scheduler"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class Target:
    def __init__(self, port: int, seed: bytes, state: Path) -> None:
        self.settings = Settings(state_dir=state)
        token = TokenSigner(nacl.signing.SigningKey(seed)).issue("user", "alice", org="acme", ttl_s=600)
        self.channel = open_channel(f"127.0.0.1:{port}", self.settings, token=token)
        self.stub = scheduler_service_pb2_grpc.SchedulerServiceStub(self.channel)


@pytest.fixture
async def target(tmp_path: Path) -> AsyncIterator[tuple[Target, dict[str, str]]]:
    port, seed = free_port(), secrets.token_bytes(32)
    env = {
        **os.environ,
        "TANDEM_STATE_DIR": str(tmp_path / "state"),
        "TANDEM_PORTS__SCHEDULER": str(port),
        "TANDEM_MESH_KEY": seed.hex(),
        "TANDEM_LOG_LEVEL": "WARNING",
        "TANDEM_SCHEDULER_CANCEL_GRACE_S": "1",
        "TANDEM_TARGETS__EVENTS": f"127.0.0.1:{free_port()}",  # nobody there: events wait in the outbox
    }
    made = Target(port, seed, tmp_path / "state")
    yield made, env
    await made.channel.close()


def request(n: int, starts: Path) -> pb.CreateJobRequest:
    run = f'echo "$TANDEM_RESTART_COUNT" >> {starts}/job-{n}; exec sleep 600'
    task = job_spec_pb2.TaskSpec(name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run=run)
    spec = job_spec_pb2.JobSpec(
        display_name=f"storm {n}",
        tasks=[task],
        recovery=job_spec_pb2.RecoveryPolicy(max_restarts_on_errors=3),
    )
    return pb.CreateJobRequest(parent="orgs/acme", spec=spec, request_id=f"storm-{n}")


async def create(stub: scheduler_service_pb2_grpc.SchedulerServiceStub, req: pb.CreateJobRequest) -> str:
    return (await stub.CreateJob(req, timeout=10)).job.name


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def submit_until_accepted(
    stub: scheduler_service_pb2_grpc.SchedulerServiceStub, req: pb.CreateJobRequest
) -> str:
    deadline = time.monotonic() + 60
    while True:
        try:
            return (await stub.CreateJob(req, timeout=10)).job.name
        except RpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_sigkill_during_a_submission_storm_loses_and_duplicates_nothing(
    target: tuple[Target, dict[str, str]], tmp_path: Path
) -> None:
    client, env = target
    starts = tmp_path / "starts"
    starts.mkdir()
    try:
        await storm_kill_and_check(client, env, starts, tmp_path)
    finally:
        kill_tasks_under(tmp_path)  # a failed check must not leave the storm's tasks running


async def storm_kill_and_check(client: Target, env: dict[str, str], starts: Path, tmp_path: Path) -> None:
    requests = [request(n, starts) for n in range(JOBS)]
    log = tmp_path / "scheduler.log"
    with scheduler_process(env, log) as first:
        await submit_until_accepted(client.stub, requests[0])  # the server is up
        storm = [asyncio.create_task(create(client.stub, r)) for r in requests[1:]]
        pending, answered = set(storm), 0
        while answered < len(storm) // 3:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            answered += len(done)
        first.send_signal(signal.SIGKILL)
        first.wait()
        await asyncio.gather(*storm, return_exceptions=True)

    with scheduler_process(env, log) as second:  # killed again while it reattaches and launches
        for r in requests[: JOBS // 2]:
            await submit_until_accepted(client.stub, r)
        second.send_signal(signal.SIGKILL)
        second.wait()

    with scheduler_process(env, log):
        names = [await submit_until_accepted(client.stub, r) for r in requests]
        assert len(set(names)) == JOBS  # one job per request id
        deadline = time.monotonic() + 90
        while True:
            jobs = [(await client.stub.GetJob(pb.GetJobRequest(name=n))).job for n in names]
            if all(j.state == State.STATE_RUNNING for j in jobs):
                break
            assert time.monotonic() < deadline, [State.Name(j.state) for j in jobs]
            await asyncio.sleep(0.2)
        listed = await client.stub.ListJobs(pb.ListJobsRequest(parent="orgs/acme", page_size=1000))
        assert sorted(j.name for j in listed.jobs) == sorted(names)  # nothing duplicated, nothing lost
        await asyncio.sleep(1.0)  # a second copy, had one been started, would have written by now
        for n in range(JOBS):
            lines = (starts / f"job-{n}").read_text().split()
            assert len(lines) == len(set(lines)), f"job {n} started an attempt twice: {lines}"
            assert lines[-1] == str(jobs[n].tasks[0].restart_count)
        pids = {j.tasks[0].backend_handle.local.pid for j in jobs}
        assert len(pids) == JOBS and all(alive(pid) for pid in pids)
        for name in names:
            await client.stub.CancelJob(pb.CancelJobRequest(name=name))
        deadline = time.monotonic() + 60
        while True:
            jobs = [(await client.stub.GetJob(pb.GetJobRequest(name=n))).job for n in names]
            if all(j.state == State.STATE_CANCELLED for j in jobs):
                break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
