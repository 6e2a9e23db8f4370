"""The Kubernetes backend against a stand-in API server (`tests/support/kube_api.py`): no cluster runs here,
so (a) every object the backend generates is checked against the Kubernetes OpenAPI schemas and (b) the
backend's real client calls go over HTTP to an in-memory implementation of the endpoints it uses.

Run: .venv/bin/python -m pytest tests/services/scheduler/test_kubernetes.py
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from services.scheduler.backends.base import (
    Backend,
    BackendUnavailable,
    LaunchRefused,
    LaunchSpec,
    Observed,
    Phase,
    Resources,
)
from services.scheduler.backends.kubernetes import (
    PRIORITY_BANDS,
    KubernetesBackend,
    connect,
    label_value,
    object_name,
    priority_band,
    priority_class,
)
from services.scheduler.backends.task_secrets import format_secrets, parse_secrets
from tests.support.kube_api import (
    FakeKubeApi,
    kubernetes_backend,
    make_backend,
    matches_labels,
    running_kube_api,
    validate,
)

NS = "tandem-jobs"


def spec(tmp_path: Path, **overrides: object) -> LaunchSpec:
    values: dict[str, object] = {
        "key": "orgs-acme-jobs-j1.trainer.0",
        "job": "orgs/acme/jobs/j1",
        "task": "trainer",
        "attempt": 0,
        "command": "echo hello from $TANDEM_NODE_RANK",
        "env": {"TANDEM_JOB": "orgs/acme/jobs/j1", "TANDEM_JOB_TOKEN": "tdm1.claims.sig", "LR": "0.001"},
        "log_dir": tmp_path / "logs",
    }
    values.update(overrides)
    return LaunchSpec(**values)  # type: ignore[arg-type]


def env_of(job: dict[str, object]) -> dict[str, object]:
    container = job["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


@pytest.fixture
def kube_api() -> Iterator[FakeKubeApi]:
    with running_kube_api() as api:
        yield api


@pytest.fixture
def backend(kube_api: FakeKubeApi) -> KubernetesBackend:
    return make_backend(kube_api)


# -- (a) the objects against the OpenAPI schemas ---------------------------------------------------------


def test_every_generated_object_matches_the_kubernetes_schema(tmp_path: Path) -> None:
    backend = KubernetesBackend(
        image="tandem-trainer:1", namespace=NS, service_account="tandem-jobs", image_pull_secrets=["regcred"],
        node_selector={"pool": "gpu"}, run_as_user=10001, configuration=k8s.Configuration(host="http://127.0.0.1:1"),
    )  # fmt: skip
    variants = [
        spec(tmp_path),
        spec(
            tmp_path,
            key="orgs/acme/jobs/a-very-long-job-name-that-goes-on-and-on/tasks/trainer/attempts/12",
            num_nodes=4,
            resources=Resources(gpus=8, gpu_type="NVIDIA-H100-80GB-HBM3", cpus=31.5, memory_gib=240),
            secret_env={"OPENAI_API_KEY": "orgs/acme/secrets/openai", "HF_TOKEN": "orgs/acme/secrets/hf"},
            file_mounts=[("/data", "datasets", True), ("/scratch", "/mnt/scratch", False)],
            workdir=Path("/work"),
            time_limit_s=3600.5,
            priority=900,
        ),
    ]
    for variant in variants:
        validate(backend.job_object(variant))
        validate(backend.service_object(variant, owner_uid="0b9f7c1e-0000-4000-8000-000000000001"))
        validate(backend.network_policy_object(variant, owner_uid="0b9f7c1e-0000-4000-8000-000000000001"))
    for band in PRIORITY_BANDS:
        validate(priority_class(band))


def test_names_and_label_values_are_valid_and_stable() -> None:
    keys = ["orgs-acme-jobs-j1.trainer.0", "orgs/acme/jobs/" + "x" * 200 + "/trainer/3", "UPPER_case.key"]
    for key in keys:
        name = object_name(key)
        assert name == object_name(key) and len(name) <= 55 and name[0].isalpha()
        assert len(label_value(key)) <= 63
    assert label_value("orgs-acme-jobs-j1.trainer.0") == "orgs-acme-jobs-j1.trainer.0"
    assert object_name(keys[1]) != object_name(keys[1] + "4")
    assert [priority_band(p).name for p in (0, 249, 250, 500, 749, 750, 1000)] == [
        "tandem-low", "tandem-low", "tandem-normal", "tandem-high", "tandem-high", "tandem-critical",
        "tandem-critical",
    ]  # fmt: skip
    assert all(priority_class(band)["preemptionPolicy"] == "Never" for band in PRIORITY_BANDS)


def test_the_stand_in_refuses_what_the_schema_refuses() -> None:
    with pytest.raises(Exception, match="notAField"):
        validate(
            {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": {"notAField": 1}}
        )
    assert matches_labels({"a": "1", "b": "2"}, "a=1,b in (2,3),!c")
    assert not matches_labels({"a": "1"}, "a!=1")


# -- (b) the backend against the stand-in API server ----------------------------------------------------


def test_the_backend_satisfies_the_interface(backend: KubernetesBackend) -> None:
    assert isinstance(backend, Backend)
    assert backend.name == "kubernetes"


async def test_launch_creates_an_indexed_job_and_a_headless_service(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    task = spec(
        tmp_path,
        num_nodes=2,
        resources=Resources(gpus=4, cpus=16, memory_gib=64.5),
        secret_env={"OPENAI_API_KEY": "orgs/acme/secrets/openai"},
        priority=600,
    )
    handle = await backend.launch(task)
    json.dumps(handle)  # the engine stores it
    name = object_name(task.key)
    assert handle["job"] == name and handle["service"] == name and handle["num_nodes"] == 2

    job = kube_api.job(NS, name)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert job["spec"]["backoffLimit"] == 0
    labels = job["metadata"]["labels"]
    assert labels == {
        "app.kubernetes.io/managed-by": "tandem",
        "tandem.dev/job": label_value("orgs/acme/jobs/j1"),
        "tandem.dev/task": "trainer",
        "tandem.dev/attempt": "0",
        "tandem.dev/key": "orgs-acme-jobs-j1.trainer.0",
    }
    assert job["spec"]["template"]["metadata"]["labels"] == labels
    assert job["metadata"]["annotations"]["tandem.dev/job"] == "orgs/acme/jobs/j1"
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["subdomain"] == name and pod_spec["restartPolicy"] == "Never"
    assert pod_spec["priorityClassName"] == "tandem-high"
    container = pod_spec["containers"][0]
    assert container["image"] == "tandem-trainer:test"
    assert container["resources"] == {
        "requests": {"cpu": "16000m", "memory": "66048Mi"},
        "limits": {"nvidia.com/gpu": "4"},
    }
    assert container["command"][:3] == ["python", "-m", "services.scheduler.backends.task_secrets"]
    assert container["command"][3:] == ["bash", "-euo", "pipefail", "-c", task.command]

    env = env_of(job)
    rank_ref = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env["TANDEM_NODE_RANK"] == env["SKYPILOT_NODE_RANK"] == rank_ref
    hosts = f"{name}-0.{name}\n{name}-1.{name}"
    assert env["TANDEM_NODE_IPS"] == env["SKYPILOT_NODE_IPS"] == hosts
    assert env["TANDEM_NUM_NODES"] == "2" and env["LR"] == "0.001" and env["TANDEM_RESTART_COUNT"] == "0"
    assert env["TANDEM_JOB_TOKEN"] == "tdm1.claims.sig"
    assert env["TANDEM_SECRETS"] == "OPENAI_API_KEY=orgs/acme/secrets/openai"
    assert "OPENAI_API_KEY" not in env  # the name travels, never a value
    assert not [obj for obj in kube_api.created if obj["kind"] == "Secret"]

    service = kube_api.objects[("services", NS, name)]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"]["tandem.dev/key"] == labels["tandem.dev/key"]
    assert service["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert ("priorityclasses", "", "tandem-high") in kube_api.objects
    pods = kube_api.pods(NS, name)
    assert sorted(pods) == [0, 1]  # what the Job controller makes from it: one pod per index
    assert all(p["spec"]["hostname"] == f"{name}-{r}" for r, p in pods.items())


async def test_task_pods_run_as_non_root_read_only_with_no_mesh_secret(
    kube_api: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh_key, master_key = os.urandom(32).hex(), os.urandom(32).hex()
    monkeypatch.setenv("TANDEM_MESH_KEY", mesh_key)  # the scheduler's own environment holds them
    monkeypatch.setenv("TANDEM_VAULT__MASTER_KEY", master_key)
    task = spec(
        tmp_path, num_nodes=2, workdir=Path("/work/task"), secret_env={"HF_TOKEN": "orgs/acme/secrets/hf"}
    )
    await make_backend(kube_api).launch(task)
    job = kube_api.job(NS, object_name(task.key))
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }
    writable = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert writable == {"/tmp": "tandem-tmp", "/work/task": "tandem-work"}
    assert {v["name"]: v for v in pod["volumes"]}["tandem-work"] == {"name": "tandem-work", "emptyDir": {}}
    assert env_of(job)["HOME"] == "/work/task"
    sent = json.dumps(kube_api.created)
    assert (
        mesh_key not in sent
        and master_key not in sent
        and "MESH_KEY" not in sent
        and "MASTER_KEY" not in sent
    )
    assert not [o for o in kube_api.created if o["kind"] == "Secret"]
    assert not [v for v in pod["volumes"] if set(v) - {"name", "emptyDir"}]
    assert "envFrom" not in container and all("secretKeyRef" not in str(e) for e in container["env"])

    kube_api.created.clear()
    await make_backend(kube_api, run_as_user=None, read_only_root_filesystem=False).launch(
        spec(tmp_path, key="k2", workdir=Path("/work/task"))
    )
    (job,) = [o for o in kube_api.created if o["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False
    assert "volumes" not in pod and "HOME" not in env_of(job)


async def test_an_attempts_network_policy_opens_its_pods_to_its_own_job_only(
    kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    task = spec(tmp_path, num_nodes=2)
    await make_backend(kube_api).launch(task)
    assert not [key for key in kube_api.objects if key[0] == "networkpolicies"], "off by default"

    other = spec(tmp_path, key="orgs-acme-jobs-j1.trainer.1", attempt=1)
    await make_backend(kube_api, network_policy=True).launch(other)
    name = object_name(other.key)
    policy = kube_api.objects[("networkpolicies", NS, name)]  # the stand-in checked it against the schema
    job = kube_api.job(NS, name)
    assert policy["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    rules = policy["spec"]
    assert rules["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "tandem",
        "tandem.dev/key": label_value(other.key),
    }
    assert sorted(rules["policyTypes"]) == ["Egress", "Ingress"]
    same_job = {"app.kubernetes.io/managed-by": "tandem", "tandem.dev/job": label_value("orgs/acme/jobs/j1")}
    assert rules["ingress"] == [{"from": [{"podSelector": {"matchLabels": same_job}}]}]
    assert rules["egress"] == [{"to": [{"podSelector": {"matchLabels": same_job}}]}]

    def selected(pod_labels: dict[str, str], labels: dict[str, str]) -> bool:
        return matches_labels(pod_labels, ",".join(f"{k}={v}" for k, v in labels.items()))

    first = kube_api.job(NS, object_name(task.key))["spec"]["template"]["metadata"]["labels"]
    mine = job["spec"]["template"]["metadata"]["labels"]
    elsewhere = {**mine, "tandem.dev/job": label_value("orgs/globex/jobs/j1")}
    assert selected(mine, rules["podSelector"]["matchLabels"]) and not selected(
        first, rules["podSelector"]["matchLabels"]
    )
    assert selected(first, same_job) and not selected(elsewhere, same_job)
    await make_backend(kube_api, network_policy=True).launch(other)  # a relaunch meets it
    kube_api.remove_job(NS, name)
    assert ("networkpolicies", NS, name) not in kube_api.objects, "deleted with its Job"


async def test_a_single_node_task_gets_no_service_and_its_pod_ip(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    handle = await backend.launch(spec(tmp_path))
    assert handle["service"] == ""
    assert not [key for key in kube_api.objects if key[0] == "services"]
    job = kube_api.job(NS, handle["job"])
    assert env_of(job)["TANDEM_NODE_IPS"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "subdomain" not in job["spec"]["template"]["spec"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][0] == "bash"
    assert "limits" not in job["spec"]["template"]["spec"]["containers"][0]["resources"]


async def test_find_by_key_and_relaunch_returns_the_existing_handle(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    task = spec(tmp_path, num_nodes=2)
    assert await backend.find(task.key) is None
    handle = await backend.launch(task)
    found = await backend.find(task.key)
    assert found is not None
    assert found == handle  # the log folder too, from the Job's annotation
    again = await backend.launch(task)
    assert again == handle
    assert len([obj for obj in kube_api.created if obj["kind"] == "Job"]) == 1
    assert await backend.find("orgs-acme-jobs-j1.trainer.1") is None


async def test_a_jobs_own_namespace_node_selector_and_priority_class_win(
    kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    backend = make_backend(kube_api, namespaces=["team-a"], node_selector={"pool": "gpu", "zone": "a"})
    options = {
        "namespace": "team-a",
        "priority_class_name": "research-high",
        "node_selector.pool": "h100",
        "node_selector.example.com/rack": "r7",
    }
    task = spec(tmp_path, num_nodes=2, options=options)
    validate(backend.job_object(task))
    handle = await backend.launch(task)
    assert handle["namespace"] == "team-a"
    job = kube_api.job("team-a", handle["job"])
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"pool": "h100", "zone": "a", "example.com/rack": "r7"}
    assert pod_spec["priorityClassName"] == "research-high"
    assert ("services", "team-a", handle["service"]) in kube_api.objects
    assert not [k for k in kube_api.objects if k[1] == NS]  # nothing in the default namespace
    assert not [k for k in kube_api.objects if k[0] == "priorityclasses"]  # the job names its own
    assert await backend.find(task.key) == handle  # a restarted scheduler finds it in its namespace
    kube_api.start_job("team-a", handle["job"])
    assert (await backend.poll(handle)).phase is Phase.RUNNING
    await backend.cancel(handle, grace_s=0)
    assert not kube_api.pods("team-a", handle["job"])
    with pytest.raises(LaunchRefused, match="'kube-system' is not one this scheduler runs jobs in"):
        await backend.launch(
            spec(tmp_path, key="orgs-acme-jobs-j2.trainer.0", options={"namespace": "kube-system"})
        )
    assert not [k for k in kube_api.objects if k[1] == "kube-system"]


async def test_a_tasks_labels_are_on_its_pods_under_tandems_own(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    task = spec(tmp_path, labels={"team": "post-training", "tandem.dev/job": "forged"})
    validate(backend.job_object(task))
    handle = await backend.launch(task)
    job = kube_api.job(NS, handle["job"])
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["team"] == "post-training"
    assert pod_labels["tandem.dev/job"] == job["metadata"]["labels"]["tandem.dev/job"] != "forged"
    assert "team" not in job["metadata"]["labels"]  # SkyPilot's labels are the pods'
    assert await backend.find(task.key) == handle


async def test_a_jobs_context_must_be_the_one_the_backend_reaches_its_cluster_through(
    kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    # SkyPilot's `infra: k8s/CONTEXT` arrives as the job's kubernetes.context.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": kube_api.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "kind-rl", "context": {"cluster": "c", "user": "u"}},
                    {"name": "other", "context": {"cluster": "c", "user": "u"}},
                ],
                "current-context": "kind-rl",
            }
        )
    )
    assert connect(str(kubeconfig))[1] == "kind-rl"  # the current context
    configuration, context = connect(str(kubeconfig), "other")
    assert (configuration.host, context) == (kube_api.url, "other")
    configuration, context = connect(str(kubeconfig))
    backend = KubernetesBackend(
        image="tandem-trainer:test", namespace=NS, configuration=configuration, context=context
    )
    handle = await backend.launch(spec(tmp_path, options={"context": "kind-rl"}))
    assert kube_api.job(NS, handle["job"])
    with pytest.raises(
        LaunchRefused,
        match=r"context 'other' \(kubernetes.context, as in infra: k8s/other\), .* through the context 'kind-rl'",
    ):
        await backend.launch(spec(tmp_path, key="orgs-acme-jobs-j2.trainer.0", options={"context": "other"}))
    nameless = make_backend(kube_api)  # a configuration without a context's name
    with pytest.raises(LaunchRefused, match="through no named context"):
        await nameless.launch(
            spec(tmp_path, key="orgs-acme-jobs-j3.trainer.0", options={"context": "kind-rl"})
        )
    assert len([k for k in kube_api.objects if k[0] == "jobs"]) == 1
    await backend.close()
    await nameless.close()


async def test_a_scheduler_that_died_after_creating_the_job_gets_its_service_on_relaunch(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    task = spec(tmp_path, num_nodes=2)
    handle = await backend.launch(task)
    del kube_api.objects[("services", NS, handle["service"])]
    assert await backend.launch(task) == handle
    assert ("services", NS, handle["service"]) in kube_api.objects


async def test_poll_follows_the_job_from_queued_to_success(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    handle = await backend.launch(spec(tmp_path, num_nodes=2))
    assert (await backend.poll(handle)).phase is Phase.QUEUED
    kube_api.start_job(NS, handle["job"], node="gpu-node-3")
    running = await backend.poll(handle)
    assert running.phase is Phase.RUNNING
    assert [(n.rank, n.node, n.address) for n in running.nodes] == [
        (0, "gpu-node-3", "10.1.0.10"),
        (1, "gpu-node-3", "10.1.0.11"),
    ]
    kube_api.finish_job(NS, handle["job"])
    assert await backend.poll(handle) == Observed(Phase.EXITED, exit_code=0, nodes=running.nodes)


async def test_a_failed_rank_reports_its_exit_code(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    handle = await backend.launch(spec(tmp_path, num_nodes=2))
    kube_api.start_job(NS, handle["job"])
    kube_api.finish_job(NS, handle["job"], {1: 3})
    observed = await backend.poll(handle)
    assert observed.phase is Phase.EXITED and observed.exit_code == 3 and not observed.preempted
    assert "rank 1 exited with 3" in observed.message


@pytest.mark.parametrize("reason", ["Evicted", "Preempting"])
async def test_an_evicted_or_preempted_pod_is_a_preemption(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
    reason: str,
) -> None:
    handle = await backend.launch(spec(tmp_path, num_nodes=2))
    kube_api.start_job(NS, handle["job"])
    kube_api.evict_pod(NS, handle["job"], rank=1, reason=reason)
    observed = await backend.poll(handle)
    assert observed.phase is Phase.EXITED and observed.preempted
    assert observed.message.startswith(f"rank 1: {reason}")


async def test_a_pod_whose_node_is_gone_is_lost(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    handle = await backend.launch(spec(tmp_path, num_nodes=2))
    kube_api.start_job(NS, handle["job"])
    kube_api.evict_pod(NS, handle["job"], rank=0, reason="NodeLost", by="DeletionByPodGC")
    observed = await backend.poll(handle)
    assert observed.phase is Phase.LOST and observed.message.startswith("rank 0: NodeLost")


async def test_a_job_over_its_time_limit_fails_without_preemption(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    handle = await backend.launch(spec(tmp_path, time_limit_s=60))
    assert kube_api.job(NS, handle["job"])["spec"]["activeDeadlineSeconds"] == 60
    kube_api.start_job(NS, handle["job"])
    kube_api.fail_job(NS, handle["job"], "DeadlineExceeded", "Job was active longer than specified deadline")
    observed = await backend.poll(handle)
    assert (observed.phase, observed.exit_code, observed.preempted) == (Phase.EXITED, 137, False)
    assert "DeadlineExceeded" in observed.message


async def test_without_rights_on_priority_classes_it_assumes_the_deployed_ones(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    kube_api.forbid("priorityclasses")
    handle = await backend.launch(spec(tmp_path))
    assert kube_api.job(NS, handle["job"])["spec"]["template"]["spec"]["priorityClassName"] == "tandem-low"


async def test_a_deleted_job_is_lost(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    handle = await backend.launch(spec(tmp_path))
    kube_api.start_job(NS, handle["job"])
    kube_api.remove_job(NS, handle["job"])
    observed = await backend.poll(handle)
    assert observed.phase is Phase.LOST and "no longer exists" in observed.message


async def test_cancel_fails_the_job_and_stops_its_pods_with_the_grace(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    handle = await backend.launch(spec(tmp_path, num_nodes=2))
    kube_api.start_job(NS, handle["job"])
    await backend.cancel(handle, grace_s=7)
    mark = [{"op": "add", "path": "/metadata/annotations/tandem.dev~1cancelled", "value": "7"}]
    deadline = [{"op": "add", "path": "/spec/activeDeadlineSeconds", "value": 1}]
    assert kube_api.patches == [("jobs", handle["job"], mark), ("jobs", handle["job"], deadline)]
    assert kube_api.job(NS, handle["job"])["metadata"]["annotations"]["tandem.dev/cancelled"] == "7"
    stopped = [options for plural, _, options in kube_api.deletions if plural == "pods"]
    assert len(stopped) == 2 and all(options["gracePeriodSeconds"] == 7 for options in stopped)
    assert not kube_api.pods(NS, handle["job"])
    observed = await backend.poll(handle)  # the Job stays, Failed, so the end is visible
    assert (observed.phase, observed.exit_code, observed.message) == (Phase.EXITED, 143, "cancelled")
    await backend.cancel(handle, grace_s=7)  # idempotent
    assert len(kube_api.patches) == 2 and (await backend.poll(handle)).exit_code == 143


async def test_cancel_of_a_suspended_job_deletes_it(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    handle = await backend.launch(spec(tmp_path, num_nodes=2))
    kube_api.job(NS, handle["job"])["spec"]["suspend"] = True  # a quota manager holds it
    assert (await backend.poll(handle)).phase is Phase.QUEUED
    await backend.cancel(handle, grace_s=3)
    assert (
        "jobs",
        handle["job"],
        {"propagationPolicy": "Foreground", "gracePeriodSeconds": 3},
    ) in kube_api.deletions
    assert not [key for key in kube_api.objects if key[0] in ("jobs", "pods", "services")]
    await backend.cancel(handle)  # idempotent
    assert (await backend.poll(handle)).phase is Phase.LOST


async def test_logs_are_a_file_refreshed_from_the_pod_logs(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    handle = await backend.launch(spec(tmp_path, num_nodes=2))
    assert backend.logs(handle, 1) is None  # nothing yet; a refresh is under way
    kube_api.start_job(NS, handle["job"])
    kube_api.set_log(NS, handle["job"], 1, "step 1\n")
    while (path := backend.logs(handle, 1)) is None or path.read_text() != "step 1\n":  # noqa: ASYNC110
        await asyncio.sleep(0.05)  # logs() refreshes in the background; the file is what the engine reads
    assert path == tmp_path / "logs" / "rank-1.log"
    kube_api.set_log(NS, handle["job"], 1, "step 1\nstep 2\n")
    kube_api.finish_job(NS, handle["job"])
    await backend.poll(handle)  # the end of the attempt captures the last lines
    assert path.read_text() == "step 1\nstep 2\n"  # appended: earlier byte offsets still hold
    assert (tmp_path / "logs" / "rank-0.log").read_text() == ""


async def test_an_unreachable_api_server_is_backend_unavailable(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    handle = await backend.launch(spec(tmp_path))
    kube_api.stop()
    with pytest.raises(BackendUnavailable, match="unreachable"):
        await backend.poll(handle)
    with pytest.raises(BackendUnavailable):
        await backend.launch(spec(tmp_path, key="orgs-acme-jobs-j2.trainer.0"))
    with pytest.raises(BackendUnavailable):
        await backend.find(handle["key"])
    with pytest.raises(BackendUnavailable):
        await backend.cancel(handle)
    with pytest.raises(BackendUnavailable):
        await backend.inventory()


async def test_a_refused_object_is_launch_refused_with_the_api_message(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    await backend.launch(spec(tmp_path, key="warm-up.0"))  # the PriorityClass exists now
    kube_api.refuse_next_create('admission webhook "policy.acme" denied the request: no hostPath')
    with pytest.raises(LaunchRefused, match=r"\(422\).*no hostPath"):
        await backend.launch(spec(tmp_path))
    bad = make_backend(kube_api, termination_grace_s="30s")  # not an integer
    # Newer clients refuse it before sending (their models check bodies); older ones send it and the
    # API server's schema check answers 422. Either way the attempt is refused for good.
    with pytest.raises(LaunchRefused, match=r"client refused|422"):
        await bad.launch(spec(tmp_path, key="orgs-acme-jobs-j3.trainer.0"))


async def test_inventory_reports_nodes_and_what_is_free(
    backend: KubernetesBackend,
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    kube_api.add_node("gpu-a", gpus=8, cpus=64, memory_gib=512, labels={"nvidia.com/gpu.product": "H100"})
    kube_api.add_node("cpu-b", cpus=16, memory_gib=64, ready=False)
    handle = await backend.launch(spec(tmp_path, resources=Resources(gpus=2, cpus=8, memory_gib=32)))
    kube_api.start_job(NS, handle["job"], node="gpu-a")
    nodes = {node.name: node for node in await backend.inventory()}
    gpu = nodes["gpu-a"]
    assert (gpu.gpus, gpu.gpus_free, gpu.gpu_type, gpu.cpus, gpu.cpus_free) == (8, 6, "H100", 64, 56)
    assert gpu.memory_free_gib == 480 and gpu.up
    assert not nodes["cpu-b"].up and nodes["cpu-b"].gpus == 0


async def test_commands_run_to_their_exit_code_with_the_stand_in_kubelet(tmp_path: Path) -> None:
    task = spec(
        tmp_path,
        num_nodes=2,
        command='echo "rank $TANDEM_NODE_RANK of $TANDEM_NUM_NODES"; exit $((TANDEM_NODE_RANK * 3))',
    )
    async with kubernetes_backend() as (backend, _api):
        handle = await backend.launch(task)
        observed = await backend.poll(handle)
        while observed.phase is not Phase.EXITED:
            await asyncio.sleep(0.05)
            observed = await backend.poll(handle)
    assert observed.exit_code == 3
    assert (tmp_path / "logs" / "rank-1.log").read_text() == "rank 1 of 2\n"


def test_secret_names_round_trip() -> None:
    mapping = {"B_KEY": "orgs/acme/secrets/b", "A_KEY": "orgs/acme/secrets/a"}
    assert format_secrets(mapping) == "A_KEY=orgs/acme/secrets/a,B_KEY=orgs/acme/secrets/b"
    assert parse_secrets(format_secrets(mapping)) == mapping
    assert parse_secrets("") == {}
    with pytest.raises(ValueError, match="ENV=secret-name"):
        parse_secrets("NOVALUE")
