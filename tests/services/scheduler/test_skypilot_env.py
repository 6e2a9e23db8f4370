"""SkyPilot's task environment and sibling host names, through the scheduler on the local backend (the Slurm
and Kubernetes runs of the same group are in test_slurm_jobs.py and test_kubernetes_jobs.py): a two-task
SkyPilot job group whose `client` task reaches its `server` sibling as `server-0.$SKYPILOT_JOBGROUP_NAME`,
and whose `server` prints `--nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE` the way torchrun lines use it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from services.scheduler.backends import group_hosts
from services.scheduler.backends.base import LaunchSpec
from services.scheduler.backends.local import hand_over_attempt
from services.scheduler.spec import parse_yaml
from tests.services.scheduler.test_scheduler import ORG, TERMINAL, Clients, log_text, wait_for
from tests.services.scheduler.test_slurm_jobs import clients_for
from tests.support.mesh import mesh_settings, running_mesh
from tests.support.postgres import free_port
from tests.support.slurm import SlurmCluster

pytestmark = pytest.mark.timeout(180)

# The server answers one connection with its task's name; the client tries its sibling's host name until the
# server listens (they start together, as SkyPilot starts a group's tasks), then prints the answer.
SERVER = """import os, socket
s = socket.create_server(("0.0.0.0", int(os.environ["PAIR_PORT"])))
c, _ = s.accept()
c.sendall(b"hello from " + os.environ["TANDEM_TASK"].encode())
c.close()
"""
CLIENT = """import os, socket, time
host = "server-0." + os.environ["SKYPILOT_JOBGROUP_NAME"]
print("resolved", host, socket.gethostbyname(host), flush=True)
for _ in range(600):
    try:
        c = socket.create_connection((host, int(os.environ["PAIR_PORT"])), timeout=5)
        break
    except OSError:
        time.sleep(0.1)
print("client got:", c.recv(100).decode(), flush=True)
"""


def pair_group(port: int, scripts: Path, accelerators: str = "") -> str:
    """The job group as a SkyPilot file: a header document, then one document per task."""
    scripts.mkdir(parents=True, exist_ok=True)
    (scripts / "server.py").write_text(SERVER)
    (scripts / "client.py").write_text(CLIENT)
    resources = f"resources:\n  accelerators: {accelerators}\n" if accelerators else ""
    return f"""name: pair
execution: parallel
---
name: server
{resources}envs:
  PAIR_PORT: {port}
run: |
  echo "torchrun --nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE setup_rank=$SKYPILOT_SETUP_NODE_RANK"
  echo "id=$SKYPILOT_TASK_ID group=$SKYPILOT_JOBGROUP_NAME"
  echo "ids=$(echo "$SKYPILOT_TASK_IDS" | tr '\\n' ,)"
  echo "user=$SKYPILOT_USER user_id=$SKYPILOT_USER_ID managed=$SKYPILOT_MANAGED_JOB_ID root=$SKYPILOT_ROOT_JOB_ID"
  python {scripts / "server.py"}
---
name: client
envs:
  PAIR_PORT: {port}
