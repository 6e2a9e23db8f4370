"""A real Slurm cluster on this machine for the test session, from Debian's packages (`slurm-wlm munge`):
one node, or several (one `slurmd -N <name>` each) for multi-node tasks.

What it sets up is what a plain machine needs (no systemd, no cgroups, no accounting database):

- munge: a private `munged` run as the munge user with its own 1024-byte key, socket, pid, seed and log
  files in the cluster's folder (`AuthInfo=socket=...` in slurm.conf), so test sessions running at the same
  time never share one or stop each other's.
- slurm: `slurm.conf` in a temporary folder (named by `SLURM_CONF` for every client command), its own
  spool, state and log folders and free ports, so it never touches a cluster configured in /etc/slurm.
  `slurmctld` and the `slurmd`s run as root daemons; the fixture waits until `sinfo` shows every node idle.

`running_cluster()` stops the daemons on exit. `slurm_cluster` (one node) and `slurm_two_nodes` are the
session-scoped pytest fixtures around it, registered in tests/conftest.py (a test module that imports them
itself gets clusters of its own): where Slurm is not installed they skip, except under CI (the env var CI
set), where they fail, as for PostgreSQL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path  # slurm.conf; every client command needs SLURM_CONF pointing at it
    node: str  # the first node's name (with one node: this machine's hostname)
    root: Path  # the cluster's folder: spool, state, logs
    nodes: tuple[str, ...] = ()  # every node's name

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster (e.g. `scontrol requeue 42`)."""
        return subprocess.run(
            cmd, env={**os.environ, **self.env}, capture_output=True, text=True, check=check, timeout=30
        )


def available() -> bool:
    return all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_munge(root: Path) -> Path:
    """A private munged for this cluster (its own key, socket and files under `root/munge`, run as the munge
    user), so that clusters of concurrent test sessions never share or stop each other's munged. Returns its
    socket."""
    munge = root / "munge"
    munge.mkdir()
    munge.chmod(0o711)  # as /run/munge: jobs of any user reach the socket (their srun needs it), list nothing
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for path in (munge, key):
        shutil.chown(path, "munge", "munge")
    socket_path = munge / "munge.socket"
    subprocess.run(
        [
            "runuser", "-u", "munge", "--", "munged", "--force",
            f"--socket={socket_path}", f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        cred = subprocess.run(["munge", "-n", f"--socket={socket_path}"], capture_output=True, check=False)
        check = subprocess.run(
            ["unmunge", f"--socket={socket_path}"], input=cred.stdout, capture_output=True, check=False
        )
        if check.returncode == 0:
            return socket_path
        if time.monotonic() > deadline:
            raise RuntimeError(f"munged did not start: {(cred.stderr + check.stderr).decode()}")
        time.sleep(0.2)


TMP_DISK_MB = 2048  # each node's TmpDisk


def _slurm_conf(root: Path, host: str, nodes: Sequence[str], cpus: int, memory_mb: int, munge: Path) -> str:
    """One node is this machine under its own name; several are slurmds on this machine, one per name
    (`slurmd -N`), each on its own port with its own spool, pid and log files."""
    # TmpDisk: 2 GiB of /tmp for `--tmp` requests (SkyPilot's disk_size), well below what the machine has.
    if len(nodes) == 1:
        node_lines = [
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} TmpDisk={TMP_DISK_MB} "
            "State=UNKNOWN"
        ]
    else:
        node_lines = [
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={cpus} "
            f"RealMemory={memory_mb} TmpDisk={TMP_DISK_MB} State=UNKNOWN"
            for n in nodes
        ]
    return f"""\
ClusterName=tandemtest
AuthInfo=socket={munge}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MinJobAge=300
KillWait=5
InactiveLimit=0
SchedulerParameters=sched_interval=1
{chr(10).join(node_lines)}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a daemon's parent is init, which in a container may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _stop(pid_file: Path, name: str) -> None:
    pid = None
    with suppress(OSError, ValueError):
        pid = int(pid_file.read_text().strip())
    if pid is None:
        return
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if not _running(pid):
            return
        time.sleep(0.1)
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def wait_idle(cluster: SlurmCluster, timeout_s: float = 60.0) -> None:
    """Waits until `sinfo` shows every node idle (or mixed, allocated: up and taking jobs)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        last = (out.stdout + out.stderr).strip()
        states = out.stdout.split()
        if (
            out.returncode == 0
            and len(states) == len(cluster.nodes)
            and set(states) <= {"idle", "mixed", "allocated"}
        ):
            return
        time.sleep(0.3)
    raise RuntimeError(f"the Slurm nodes never became idle: {last!r}; see the slurmd logs in {cluster.root}")


@contextmanager
def running_cluster(cpus: int = 2, memory_mb: int = 4000, nodes: int = 1) -> Iterator[SlurmCluster]:
    """Starts munged, slurmctld and one slurmd per node (each with `cpus` and `memory_mb`); stops them on
    exit."""
    if not available():
        raise RuntimeError("Slurm is not installed (apt-get install -y slurm-wlm munge)")
    root = Path(tempfile.mkdtemp(prefix="tandem-slurm-"))
    root.chmod(0o755)
    host = socket.gethostname().split(".")[0]
    names = (host,) if nodes == 1 else tuple(f"tn{i}" for i in range(nodes))
    (root / "state").mkdir()
    for name in names:
        (root / "spool" / name).mkdir(parents=True)
    conf = root / "slurm.conf"
    cluster = SlurmCluster(conf=conf, node=names[0], root=root, nodes=names)
    env = {**os.environ, **cluster.env}
    try:
        conf.write_text(_slurm_conf(root, host, names, cpus, memory_mb, _start_munge(root)))
        subprocess.run(["slurmctld", "-f", str(conf), "-c"], env=env, check=True, capture_output=True)
        for name in names:
            by_name = ["-N", name] if nodes > 1 else []
            subprocess.run(["slurmd", "-f", str(conf), *by_name], env=env, check=True, capture_output=True)
        wait_idle(cluster)
        yield cluster
    finally:
        for name in names:
            _stop(root / f"slurmd-{name}.pid", "slurmd")
        _stop(root / "slurmctld.pid", "slurmctld")
        _stop(root / "munge" / "munged.pid", "munged")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running one-node cluster for the whole session."""
    if not available():
        if os.environ.get("CI"):
            pytest.fail("Slurm is not installed; .ci/run installs slurm-wlm and munge")
        pytest.skip("Slurm is not installed (apt-get install -y slurm-wlm munge)")
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def slurm_two_nodes() -> Iterator[SlurmCluster]:
    """A running two-node cluster (two slurmds on this machine, one CPU each) for multi-node tasks."""
    if not available():
        if os.environ.get("CI"):
            pytest.fail("Slurm is not installed; .ci/run installs slurm-wlm and munge")
        pytest.skip("Slurm is not installed (apt-get install -y slurm-wlm munge)")
    with running_cluster(cpus=1, memory_mb=2000, nodes=2) as cluster:
        yield cluster
