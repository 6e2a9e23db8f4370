"""The scheduler driving the Slurm backend on a real one-node cluster (tests/support/slurm.py): a command
job and the online RL demo job (3 steps) run through CreateJob to SUCCEEDED, the demo leaving a checkpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from mesh.identity import TokenSigner, load_signing_key
from services.scheduler.spec import parse_yaml
from tests.services.scheduler.test_online_rl import demo_task, trainer_checkpoints
from tests.services.scheduler.test_scheduler import (
    ORG,
    TERMINAL,
    Clients,
    command,
    create,
    expect,
    log_text,
    seconds,
    wait_for,
)
from tests.support.mesh import Mesh, mesh_settings, running_mesh
from tests.support.slurm import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[3]
SLURM = job_spec_pb2.BACKEND_SLURM


@pytest.fixture
async def acme(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm_cluster: SlurmCluster
) -> AsyncIterator[Clients]:
    monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__ENABLED", "true")
    monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__CONF", str(slurm_cluster.conf))
    async with running_mesh(
        mesh_settings(tmp_path), services=["events", "vault", "taskapp_proxy", "scheduler"]
    ) as mesh:
        yield await clients_for(mesh)


async def clients_for(mesh: Mesh) -> Clients:
    return Clients(
        mesh, TokenSigner(load_signing_key("", mesh.settings.state_dir)).issue("user", "alice", org="acme")
    )


async def test_a_command_job_runs_on_slurm(acme: Clients) -> None:
    run = (
        'echo "on slurm: $TANDEM_JOB rank $TANDEM_NODE_RANK"\n'
        'echo "user=$SKYPILOT_USER user_id=$SKYPILOT_USER_ID managed=$SKYPILOT_MANAGED_JOB_ID'
        ' root=${SKYPILOT_ROOT_JOB_ID-none}"'
    )
    job = await create(acme, command(run), job_id="one", backend=SLURM)
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure.message
    assert done.backend == SLURM and done.tasks[0].backend_handle.slurm.job_id
    text = await log_text(acme, job.name)
    assert f"on slurm: {job.name} rank 0" in text, text
    # SkyPilot's submitter and managed-job variables; a one-task job is no job tree, so it has no root id.
    assert "user=alice user_id=6384e2b2 managed=one root=none" in text, text
    await acme.close()


async def test_the_jobs_slurm_options_reach_sbatch(acme: Clients) -> None:
    run = 'echo "partition=$SLURM_JOB_PARTITION"'
    chosen = await create(
        acme, command(run), backend=SLURM, slurm=job_spec_pb2.SlurmOptions(partition="debug")
    )
    done = await wait_for(acme, chosen.name, *TERMINAL, within_s=120)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure.message
    assert "partition=debug" in await log_text(acme, chosen.name)
    missing = job_spec_pb2.SlurmOptions(partition="no-such-partition")
    error = await expect(
        create(acme, command(run), backend=SLURM, slurm=missing),
        grpc.StatusCode.FAILED_PRECONDITION,
        "FAILED_PRECONDITION",
    )
    assert [v.field for v in error.violations] == ["spec.slurm.partition"]
    assert "no partition 'no-such-partition'" in error.message, error
    await acme.close()


async def test_a_skypilot_files_infra_names_the_cluster_and_partition_or_is_refused(acme: Clients) -> None:
    # tests/support/slurm.py's cluster is `tandemtest`, with the one partition `debug`.
    run = 'echo "on $SLURM_CLUSTER_NAME in $SLURM_JOB_PARTITION"'

    def request(job_id: str, infra: str) -> pb.CreateJobRequest:
        spec = parse_yaml(f"name: {job_id}\nresources: {{infra: '{infra}'}}\nrun: {run}\n")
        return pb.CreateJobRequest(parent=ORG, job_id=job_id, spec=spec)

    for job_id, infra in {"named": "slurm/tandemtest/debug", "any-cluster": "slurm/*/debug"}.items():
        reply = await acme.scheduler.CreateJob(request(job_id, infra))
        done = await wait_for(acme, reply.job.name, *TERMINAL, within_s=120)
        assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure.message
        assert "on tandemtest in debug" in await log_text(acme, done.name)
    for job_id, infra, field, named in (
        (
            "no-partition",
            "slurm/tandemtest/gpu",
            "spec.slurm.partition",
            "'tandemtest' has no partition 'gpu' (slurm.partition); its partitions: debug",
        ),
        (
            "elsewhere",
            "slurm/other-cluster",
            "spec.slurm.cluster",
            "Slurm cluster 'other-cluster' (slurm.cluster, as in infra: slurm/other-cluster), and this "
            "scheduler's Slurm cluster is 'tandemtest'",
        ),
    ):
        error = await expect(
            acme.scheduler.CreateJob(request(job_id, infra)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "FAILED_PRECONDITION",
        )
        assert [(v.field, v.description) for v in error.violations] == [(field, error.message)]
        assert named in error.message, error
    await acme.close()


async def test_a_failing_slurm_task_is_recovered_and_cancel_ends_a_running_one(acme: Clients) -> None:
    run = 'echo "restart=$TANDEM_RESTART_COUNT"; [ "$TANDEM_RESTART_COUNT" -ge 1 ]'
    recovery = job_spec_pb2.RecoveryPolicy(max_restarts_on_errors=2, initial_backoff=seconds(0.3))
    job = await create(acme, command(run), backend=SLURM, recovery=recovery)
    done = await wait_for(acme, job.name, *TERMINAL, within_s=180)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED and done.tasks[0].restart_count == 1
    text = await log_text(acme, job.name)
    assert [line for line in text.splitlines() if line.startswith("restart=")] == ["restart=0", "restart=1"]

    sleeper = await create(acme, command("echo started; exec sleep 600"), backend=SLURM)
    await wait_for(acme, sleeper.name, job_pb2.Job.State.STATE_RUNNING, within_s=120)
    await acme.scheduler.CancelJob(pb.CancelJobRequest(name=sleeper.name))
    cancelled = await wait_for(acme, sleeper.name, *TERMINAL, within_s=120)
    assert cancelled.state == job_pb2.Job.State.STATE_CANCELLED


async def test_the_demo_job_runs_on_slurm(acme: Clients, tmp_path: Path) -> None:
    job = await create(acme, demo_task(tmp_path / "model"), job_id="demo", backend=SLURM)
    done = await wait_for(acme, job.name, *TERMINAL, within_s=840)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, (
        done.failure.message,
        await log_text(acme, job.name),
    )
    assert trainer_checkpoints(tmp_path, job.name), await log_text(acme, job.name)
    await acme.close()
