"""The `local` backend: each node rank of an attempt is a process group on the scheduler's own machine.

One attempt lives in `<root>/<key>/` (the attempt folder): `launch.json`, the marker `find` reads, written
atomically **before** any process starts and rewritten with the processes once they run. Each node rank runs

    bash -c <wrapper> tandem-rank <command> <exit file>

in its own session (`start_new_session=True`, so its pid is its process group id), with stdout and stderr
appended to `<log_dir>/rank-<r>.log` (the attempts of one task may share a log folder: each appends). The
wrapper runs the command with `bash -euo pipefail -c` and writes the command's exit code to
`<root>/<key>/rank-<r>.exit` (through a rename, so a reader never sees half of it), then exits with that
code. A scheduler that restarted is not the parent of the processes any more and cannot wait for them, so
it reads their exit code from that file.

The handle names each rank's pid, pgid and start time (field 22 of /proc/<pid>/stat, in clock ticks since
boot) and the boot id: a process counts as the attempt's only when all three match, so a pid the kernel
reused for something else is never mistaken for the task.

A rank that ended without an exit file was killed by a signal the wrapper could not outlive (SIGKILL): after
`cancel` that is reported as 128 + 9, otherwise the attempt is LOST. When one rank of a multi-node attempt
fails, the others are sent SIGTERM (SIGKILL after `failure_grace_s`) and the attempt is EXITED with the failed
rank's code once every rank has ended.

Processes that leave their process group on purpose (`setsid`, daemons) escape `cancel`. There are no
file mounts: a spec's mount must name a host path at that same path, otherwise launch refuses it.

**Whose account** (`run_as`). `mesh`: the scheduler's own, so a task can read whatever the mesh can, its
state folder included; with `one_organization` (what the scheduler's `auto` falls back to where it cannot
isolate) the first organization to launch is the only one served. `org` (the scheduler running as root):
each organization's tasks run as an unprivileged user of its own, `tdm-<org>` (created with `useradd
--system` on first use), which owns the attempt folder, the task's working folder and its volumes (mode
0700), and with `sandbox` inside bubblewrap (`sandbox.py`: its own /proc, the mesh's state folder empty but
for the task's folders). The folders above them get execute-only permission for others, so the task can
reach its own folders without listing anything; the mesh keeps its keys and databases 0600 (`harden_state`).
A mount of a folder of the scheduler's that is not the organization's own is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.files import write_atomic
from services.scheduler.backends import group_hosts
from services.scheduler.backends import sandbox as sandboxing
from services.scheduler.backends.base import (
    Handle,
    LaunchRefused,
    LaunchSpec,
    NodeAssignment,
    NodeInventory,
    Observed,
    Phase,
)
from services.scheduler.backends.task_image import (
    ATTEMPT_DIR_ENV,
    DEFAULT_PULL_TIMEOUT_S,
    PULL_TIMEOUT_ENV,
    RUNTIME_CONFIG_ENVS,
    RUNTIME_ENV,  # the docker or podman CLI a task with an image runs through
)

KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
MARKER = "launch.json"
LOCK = "launch.lock"
MAX_COMMAND_BYTES = 131072 - 1  # MAX_ARG_STRLEN: the command is one argument of bash -c
CONTAINER_RUNTIMES = ("docker", "podman")  # tried in order for a task with an image
KEY_ENV = "TANDEM_ATTEMPT_KEY"  # in every rank's environment, so find can recognise its processes
CANCELLED = "cancelled"  # a file in the attempt folder: cancel was asked for
FAILED_AT = "failed_at"  # a file in the attempt folder: when a rank was first seen failing
ORGANIZATION = "organization"  # under one_organization: the one organization this backend serves

# The variables a task inherits from the scheduler's own environment; everything else comes from the spec,
# so nothing of the scheduler's (its mesh key, its credentials) leaks into a task.
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TZ", "TMPDIR")

_WRAPPER = """\
trap 'tandem_signalled=1' TERM INT HUP
bash -euo pipefail -c "$1"
code=$?
printf '%s\\n' "$code" > "$2.tmp" && mv -f "$2.tmp" "$2"
exit "$code"
"""


def check_key(key: str) -> None:
    """Keys name folders and Slurm jobs: letters, digits, `.`, `_`, `-`, not starting with `.` or `-`."""
    if not KEY_PATTERN.fullmatch(key):
        raise LaunchRefused(f"attempt key {key!r} must match {KEY_PATTERN.pattern}")


def check_mounts(spec: LaunchSpec) -> None:
    """Processes on a host see its files as they are: a mount can only name a host path at that same path."""
    for path, source, _read_only in spec.file_mounts:
        if path != source:
            raise LaunchRefused(
                f"the {spec.key} attempt mounts {source} at {path}: this backend has no mounts"
            )


def check_disk(spec: LaunchSpec, folder: Path) -> None:
    """SkyPilot's `disk_size` on a host: the task's folder must have that much free space now."""
    wanted = spec.resources.disk_gib
    if wanted <= 0:
        return
    free = shutil.disk_usage(folder).free / 2**30
    if free < wanted:
        raise LaunchRefused(
            f"the task asks {wanted:g} GiB of disk (resources.disk_size); {folder} has {free:.1f} GiB free"
        )


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_time(pid: int, *, zombie: bool = False) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); None for a gone pid, and for a
    zombie unless `zombie`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] in ("Z", "X") and not zombie:
        return None
    return int(fields[19])


def _first_failure(attempt_dir: Path) -> tuple[float, int] | None:
    """(when, rank) of the first rank seen failing, as recorded in the attempt folder."""
    try:
        data = json.loads((attempt_dir / FAILED_AT).read_text())
        return float(data["time"]), int(data["rank"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _group_is_ours(rank: _Rank) -> bool:
    """Whether signalling the rank's process group can only reach the task. Linux never hands out a pid that
    is still some group's id, so a group whose leader is gone holds only the task's leftovers (or nothing);
    a live process with the leader's pid but another start time means the pid, and the group, are new."""
    if rank.pgid <= 0:
        return False
    start = process_start_time(rank.pgid, zombie=True)
    return start is None or start == rank.start_time


