"""SkyPilot's mounts under `~/` on the Kubernetes backend: the objects CreateJob makes on the in-test Kubernetes
API (tests/support/kube_api.py, without the kubelet). A `~/PATH` mount is at `/mnt/tandem-home/PATH` in the pod,
HOME names that folder (an emptyDir of the pod's, the mounts inside it), and `TANDEM_MOUNT_<NAME>` the mount.
Beside test_sky_gaps.py because the Kubernetes fixtures share a name with the host backends' ones."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from services.scheduler.spec import load_yaml
from tests.services.scheduler.test_kubernetes_jobs import acme
from tests.services.scheduler.test_scheduler import ORG, Clients
from tests.services.scheduler.test_skypilot_kubernetes import cluster, created
from tests.support.kube_api import FakeKubeApi, validate

__all__ = ["acme", "cluster"]
pytestmark = pytest.mark.timeout(120)


async def test_mounts_under_home_are_under_the_pods_home(
    acme: Clients, cluster: FakeKubeApi, tmp_path: Path
) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            resources: {infra: k8s}
            volumes: {~/ckpt: rl-checkpoints}
            file_mounts:
              ~/data: s3://datasets/gsm8k
              ~/.cache/huggingface: /shared/hf
              /abs: /shared/abs
            run: ls ~/data ~/ckpt
            """
        )
    )
    await acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, spec=load_yaml(path)))
    [job] = await created(cluster, "jobs")
    validate(job)
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HOME"] == "/mnt/tandem-home"
    assert env["TANDEM_MOUNT_DATA"] == "/mnt/tandem-home/data"
    assert env["TANDEM_MOUNT_HUGGINGFACE"] == "/mnt/tandem-home/.cache/huggingface"
    assert env["TANDEM_MOUNT_ABS"] == "/abs"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert "emptyDir" in mounted["/mnt/tandem-home"]  # HOME, writable, holding the mounts
    assert "emptyDir" in mounted["/mnt/tandem-home/data"]  # the bucket's folder
    assert mounted["/mnt/tandem-home/.cache/huggingface"]["hostPath"]["path"] == "/shared/hf"
    assert mounted["/mnt/tandem-home/ckpt"]["persistentVolumeClaim"]["claimName"] == "rl-checkpoints"
    assert mounted["/abs"]["hostPath"]["path"] == "/shared/abs"
    assert not any(path.startswith("~") for path in mounted)
