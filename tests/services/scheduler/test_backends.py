"""The backend conformance suite: the same tests against every job backend, on real processes and a real
one-node Slurm cluster (tests/support/slurm.py).

To add a backend, write a factory `(request, tmp_path) -> Case` and add it to `FACTORIES` and to the `case`
fixture's params (and to `MULTI_NODE` / `multi_case` when it can run a task on several nodes); tests that
need something a backend cannot do check the `Case` flags.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from services.scheduler.backends.base import (
    Backend,
    BackendUnavailable,
    Handle,
    LaunchRefused,
    LaunchSpec,
    NodeAssignment,
    Observed,
    Phase,
    Resources,
)
from services.scheduler.backends.local import LocalBackend
from services.scheduler.backends.slurm import SlurmBackend, nice_for, observe
from tests.support.kube_api import make_backend, running_kube_api
from tests.support.slurm import SlurmCluster  # its fixtures are registered in tests/conftest.py

WAIT_S = 60.0  # a bound so a broken backend fails the test instead of hanging it; never a timing claim


@dataclass
class Case:
    """One backend under test, and how to build what the tests hand it."""

    kind: str
    backend: Backend
    fresh: Callable[[], Backend]  # a new backend object, as a restarted scheduler builds it
    root: Path
    multi_node: bool = True  # can run a task on several nodes here
    process_tree: bool = False  # the test can see the task's processes (same machine, same pid space)
    requeue: Callable[[Handle], None] | None = None  # make the backend itself requeue a running attempt
    release: Callable[[Handle], None] = lambda _: None  # let a requeued attempt start again now
    _count: list[int] = field(default_factory=lambda: [0])

    def spec(self, command: str, **kwargs: Any) -> LaunchSpec:
        self._count[0] += 1
        # unique across the session: the Slurm cluster outlives a test and remembers finished jobs' names
        key = kwargs.pop("key", f"orgs-acme-jobs-j{self._count[0]}-{uuid.uuid4().hex[:8]}.main.0")
        return LaunchSpec(
            key=key,
            job=f"orgs/acme/jobs/j{self._count[0]}",
            task="main",
            attempt=0,
            command=command,
            env=kwargs.pop("env", {"TANDEM_JOB": f"orgs/acme/jobs/j{self._count[0]}"}),
            log_dir=kwargs.pop("log_dir", self.root / key),
            **kwargs,
        )


def _local(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    root = tmp_path / "local"

    def make() -> Backend:
        return LocalBackend(root / "attempts", gpus=0, failure_grace_s=2.0)

    yield Case("local", make(), make, root / "logs", process_tree=True)


def _slurm(request: pytest.FixtureRequest, tmp_path: Path, fixture: str = "slurm_cluster") -> Iterator[Case]:
    cluster: SlurmCluster = request.getfixturevalue(fixture)
    requeued: dict[str, float] = {}  # job id -> when it was requeued

    def requeue(handle: Handle) -> None:
        # Slurm shows a job RUNNING while slurmd is still launching its batch script; the preemption the
        # test means hits a task that runs, so it waits for the job's srun step.
        job, deadline = str(handle["job_id"]), time.monotonic() + WAIT_S
        while f"{job}.0" not in cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%i", check=False).stdout:
            assert time.monotonic() < deadline, f"job {job}'s step never started"
            time.sleep(0.1)
        cluster.run("scontrol", "requeue", job)
        requeued[job] = time.time()

    def release(handle: Handle) -> None:  # Slurm holds a requeued job back for a while (BeginTime)
        # slurmd refuses to launch a job whose credential it revoked in the same second ("Job N already
        # killed, do not launch batch job": the job then ends FAILED, exit 1); Slurm's own hold after a
        # requeue is far longer, so a release that soon is the test's doing, not a preemption's.
        job = str(handle["job_id"])
        time.sleep(max(0.0, requeued.pop(job, 0.0) + 1.5 - time.time()))
        cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now")

    def make() -> Backend:
        return SlurmBackend(env=cluster.env)

    multi_node = len(cluster.nodes) > 1
    yield Case("slurm", make(), make, tmp_path / "slurm", multi_node, requeue=requeue, release=release)


def _slurm_two_nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    return _slurm(request, tmp_path, "slurm_two_nodes")


def _kubernetes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    """The Kubernetes backend against the stand-in API server, which runs each pod's command as a local
    process (tests/support/kube_api.py); requeue has no stand-in and is skipped."""
    with running_kube_api(run_pods=True) as api:
        yield Case("kubernetes", make_backend(api), lambda: make_backend(api), tmp_path / "logs")


FACTORIES = {"local": _local, "slurm": _slurm, "kubernetes": _kubernetes}
MULTI_NODE = {"local": _local, "slurm": _slurm_two_nodes}


@pytest.fixture(params=["local", pytest.param("slurm", marks=pytest.mark.slow), "kubernetes"])
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    async for c in _serve(FACTORIES[request.param], request, tmp_path):
        yield c


@pytest.fixture(params=["local", pytest.param("slurm", marks=pytest.mark.slow)])
async def multi_case(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A backend that runs tasks on two nodes here (Slurm: two slurmds on this machine)."""
    async for c in _serve(MULTI_NODE[request.param], request, tmp_path):
        yield c


