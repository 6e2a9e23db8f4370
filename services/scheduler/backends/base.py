"""The one interface every job backend implements (local processes, Slurm, Kubernetes).

The scheduler's engine decides *what* runs (admission, placement, restarts, cancellation); a backend only
carries out one task attempt at a time and reports what it sees. The protocol, for one attempt:

1. The engine stores the attempt (job, task, attempt number) **before** it calls `launch`, so a scheduler
   that dies during the call finds the attempt on restart and asks the backend with `find` whether it was
   launched (every backend labels what it launches with the attempt's `key`, so the answer never depends
   on the call having returned).
2. `launch(spec)` starts the attempt and returns its `Handle`, a small JSON-able dict the engine stores
   beside the attempt. It must be idempotent per `spec.key`: launching a key that is already running
   returns the existing handle instead of starting a second copy.
3. `poll(handle)` says what the attempt is doing now (`Observed`): queued by the backend, running, exited
   with a code, or lost (the backend no longer knows it, or its node died). The engine polls; a backend may
   also watch, but `poll` must always answer from the backend's own state, never from a cache alone.
4. `cancel(handle, grace_s)` stops the attempt: a polite signal, then a hard kill after `grace_s`; it is
   idempotent and returns once the backend accepted the request (the next `poll`s show it ending).
5. `logs(handle, node_rank)` names where the attempt's output is, as a local file the scheduler can read
   (the backends here write logs to a folder the scheduler shares: local disk, the Slurm shared spool, or
   a log collector's mount); `None` when there is none yet.

Backends raise `BackendUnavailable` when the backend itself cannot be reached (slurmctld down, API server
unreachable): the engine marks the affected jobs and retries later, never treating it as a task failure.
Nothing in this module imports grpc, protobuf or a backend's client library.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

Handle = dict[str, Any]  # JSON-able; stored with the attempt, handed back to poll/cancel/logs/find


class BackendUnavailable(Exception):
    """The backend cannot be reached right now; the call may succeed later."""


class LaunchRefused(Exception):
    """The backend refused this attempt for good (e.g. Slurm rejects the request, an object is invalid)."""


@dataclass(frozen=True)
class NodeInventory:
    """One node as a backend reports it: what it has and what is free now."""

    name: str
    address: str
    gpus: int = 0
    gpus_free: int = 0
    gpu_type: str = ""
    cpus: float = 0.0
    cpus_free: float = 0.0
    memory_gib: float = 0.0
    memory_free_gib: float = 0.0
    labels: Mapping[str, str] = field(default_factory=dict)
    up: bool = True


@dataclass(frozen=True)
class Resources:
    """What one node of a task needs (the spec's `resources`, parsed)."""

    gpus: int = 0
    gpu_type: str = ""  # "" = any
    cpus: float = 0.0
    memory_gib: float = 0.0
    disk_gib: float = 0.0  # local disk (SkyPilot's disk_size); 0 = the backend's default


@dataclass(frozen=True)
class NodeAssignment:
    """Where one node rank of an attempt runs, as the engine placed it (the local backend) or as the backend
    reports it after launch (Slurm, Kubernetes)."""

    rank: int
    node: str = ""
    address: str = ""
    gpu_indices: tuple[int, ...] = ()
    gpu_type: str = ""  # the GPU type of the accelerator alternative placed ("" when the task named none)


# The per-node variables every backend sets: the node's rank, and the task's node addresses (one a line).
RANK_VARIABLES = ("TANDEM_NODE_RANK", "SKYPILOT_NODE_RANK", "SKYPILOT_SETUP_NODE_RANK")
IPS_VARIABLES = ("TANDEM_NODE_IPS", "SKYPILOT_NODE_IPS", "SKYPILOT_SETUP_NODE_IPS")
POD_HOME = "/mnt/tandem-home"  # Kubernetes: HOME of a pod whose task mounts under ~/ (an emptyDir there)

NODE_SELECTOR_OPTION = "node_selector."  # LaunchSpec.options keys of a job's own Kubernetes node labels


@dataclass(frozen=True)
class RegistryLogin:
    """A private registry's login: SkyPilot's SKYPILOT_DOCKER_USERNAME, _PASSWORD and _SERVER, from the task's
    vault secrets. Never printed: the password is left out of the repr."""

    username: str
    password: str = field(repr=False)
    server: str


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a backend needs to run one attempt of one task."""

    key: str  # unique per attempt, e.g. "orgs-acme-jobs-j1.trainer.2"; a label/name on what is launched
    job: str  # orgs/{org}/jobs/{job}
    task: str
    attempt: int  # from 0; also TANDEM_RESTART_COUNT
    command: str  # the shell script to run on every node (setup, then run), run with bash -euo pipefail
    env: Mapping[str, str]  # the task's environment (TANDEM_* and SKYPILOT_* included, except per-node ones)
    num_nodes: int = 1
    resources: Resources = Resources()
    nodes: Sequence[NodeAssignment] = ()  # set by the engine when it placed the attempt itself
    log_dir: Path = Path()  # where the attempt's logs go (one file per node rank)
    workdir: Path | None = None
    priority: int = 0  # -1000..1000, higher first; backends map it (Slurm nice/QoS, Kubernetes PriorityClass)
    time_limit_s: float = 0.0  # 0 = none
    requeue_on_failure: bool = False  # the backend may requeue by itself (Slurm --requeue)
    secret_env: Mapping[str, str] = field(default_factory=dict)  # env name -> vault secret name; injected
    # at run time through the vault's runtime path with TANDEM_JOB_TOKEN, never as plaintext on the backend
    file_mounts: Sequence[tuple[str, str, bool]] = ()  # (path in the task, source path or volume, read-only)
    options: Mapping[str, str] = field(default_factory=dict)  # the spec's options for this backend, which
    # win over the backend's settings: Slurm `partition`, `account`, `qos`; Kubernetes e.g. `namespace`
    ports: Sequence[str] = ()  # TCP ports the task listens on, each "PORT" or "FIRST-LAST" (SkyPilot's ports)
    preemptible: bool = False  # SkyPilot's use_spot: placed below every attempt that is not, may be preempted
    image: str = ""  # the container image to run in (SkyPilot's image_id docker:IMAGE); "" = the default
    labels: Mapping[str, str] = field(default_factory=dict)  # SkyPilot's labels: Kubernetes pod labels
    # SkyPilot's task `config.kubernetes`: a partial Pod merged into the pods (checked: backends/pod_config.py),
    # labels and annotations of the Job and its pods, and the Kueue LocalQueue the Job is submitted to
    pod_config: Mapping[str, Any] = field(default_factory=dict)
    custom_labels: Mapping[str, str] = field(default_factory=dict)
    custom_annotations: Mapping[str, str] = field(default_factory=dict)
    queue_name: str = ""
    registry_login: RegistryLogin | None = None  # the image's registry login, opened by the engine for a
    # backend whose puller needs the value at launch (Kubernetes' image pull Secret); host backends open it
    # in the task (task_image.py), so it is None for them
    sibling_tasks: Sequence[str] = ()  # the job group's other tasks, when the group's tasks reach each other
    # by host name (`{task}-{rank}.{group}`, SkyPilot's inter_connection); empty: no sibling host names
    sibling_hosts_required: bool = False  # `inter_connection: true`: fail (PRECHECK) without those names


class Phase(enum.Enum):
    QUEUED = "queued"  # accepted by the backend, not running yet
    RUNNING = "running"
    EXITED = "exited"  # finished; `exit_code` says how
    LOST = "lost"  # the backend does not know it any more, or its node is gone


@dataclass(frozen=True)
class Observed:
    phase: Phase
    exit_code: int | None = None  # for EXITED; a signal death is 128 + the signal number
    message: str = ""  # what the backend said (reason, node failure), for Failure.message
    nodes: Sequence[NodeAssignment] = ()  # where it runs, once known
    preempted: bool = False  # the backend itself preempted or requeued it


@runtime_checkable
class Backend(Protocol):
    name: str  # "local", "slurm", "kubernetes"

    async def inventory(self) -> list[NodeInventory]:
        """The nodes this backend can place on, with what is free now."""
        ...

    async def option_problems(self, options: Mapping[str, str]) -> dict[str, str]:
        """What of a job's options for this backend (`LaunchSpec.options`) names something it does not have
        (a Slurm cluster or partition, a Kubernetes context), by option, each saying why; empty when all is
        well. CreateJob refuses such a job, and `launch` refuses such an attempt."""
        ...

    async def launch(self, spec: LaunchSpec) -> Handle:
        """Start the attempt (idempotent per `spec.key`) and return its handle."""
        ...

    async def find(self, key: str) -> Handle | None:
        """The handle of what was launched for `key`, if anything was; for a scheduler that died mid-launch."""
        ...

    async def poll(self, handle: Handle) -> Observed:
        """What the attempt is doing now, from the backend's own state."""
        ...

    async def cancel(self, handle: Handle, grace_s: float = 10.0) -> None:
        """Stop the attempt: a polite signal, a hard kill after `grace_s`; idempotent."""
        ...

    def logs(self, handle: Handle, node_rank: int = 0) -> Path | None:
        """The file holding the attempt's output on node `node_rank`, if there is one yet."""
        ...

    async def close(self) -> None:
        """Release clients and watches; running attempts keep running."""
        ...