def _mark_cancelled(attempt_dir: Path) -> None:
    if attempt_dir.is_dir():
        write_atomic(attempt_dir / CANCELLED, f"{time.time()}\n")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def detect_gpus() -> tuple[int, str]:
    """(count, model) from `nvidia-smi`; (0, "") where there is none."""
    if not shutil.which("nvidia-smi"):
        return 0, ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, ""
    names = [line.split(",", 1)[1].strip() for line in out.splitlines() if "," in line]
    return len(names), (names[0].removeprefix("NVIDIA ") if names else "")


def _memory_gib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1024 * 1024)
    return 0.0


def _processes_with_key(key: str, attempt_dir: Path, log_dir: Path) -> list[dict[str, Any]]:
    """The rank wrappers (session leaders) whose environment holds `TANDEM_ATTEMPT_KEY=<key>`."""
    wanted = f"{KEY_ENV}={key}".encode()
    found: list[dict[str, Any]] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if wanted not in environ or os.getsid(pid) != pid:
                continue
        except (OSError, ProcessLookupError):
            continue
        start = process_start_time(pid)
        rank = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"TANDEM_NODE_RANK=")), b"0")
        if start is None:
            continue
        r = int(rank)
        found.append(
            {
                "rank": r,
                "pid": pid,
                "pgid": pid,
                "start_time": start,
                "exit_file": str(attempt_dir / f"rank-{r}.exit"),
                "log": str(log_dir / f"rank-{r}.log"),
            }
        )
    return sorted(found, key=lambda r: int(r["rank"]))


@dataclass
class _Rank:
    rank: int
    pid: int
    pgid: int
    start_time: int
    exit_file: Path
    log: Path


