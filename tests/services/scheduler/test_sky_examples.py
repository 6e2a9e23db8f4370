"""The SkyPilot-vocabulary examples, examples/jobs/sky-torchrun.yaml and sky-two-node.yaml, run through the
scheduler with real torchrun and torch.distributed (gloo on CPU): on the local backend, whose GPUs are
declared so `$SKYPILOT_NUM_GPUS_PER_NODE` is 2, and on real Slurm (one node, then two), whose nodes have no
GPUs, so the examples' CPU fallback of two processes a node runs."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from services.scheduler import expand
from services.scheduler.backends.base import LaunchSpec, Phase
from services.scheduler.backends.local import LocalBackend
from services.scheduler.spec import load_yaml
from tests.services.scheduler.test_scheduler import ORG, TERMINAL, Clients, wait_for
from tests.services.scheduler.test_skypilot_env import local, mesh_clients, slurm
from tests.support.postgres import free_port
from tests.support.slurm import SlurmCluster

pytestmark = pytest.mark.timeout(300)
__all__ = ["local", "slurm"]  # fixtures
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "jobs"
LINE = re.compile(r"rank (\d+) of (\d+) \(gloo\): sum of ranks (\d+)")


async def run_example(
    clients: Clients, name: str, job_id: str, *, cpu_only: bool = False, **spec: object
) -> str:
    """Submit the example with a free MASTER_PORT; it must succeed. The text of every node's log."""
    group = load_yaml(EXAMPLES / name, envs={"MASTER_PORT": str(free_port())})
    for task in group.tasks:
        if cpu_only:  # what `tandem launch --gpus` cannot say: no GPUs at all
            task.resources.ClearField("gpus")
            del task.resources.gpu_alternatives[:]
    for key, value in spec.items():
        setattr(group, key, value)
    reply = await clients.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id=job_id, spec=group))
    done = await wait_for(clients, reply.job.name, *TERMINAL, within_s=240)
    nodes = max(group.tasks[0].num_nodes, 1)
    text = "".join([await log_text_rank(clients, reply.job.name, rank) for rank in range(nodes)])
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, (done.failure.message, text)
    return text


async def log_text_rank(clients: Clients, job: str, rank: int) -> str:
    chunks = [r.data async for r in clients.scheduler.StreamLogs(pb.StreamLogsRequest(job=job, rank=rank))]
    return b"".join(chunks).decode()


def processes(text: str) -> set[tuple[int, int, int]]:
    """(rank, world, sum) of every process that reported."""
    return {(int(r), int(w), int(s)) for r, w, s in LINE.findall(text)}


def every_rank(world: int) -> set[tuple[int, int, int]]:
    return {(rank, world, sum(range(world))) for rank in range(world)}


async def test_the_torchrun_example_starts_one_process_per_gpu(local: Clients) -> None:
    text = await run_example(local, "sky-torchrun.yaml", "torchrun")
    assert processes(text) == every_rank(2), text


async def test_the_two_node_example_on_the_local_backend(tmp_path: Path) -> None:
    """The scheduler's local backend has one node, so the job goes to the backend itself, with the script and
    environment the scheduler would give it (`expand`): two nodes of two processes on this machine."""
    job = "orgs/acme/jobs/two-node"
    task = load_yaml(EXAMPLES / "sky-two-node.yaml", envs={"MASTER_PORT": str(free_port())}).tasks[0]
    env = expand.task_env(task, job=job, attempt=0, gpus_per_node=2, backend="local")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    backend = LocalBackend(tmp_path / "attempts", gpus=4, failure_grace_s=2.0)
    spec = LaunchSpec(
        key="orgs-acme-jobs-two-node.sky-two-node.0",
        job=job,
        task=task.name,
        attempt=0,
        command=expand.command_for(task, job=job, gpus_granted=2),
        env=env,
        num_nodes=2,
        log_dir=tmp_path / "logs",
    )
    handle = await backend.launch(spec)
    observed = await backend.poll(handle)
    for _ in range(2400):  # a bound, so a hung rendezvous fails the test
        if observed.phase in (Phase.EXITED, Phase.LOST):
            break
        await asyncio.sleep(0.1)
        observed = await backend.poll(handle)
    text = "".join(path.read_text() for path in sorted((tmp_path / "logs").glob("rank-*.log")))
    assert observed.phase is Phase.EXITED and observed.exit_code == 0, (observed, text)
    assert processes(text) == every_rank(4), text


@pytest.mark.slow
async def test_the_torchrun_example_on_slurm(slurm: Clients) -> None:
    text = await run_example(
        slurm, "sky-torchrun.yaml", "torchrun", cpu_only=True, backend=job_spec_pb2.BACKEND_SLURM
    )
    assert processes(text) == every_rank(2), text


@pytest.fixture
async def slurm_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm_two_nodes: SlurmCluster
) -> AsyncIterator[Clients]:
    monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__ENABLED", "true")
    monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__CONF", str(slurm_two_nodes.conf))
    async with mesh_clients(tmp_path) as clients:
        yield clients


@pytest.mark.slow
async def test_the_two_node_example_on_two_slurm_nodes(slurm_two: Clients) -> None:
    text = await run_example(
        slurm_two, "sky-two-node.yaml", "two-node", cpu_only=True, backend=job_spec_pb2.BACKEND_SLURM
    )
    assert processes(text) == every_rank(4), text