async def _serve(
    factory: Callable[..., Iterator[Case]], request: pytest.FixtureRequest, tmp_path: Path
) -> Any:
    gen = factory(request, tmp_path)
    c = next(gen)
    yield c
    await c.backend.close()
    for _ in gen:
        pass


async def wait_until(
    backend: Backend, handle: Handle, done: Callable[[Observed], bool], timeout_s: float = WAIT_S
) -> Observed:
    deadline = time.monotonic() + timeout_s
    while True:
        observed = await backend.poll(handle)
        if done(observed) or time.monotonic() > deadline:
            return observed
        await asyncio.sleep(0.1)


def ended(o: Observed) -> bool:
    return o.phase in (Phase.EXITED, Phase.LOST)


def running(o: Observed) -> bool:
    return o.phase is Phase.RUNNING or ended(o)


async def run_to_end(case: Case, spec: LaunchSpec) -> tuple[Handle, Observed]:
    handle = await case.backend.launch(spec)
    return handle, await wait_until(case.backend, handle, ended)


def log_text(backend: Backend, handle: Handle, rank: int = 0) -> str:
    path = backend.logs(handle, rank)
    return path.read_text() if path else ""


# -- the conformance suite -------------------------------------------------------------------------------


async def test_exit_zero_and_logs(case: Case) -> None:
    handle, observed = await run_to_end(case, case.spec("echo out-line; echo err-line >&2"))
    assert observed.phase is Phase.EXITED and observed.exit_code == 0, observed
    json.dumps(handle)  # the engine stores it as JSON
    log = log_text(case.backend, handle)
    assert "out-line" in log and "err-line" in log


async def test_exit_code_is_reported(case: Case) -> None:
    _, observed = await run_to_end(case, case.spec("echo before; exit 3"))
    assert observed.phase is Phase.EXITED and observed.exit_code == 3, observed


async def test_failing_command_stops_the_script(case: Case) -> None:
    """bash -euo pipefail: a failing step (even inside a pipe) ends the script with its code."""
    handle, observed = await run_to_end(case, case.spec("false | cat; echo not-reached"))
    assert observed.phase is Phase.EXITED and observed.exit_code == 1, observed
    assert "not-reached" not in log_text(case.backend, handle)


