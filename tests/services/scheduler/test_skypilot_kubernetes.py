"""A SkyPilot task file with a workdir, buckets, ports, disk_size, use_spot and image_id, loaded by `load_yaml`
and sent through CreateJob to the Kubernetes backend, which creates its objects on the in-test Kubernetes API
(tests/support/kube_api.py, with one node and without playing the kubelet: the pod would copy into `/data`
of this machine). Every object is checked against the Kubernetes OpenAPI schemas."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tandem.scheduler.v1 import job_spec_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from services.scheduler.backends.kubernetes import PRIORITY_BANDS
from services.scheduler.spec import load_yaml
from tests.services.scheduler.test_kubernetes_jobs import NS, acme
from tests.services.scheduler.test_scheduler import ORG, Clients
from tests.support.kube_api import FakeKubeApi, running_kube_api, validate

__all__ = ["acme"]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def with_network_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SCHEDULER_KUBERNETES__NETWORK_POLICY", "true")


@pytest.fixture
def cluster() -> Iterator[FakeKubeApi]:
    with running_kube_api(run_pods=False) as api:
        api.add_node("node-a")
        yield api


def sent(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as the backend sent it: the stand-in adds a status, which some kinds have none of."""
    return {k: v for k, v in obj.items() if k != "status"}


async def created(cluster: FakeKubeApi, plural: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 60
    while True:
        found = [obj for (kind, ns, _), obj in cluster.objects.items() if kind == plural and ns in (NS, "")]
        if found:
            return found
        assert time.monotonic() < deadline, f"no {plural} was created"
        await asyncio.sleep(0.05)


async def test_a_skypilot_task_becomes_its_kubernetes_objects(
    acme: Clients, cluster: FakeKubeApi, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    path = tmp_path / "task.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            name: serve_from_buckets
            workdir: {code}
            resources:
              infra: k8s
              disk_size: 100
              ports: [8080, "9000-9001"]
              use_spot: true
              image_id: docker:nvcr.io/nvidia/pytorch:24.01-py3
            envs:
              AWS_ENDPOINT_URL: http://minio.storage:9000
            file_mounts:
              /data: s3://datasets/gsm8k
              /ckpt: {{name: run-ckpts, store: s3, mode: MOUNT_CACHED}}
            run: python serve.py --port 8080
            """
        )
    )
    spec = load_yaml(path)
    assert spec.backend == job_spec_pb2.BACKEND_KUBERNETES
    await acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, spec=spec))
    [job] = await created(cluster, "jobs")
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    validate(job)

    assert container["image"] == "nvcr.io/nvidia/pytorch:24.01-py3"  # the task's, not the backend's
    assert container["resources"]["requests"]["ephemeral-storage"] == "102400Mi"
    assert container["resources"]["limits"]["ephemeral-storage"] == "102400Mi"
    assert [p["containerPort"] for p in container["ports"]] == [8080, 9000, 9001]
    assert pod["priorityClassName"] == "tandem-preemptible"

    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TANDEM_PORTS"] == "8080,9000-9001"
    plan = json.loads(env["TANDEM_BUCKETS"])
    assert [(m["url"], m["folder"], m["mode"], m["create"]) for m in plan["mounts"]] == [
        ("s3://datasets/gsm8k", "/data", "copy", False),
        ("s3://run-ckpts", "/ckpt", "mount_cached", True),
    ]
    assert plan["endpoint_url"] == "http://minio.storage:9000" and plan["credentials"] == []
    script = container["command"][-1]
    assert "-m services.scheduler.backends.task_buckets" in script
    assert f"cp -R -p -- {code}/. ." in script  # the workdir, filled before setup

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounted["/data"]["name"]] and not mounted["/data"]["readOnly"]
    assert "emptyDir" in volumes[mounted["/ckpt"]["name"]]
    assert volumes[mounted[str(code)]["name"]]["hostPath"]["path"] == str(code)
    assert mounted[str(code)]["readOnly"]

    [service] = await created(cluster, "services")
    validate(service)
    assert "clusterIP" not in service["spec"]  # one node: a ClusterIP Service in front of the task's ports
    assert [p["port"] for p in service["spec"]["ports"]] == [8080, 9000, 9001]
    [policy] = await created(cluster, "networkpolicies")
    validate(sent(policy))
    assert {
        "ports": [{"protocol": "TCP", "port": 8080}, {"protocol": "TCP", "port": 9000, "endPort": 9001}]
    } in (policy["spec"]["ingress"])
    classes = {obj["metadata"]["name"]: obj for obj in await created(cluster, "priorityclasses")}
    validate(sent(classes["tandem-preemptible"]))
    assert classes["tandem-preemptible"]["value"] < min(band.value for band in PRIORITY_BANDS)
