"""The `slurm` backend: one Slurm batch job per task attempt, driven through Slurm's own commands.

`launch` submits a generated batch script with `sbatch --parsable`; the job is named after the attempt key
(`--job-name=<key>`), which is how `find` recognises it (`squeue --name`, then `sacct --name` where
accounting exists). The script exports the task's environment, then runs the command once per node as one
`srun` step (`--ntasks-per-node=1`, `--kill-on-bad-exit=1`), each with TANDEM_NODE_RANK / SKYPILOT_NODE_RANK
(and SKYPILOT_SETUP_NODE_RANK) from SLURM_NODEID and TANDEM_NODE_IPS / SKYPILOT_NODE_IPS (and
SKYPILOT_SETUP_NODE_IPS; newline-separated addresses) from `scontrol show hostnames $SLURM_JOB_NODELIST`
(each node's `NodeAddr`, as an IPv4 address where it resolves). Node rank r writes `<log_dir>/rank-<r>.log`
(appended, so a requeued job's runs follow each other); the batch shell itself writes `<log_dir>/batch.log`.
When a node fails, srun stops the others and the job exits with the code of the node that failed first.

State comes from `scontrol show job` (live jobs and finished ones Slurm still remembers, `MinJobAge`) and,
for jobs it forgot, from `sacct` where the cluster has accounting (slurmdbd); a job neither knows is LOST.
Slurm's states map to `Observed` as:

| Slurm | Observed |
|---|---|
| PENDING, CONFIGURING, SUSPENDED, RESV_DEL_HOLD | QUEUED (preempted when Slurm restarted it before: `Restarts` > 0) |
| REQUEUED, REQUEUE_HOLD, REQUEUE_FED | QUEUED, preempted |
| RUNNING, COMPLETING, SIGNALING, STAGE_OUT | RUNNING |
| COMPLETED | EXITED 0 |
| FAILED, CANCELLED, TIMEOUT, DEADLINE, OUT_OF_MEMORY | EXITED with Slurm's `ExitCode` (`code:signal`) |
| PREEMPTED | LOST, preempted |
| NODE_FAIL, BOOT_FAIL, LAUNCH_FAILED, anything else | LOST |

A signal in `ExitCode` is reported as 128 + the signal. A job whose `ExitCode` is 0:0 although it did not
complete is reported as 143 (SIGTERM) when cancelled or timed out, 137 when out of memory, 1 when FAILED.

Priorities: `--nice=1000 - priority`, so priority 1000 submits at nice 0 and priority 0 at nice 1000 (nice
is only ever raised, which any user may do). `qos_by_priority` optionally picks a QoS by priority threshold.

**Whose account** (`run_as`). `mesh`: the scheduler's own, which can read the mesh's state folder, fit for
one organization only. `org` (the scheduler running as root): `sbatch --uid=tdm-<org> --gid=<its group>`,
the organization's unprivileged user of the local backend, which gets the job's working and log folders
(and its named volumes) and its own HOME, USER and LOGNAME; every node must know the user by the same uid.

A Slurm command that cannot reach slurmctld (or is not installed, or runs past `command_timeout_s`) raises
`BackendUnavailable`; a submission Slurm rejects raises `LaunchRefused` with Slurm's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import math
import os
import pwd
import re
import shlex
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.scheduler.backends.base import (
    BackendUnavailable,
    Handle,
    LaunchRefused,
    LaunchSpec,
    NodeAssignment,
    NodeInventory,
    Observed,
    Phase,
)
from services.scheduler.backends.local import (
    INHERITED_ENV,
    MAX_COMMAND_BYTES,
    check_key,
    check_mounts,
    check_run_as,
    claim_organization,
    hand_over_attempt,
    job_org,
    org_account,
)
from services.scheduler.backends.task_image import LOGIN_ENVS
from services.scheduler.backends.task_secrets import format_secrets

_UNREACHABLE = (
    "unable to contact slurm controller",
    "connect failure",
    "connection refused",
    "socket timed out",
    "zero bytes were transmitted",
    "communication connection failure",
    "slurm_persist_conn_open",
    "unable to establish controller",
    "slurmctld not responding",
)
_INVALID_JOB = ("invalid job id", "unknown job")
_OWN_ACCOUNT_ENV = ("HOME", "USER", "LOGNAME")  # under run_as = org, the job's user's, never the scheduler's
QUEUED_STATES = {"PENDING", "CONFIGURING", "SUSPENDED", "RESV_DEL_HOLD", "RESIZING"}
REQUEUED_STATES = {"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}
RUNNING_STATES = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "STOPPED"}
EXITED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "DEADLINE", "OUT_OF_MEMORY"}
_NODE_DOWN = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN", "POWER_DOWN", "FUTURE", "UNKNOWN")

# Runs on every node of the job as one srun task; $1 is the task's command.
# A node that fails records when and how in the log folder ($2); the ranks srun then stops die of its signal
# before they could, so the job exits with the code of the rank that failed first, not of those stopped after.
_NODE_SHELL = """export TANDEM_NODE_RANK="$SLURM_NODEID" SKYPILOT_NODE_RANK="$SLURM_NODEID" \\
  SKYPILOT_SETUP_NODE_RANK="$SLURM_NODEID"