class LocalBackend:
    """Runs attempts as process groups on this machine. `root` holds one folder per attempt key; GPU, CPU
    and memory counts left as None are read from the machine (`nvidia-smi`, the CPUs this process may use,
    /proc/meminfo)."""

    name = "local"

    def __init__(
        self,
        root: Path,
        *,
        gpus: int | None = None,
        gpu_type: str | None = None,
        cpus: float | None = None,
        memory_gib: float | None = None,
        node_name: str = "",
        address: str = "127.0.0.1",
        inherit_env: Sequence[str] = INHERITED_ENV,
        failure_grace_s: float = 10.0,
        run_as: str = "mesh",
        sandbox: bool | None = None,
        hide: Sequence[Path] = (),
        one_organization: bool = False,
        container_runtimes: Sequence[str] = CONTAINER_RUNTIMES,
        image_pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
    ) -> None:
        check_run_as(run_as)
        self.run_as = run_as
        if sandbox is None:
            sandbox = run_as == "org" and not sandboxing.problem()
        if sandbox and run_as != "org":
            raise ValueError("the sandbox runs tasks as their organization's user: it needs run_as = org")
        self.sandbox = sandbox
        # What a sandboxed task finds empty: the scheduler's work folder (`root`'s parent) and `hide`.
        self.hide = tuple(dict.fromkeys([Path(root).resolve().parent, *(Path(h).resolve() for h in hide)]))
        self.one_organization = one_organization
        self.container_runtimes = tuple(container_runtimes)
        if image_pull_timeout_s <= 0:
            raise ValueError("image_pull_timeout_s must be positive")
        self.image_pull_timeout_s = image_pull_timeout_s
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if gpus is None:
            detected, model = detect_gpus()
            gpus, gpu_type = detected, gpu_type if gpu_type is not None else model
        self.gpus = gpus
        self.gpu_type = gpu_type or ""
        self.cpus = cpus if cpus is not None else float(len(os.sched_getaffinity(0)))
        self.memory_gib = memory_gib if memory_gib is not None else _memory_gib()
        self.node_name = node_name or socket.gethostname()
        self.address = address
        self.inherit_env = tuple(inherit_env)
        self.failure_grace_s = failure_grace_s
        self._boot_id = boot_id()
        self._bash = shutil.which("bash") or "/bin/bash"
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # pid -> the processes this object started
        self._locks: dict[str, asyncio.Lock] = {}
        self._ended: set[str] = set()  # keys whose processes have all ended, skipped by inventory

    # -- the Backend interface ---------------------------------------------------------------------------

    async def inventory(self) -> list[NodeInventory]:
        """One node: this machine. What is free is the capacity less what running attempts reserved."""
        gpus_held: set[int] = set()
        gpus_unindexed = 0
        cpus_held = 0.0
        memory_held = 0.0
        for marker in self.root.glob(f"*/{MARKER}"):
            if marker.parent.name in self._ended:
                continue
            handle = self._read_marker(marker)
            if handle is None or not handle.get("ranks"):
                continue
            if not self._alive_ranks(handle):
                self._ended.add(marker.parent.name)  # an attempt that ended never runs again
                continue
            res = handle.get("resources", {})
            for node in handle.get("nodes", []):
                gpus_held.update(node.get("gpu_indices", []))
            if not any(node.get("gpu_indices") for node in handle.get("nodes", [])):
                gpus_unindexed += int(res.get("gpus", 0)) * int(handle.get("num_nodes", 1))
            cpus_held += float(res.get("cpus", 0.0)) * int(handle.get("num_nodes", 1))
            memory_held += float(res.get("memory_gib", 0.0)) * int(handle.get("num_nodes", 1))
        return [
            NodeInventory(
                name=self.node_name,
                address=self.address,
                gpus=self.gpus,
                gpus_free=max(0, self.gpus - len(gpus_held) - gpus_unindexed),
                gpu_type=self.gpu_type,
                cpus=self.cpus,
                cpus_free=max(0.0, self.cpus - cpus_held),
                memory_gib=self.memory_gib,
                memory_free_gib=max(0.0, self.memory_gib - memory_held),
            )
        ]

    async def option_problems(self, options: Mapping[str, str]) -> dict[str, str]:
        """None: a job has no options for the local backend (a spec with a `slurm` or `kubernetes` block is
        not for it)."""
        return {}

    async def launch(self, spec: LaunchSpec) -> Handle:
        check_key(spec.key)
        check_mounts(spec)
        if spec.num_nodes < 1:
            raise LaunchRefused(f"num_nodes must be at least 1, not {spec.num_nodes}")
        if spec.nodes and len(spec.nodes) != spec.num_nodes:
            raise LaunchRefused(f"{len(spec.nodes)} node assignments for {spec.num_nodes} nodes")
        if len(spec.command.encode()) > MAX_COMMAND_BYTES:
            raise LaunchRefused(
                f"the command is over {MAX_COMMAND_BYTES} bytes, Linux's limit for one argument"
            )
        async with self._locks.setdefault(spec.key, asyncio.Lock()):
            return await asyncio.to_thread(self._launch_once, spec)

    async def find(self, key: str) -> Handle | None:
        """The handle in `<root>/<key>/launch.json`. A marker without processes (the scheduler died between
        writing it and recording them) is completed from the processes that carry `TANDEM_ATTEMPT_KEY=<key>`
        in their environment; when there are none, nothing was launched."""
        return await asyncio.to_thread(self._find, key)

    def _find(self, key: str) -> Handle | None:
        if not KEY_PATTERN.fullmatch(key):
            return None
        marker = self.root / key / MARKER
        handle = self._read_marker(marker)
        if handle is None:
            return None
        if handle.get("ranks"):
            return handle
        ranks = _processes_with_key(key, Path(handle["dir"]), Path(handle["log_dir"]))
        if not ranks:
            return None
        handle["ranks"] = ranks
        handle["pid"], handle["pgid"] = ranks[0]["pid"], ranks[0]["pgid"]
        write_atomic(marker, json.dumps(handle))
        return handle

    async def poll(self, handle: Handle) -> Observed:
        ranks = self._ranks(handle)
        nodes = self._nodes(handle)
        if not ranks:
            return Observed(Phase.LOST, message="the attempt's processes were never started", nodes=nodes)
        attempt_dir = Path(handle["dir"])
        cancelled = (attempt_dir / CANCELLED).exists()
        running: list[_Rank] = []
        codes: dict[int, int | None] = {}
        for rank in ranks:
            code = self._rank_exit(rank)
            if code is None and self._is_alive(rank):
                running.append(rank)
            else:
                codes[rank.rank] = code
        failed = {r: c for r, c in codes.items() if c != 0}
        if running:
            if failed and not cancelled:
                first, code = min(failed.items())
                self._stop_after_failure(attempt_dir, first, running)
                why = f"rank {first} exited {code}" if code is not None else f"rank {first} vanished"
                return Observed(Phase.RUNNING, message=f"{why}; stopping the other ranks", nodes=nodes)
            return Observed(Phase.RUNNING, nodes=nodes)
        if not failed:
            return Observed(Phase.EXITED, exit_code=0, nodes=nodes)
        recorded = _first_failure(attempt_dir)
        first, code = min(failed.items(), key=lambda item: (item[1] is None, item[0]))
        if recorded is not None and recorded[1] in failed:
            first, code = recorded[1], failed[recorded[1]]
        if code is None:
            if cancelled:
                return Observed(
                    Phase.EXITED, exit_code=128 + signal.SIGKILL, message="cancelled", nodes=nodes
                )
            return Observed(
                Phase.LOST,
                message=f"rank {first} ended without an exit status (killed from outside?)",
                nodes=nodes,
            )
        message = "cancelled" if cancelled else (f"rank {first} exited {code}" if len(ranks) > 1 else "")
        return Observed(Phase.EXITED, exit_code=code, message=message, nodes=nodes)

    async def cancel(self, handle: Handle, grace_s: float = 10.0) -> None:
        """SIGTERM to every rank's process group, SIGKILL to what is left after `grace_s`; returns when every
        rank has ended (at most about `grace_s` plus the kill)."""
        ranks = self._ranks(handle)
        alive = [r for r in ranks if self._is_alive(r)]
        if alive:  # before any signal, so a rank SIGKILL leaves without an exit file reads as cancelled
            _mark_cancelled(Path(handle["dir"]))
        for rank in alive:
            _signal_group(rank.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            alive = [r for r in alive if self._is_alive(r)]
        for rank in ranks:  # the whole tree: the wrapper may be gone while a child of it lingers
            if _group_is_ours(rank):
                _signal_group(rank.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0  # a process stuck in the kernel (D state) dies when it can
        while alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            alive = [r for r in alive if self._is_alive(r)]

    def logs(self, handle: Handle, node_rank: int = 0) -> Path | None:
        path = Path(handle["log_dir"]) / f"rank-{node_rank}.log"
        return path if path.exists() else None

    async def close(self) -> None:
        """Forgets the processes it started; they keep running and a new backend object reattaches."""
        self._children.clear()

    # -- launching ---------------------------------------------------------------------------------------

    def _launch_once(self, spec: LaunchSpec) -> Handle:
        """Under an exclusive lock on the attempt folder, so two schedulers sharing `root` (or two backend
        objects) never both start a key."""
        attempt_dir = self.root / spec.key
        attempt_dir.mkdir(parents=True, exist_ok=True)
        with open(attempt_dir / LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            existing = self._find(spec.key)
            return existing if existing is not None else self._launch(spec, attempt_dir)

    def _launch(self, spec: LaunchSpec, attempt_dir: Path) -> Handle:
        log_dir = Path(spec.log_dir) if str(spec.log_dir) not in ("", ".") else attempt_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        cwd = Path(spec.workdir) if spec.workdir is not None else attempt_dir
        if not cwd.is_dir():
            raise LaunchRefused(f"workdir {cwd} is not a folder")
        check_disk(spec, cwd)
        runtime = self.container_runtime(spec.image) if spec.image else ""
        account = None
        if self.run_as == "org":
            work_dir = self.root.parent.resolve()
            for _, source, _ in spec.file_mounts:
                path = Path(source).resolve()
                if any(path.is_relative_to(h) for h in self.hide) and not path.is_relative_to(work_dir):
                    raise LaunchRefused(f"the mount of {source} names a path in the mesh's state folder")
            account = hand_over_attempt(
                spec, (attempt_dir, cwd, log_dir), work_dir, open_above=not self.sandbox
            )
        elif self.one_organization:
            claim_organization(self.root, job_org(spec.job), "TANDEM_SCHEDULER_LOCAL__RUN_AS")
        nodes = self._assign(spec)
        handle: Handle = {
            "backend": self.name,
            "key": spec.key,
            "dir": str(attempt_dir),
            "log_dir": str(log_dir),
            "num_nodes": spec.num_nodes,
            "boot_id": self._boot_id,
            "resources": {
                "gpus": spec.resources.gpus,
                "cpus": spec.resources.cpus,
                "memory_gib": spec.resources.memory_gib,
            },
            "nodes": [
                {"rank": n.rank, "node": n.node, "address": n.address, "gpu_indices": list(n.gpu_indices)}
                for n in nodes
            ],
            "ranks": [],
        }
        for rank in range(spec.num_nodes):  # a relaunch after a crash before any process started
            (attempt_dir / f"rank-{rank}.exit").unlink(missing_ok=True)
        write_atomic(attempt_dir / MARKER, json.dumps(handle))
        ranks: list[dict[str, Any]] = []
        try:
            for node in nodes:
                ranks.append(self._start_rank(spec, node, nodes, attempt_dir, log_dir, cwd, account, runtime))
        except OSError as exc:
            for started in ranks:
                _signal_group(started["pgid"], signal.SIGKILL)
            (attempt_dir / MARKER).unlink(missing_ok=True)
            raise LaunchRefused(f"cannot start the task: {exc}") from exc
        handle["ranks"] = ranks
        handle["pid"], handle["pgid"] = ranks[0]["pid"], ranks[0]["pgid"]
        write_atomic(attempt_dir / MARKER, json.dumps(handle))
        return handle

    def _assign(self, spec: LaunchSpec) -> list[NodeAssignment]:
        if spec.nodes:
            return sorted(spec.nodes, key=lambda n: n.rank)
        return [
            NodeAssignment(rank=r, node=self.node_name, address=self.address) for r in range(spec.num_nodes)
        ]

    def _env(self, spec: LaunchSpec, node: NodeAssignment, nodes: Sequence[NodeAssignment]) -> dict[str, str]:
        env = {name: os.environ[name] for name in self.inherit_env if name in os.environ}
        env.update(spec.env)
        ips = "\n".join(n.address or self.address for n in nodes)
        env.setdefault("TANDEM_NUM_NODES", str(spec.num_nodes))
        env.setdefault("SKYPILOT_NUM_NODES", str(spec.num_nodes))
        for variable in ("TANDEM_NODE_IPS", "SKYPILOT_NODE_IPS", "SKYPILOT_SETUP_NODE_IPS"):
            env.setdefault(variable, ips)
        env.setdefault("TANDEM_RESTART_COUNT", str(spec.attempt))
        env["TANDEM_NODE_RANK"] = env["SKYPILOT_NODE_RANK"] = env["SKYPILOT_SETUP_NODE_RANK"] = str(node.rank)
        env[KEY_ENV] = spec.key
        if node.gpu_indices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in node.gpu_indices)
        return env

    def _start_rank(
        self,
        spec: LaunchSpec,
        node: NodeAssignment,
        nodes: Sequence[NodeAssignment],
        attempt_dir: Path,
        log_dir: Path,
        cwd: Path,
        account: pwd.struct_passwd | None = None,
        runtime: str = "",
    ) -> dict[str, Any]:
        log = log_dir / f"rank-{node.rank}.log"
        exit_file = attempt_dir / f"rank-{node.rank}.exit"
        env = self._env(spec, node, nodes)
        if runtime:  # for task_image.py, which pulls the image within the bound and runs the task in it
            env[RUNTIME_ENV] = runtime
            env[PULL_TIMEOUT_ENV] = f"{self.image_pull_timeout_s:g}"
            env[ATTEMPT_DIR_ENV] = str(attempt_dir)
            env.update({k: os.environ[k] for k in RUNTIME_CONFIG_ENVS if k in os.environ})
        user: dict[str, Any] = {}
        argv = [self._bash, "-c", _WRAPPER, "tandem-rank", spec.command, str(exit_file)]
        if account is not None:
            env["HOME"], env["USER"], env["LOGNAME"] = str(cwd), account.pw_name, account.pw_name
            if self.sandbox:
                argv = sandboxing.command(
                    argv,
                    account,
                    cwd=cwd,
                    hide=self.hide,
                    own=[attempt_dir, cwd, log_dir, *_hosts_folder(spec)],
                    mounts=[(Path(source), read_only) for _, source, read_only in spec.file_mounts],
                )
            else:
                user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
                **user,
            )
        self._children[proc.pid] = proc
        start = process_start_time(proc.pid, zombie=True)
        return {
            "rank": node.rank,
            "pid": proc.pid,
            "pgid": proc.pid,  # a new session leader leads its own process group
            "start_time": start if start is not None else -1,
            "exit_file": str(exit_file),
            "log": str(log),
        }

    def container_runtime(self, image: str) -> str:
        """The first of `container_runtimes` (docker, podman) that is installed and answers; LaunchRefused
        naming what was tried when none does, so a task with an image never runs on the host's software."""
        tried = []
        for name in self.container_runtimes:
            path = shutil.which(name)
            if path is None:
                tried.append(f"{name}: not installed")
                continue
            try:
                done = subprocess.run([path, "info"], capture_output=True, text=True, timeout=20, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                tried.append(f"{name}: {exc}")
                continue
            if done.returncode == 0:
                return path
            last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [
                f"exit {done.returncode}"
            ]
            tried.append(f"{name}: {last[0]}")
        raise LaunchRefused(
            f"the task runs in the image {image} (resources.image_id), and this machine has no container "
            f"runtime that works ({'; '.join(tried) or 'none configured'})"
        )

    # -- watching ----------------------------------------------------------------------------------------

    @staticmethod
    def _read_marker(path: Path) -> Handle | None:
        try:
            data: Handle = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data

    def _ranks(self, handle: Handle) -> list[_Rank]:
        """The handle's ranks; after a reboot no pid is the attempt's any more (pid -1), but the exit files
        still say how the ranks that finished ended."""
        same_boot = handle.get("boot_id", "") == self._boot_id
        return [
            _Rank(
                rank=int(r["rank"]),
                pid=int(r["pid"]) if same_boot else -1,
                pgid=int(r["pgid"]) if same_boot else -1,
                start_time=int(r["start_time"]),
                exit_file=Path(r["exit_file"]),
                log=Path(r["log"]),
            )
            for r in handle.get("ranks", [])
        ]

    def _is_alive(self, rank: _Rank) -> bool:
        if rank.pid <= 0:
            return False
        child = self._children.get(rank.pid)
        if child is not None:  # our own unreaped child: its pid cannot have been reused
            return child.poll() is None
        return process_start_time(rank.pid) == rank.start_time

    def _alive_ranks(self, handle: Handle) -> list[_Rank]:
        return [r for r in self._ranks(handle) if self._is_alive(r)]

    def _rank_exit(self, rank: _Rank) -> int | None:
        """The rank's exit code once it ended: the wrapper's exit file, else the status of our own child."""
        try:
            return int(rank.exit_file.read_text().strip())
        except (OSError, ValueError):
            pass
        child = self._children.get(rank.pid)
        if child is not None and child.poll() is not None:
            return _exit_code(child.returncode)
        return None

    def _stop_after_failure(self, attempt_dir: Path, rank: int, running: Sequence[_Rank]) -> None:
        """SIGTERM to the ranks still running once a rank failed, SIGKILL after `failure_grace_s`; the first
        failed rank is recorded so the attempt reports its code, not the code of the ranks stopped after."""
        first = _first_failure(attempt_dir)
        if first is None:
            first = (time.time(), rank)
            write_atomic(attempt_dir / FAILED_AT, json.dumps({"time": first[0], "rank": rank}))
        sig = signal.SIGKILL if time.time() - first[0] > self.failure_grace_s else signal.SIGTERM
        for r in running:
            _signal_group(r.pgid, sig)

    @staticmethod
    def _nodes(handle: Handle) -> list[NodeAssignment]:
        return [
            NodeAssignment(
                rank=int(n["rank"]),
                node=str(n.get("node", "")),
                address=str(n.get("address", "")),
                gpu_indices=tuple(int(i) for i in n.get("gpu_indices", [])),
            )
            for n in handle.get("nodes", [])
        ]


# ---- accounts (run_as = "org") ---------------------------------------------------------------------


def check_run_as(run_as: str) -> None:
    """`mesh` or `org`; `org` only for a scheduler running as root (it starts tasks as other users)."""
    if run_as not in ("mesh", "org"):
        raise ValueError(f"run_as must be mesh or org, not {run_as!r}")
    if run_as == "org" and os.geteuid() != 0:
        raise ValueError("run_as = org needs the scheduler to run as root (it starts tasks as other users)")


def claim_organization(root: Path, org: str, setting: str) -> None:
    """For a backend whose tasks run as the mesh's own account: the first organization to launch is the only
    one it serves. Its name is kept in `<root>/organization`, created exclusively, so two launches of
    different organizations never both pass; any other organization's launch is refused."""
    path = root / ORGANIZATION
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(org)
    owner = ""
    for _ in range(100):  # a claim a concurrent launch has created and not written yet
        owner = path.read_text().strip()
        if owner:
            break
        time.sleep(0.01)
    if owner != org:
        raise LaunchRefused(
            f"tasks here run as the mesh's own account, which can read the mesh's keys, so this backend serves"
            f" one organization only ({owner or 'another'}), not {org}: run the scheduler as root with"
            f" {setting}=org (see BACKENDS.md, whose account)"
        )


def hand_over_attempt(
    spec: LaunchSpec, folders: Sequence[Path], work_dir: Path, open_above: bool = True
) -> pwd.struct_passwd:
    """The attempt's organization's account (`org_account`), made the owner of the attempt's `folders`
    with what they hold (small, and what the engine wrote there is the task's) and of the named volumes it
    mounts (its organization's folders under `<work_dir>/volumes/<org>/`). The folders between `work_dir`
    and them, `work_dir` included, become execute-only for others, so no task lists the jobs and volumes of
    other organizations.

    A mount of any other path inside `work_dir` (another job's folder, say, a checkpoint to serve) must
    already belong to the organization's user, which wrote it: anything else there, another organization's
    folders above all, is refused and never handed over. A host path outside `work_dir` stays as it is."""
    org = job_org(spec.job)
    account = org_account(org)
    work_dir = work_dir.resolve()
    volumes = work_dir / "volumes" / org
    folders = [*folders, *_hosts_folder(spec)]  # the job's sibling host names, written by its tasks
    handed = list(dict.fromkeys(folders))
    for _, source, _ in spec.file_mounts:
        path = Path(source).resolve()
        if not path.is_relative_to(work_dir):
            continue
        if path.is_relative_to(volumes) and path != volumes:
            handed.append(path)
        elif not path.exists() or path.stat().st_uid != account.pw_uid:
            raise LaunchRefused(
                f"the mount of {source} names a folder of the scheduler's that is not {org}'s own"
            )
    for folder in handed:
        hand_over(folder, account, recursive=folder in folders, open_above=open_above)
    for folder in handed:
        for parent in folder.resolve().parents:
            mode = parent.stat()
            if parent.is_relative_to(work_dir) and mode.st_uid != account.pw_uid:
                os.chmod(parent, (mode.st_mode & 0o7700) | 0o011)  # noqa: S103 - others may enter, not list
    return account


def _hosts_folder(spec: LaunchSpec) -> list[Path]:
    """The job's sibling host names folder (backends/group_hosts.py), shared by its tasks, where it has one."""
    hosts = spec.env.get(group_hosts.DIR_ENV)
    return [Path(hosts)] if hosts else []


def job_org(job: str) -> str:
    """`acme` of `orgs/acme/jobs/j1`."""
    parts = job.split("/")
    if len(parts) < 2 or parts[0] != "orgs" or not parts[1]:
        raise LaunchRefused(f"cannot tell the organization of job {job!r}")
    return parts[1]


def org_user_name(org: str) -> str:
    """`tdm-<org>`, or a shortened name with a hash where that passes the 32 characters a user name may have."""
    name = f"tdm-{org}"
    return name if len(name) <= 32 else f"tdm-{org[:18]}-{hashlib.sha256(org.encode()).hexdigest()[:9]}"


def org_account(org: str) -> pwd.struct_passwd:
    """The organization's unprivileged user, created (a system user with its own group, no login, no home)
    on first use."""
    name = org_user_name(org)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    command = ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"]
    result = subprocess.run(
        [*command, "--shell", "/usr/sbin/nologin", name], capture_output=True, text=True, check=False
    )
    try:
        return pwd.getpwnam(name)  # created now, or by a concurrent launch a moment ago
    except KeyError:
        raise LaunchRefused(
            f"cannot create the user {name} for {org}'s tasks: {result.stderr.strip()}"
        ) from None


def hand_over(
    folder: Path, account: pwd.struct_passwd, recursive: bool = False, open_above: bool = True
) -> None:
    """`folder` (made if missing) owned by `account`, mode 0700 (with what it holds when `recursive`), and
    with `open_above` reachable: each folder above it gets execute-only permission for others (enter, not
    list), so the task reaches its own folders and nothing else by name unless that is readable by everyone.
    A sandboxed task needs none of that (the sandbox opens such folders in its own view), so the host's
    folders keep their modes, and a later change of theirs cannot cut the task off."""
    folder.mkdir(parents=True, exist_ok=True)
    inside = folder.rglob("*") if recursive else ()
    for item in (folder, *inside):
        if not item.is_symlink() and item.stat().st_uid != account.pw_uid:
            os.chown(item, account.pw_uid, account.pw_gid)
    os.chmod(folder, 0o700)
    for parent in folder.resolve().parents if open_above else ():
        mode = parent.stat().st_mode
        if not mode & 0o001:
            os.chmod(parent, (mode & 0o7777) | 0o001)
