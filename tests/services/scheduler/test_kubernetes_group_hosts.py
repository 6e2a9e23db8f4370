"""The tasks of a job group reach each other as `{task}-{rank}.{group}` on Kubernetes, the names SkyPilot job
groups use and the local and Slurm backends give (backends/group_hosts.py): one headless Service per group,
named as the group, whose EndpointSlices the backend writes from the pods it sees. Driven against the
stand-in API server (tests/support/kube_api.py), which checks every object against the Kubernetes schemas.

Run: .venv/bin/python -m pytest tests/services/scheduler/test_kubernetes_group_hosts.py
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from services.scheduler.backends import group_hosts
from services.scheduler.backends.base import LaunchRefused, LaunchSpec, Phase
from services.scheduler.backends.kubernetes import KubernetesBackend
from tests.support.kube_api import FakeKubeApi, kubernetes_backend, make_backend, running_kube_api, validate

pytestmark = pytest.mark.timeout(120)
NS = "tandem-jobs"
JOB = "orgs/acme/jobs/rl-1a2b"


def launch_spec(tmp_path: Path, task: str, attempt: int = 0, **overrides: Any) -> LaunchSpec:
    values: dict[str, Any] = {
        "key": f"orgs-acme-jobs-rl-1a2b.{task}.{attempt}",
        "job": JOB,
        "task": task,
        "attempt": attempt,
        "command": "echo ready",
        "env": {"TANDEM_JOB": JOB, "SKYPILOT_JOBGROUP_NAME": "rl-1a2b"},
        "log_dir": tmp_path / task / str(attempt),
        "sibling_tasks": tuple(t for t in ("trainer", "eval") if t != task),
    }
    values.update(overrides)
    return LaunchSpec(**values)


def objects(api: FakeKubeApi, plural: str) -> dict[str, dict[str, Any]]:
    return {name: obj for (kind, ns, name), obj in api.objects.items() if kind == plural and ns == NS}


def sent(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != "status"}


def hosts(api: FakeKubeApi, task: str) -> dict[str, str]:
    """The names the group's Service gives `task`'s pods: hostname -> address."""
    slice_ = objects(api, "endpointslices")[f"rl-1a2b.{task}"]
    return {e["hostname"]: e["addresses"][0] for e in slice_["endpoints"]}


@pytest.fixture
def kube_api() -> Any:
    with running_kube_api() as api:
        yield api


@pytest.fixture
def backend(kube_api: FakeKubeApi) -> KubernetesBackend:
    return make_backend(kube_api)


async def test_a_groups_tasks_share_one_headless_service_named_as_the_group(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    trainer = await backend.launch(launch_spec(tmp_path, "trainer", num_nodes=2))
    evaluator = await backend.launch(launch_spec(tmp_path, "eval"))

    service = objects(kube_api, "services")["rl-1a2b"]
    validate(sent(service))
    assert service["spec"] == {"clusterIP": "None", "publishNotReadyAddresses": True}  # no selector: ours
    assert service["metadata"]["annotations"]["tandem.dev/job"] == JOB
    owners = [(ref["kind"], ref["name"], ref["uid"]) for ref in service["metadata"]["ownerReferences"]]
    assert owners == [("Job", trainer["job"], trainer["uid"]), ("Job", evaluator["job"], evaluator["uid"])]

    assert objects(kube_api, "endpointslices") == {}  # no pod has an address yet
    kube_api.start_job(NS, trainer["job"])
    kube_api.start_job(NS, evaluator["job"])
    await backend.poll(trainer)
    await backend.poll(evaluator)
    slices = objects(kube_api, "endpointslices")
    assert sorted(slices) == ["rl-1a2b.eval", "rl-1a2b.trainer"]
    for slice_ in slices.values():
        validate(sent(slice_))
        labels = slice_["metadata"]["labels"]
        assert labels["kubernetes.io/service-name"] == "rl-1a2b"
        assert labels["endpointslice.kubernetes.io/managed-by"] == "tandem.dev/scheduler"
        assert slice_["metadata"]["ownerReferences"][0]["uid"] == service["metadata"]["uid"]
        assert slice_["addressType"] == "IPv4"

    job = kube_api.job(NS, trainer["job"])
    assert job["metadata"]["annotations"]["tandem.dev/group"] == "rl-1a2b"
    [container] = job["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env[group_hosts.TASKS_ENV] == "eval" and group_hosts.REQUIRED_ENV not in env
    assert "for _tandem_host in eval-0.rl-1a2b; do" in container["command"][-1]
    assert container["command"][-1].endswith("echo ready")
    assert job["spec"]["template"]["spec"]["subdomain"] == trainer["job"]  # its own ranks, as before


async def test_poll_names_each_ranks_pod_task_rank_group(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    trainer = await backend.launch(launch_spec(tmp_path, "trainer", num_nodes=2))
    assert (await backend.poll(trainer)).phase == Phase.QUEUED
    assert objects(kube_api, "endpointslices") == {}

    kube_api.start_job(NS, trainer["job"])
    assert (await backend.poll(trainer)).phase == Phase.RUNNING
    assert hosts(kube_api, "trainer") == {"trainer-0": "10.1.0.10", "trainer-1": "10.1.0.11"}
    slice_ = objects(kube_api, "endpointslices")["rl-1a2b.trainer"]
    validate(sent(slice_))
    pods = kube_api.pods(NS, trainer["job"])
    assert [e["targetRef"]["name"] for e in slice_["endpoints"]] == [
        p["metadata"]["name"] for p in pods.values()
    ]
    assert all(e["conditions"] == {"ready": True} for e in slice_["endpoints"])

    writes = len(kube_api.patches)
    await backend.poll(trainer)  # nothing changed: nothing written
    assert len(kube_api.patches) == writes

    kube_api.finish_job(NS, trainer["job"])
    assert (await backend.poll(trainer)).phase == Phase.EXITED
    assert hosts(kube_api, "trainer") == {}  # an ended attempt's addresses are no one's any more


async def test_a_retry_keeps_the_service_and_takes_the_names_over(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    first = await backend.launch(launch_spec(tmp_path, "trainer"))
    await backend.launch(launch_spec(tmp_path, "eval"))
    kube_api.start_job(NS, first["job"])
    await backend.poll(first)
    kube_api.finish_job(NS, first["job"], {0: 1})

    second = await backend.launch(launch_spec(tmp_path, "trainer", attempt=1))
    service = objects(kube_api, "services")["rl-1a2b"]
    assert second["uid"] in [ref["uid"] for ref in service["metadata"]["ownerReferences"]]
    assert len(service["metadata"]["ownerReferences"]) == 3
    kube_api.start_job(NS, second["job"], node="node-b")
    await backend.poll(second)
    assert hosts(kube_api, "trainer") == {"trainer-0": "10.1.0.10"}
    assert objects(kube_api, "endpointslices")["rl-1a2b.trainer"]["endpoints"][0]["nodeName"] == "node-b"

    # The first attempt's end, seen after the retry took over, leaves the retry's names alone; a backend
    # that restarted (nothing cached) finds the attempt and does the same.
    assert (await backend.poll(first)).phase == Phase.EXITED
    restarted = make_backend(kube_api)
    found = await restarted.find(first["key"])
    assert found is not None and found["group"] == "rl-1a2b" and found["task"] == "trainer"
    await restarted.poll(found)
    assert hosts(kube_api, "trainer") == {"trainer-0": "10.1.0.10"}
    await restarted.close()

    # The first attempt's Job goes (its TTL): the Service stays for the others; with the last, all goes.
    kube_api.remove_job(NS, first["job"])
    assert "rl-1a2b" in objects(kube_api, "services")
    for handle_job in [j for (kind, ns, j) in list(kube_api.objects) if kind == "jobs" and ns == NS]:
        kube_api.remove_job(NS, handle_job)
    assert "rl-1a2b" not in objects(kube_api, "services")
    assert objects(kube_api, "endpointslices") == {}


async def test_a_retry_in_the_other_address_family_gets_a_new_slice(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    """A slice's addressType cannot change: pods whose addresses are of the other family (a cluster moved to
    IPv6) get the task a new slice."""
    first = await backend.launch(launch_spec(tmp_path, "trainer"))
    kube_api.start_job(NS, first["job"])
    await backend.poll(first)
    kube_api.finish_job(NS, first["job"], {0: 1})
    await backend.poll(first)
    second = await backend.launch(launch_spec(tmp_path, "trainer", attempt=1))
    kube_api.start_job(NS, second["job"])
    kube_api.pods(NS, second["job"])[0]["status"]["podIP"] = "fd00::10"
    await backend.poll(second)
    slice_ = objects(kube_api, "endpointslices")["rl-1a2b.trainer"]
    validate(sent(slice_))
    assert slice_["addressType"] == "IPv6" and hosts(kube_api, "trainer") == {"trainer-0": "fd00::10"}
    assert ("endpointslices", "rl-1a2b.trainer", {}) in kube_api.deletions


async def test_a_relaunch_of_the_same_attempt_adds_no_owner(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    first = await backend.launch(launch_spec(tmp_path, "trainer"))
    again = await backend.launch(launch_spec(tmp_path, "trainer"))
    assert again == first
    owners = objects(kube_api, "services")["rl-1a2b"]["metadata"]["ownerReferences"]
    assert [ref["uid"] for ref in owners] == [first["uid"]]


async def test_without_siblings_there_is_no_group_service(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    handle = await backend.launch(launch_spec(tmp_path, "trainer", sibling_tasks=()))
    assert "group" not in handle
    assert objects(kube_api, "services") == {} and objects(kube_api, "endpointslices") == {}
    [container] = kube_api.job(NS, handle["job"])["spec"]["template"]["spec"]["containers"]
    assert container["command"][-1] == "echo ready"
    assert group_hosts.TASKS_ENV not in {item["name"] for item in container["env"]}


async def test_required_names_reach_the_pod(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    handle = await backend.launch(launch_spec(tmp_path, "eval", sibling_hosts_required=True))
    [container] = kube_api.job(NS, handle["job"])["spec"]["template"]["spec"]["containers"]
    assert {"name": group_hosts.REQUIRED_ENV, "value": "1"} in container["env"]


async def test_another_jobs_service_of_that_name_refuses_the_launch(
    backend: KubernetesBackend, kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    await backend.launch(launch_spec(tmp_path, "trainer", job="orgs/other/jobs/rl-1a2b"))
    with pytest.raises(LaunchRefused, match=r"Service rl-1a2b exists .* not job orgs/acme/jobs/rl-1a2b's"):
        await backend.launch(launch_spec(tmp_path, "eval"))


async def test_names_that_cannot_be_dns_labels_are_refused(
    backend: KubernetesBackend, tmp_path: Path
) -> None:
    with pytest.raises(LaunchRefused, match=r"host name 'tttttttttt.*' of task .* is not a DNS label"):
        await backend.launch(launch_spec(tmp_path, "t" * 62, num_nodes=12))
    with pytest.raises(LaunchRefused, match="job id 'rl-' cannot name the job group's Service"):
        await backend.launch(launch_spec(tmp_path, "trainer", job="orgs/acme/jobs/rl-"))


async def test_pods_wait_for_their_siblings_names_then_go_on(tmp_path: Path) -> None:
    """With the stand-in's kubelet (no cluster DNS here, so no name resolves) the pod waits its
    TANDEM_GROUP_HOSTS_WAIT_S, says which names it missed, and runs its command."""
    env = {"TANDEM_JOB": JOB, group_hosts.WAIT_ENV: "0"}
    async with kubernetes_backend() as (backend, _api):
        spec = launch_spec(tmp_path, "trainer", command='echo "siblings: $TANDEM_GROUP_TASKS"', env=env)
        handle = await backend.launch(spec)
        observed = await wait_end(backend, handle)
        assert observed.exit_code == 0, observed.message
        log = (tmp_path / "trainer" / "0" / "rank-0.log").read_text()
        assert "no host name yet for eval-0.rl-1a2b" in log and "siblings: eval" in log

        required = launch_spec(tmp_path, "eval", env=env, sibling_hosts_required=True)
        observed = await wait_end(backend, await backend.launch(required))
        assert observed.exit_code == group_hosts.REQUIRED_EXIT  # a PRECHECK failure, as on local and Slurm


async def wait_end(backend: KubernetesBackend, handle: dict[str, Any]) -> Any:
    while True:
        observed = await backend.poll(handle)
        if observed.phase in (Phase.EXITED, Phase.LOST):
            return observed
        await asyncio.sleep(0.05)


def test_the_wait_script_runs_in_bash(tmp_path: Path) -> None:
    script = group_hosts.wait_script(["eval", "replay"], "rl-1a2b.invalid") + "echo ran"
    base = {"PATH": os.environ["PATH"], group_hosts.WAIT_ENV: "0.5"}  # whole seconds in bash: 0
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], env=base, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert "after 0s, no host name yet for eval-0.rl-1a2b.invalid replay-0.rl-1a2b.invalid" in done.stderr
    strict = {**base, group_hosts.REQUIRED_ENV: "1"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], env=strict, capture_output=True, text=True, check=False
    )
    assert done.returncode == group_hosts.REQUIRED_EXIT and "ran" not in done.stdout
    assert group_hosts.wait_script([], "rl-1a2b") == ""