bash -euo pipefail -c "$1"
code=$?
if [ "$code" != 0 ]; then echo "$(date +%s%N) $code" > "$2/.exit-$SLURM_JOB_ID-$SLURM_NODEID"; fi
exit "$code"
"""

# After the step: the first failure's code, else srun's.
_FIRST_FAILURE = """code=$?
if [ "$code" != 0 ]; then
  first=$(cat "$tandem_logs"/.exit-"$SLURM_JOB_ID"-* 2>/dev/null | sort -n | head -n 1 | cut -d' ' -f2)
  code=${first:-$code}
fi
rm -f "$tandem_logs"/.exit-"$SLURM_JOB_ID"-*
exit "$code"
"""


# Every node's address, by node rank: Slurm's NodeAddr, as an IPv4 address where it resolves.
_NODE_IPS = r"""tandem_ips=""
for h in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  addr=$(scontrol show node "$h" -o | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  ip=$(getent ahostsv4 "${addr:-$h}" 2>/dev/null | awk 'NR==1{print $1}')
  tandem_ips+="${ip:-${addr:-$h}}"$'\n'
done
export TANDEM_NODE_IPS="${tandem_ips%$'\n'}" SKYPILOT_NODE_IPS="${tandem_ips%$'\n'}" \
  SKYPILOT_SETUP_NODE_IPS="${tandem_ips%$'\n'}"
"""


CONTAINER_RUNTIMES = ("pyxis", "apptainer")
PREEMPTIBLE_NICE = 2001  # added for use_spot: after every attempt that is not preemptible (nice 0..2000)


def enroot_image(image: str) -> str:
    """A docker reference as enroot writes it: a registry host is set off by `#` (`nvcr.io/nvidia/pytorch:24`
    -> `nvcr.io#nvidia/pytorch:24`); an image of the default registry stays as it is."""
    first, sep, rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return f"{first}#{rest}"
    return image


def registry_login(spec: LaunchSpec) -> dict[str, str]:
    """`{ENV: secret name}` of SkyPilot's registry login (SKYPILOT_DOCKER_USERNAME, _PASSWORD, _SERVER) when
    the task has an image and all three among its secrets; empty otherwise."""
    if not spec.image or not all(name in spec.secret_env for name in LOGIN_ENVS):
        return {}
    return {name: spec.secret_env[name] for name in LOGIN_ENVS}


def nice_for(priority: int) -> int:
    """Tandem's priority -1000..1000 (higher first) as Slurm's nice (higher last): 1000 - priority, 0..2000."""
    return 1000 - max(-1000, min(1000, priority))


def _time_limit(seconds: float) -> str:
    """Slurm's `days-hours:minutes:seconds`; Slurm itself rounds up to whole minutes."""
    total = math.ceil(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"


def parse_fields(line: str) -> dict[str, str]:
    """`Key=Value Key=Value ...` as `scontrol -o` prints it; values may contain `=` but not spaces, except
    the trailing free-text fields, which are not needed here."""
    fields: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def exit_code_of(slurm_exit: str) -> int:
    """Slurm's `ExitCode=code:signal` as a process exit code (a signal death is 128 + the signal)."""
    code, _, sig = slurm_exit.partition(":")
    try:
        if sig and int(sig) > 0:
            return 128 + int(sig)
        return int(code)
    except ValueError:
        return 1


def observe(fields: Mapping[str, str], nodes: Sequence[NodeAssignment] = ()) -> Observed:
    """`Observed` from a job's fields (`JobState`, `Reason`, `ExitCode`, `Restarts`), as scontrol or sacct
    report them; see the module docstring for the mapping."""
    state = fields.get("JobState", "").split()[0].rstrip("+") if fields.get("JobState") else ""
    reason = fields.get("Reason", "")
    restarts = int(fields.get("Restarts", "0") or 0)
    detail = f"{state}" + (f" ({reason})" if reason and reason not in ("None", "(null)") else "")
    if state in REQUEUED_STATES:
        return Observed(Phase.QUEUED, message=detail, preempted=True)
    if state in QUEUED_STATES:
        if restarts:
            return Observed(Phase.QUEUED, message=f"{detail}; requeued {restarts}x", preempted=True)
        return Observed(Phase.QUEUED, message=detail)
    if state in RUNNING_STATES:
        message = f"running again after {restarts} requeue(s)" if restarts else ""
        return Observed(Phase.RUNNING, message=message, nodes=nodes)
    if state == "COMPLETED":
        return Observed(Phase.EXITED, exit_code=0, nodes=nodes)
    if state in EXITED_STATES:
        code = exit_code_of(fields.get("ExitCode", "1:0"))
        if code == 0:  # ended before the script reported anything: how Slurm ends such jobs
            code = {"OUT_OF_MEMORY": 128 + 9, "FAILED": 1}.get(state, 128 + 15)
        return Observed(Phase.EXITED, exit_code=code, message=detail, nodes=nodes)
    if state == "PREEMPTED":
        return Observed(Phase.LOST, message=detail, preempted=True, nodes=nodes)
    return Observed(Phase.LOST, message=detail or "Slurm reports no state for the job", nodes=nodes)


class SlurmBackend:
    """Submits attempts to a Slurm cluster through `sbatch`, `squeue`, `scontrol`, `scancel`, `sinfo`
    and, where accounting exists, `sacct`. Every command runs with `env` added to this process's environment
    (e.g. `SLURM_CONF`) and is killed after `command_timeout_s`.

    partition, account, qos: passed as `--partition`, `--account`, `--qos` when not empty; a spec's own
      (`LaunchSpec.options`) win. A spec's partition the cluster does not have, or its `cluster` when that
      is not this cluster's ClusterName, refuses the launch (PRECHECK), naming it.
    qos_by_priority: (minimum priority, QoS) pairs; the highest threshold at or below a spec's priority wins
      over `qos`.
    cluster: a named cluster (`--clusters`) for federations; empty for the default one.
    extra_sbatch_args: appended to every sbatch call as given (e.g. `--constraint=h100`).
    inherit_env: variables of this process a job gets (`--export`); the task's own environment comes from
      the spec, so nothing else of the scheduler's leaks into a job.
    use_sacct: True/False forces it; None asks `sacct` once whether accounting is enabled.
    run_as: whose account a job runs as. `mesh`: the scheduler's own (`sbatch` as it is), which can read
      the mesh's state folder. `org` (the scheduler running as root): the organization's own unprivileged
      user, `tdm-<org>` as on the local backend (`sbatch --uid --gid`), which owns the job's working and
      log folders; every node must know that user by the same uid (`useradd` here on first use covers
      this machine only).
    work_dir: the scheduler's work folder; under `org`, the named volumes below it that a job mounts are
      handed to its user too.
    container_runtime: how a task with an image (SkyPilot's `image_id: docker:IMAGE`) runs: `pyxis` (the
      srun step in the image through pyxis/enroot's `--container-image`) or `apptainer` (each node's
      command under `apptainer exec docker://IMAGE`). A cluster without it refuses the launch (PRECHECK).
    preemptible_qos: the QoS of preemptible attempts (SkyPilot's `use_spot`), where the cluster has one
      that its preemption rules let others preempt; empty keeps the usual QoS.
    """

    name = "slurm"

    def __init__(
        self,
        *,
        partition: str = "",
        account: str = "",
        qos: str = "",
        qos_by_priority: Sequence[tuple[int, str]] = (),
        cluster: str = "",
        extra_sbatch_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        inherit_env: Sequence[str] = INHERITED_ENV,
        command_timeout_s: float = 30.0,
        use_sacct: bool | None = None,
        run_as: str = "mesh",
        work_dir: Path | None = None,
        one_organization: bool = False,
        container_runtime: str = "pyxis",
        preemptible_qos: str = "",
    ) -> None:
        check_run_as(run_as)
        if one_organization and work_dir is None:
            raise ValueError("one_organization keeps its organization in work_dir: give one")
        if container_runtime not in CONTAINER_RUNTIMES:
            raise ValueError(f"container_runtime must be one of {', '.join(CONTAINER_RUNTIMES)}")
        self.container_runtime = container_runtime
        self.preemptible_qos = preemptible_qos
        self.run_as = run_as
        self.work_dir = work_dir
        self.one_organization = one_organization and run_as == "mesh"
        self.partition = partition
        self.account = account
        self.qos = qos
        self.qos_by_priority = sorted(qos_by_priority)
        self.cluster = cluster
        self.extra_sbatch_args = tuple(extra_sbatch_args)
        self.env = dict(env or {})
        self.inherit_env = tuple(inherit_env)
        self.command_timeout_s = command_timeout_s
        self._use_sacct = use_sacct
        self._locks: dict[str, asyncio.Lock] = {}
        self._hostnames: dict[str, list[str]] = {}
        self._cluster_name: str | None = None

    # -- running Slurm's commands ------------------------------------------------------------------------

    async def _run(self, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
        """(returncode, stdout, stderr); BackendUnavailable when the command is missing, hangs, or says it
        cannot reach slurmctld."""
        if shutil.which(args[0], path=self.env.get("PATH", os.environ.get("PATH"))) is None:
            raise BackendUnavailable(f"{args[0]} is not installed here")
        cmd = [*args]
        if self.cluster and args[0] in ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "sacct"):
            cmd.insert(1, f"--clusters={self.cluster}")
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **self.env},
        )
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(stdin.encode() if stdin is not None else None), self.command_timeout_s
            )
        except TimeoutError as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise BackendUnavailable(f"{args[0]} did not answer within {self.command_timeout_s:g}s") from exc
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        returncode = proc.returncode if proc.returncode is not None else -1
        if returncode != 0 and any(s in stderr.lower() for s in _UNREACHABLE):
            raise BackendUnavailable(f"{args[0]}: {stderr.strip()}")
        return returncode, stdout, stderr

    async def _sacct_enabled(self) -> bool:
        if self._use_sacct is None:
            try:
                rc, _, err = await self._run("sacct", "-n", "-X", "-P", "-o", "JobID", "-S", "now")
            except BackendUnavailable:
                return False
            self._use_sacct = rc == 0 and "disabled" not in err.lower()
        return self._use_sacct

    # -- the Backend interface ---------------------------------------------------------------------------

    async def inventory(self) -> list[NodeInventory]:
        """Slurm's nodes (of `partition` when set) from `scontrol show node -o`."""
        rc, out, err = await self._run("scontrol", "show", "node", "-o")
        if rc != 0:
            raise BackendUnavailable(f"scontrol show node: {err.strip()}")
        nodes = []
        for line in out.splitlines():
            f = parse_fields(line)
            if not f.get("NodeName"):
                continue
            if self.partition and self.partition not in f.get("Partitions", "").split(","):
                continue
            gpus, gpu_type = _gres_gpus(f.get("Gres", ""))
            gpus_used = _tres(f.get("AllocTRES", ""), "gres/gpu")
            cpus = float(f.get("CPUTot", "0") or 0)
            memory = float(f.get("RealMemory", "0") or 0) / 1024
            features = f.get("AvailableFeatures", "")
            state = f.get("State", "")
            nodes.append(
                NodeInventory(
                    name=f["NodeName"],
                    address=f.get("NodeAddr", f["NodeName"]),
                    gpus=gpus,
                    gpus_free=max(0, gpus - int(gpus_used)),
                    gpu_type=gpu_type,
                    cpus=cpus,
                    cpus_free=max(0.0, cpus - float(f.get("CPUAlloc", "0") or 0)),
                    memory_gib=memory,
                    memory_free_gib=max(0.0, memory - float(f.get("AllocMem", "0") or 0) / 1024),
                    labels={x: "" for x in features.split(",") if x and x != "(null)"},
                    up=not any(s in state for s in _NODE_DOWN),
                )
            )
        return nodes

    async def launch(self, spec: LaunchSpec) -> Handle:
        check_key(spec.key)
        check_mounts(spec)
        if len(spec.command.encode()) > MAX_COMMAND_BYTES:
            raise LaunchRefused(
                f"the command is over {MAX_COMMAND_BYTES} bytes, Linux's limit for one argument"
            )
        async with self._locks.setdefault(spec.key, asyncio.Lock()):
            existing = await self.find(spec.key)
            if existing is not None:
                return existing
            if str(spec.log_dir) in ("", "."):
                raise LaunchRefused("the Slurm backend needs a log_dir (on storage the nodes share)")
            log_dir = await asyncio.to_thread(_make_dir, Path(spec.log_dir))
            if self.run_as == "org":
                await asyncio.to_thread(self._hand_over, spec, log_dir)
            elif self.one_organization and self.work_dir is not None:
                claim_organization(
                    self.work_dir / "slurm", job_org(spec.job), "TANDEM_SCHEDULER_SLURM__RUN_AS"
                )
            problems = await self.option_problems(spec.options)
            if problems:
                raise LaunchRefused("; ".join(problems.values()))
            if spec.image:
                await self._check_containers(spec.image)
            rc, out, err = await self._run(*self.sbatch_args(spec), stdin=self.batch_script(spec))
            if rc != 0:
                raise LaunchRefused(err.strip() or out.strip() or f"sbatch exited {rc}")
            job_id = out.strip().split(";")[0]  # --parsable prints "id" or "id;cluster"
            return self._handle(spec.key, job_id, log_dir, spec.num_nodes)

    async def cluster_name(self) -> str:
        """This cluster's name, `scontrol show config`'s ClusterName (asked once)."""
        if self._cluster_name is None:
            rc, out, err = await self._run("scontrol", "show", "config")
            if rc != 0:
                raise BackendUnavailable(f"scontrol show config: {err.strip()}")
            found = re.search(r"^ClusterName\s*=\s*(\S+)", out, re.MULTILINE)
            self._cluster_name = found.group(1) if found else ""
        return self._cluster_name

    async def partitions(self) -> list[str]:
        """The cluster's partitions, from `scontrol show partition -o`."""
        rc, out, err = await self._run("scontrol", "show", "partition", "-o")
        if rc != 0:
            raise BackendUnavailable(f"scontrol show partition: {err.strip()}")
        return [f["PartitionName"] for f in map(parse_fields, out.splitlines()) if f.get("PartitionName")]

    async def option_problems(self, options: Mapping[str, str]) -> dict[str, str]:
        """A job for another cluster (its `slurm.cluster`, SkyPilot's `infra: slurm/CLUSTER`), or naming a
        partition this cluster does not have (`slurm.partition`, `infra: slurm/CLUSTER/PARTITION`), each
        named."""
        problems: dict[str, str] = {}
        wanted = options.get("cluster", "")
        if wanted:
            name = await self.cluster_name()
            if wanted != name:
                problems["cluster"] = (
                    f"the job is for the Slurm cluster {wanted!r} (slurm.cluster, as in infra: "
                    f"slurm/{wanted}), and this scheduler's Slurm cluster is {name!r}"
                )
        partition = options.get("partition", "")
        if partition:
            known = await self.partitions()
            if partition not in known:
                problems["partition"] = (
                    f"the Slurm cluster {await self.cluster_name()!r} has no partition {partition!r} "
                    f"(slurm.partition); its partitions: {', '.join(known) or 'none'}"
                )
        return problems

    async def _check_containers(self, image: str) -> None:
        """LaunchRefused unless this cluster can run an image the configured way: pyxis adds
        `--container-image` to srun; Apptainer is a command (looked for where sbatch runs)."""
        if self.container_runtime == "pyxis":
            _rc, out, err = await self._run("srun", "--help")
            if "--container-image" not in out + err:
                raise LaunchRefused(
                    f"the task runs in the image {image} (resources.image_id), and this Slurm cluster has no "
                    "pyxis plugin (srun has no --container-image); install pyxis and enroot, or set the "
                    "scheduler's slurm.container_runtime to apptainer where the cluster has Apptainer"
                )
        elif not (shutil.which("apptainer") or shutil.which("singularity")):
            raise LaunchRefused(
                f"the task runs in the image {image} (resources.image_id), and this cluster has no Apptainer "
                "(no apptainer or singularity command); install it, or set the scheduler's "
                "slurm.container_runtime to pyxis where the cluster has pyxis"
            )

    async def find(self, key: str) -> Handle | None:
        """The job named `key`: a live or recently finished one from squeue, else one sacct remembers (from
        the last 7 days). With several (two schedulers raced), a live one wins, then the newest."""
        rc, out, err = await self._run("squeue", "-h", "--states=all", f"--name={key}", "-o", "%i|%T|%Z")
        if rc != 0:
            raise BackendUnavailable(f"squeue: {err.strip()}")
        jobs = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
        if not jobs and await self._sacct_enabled():
            rc, out, _ = await self._run(
                "sacct", "-n", "-X", "-P", "-S", "now-7days", f"--name={key}", "-o", "JobID,State,WorkDir"
            )
            jobs = [line.split("|") for line in out.splitlines() if line.count("|") == 2] if rc == 0 else []
        if not jobs:
            return None
        ended = EXITED_STATES | {"PREEMPTED", "NODE_FAIL", "BOOT_FAIL"}
        live = [j for j in jobs if (j[1].split() or [""])[0] not in ended]  # sacct: "CANCELLED by 0"
        job_id = max(live or jobs, key=lambda j: int(re.sub(r"\D.*", "", j[0]) or 0))[0]
        rc, out, _ = await self._run("scontrol", "show", "job", "-o", job_id)
        fields = parse_fields(out) if rc == 0 else {}
        log_dir = Path(fields.get("StdOut", "")).parent if fields.get("StdOut") else Path()
        nodes = int(fields.get("NumNodes", "1").split("-")[0] or 1)
        return self._handle(key, job_id, log_dir, nodes)

    async def poll(self, handle: Handle) -> Observed:
        job_id = str(handle["job_id"])
        rc, out, err = await self._run("scontrol", "show", "job", "-o", job_id)
        if rc == 0 and out.strip():
            fields = parse_fields(out.splitlines()[0])
            return observe(fields, await self._nodes(fields))
        if rc != 0 and not any(s in err.lower() for s in _INVALID_JOB):
            raise BackendUnavailable(f"scontrol show job {job_id}: {err.strip()}")
        if await self._sacct_enabled():
            rc, out, _ = await self._run(
                "sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,Reason,NodeList"
            )
            lines = [line.split("|") for line in out.splitlines() if line.strip()] if rc == 0 else []
            if lines:
                state, exit_code, reason, _ = [*lines[-1], "", "", "", ""][:4]
                return observe({"JobState": state, "ExitCode": exit_code, "Reason": reason})
        return Observed(Phase.LOST, message=f"Slurm no longer knows job {job_id}")

    async def cancel(self, handle: Handle, grace_s: float = 10.0) -> None:
        """`scancel --signal=TERM --full` (the batch shell and every step); once the job still runs after
        `grace_s`, `scancel --signal=KILL --full` and a plain `scancel`, which ends the job for Slurm too. A
        pending job is cancelled at once."""
        job_id = str(handle["job_id"])
        observed = await self.poll(handle)
        if observed.phase in (Phase.EXITED, Phase.LOST):
            return
        if observed.phase is Phase.RUNNING:
            await self._scancel("--signal=TERM", "--full", job_id)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                await asyncio.sleep(0.25)
                if (await self.poll(handle)).phase is not Phase.RUNNING:
                    return
            await self._scancel("--signal=KILL", "--full", job_id)
        await self._scancel(job_id)

    def logs(self, handle: Handle, node_rank: int = 0) -> Path | None:
        if not handle.get("log_dir"):
            return None
        path = Path(handle["log_dir"]) / f"rank-{node_rank}.log"
        return path if path.exists() else None

    async def close(self) -> None:
        self._hostnames.clear()

    # -- the job ---------------------------------------------------------------------------------------

    def _hand_over(self, spec: LaunchSpec, log_dir: Path) -> None:
        workdir = Path(spec.workdir).absolute() if spec.workdir else log_dir
        hand_over_attempt(spec, (workdir, log_dir), self.work_dir or workdir)

    def job_user(self, spec: LaunchSpec) -> pwd.struct_passwd | None:
        """The user the job runs as under `run_as = org` (created on first use); None under `mesh`."""
        return org_account(job_org(spec.job)) if self.run_as == "org" else None

    def sbatch_args(self, spec: LaunchSpec) -> list[str]:
        log_dir = Path(spec.log_dir).absolute()
        workdir = Path(spec.workdir).absolute() if spec.workdir else log_dir
        account = self.job_user(spec)
        inherited = set(self.inherit_env) - (set(_OWN_ACCOUNT_ENV) if account else set())
        exported = sorted(n for n in {*inherited, *self.env} if n in os.environ or n in self.env)
        args = [
            "sbatch",
            "--parsable",
            f"--job-name={spec.key}",
            f"--nodes={spec.num_nodes}",
            "--ntasks-per-node=1",
            f"--output={log_dir / 'batch.log'}",
            "--open-mode=append",
            f"--chdir={workdir}",
            f"--nice={nice_for(spec.priority) + (PREEMPTIBLE_NICE if spec.preemptible else 0)}",
            "--requeue" if spec.requeue_on_failure or spec.preemptible else "--no-requeue",
            f"--export={','.join(exported) or 'NONE'}",
        ]
        res = spec.resources
        if res.gpus > 0:
            args.append(f"--gres=gpu:{res.gpu_type}:{res.gpus}" if res.gpu_type else f"--gres=gpu:{res.gpus}")
        if res.cpus > 0:
            args.append(f"--cpus-per-task={math.ceil(res.cpus)}")
        if res.memory_gib > 0:
            args.append(f"--mem={math.ceil(res.memory_gib * 1024)}M")
        if res.disk_gib > 0:  # SkyPilot's disk_size: the node's TmpDisk must have it
            args.append(f"--tmp={math.ceil(res.disk_gib * 1024)}M")
        if spec.time_limit_s > 0:
            args.append(f"--time={_time_limit(spec.time_limit_s)}")
        placed = list(dict.fromkeys(n.node for n in spec.nodes if n.node))
        if len(placed) == spec.num_nodes:  # the engine placed it on Slurm's nodes itself
            args.append(f"--nodelist={','.join(placed)}")
        qos = self.qos
        for threshold, name in self.qos_by_priority:
            if spec.priority >= threshold:
                qos = name
        if spec.preemptible and self.preemptible_qos:
            qos = self.preemptible_qos
        chosen = {"partition": self.partition, "account": self.account, "qos": qos}
        chosen.update({k: v for k, v in spec.options.items() if k in chosen and v})  # the spec's win
        args += [f"--{flag}={value}" for flag, value in chosen.items() if value]
        if account is not None:  # root's sbatch submits the job as this user
            args += [f"--uid={account.pw_name}", f"--gid={grp.getgrgid(account.pw_gid).gr_name}"]
        return [*args, *self.extra_sbatch_args]

    def batch_script(self, spec: LaunchSpec) -> str:
        """The batch script: the task's environment, the node addresses, then one srun step running the
        command on every node."""
        env = dict(spec.env)
        env.setdefault("TANDEM_RESTART_COUNT", str(spec.attempt))
        account = self.job_user(spec)
        if account is not None:  # the job's own, not the scheduler's (which --export leaves out)
            home = str(Path(spec.workdir or spec.log_dir).absolute())
            env.update(HOME=home, USER=account.pw_name, LOGNAME=account.pw_name)
        lines = [
            "#!/bin/bash",
            f"# Tandem attempt {spec.key} ({spec.job}, task {spec.task}, attempt {spec.attempt})",
            "set -uo pipefail",
            "export SLURM_EXPORT_ENV=ALL  # srun steps get this shell's whole environment",
            *(
                f"export {name}={shlex.quote(value)}"
                for name, value in sorted(env.items())
                if _env_name(name)
            ),
            *_NODE_IPS.splitlines(),
            'export TANDEM_NUM_NODES="$SLURM_JOB_NUM_NODES" SKYPILOT_NUM_NODES="$SLURM_JOB_NUM_NODES"',
            f"export TANDEM_ATTEMPT_KEY={shlex.quote(spec.key)}",
        ]
        srun = [
            "srun",
            "--kill-on-bad-exit=1",
            f"--nodes={spec.num_nodes}",
            f"--ntasks={spec.num_nodes}",
            "--ntasks-per-node=1",
            f"--output={Path(spec.log_dir).absolute() / 'rank-%n.log'}",
            "--open-mode=append",
            *self.container_args(spec),
            "bash",
            "-c",
            _NODE_SHELL,
            "tandem-node",
            spec.command,
            str(Path(spec.log_dir).absolute()),
        ]
        lines.append(f"tandem_logs={shlex.quote(str(Path(spec.log_dir).absolute()))}")
        step = " ".join(shlex.quote(a) for a in srun)
        login = registry_login(spec)
        if login:  # the private registry's login, opened here for the pull that precedes the step
            workdir = Path(spec.workdir).absolute() if spec.workdir else Path(spec.log_dir).absolute()
            lines += [
                f"tandem_registry=$(mktemp -d {shlex.quote(str(workdir))}/.tandem-registry-XXXXXX) || exit 223",
                "trap 'rm -rf \"$tandem_registry\"' EXIT",
            ]
            helper = [sys.executable, "-m", "services.scheduler.backends.task_image", "--slurm"]
            helper += [self.container_runtime, "--secrets", format_secrets(login), "--folder"]
            step = f'{shlex.join(helper)} "$tandem_registry" --image {shlex.quote(spec.image)} -- {step}'
        lines.append(step)
        lines.append(_FIRST_FAILURE)
        return "\n".join(lines)

    def container_args(self, spec: LaunchSpec) -> list[str]:
        """What puts a task with an image into it: pyxis's srun options, or `apptainer exec` before the node
        shell. Either way the working and log folders and the mounts are at their own paths inside."""
        if not spec.image:
            return []
        workdir = str(Path(spec.workdir).absolute() if spec.workdir else Path(spec.log_dir).absolute())
        folders = [workdir, str(Path(spec.log_dir).absolute()), *(s for _p, s, _r in spec.file_mounts)]
        folders = list(dict.fromkeys(folders))
        if self.container_runtime == "pyxis":
            return [
                f"--container-image={enroot_image(spec.image)}",
                f"--container-mounts={','.join(folders)}",
                f"--container-workdir={workdir}",
            ]
        binds = [arg for folder in folders for arg in ("--bind", folder)]
        return ["apptainer", "exec", "--pwd", workdir, *binds, f"docker://{spec.image}"]

    def _handle(self, key: str, job_id: str, log_dir: Path, num_nodes: int) -> Handle:
        return {
            "backend": self.name,
            "key": key,
            "job_id": job_id,
            "cluster": self.cluster,
            "log_dir": str(log_dir) if str(log_dir) not in ("", ".") else "",
            "num_nodes": num_nodes,
        }

    async def _scancel(self, *args: str) -> None:
        rc, _, err = await self._run("scancel", *args)
        if rc != 0 and not any(s in err.lower() for s in (*_INVALID_JOB, "already completing", "completed")):
            raise BackendUnavailable(f"scancel: {err.strip()}")

    async def _nodes(self, fields: Mapping[str, str]) -> list[NodeAssignment]:
        nodelist = fields.get("NodeList", "")
        if not nodelist or nodelist == "(null)":
            return []
        if nodelist not in self._hostnames:
            rc, out, _ = await self._run("scontrol", "show", "hostnames", nodelist)
            self._hostnames[nodelist] = out.split() if rc == 0 else [nodelist]
        return [NodeAssignment(rank=r, node=h, address=h) for r, h in enumerate(self._hostnames[nodelist])]


def _make_dir(path: Path) -> Path:
    path = path.absolute()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _env_name(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None


def _gres_gpus(gres: str) -> tuple[int, str]:
    """`gpu:h100:8(S:0-1),shard:4` -> (8, "h100")."""
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        gpu_type = parts[1] if len(parts) == 3 else ""
        with contextlib.suppress(ValueError):
            return int(count), gpu_type
    return 0, ""


def _tres(tres: str, name: str) -> float:
    """One entry of a TRES list such as `cpu=4,mem=8G,gres/gpu=2`."""
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key == name:
            with contextlib.suppress(ValueError):
                return float(value)
    return 0.0
