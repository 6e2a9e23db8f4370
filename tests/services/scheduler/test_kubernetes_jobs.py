"""The scheduler driving the Kubernetes backend end to end: CreateJob through the engine to the backend, which
talks to the in-test Kubernetes API (tests/support/kube_api.py, playing the kubelet too: each pod's command
runs as a local process). The scheduler finds that API as it would a cluster's, through a kubeconfig file."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from services.scheduler.spec import parse_yaml
from tests.services.scheduler.test_scheduler import (
    ORG,
    TERMINAL,
    Clients,
    command,
    create,
    expect,
    log_text,
    wait_for,
)
from tests.services.scheduler.test_slurm_jobs import clients_for
from tests.support.kube_api import FakeKubeApi, running_kube_api
from tests.support.mesh import mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(180)
KUBERNETES = job_spec_pb2.BACKEND_KUBERNETES
NS = "tandem-jobs"


@pytest.fixture
def cluster() -> Iterator[FakeKubeApi]:
    with running_kube_api(run_pods=True) as api:
        yield api


@pytest.fixture
async def acme(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cluster: FakeKubeApi
) -> AsyncIterator[Clients]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {"server": cluster.url}}],
                "users": [{"name": "scheduler", "user": {"token": "test-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "scheduler"}}],
                "current-context": "test",
            }
        )
    )
    monkeypatch.setenv("TANDEM_SCHEDULER_KUBERNETES__KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("TANDEM_SCHEDULER_KUBERNETES__ENABLED", "true")
    monkeypatch.setenv("TANDEM_SCHEDULER_KUBERNETES__IMAGE", "tandem-trainer:test")
    monkeypatch.setenv("TANDEM_SCHEDULER_KUBERNETES__NAMESPACE", NS)
    monkeypatch.setenv("TANDEM_SCHEDULER_KUBERNETES__NAMESPACES", '["team-a"]')
    async with running_mesh(
        mesh_settings(tmp_path / "state"), services=["events", "vault", "taskapp_proxy", "scheduler"]
    ) as mesh:
        clients = await clients_for(mesh)
        try:
            yield clients
        finally:
            await clients.close()


def jobs_in(cluster: FakeKubeApi, namespace: str) -> list[dict[str, object]]:
    return [obj for (plural, ns, _), obj in cluster.objects.items() if plural == "jobs" and ns == namespace]


async def test_a_job_runs_on_kubernetes_with_its_environment_and_log(
    acme: Clients, cluster: FakeKubeApi
) -> None:
    run = 'echo "on kubernetes: $TANDEM_JOB task $TANDEM_TASK rank $TANDEM_NODE_RANK of $SKYPILOT_NUM_NODES"'
    job = await create(acme, command(run), backend=KUBERNETES)
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure.message
    assert done.backend == KUBERNETES
    handle = done.tasks[0].backend_handle.kubernetes
    assert (handle.api_version, handle.kind, handle.namespace) == ("batch/v1", "Job", NS) and handle.uid
    assert f"on kubernetes: {job.name} task main rank 0 of 1" in await log_text(acme, job.name)
    [created] = jobs_in(cluster, NS)
    assert created["metadata"]["name"] == handle.name  # type: ignore[index]
    assert created["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tandem"  # type: ignore[index]


async def test_the_jobs_kubernetes_options_reach_the_cluster(acme: Clients, cluster: FakeKubeApi) -> None:
    options = job_spec_pb2.KubernetesOptions(namespace="team-a", priority_class_name="research")
    options.node_selector["pool"] = "cpu"
    job = await create(acme, command("echo placed"), backend=KUBERNETES, kubernetes=options)
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure.message
    assert done.tasks[0].backend_handle.kubernetes.namespace == "team-a"
    [created] = jobs_in(cluster, "team-a")
    pod_spec = created["spec"]["template"]["spec"]  # type: ignore[index]
    assert pod_spec["nodeSelector"] == {"pool": "cpu"} and pod_spec["priorityClassName"] == "research"
    assert not jobs_in(cluster, NS)

    elsewhere = job_spec_pb2.KubernetesOptions(namespace="kube-system")
    refused = await create(acme, command("echo never"), backend=KUBERNETES, kubernetes=elsewhere)
    failed = await wait_for(acme, refused.name, *TERMINAL, within_s=120)
    assert failed.state == job_pb2.Job.State.STATE_FAILED
    assert "kube-system" in failed.failure.message and "team-a" in failed.failure.message, failed.failure
    assert not jobs_in(cluster, "kube-system")


async def test_a_skypilot_files_infra_context_is_the_kubeconfigs_or_refused(
    acme: Clients, cluster: FakeKubeApi
) -> None:
    ours = parse_yaml("name: ctx\nresources: {infra: k8s/test}\nrun: echo on the test context\n")
    reply = await acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id="ctx", spec=ours))
    done = await wait_for(acme, reply.job.name, *TERMINAL, within_s=120)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure.message
    assert "on the test context" in await log_text(acme, done.name)
    other = parse_yaml("name: ctx\nresources: {infra: k8s/prod-cluster}\nrun: echo never\n")
    error = await expect(
        acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id="other", spec=other)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "FAILED_PRECONDITION",
    )
    assert [v.field for v in error.violations] == ["spec.kubernetes.context"]
    assert "context 'prod-cluster'" in error.message and "through the context 'test'" in error.message, error
    assert len(jobs_in(cluster, NS)) == 1


async def test_cancel_stops_a_running_pod(acme: Clients, cluster: FakeKubeApi) -> None:
    job = await create(acme, command("echo started; exec sleep 600"), backend=KUBERNETES)
    await wait_for(acme, job.name, job_pb2.Job.State.STATE_RUNNING, within_s=120)
    await acme.scheduler.CancelJob(pb.CancelJobRequest(name=job.name))
    cancelled = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    assert cancelled.state == job_pb2.Job.State.STATE_CANCELLED
    [created] = jobs_in(cluster, NS)
    assert not cluster.pods(NS, created["metadata"]["name"])  # type: ignore[index]


async def test_a_pod_gets_skypilots_variables(acme: Clients, cluster: FakeKubeApi) -> None:
    cluster.add_node("gpu-node", gpus=8)
    run = (
        'echo "torchrun --nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE setup_rank=$SKYPILOT_SETUP_NODE_RANK'
        ' id=$SKYPILOT_TASK_ID group=$SKYPILOT_JOBGROUP_NAME cloud=$SKYPILOT_CLUSTER_INFO"\n'
        'echo "user=$SKYPILOT_USER user_id=$SKYPILOT_USER_ID managed=$SKYPILOT_MANAGED_JOB_ID'
        ' root=${SKYPILOT_ROOT_JOB_ID-none}"'
    )
    job = await create(acme, command(run, gpus="2"), job_id="sky-env", backend=KUBERNETES)
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure.message
    text = await log_text(acme, job.name)
    assert "torchrun --nproc_per_node=2 setup_rank=0 id=acme_sky-env-0 group=sky-env" in text, text
    assert '"cloud": "kubernetes"' in text, text
    assert "user=alice user_id=6384e2b2 managed=sky-env root=none" in text, text  # one task: no job tree
