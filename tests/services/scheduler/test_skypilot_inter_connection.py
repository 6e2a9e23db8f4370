"""SkyPilot's job-group header key `inter_connection`: whether a group's tasks reach each other by the host names
`{task}-{rank}.{group}`. Unset and `true` (required) give the names on every backend, `false` gives none: the
spec as `load_yaml` reads it (SkyPilot's loader as the oracle where .venv-sky has it), the local and Slurm
backends' tasks through the scheduler, and the objects the Kubernetes backend creates on the stand-in API
server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from mesh.errors import InvalidArgument
from services.scheduler import spec as S
from services.scheduler.backends import group_hosts
from services.scheduler.engine import sibling_hosts
from tests.services.scheduler.test_kubernetes_jobs import NS, acme
from tests.services.scheduler.test_scheduler import ORG, TERMINAL, Clients, log_text, wait_for
from tests.services.scheduler.test_skypilot import SKY_PYTHON, needs_skypilot
from tests.services.scheduler.test_skypilot_env import check_server_env, mesh_clients, run_pair, slurm
from tests.support.kube_api import FakeKubeApi, running_kube_api

__all__ = ["acme", "slurm"]
pytestmark = pytest.mark.timeout(180)

GROUP = """\
name: pair
execution: parallel
{header}---
name: server
run: echo server
---
name: client
run: |
  if getent hosts "server-0.$SKYPILOT_JOBGROUP_NAME"; then echo "resolved"; else echo "no name"; fi
  echo "hosts dir: ${{TANDEM_GROUP_HOSTS_DIR:-none}}"
"""


def group(header: str = "") -> str:
    return GROUP.format(header=header)


# -- the spec ------------------------------------------------------------------------------------------------


def test_the_header_key_is_read_as_written_and_unset_means_the_names() -> None:
    unset = S.parse_yaml(group())
    assert not unset.HasField("inter_connection") and sibling_hosts(unset)
    off = S.parse_yaml(group("inter_connection: false\n"))
    assert off.HasField("inter_connection") and not off.inter_connection and not sibling_hosts(off)
    on = S.parse_yaml(group("inter_connection: true\n"))
    assert on.inter_connection and sibling_hosts(on)
    listed = S.parse_yaml(
        "name: g\ninter_connection: false\ntasks:\n  - {name: a, run: x}\n  - {name: b, run: y}\n"
    )
    assert not sibling_hosts(listed)
    serial = S.parse_yaml(group("inter_connection: true\n").replace("parallel", "serial"))
    assert not sibling_hosts(serial)  # a pipeline's tasks never run side by side


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (group("inter_connection: 'yes'\n"), "must be true or false, not str"),
        (group("inter_connection: 1\n"), "must be true or false"),
        ("run: x\ninter_connection: false\n", "one-task file's task has no siblings"),
    ],
)
def test_what_skypilot_refuses_is_refused(text: str, words: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        S.parse_yaml(text)
    found = {v.field: v.description for v in caught.value.violations}
    assert words in found["inter_connection"], found


ORACLE = """
import json, sys
from sky.utils import dag_utils
out = {}
for path in sys.argv[1:]:
    try:
        out[path] = dag_utils.load_dag_from_yaml(path).inter_connection
    except Exception as error:
        out[path] = "refused: " + str(error)