async def test_environment(case: Case) -> None:
    command = 'echo "rank=$TANDEM_NODE_RANK sky=$SKYPILOT_NODE_RANK foo=$FOO n=$TANDEM_NUM_NODES ips=$TANDEM_NODE_IPS"'
    spec = case.spec(command, env={"FOO": "two words", "TANDEM_JOB": "orgs/acme/jobs/x"})
    handle, observed = await run_to_end(case, spec)
    assert observed.exit_code == 0, observed
    log = log_text(case.backend, handle)
    assert "rank=0 sky=0 foo=two words n=1 ips=" in log
    assert "ips=\n" not in log  # the node's address is there


async def test_scheduler_environment_does_not_leak(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_MESH_KEY", "not-for-tasks")
    handle, observed = await run_to_end(case, case.spec('echo "key=${TANDEM_MESH_KEY:-unset}"'))
    assert observed.exit_code == 0
    assert "key=unset" in log_text(case.backend, handle)


async def test_cancel_ends_a_sleeping_task(case: Case) -> None:
    pids = case.root / "pids"
    command = f"sleep 30 & echo $! >> {pids}; sleep 30 & echo $! >> {pids}; echo started; wait"
    handle = await case.backend.launch(case.spec(command))
    assert (await wait_until(case.backend, handle, running)).phase is Phase.RUNNING
    await wait_until(case.backend, handle, lambda o: pids.exists() and len(pids.read_text().split()) == 2)
    await case.backend.cancel(handle, grace_s=2.0)
    observed = await wait_until(case.backend, handle, ended)
    assert observed.phase is Phase.EXITED and observed.exit_code != 0, observed
    await case.backend.cancel(handle, grace_s=0.5)  # idempotent
    if case.process_tree:
        # The signal reaches the children with their leader; on a loaded machine they may take a moment to die.
        for pid in map(int, pids.read_text().split()):
            assert await gone(pid), f"child {pid} of the task survived cancel"


async def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_cancel_kills_what_ignores_sigterm(case: Case) -> None:
    handle = await case.backend.launch(case.spec("trap '' TERM; echo started; sleep 30"))
    await wait_until(case.backend, handle, lambda o: "started" in log_text(case.backend, handle) or ended(o))
    await case.backend.cancel(handle, grace_s=0.5)
    observed = await wait_until(case.backend, handle, ended)
    assert observed.phase is Phase.EXITED and observed.exit_code != 0, observed


async def test_launch_is_idempotent_per_key(case: Case) -> None:
    runs = case.root / "runs"
    spec = case.spec(f"echo run >> {runs}; sleep 1")
    first, second = await asyncio.gather(case.backend.launch(spec), case.backend.launch(spec))
    third = await case.fresh().launch(spec)  # another scheduler object, same key
    assert first == second == third
    await wait_until(case.backend, first, ended)
    assert runs.read_text().split() == ["run"]


async def test_attempts_of_a_task_share_its_log_folder(case: Case) -> None:
    """The engine gives every attempt of a task the same log folder: each appends, none reads another's
    exit status."""
    logs = case.root / "task-logs"
    _, first = await run_to_end(case, case.spec("echo attempt-0; exit 3", log_dir=logs))
    assert first.exit_code == 3
    second = await case.backend.launch(case.spec("sleep 1; echo attempt-1", log_dir=logs))
    assert (await case.backend.poll(second)).phase in (Phase.QUEUED, Phase.RUNNING)
    assert (await wait_until(case.backend, second, ended)).exit_code == 0
    log = log_text(case.backend, second)
    assert log.index("attempt-0") < log.index("attempt-1")


async def test_find_after_a_lost_launch(case: Case) -> None:
    spec = case.spec("sleep 0.5")
    handle = await case.backend.launch(spec)  # the scheduler "dies" before storing the handle
    restarted = case.fresh()
    found = await restarted.find(spec.key)
    assert found == handle
    assert (await wait_until(restarted, found, ended)).exit_code == 0
    assert await restarted.find("orgs-acme-jobs-never.main.0") is None


async def test_reattach_after_restart(case: Case) -> None:
    handle = await case.backend.launch(case.spec("echo hi; sleep 1; exit 5"))
    assert (await wait_until(case.backend, handle, running)).phase is Phase.RUNNING
    stored = json.loads(json.dumps(handle))
    restarted = case.fresh()  # not the parent of the task's processes
    observed = await restarted.poll(stored)
    assert observed.phase in (Phase.QUEUED, Phase.RUNNING, Phase.EXITED), observed
    observed = await wait_until(restarted, stored, ended)
    assert observed.phase is Phase.EXITED and observed.exit_code == 5, observed
    assert "hi" in log_text(case.backend, stored)


async def test_two_nodes(multi_case: Case) -> None:
    case = multi_case
    command = (
        'echo "rank=$TANDEM_NODE_RANK sky=$SKYPILOT_NODE_RANK n=$TANDEM_NUM_NODES"; echo "$TANDEM_NODE_IPS"'
    )
    handle, observed = await run_to_end(case, case.spec(command, num_nodes=2))
    assert observed.exit_code == 0, observed
    first, second = log_text(case.backend, handle, 0), log_text(case.backend, handle, 1)
    assert "rank=0 sky=0 n=2" in first and "rank=1 sky=1 n=2" in second
    assert first.splitlines()[1:3] == second.splitlines()[1:3]  # every node gets both addresses, in order
    assert all(line for line in first.splitlines()[1:3])


async def test_one_failing_node_ends_the_attempt(multi_case: Case) -> None:
    case = multi_case
    command = 'if [ "$TANDEM_NODE_RANK" = 1 ]; then exit 3; fi; sleep 30'
    _, observed = await run_to_end(case, case.spec(command, num_nodes=2))
    assert observed.phase is Phase.EXITED and observed.exit_code == 3, observed


@pytest.mark.slow
async def test_backend_requeue_shows_as_preempted_then_running(case: Case) -> None:
    if case.requeue is None:
        pytest.skip(f"{case.kind} does not requeue by itself")
    handle = await case.backend.launch(case.spec("echo run; sleep 30", requeue_on_failure=True))
    assert (await wait_until(case.backend, handle, running)).phase is Phase.RUNNING
    case.requeue(handle)
    observed = await wait_until(case.backend, handle, lambda o: o.phase is not Phase.RUNNING)
    assert observed.phase is Phase.QUEUED and observed.preempted, observed
    case.release(handle)
    observed = await wait_until(case.backend, handle, running)
    assert observed.phase is Phase.RUNNING, observed
    await case.backend.cancel(handle, grace_s=1.0)


async def test_inventory(case: Case) -> None:
    nodes = await case.backend.inventory()
    assert nodes and all(n.name and n.cpus > 0 and n.memory_gib > 0 and n.up for n in nodes)
    assert all(0 <= n.cpus_free <= n.cpus and 0 <= n.gpus_free <= n.gpus for n in nodes)


async def test_a_key_that_cannot_name_a_folder_is_refused(case: Case) -> None:
    with pytest.raises(LaunchRefused):
        await case.backend.launch(case.spec("true", key="../escape"))


# -- local only --------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def sleeper(tmp_path: Path) -> LaunchSpec:
    return LaunchSpec(
        key="k.main.0", job="j", task="main", attempt=0, command="sleep 30", env={}, log_dir=tmp_path
    )


async def test_local_reused_pid_is_not_the_task(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "attempts", gpus=0)
    spec = sleeper(tmp_path)
    handle = await backend.launch(spec)
    impostor = json.loads(json.dumps(handle))
    for rank in impostor["ranks"]:
        rank["start_time"] += 1  # same pid, another process
    other = LocalBackend(tmp_path / "attempts", gpus=0)
    observed = await other.poll(impostor)
    assert observed.phase is Phase.LOST, observed
    await other.cancel(impostor, grace_s=0.2)  # must not signal a process that is not the task
    assert (await backend.poll(handle)).phase is Phase.RUNNING
    await backend.cancel(handle, grace_s=1.0)


async def test_local_gpu_assignment_and_inventory(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "attempts", gpus=4, gpu_type="H100", cpus=8, memory_gib=32)
    spec = LaunchSpec(
        key="k.main.0",
        job="j",
        task="main",
        attempt=0,
        command='echo "cuda=$CUDA_VISIBLE_DEVICES"; sleep 30',
        env={},
        log_dir=tmp_path / "logs",
        resources=Resources(gpus=2, cpus=2, memory_gib=4),
        nodes=[NodeAssignment(rank=0, gpu_indices=(1, 3))],
    )
    handle = await backend.launch(spec)
    [node] = await backend.inventory()
    assert (node.gpus, node.gpus_free, node.cpus_free, node.memory_free_gib) == (4, 2, 6, 28)
    await wait_until(backend, handle, lambda o: "cuda=" in log_text(backend, handle))
    assert "cuda=1,3" in log_text(backend, handle)
    await backend.cancel(handle, grace_s=1.0)
    [node] = await backend.inventory()
    assert node.gpus_free == 4


async def test_local_find_completes_a_marker_written_before_the_crash(tmp_path: Path) -> None:
    """The scheduler died after starting the processes but before recording them in the marker."""
    backend = LocalBackend(tmp_path / "attempts", gpus=0)
    spec = sleeper(tmp_path)
    handle = await backend.launch(spec)
    marker = tmp_path / "attempts" / "k.main.0" / "launch.json"
    partial = json.loads(marker.read_text())
    partial["ranks"] = []
    marker.write_text(json.dumps(partial))
    found = await LocalBackend(tmp_path / "attempts", gpus=0).find("k.main.0")
    assert found is not None and found["pid"] == handle["pid"]
    await backend.cancel(handle, grace_s=1.0)


async def test_local_killed_from_outside_is_lost(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "attempts", gpus=0)
    spec = sleeper(tmp_path)
    handle = await backend.launch(spec)
    os.killpg(handle["pgid"], signal.SIGKILL)
    observed = await wait_until(LocalBackend(tmp_path / "attempts", gpus=0), handle, ended)
    assert observed.phase is Phase.LOST, observed


# -- Slurm only --------------------------------------------------------------------------------------------


def test_slurm_state_mapping() -> None:
    assert observe({"JobState": "PENDING", "Reason": "Resources"}).phase is Phase.QUEUED
    assert observe({"JobState": "PENDING", "Reason": "BeginTime", "Restarts": "1"}).preempted
    assert observe({"JobState": "REQUEUED"}).preempted
    assert observe({"JobState": "COMPLETING"}).phase is Phase.RUNNING
    assert observe({"JobState": "COMPLETED", "ExitCode": "0:0"}).exit_code == 0
    assert observe({"JobState": "FAILED", "ExitCode": "3:0"}).exit_code == 3
    assert observe({"JobState": "CANCELLED", "ExitCode": "0:15"}).exit_code == 143
    assert observe({"JobState": "TIMEOUT", "ExitCode": "0:0"}).exit_code == 143
    assert observe({"JobState": "OUT_OF_MEMORY", "ExitCode": "0:0"}).exit_code == 137
    assert observe({"JobState": "FAILED", "ExitCode": "0:9"}).exit_code == 137
    assert observe({"JobState": "NODE_FAIL"}).phase is Phase.LOST
    preempted = observe({"JobState": "PREEMPTED"})
    assert preempted.phase is Phase.LOST and preempted.preempted
    assert [nice_for(p) for p in (-5000, -1000, 0, 500, 1000, 5000)] == [2000, 2000, 1000, 500, 0, 0]


def test_slurm_submission_arguments(tmp_path: Path) -> None:
    backend = SlurmBackend(partition="gpu", account="rl", qos="normal", qos_by_priority=[(900, "high")])
    spec = LaunchSpec(
        key="k.main.0",
        job="j",
        task="main",
        attempt=0,
        command="echo hi",
        env={"A": "it's"},
        num_nodes=2,
        resources=Resources(gpus=8, gpu_type="h100", cpus=7.5, memory_gib=1.5),
        log_dir=tmp_path,
        priority=950,
        time_limit_s=90061,
        requeue_on_failure=True,
    )
    args = backend.sbatch_args(spec)
    for expected in (
        "--job-name=k.main.0",
        "--nodes=2",
        "--gres=gpu:h100:8",
        "--cpus-per-task=8",
        "--mem=1536M",
        "--time=1-01:01:01",
        "--requeue",
        "--nice=50",
        "--partition=gpu",
        "--account=rl",
        "--qos=high",
        f"--output={tmp_path / 'batch.log'}",
    ):
        assert expected in args
    own = backend.sbatch_args(replace(spec, options={"partition": "big", "qos": "", "account": "ml"}))
    assert "--partition=big" in own and "--account=ml" in own and "--qos=high" in own
    script = backend.batch_script(spec)
    assert script.startswith("#!/bin/bash\n") and "export A='it'\"'\"'s'" in script and "srun " in script


@pytest.mark.slow
async def test_slurm_refuses_what_it_cannot_run(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    backend = SlurmBackend(env=slurm_cluster.env)
    spec = LaunchSpec(
        key="k.gpu.0", job="j", task="gpu", attempt=0, command="true", env={}, log_dir=tmp_path,
        resources=Resources(gpus=1),
    )  # fmt: skip
    with pytest.raises(LaunchRefused, match="gres"):
        await backend.launch(spec)


@pytest.mark.slow
async def test_slurm_takes_a_cluster_and_partition_it_has_and_names_one_it_has_not(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # SkyPilot's `infra: slurm/CLUSTER/PARTITION` arrives as the job's slurm.cluster and slurm.partition.
    backend = SlurmBackend(env=slurm_cluster.env)
    assert await backend.cluster_name() == "tandemtest"  # tests/support/slurm.py's ClusterName
    assert await backend.partitions() == ["debug"]
    assert await backend.option_problems({"cluster": "tandemtest", "partition": "debug", "qos": "x"}) == {}
    assert set(await backend.option_problems({"cluster": "other", "partition": "gpu"})) == {
        "cluster",
        "partition",
    }

    def spec(name: str, **options: str) -> LaunchSpec:
        return LaunchSpec(
            key=f"k-{uuid.uuid4().hex[:8]}.{name}.0", job="j", task=name, attempt=0, env={},
            command='echo "on $SLURM_CLUSTER_NAME in $SLURM_JOB_PARTITION"', log_dir=tmp_path / name,
            options=options,
        )  # fmt: skip

    with pytest.raises(LaunchRefused, match=r"no partition 'gpu' \(slurm.partition\); its partitions: debug"):
        await backend.launch(spec("partition", cluster="tandemtest", partition="gpu"))
    with pytest.raises(LaunchRefused, match=r"Slurm cluster 'other' .* cluster is 'tandemtest'"):
        await backend.launch(spec("cluster", cluster="other", partition="debug"))
    handle = await backend.launch(spec("both", cluster="tandemtest", partition="debug"))
    observed = await wait_until(backend, handle, ended)
    assert (observed.phase, observed.exit_code) == (Phase.EXITED, 0), observed
    assert "on tandemtest in debug" in log_text(backend, handle)


@pytest.mark.slow
async def test_slurm_unreachable_is_backend_unavailable(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    lines = slurm_cluster.conf.read_text().splitlines()
    conf.write_text(
        "\n".join("SlurmctldPort=1" if x.startswith("SlurmctldPort=") else x for x in lines) + "\n"
    )
    backend = SlurmBackend(env={"SLURM_CONF": str(conf)})
    spec = LaunchSpec(
        key="k.main.0", job="j", task="main", attempt=0, command="true", env={}, log_dir=tmp_path
    )
    with pytest.raises(BackendUnavailable, match="contact"):
        await backend.launch(spec)