run: python {scripts / "client.py"}
"""


async def run_pair(
    clients: Clients, job_id: str, scripts: Path, *, accelerators: str = "", **spec: object
) -> job_pb2.Job:
    """Submit the pair group and wait for its end; it must succeed with the client having reached the server."""
    group = parse_yaml(pair_group(free_port(), scripts, accelerators))
    for key, value in spec.items():
        setattr(group, key, value)
    reply = await clients.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, job_id=job_id, spec=group))
    done = await wait_for(clients, reply.job.name, *TERMINAL, within_s=120)
    client_log = await log_text(clients, reply.job.name, "client")
    assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, (done.failure.message, client_log)
    assert "client got: hello from server" in client_log, client_log
    return done


async def check_server_env(clients: Clients, job: job_pb2.Job, gpus: int) -> None:
    job_id = job.name.rsplit("/", 1)[-1]
    server_log = await log_text(clients, job.name, "server")
    expected = f"torchrun --nproc_per_node={gpus} setup_rank=0\nid=acme_{job_id}-0 group={job_id}\n"
    assert expected in server_log, server_log
    assert f"ids=acme_{job_id}-0,acme_{job_id}-1," in server_log, server_log
    # The submitter (clients_for's user token is alice's) and the job's id, as SkyPilot's managed jobs have
    # them; the user id is the first 8 hex digits of MD5("alice").
    assert f"user=alice user_id=6384e2b2 managed={job_id} root={job_id}\n" in server_log, server_log


@contextlib.asynccontextmanager
async def mesh_clients(tmp_path: Path) -> AsyncIterator[Clients]:
    async with running_mesh(
        mesh_settings(tmp_path), services=["events", "vault", "taskapp_proxy", "scheduler"]
    ) as mesh:
        clients = await clients_for(mesh)
        try:
            yield clients
        finally:
            await clients.close()


@pytest.fixture
async def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Clients]:
    for name, value in {"GPUS": "4", "GPU_TYPE": "H100", "CPUS": "8", "MEMORY_GIB": "16"}.items():
        monkeypatch.setenv(f"TANDEM_SCHEDULER_LOCAL__{name}", value)
    async with mesh_clients(tmp_path) as clients:
        yield clients


async def test_a_group_reaches_its_sibling_by_name_and_sees_skypilots_variables(
    local: Clients, tmp_path: Path
) -> None:
    done = await run_pair(local, "pair-local", tmp_path / "scripts", accelerators="H100:2")
    await check_server_env(local, done, gpus=2)
    assert "resolved server-0.pair-local 127.0.0.1" in await log_text(local, done.name, "client")


def test_the_hosts_view_lists_the_system_hosts_then_every_published_entry(tmp_path: Path) -> None:
    folder = tmp_path / "hosts"
    env = {
        "TANDEM_TASK": "trainer",
        "SKYPILOT_JOBGROUP_NAME": "rl-1a2b",
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
    }
    name, line = group_hosts.own_entry(env)
    assert (name, line) == ("trainer-1", "10.0.0.2 trainer-1.rl-1a2b\n")
    group_hosts.publish(folder, name, line)
    group_hosts.publish(folder, "eval-0", "10.0.0.3 eval-0.rl-1a2b\n")
    system = tmp_path / "etc-hosts"
    system.write_text("127.0.0.1 localhost")
    view = group_hosts.compose(folder, system)
    assert view.splitlines() == [
        "127.0.0.1 localhost",
        "# tandem: this job group's tasks",
        "10.0.0.3 eval-0.rl-1a2b",
        "10.0.0.2 trainer-1.rl-1a2b",
    ]
    assert group_hosts.wait_for(folder, ["eval", "missing"], timeout_s=0.3) == ["missing"]


def test_the_wrapper_runs_its_command_with_the_names_in_etc_hosts(tmp_path: Path) -> None:
    """The module end to end as a node runs it: the sibling's name resolves inside the command, the node's
    own /etc/hosts is left as it was, and the command's exit code is the wrapper's."""
    folder = tmp_path / "hosts"
    group_hosts.publish(folder, "eval-0", "10.9.8.7 eval-0.grp\n")
    before = Path("/etc/hosts").read_text()
    env = {
        **os.environ,
        group_hosts.DIR_ENV: str(folder),
        group_hosts.TASKS_ENV: "eval",
        "TANDEM_TASK": "trainer",
        "SKYPILOT_JOBGROUP_NAME": "grp",
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
    }
    script = "getent hosts eval-0.grp trainer-0.grp; exit 7"
    wrapper = [sys.executable, "-m", "services.scheduler.backends.group_hosts", "bash", "-c", script]
    done = subprocess.run(wrapper, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 7, done.stderr
    assert "10.9.8.7" in done.stdout and "eval-0.grp" in done.stdout, (done.stdout, done.stderr)
    assert "127.0.0.1" in done.stdout and "trainer-0.grp" in done.stdout
    assert Path("/etc/hosts").read_text() == before
    assert (folder / "trainer-0").read_text() == "127.0.0.1 trainer-0.grp\n"


@pytest.fixture
async def slurm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm_cluster: SlurmCluster
) -> AsyncIterator[Clients]:
    monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__ENABLED", "true")
    monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__CONF", str(slurm_cluster.conf))
    async with mesh_clients(tmp_path) as clients:
        yield clients


@pytest.mark.slow
async def test_on_slurm_a_group_reaches_its_sibling_by_name(slurm: Clients, tmp_path: Path) -> None:
    """The cluster has no GPUs: the variable is 0 there, as SkyPilot sets it for a CPU task."""
    done = await run_pair(slurm, "pair-slurm", tmp_path / "scripts", backend=job_spec_pb2.BACKEND_SLURM)
    await check_server_env(slurm, done, gpus=0)
    assert all(t.backend_handle.slurm.job_id for t in done.tasks)


@pytest.mark.skipif(os.geteuid() != 0, reason="handing folders to another user needs root")
def test_under_run_as_org_the_hosts_folder_is_the_orgs(tmp_path: Path) -> None:
    """`run_as = org`: the job's tasks run as the organization's user, who must write the job's hosts folder;
    it is handed over with the attempt's own folders."""
    hosts = tmp_path / "jobs" / "orgs-acme-jobs-pair" / ".hosts"
    spec = LaunchSpec(
        key="orgs-acme-jobs-pair.server.0",
        job="orgs/acme/jobs/pair",
        task="server",
        attempt=0,
        command="true",
        env={group_hosts.DIR_ENV: str(hosts)},
    )
    account = hand_over_attempt(spec, [tmp_path / "jobs" / "orgs-acme-jobs-pair" / "server"], tmp_path)
    assert (hosts.stat().st_uid, hosts.stat().st_mode & 0o777) == (account.pw_uid, 0o700)