print(json.dumps(out))
"""


@needs_skypilot
def test_skypilot_reads_the_same_files_alike(tmp_path: Path) -> None:
    files = {
        "unset.yaml": group(),
        "off.yaml": group("inter_connection: false\n"),
        "on.yaml": group("inter_connection: true\n"),
        "text.yaml": group("inter_connection: 'yes'\n"),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = subprocess.run(
        [str(SKY_PYTHON), "-c", ORACLE, *(str(tmp_path / name) for name in files)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sky = {Path(k).name: v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    assert sky["unset.yaml"] is None and sky["off.yaml"] is False and sky["on.yaml"] is True
    assert "must be a boolean" in sky["text.yaml"]
    for name in ("unset.yaml", "off.yaml", "on.yaml"):
        spec = S.load_yaml(tmp_path / name)
        ours = spec.inter_connection if spec.HasField("inter_connection") else None
        assert ours == sky[name], name
    with pytest.raises(InvalidArgument):
        S.load_yaml(tmp_path / "text.yaml")


# -- the local backend ---------------------------------------------------------------------------------------


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[Clients]:
    async with mesh_clients(tmp_path) as clients:
        yield clients


async def run_without_names(clients: Clients, job_id: str, **spec: Any) -> None:
    """The group with `inter_connection: false`: the client finds no sibling name and no hosts view."""
    off = S.parse_yaml(group("inter_connection: false\n"))
    for key, value in spec.items():
        setattr(off, key, value)
    reply = await clients.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id=job_id, spec=off))
    done = await wait_for(clients, reply.job.name, *TERMINAL, within_s=120)
    client_log = await log_text(clients, reply.job.name, "client")
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, (done.failure.message, client_log)
    assert "no name" in client_log and "hosts dir: none" in client_log, client_log


async def test_on_local_false_gives_no_names_and_true_gives_them(local: Clients, tmp_path: Path) -> None:
    await run_without_names(local, "pair-off")

    required = await run_pair(local, "pair-on", tmp_path / "scripts", inter_connection=True)
    await check_server_env(local, required, gpus=0)
    assert "resolved server-0.pair-on 127.0.0.1" in await log_text(local, required.name, "client")


@pytest.mark.slow
async def test_on_slurm_false_gives_no_names(slurm: Clients) -> None:
    await run_without_names(slurm, "pair-slurm-off", backend=job_spec_pb2.BACKEND_SLURM)


def test_required_names_that_do_not_come_fail_the_node_as_a_precheck(tmp_path: Path) -> None:
    """`inter_connection: true`: a sibling that never publishes its name, after the wait, fails the task with
    the PRECHECK exit instead of running it without the name."""
    env = {
        **os.environ,
        group_hosts.DIR_ENV: str(tmp_path / "hosts"),
        group_hosts.TASKS_ENV: "eval",
        group_hosts.WAIT_ENV: "0",
        group_hosts.REQUIRED_ENV: "1",
        "TANDEM_TASK": "trainer",
        "SKYPILOT_JOBGROUP_NAME": "grp",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
    }
    wrapper = [sys.executable, "-m", "services.scheduler.backends.group_hosts", "bash", "-c", "echo ran"]
    done = subprocess.run(wrapper, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == group_hosts.REQUIRED_EXIT, done.stderr
    assert "no host name yet for eval" in done.stderr and "inter_connection: true" in done.stderr
    assert "ran" not in done.stdout


# -- the Kubernetes backend ------------------------------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[FakeKubeApi]:
    with running_kube_api(run_pods=False) as api:
        api.add_node("node-a")
        yield api


def pods_env(cluster: FakeKubeApi) -> dict[str, dict[str, Any]]:
    """Each task's pod environment, by task."""
    out = {}
    for (kind, ns, _), job in list(cluster.objects.items()):
        if kind == "jobs" and ns == NS:
            [container] = job["spec"]["template"]["spec"]["containers"]
            task = job["metadata"]["labels"]["tandem.dev/task"]
            out[task] = {item["name"]: item.get("value") for item in container["env"]}
    return out


async def both_launched(cluster: FakeKubeApi) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + 60
    while len(found := pods_env(cluster)) < 2:
        assert time.monotonic() < deadline, "the group's tasks were not both launched"
        await asyncio.sleep(0.05)
    return found


def owners(cluster: FakeKubeApi, service: str) -> list[str]:
    found = cluster.objects.get(("services", NS, service), {})
    return [ref["name"] for ref in found.get("metadata", {}).get("ownerReferences", [])]


def hostnames(cluster: FakeKubeApi) -> dict[str, list[str]]:
    return {
        name: [e["hostname"] for e in obj["endpoints"]]
        for (kind, _ns, name), obj in list(cluster.objects.items())
        if kind == "endpointslices"
    }


async def submit(clients: Clients, text: str, job_id: str) -> None:
    spec = S.parse_yaml(textwrap.dedent(text))
    spec.backend = job_spec_pb2.BACKEND_KUBERNETES
    await clients.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id=job_id, spec=spec))


async def test_on_kubernetes_the_group_gets_its_service_unless_false(
    acme: Clients, cluster: FakeKubeApi
) -> None:
    await submit(acme, group(), "pair-k8s")
    env = await both_launched(cluster)
    assert (
        env["client"][group_hosts.TASKS_ENV] == "server" and env["server"][group_hosts.TASKS_ENV] == "client"
    )
    deadline = time.monotonic() + 60
    while len(owners(cluster, "pair-k8s")) < 2:  # the second launch adds its Job after creating it
        assert time.monotonic() < deadline, owners(cluster, "pair-k8s")
        await asyncio.sleep(0.05)
    assert cluster.objects[("services", NS, "pair-k8s")]["spec"]["clusterIP"] == "None"
    for job in owners(cluster, "pair-k8s"):
        cluster.start_job(NS, job)
    names = {"pair-k8s.server": ["server-0"], "pair-k8s.client": ["client-0"]}
    while hostnames(cluster) != names:  # the scheduler's polls name the pods
        assert time.monotonic() < deadline, hostnames(cluster)
        await asyncio.sleep(0.05)
    await acme.scheduler.CancelJob(pb.CancelJobRequest(name=f"{ORG}/jobs/pair-k8s"))


async def test_on_kubernetes_false_creates_no_group_service(acme: Clients, cluster: FakeKubeApi) -> None:
    await submit(acme, group("inter_connection: false\n"), "pair-off")
    env = await both_launched(cluster)
    assert all(group_hosts.TASKS_ENV not in task_env for task_env in env.values())
    assert not [key for key in cluster.objects if key[0] in ("services", "endpointslices")]
    for (kind, _ns, _), job in cluster.objects.items():
        if kind == "jobs":
            script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
            assert "_tandem_resolves" not in script  # no waiting for siblings
