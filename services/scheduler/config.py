"""Settings of the scheduler alone (`TANDEM_SCHEDULER_*`), beside the shared `mesh.settings.Settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

BackendName = Literal["local", "slurm", "kubernetes"]


class LocalSettings(BaseModel):
    """The local backend: processes on the scheduler's machine. Unset counts are read from the machine."""

    gpus: int | None = Field(None, ge=0, description="GPUs to hand out (CUDA_VISIBLE_DEVICES indices).")
    gpu_type: str | None = Field(None, description="The GPU model reported; unset: what nvidia-smi says.")
    cpus: float | None = Field(None, ge=0, description="CPU cores to hand out.")
    memory_gib: float | None = Field(None, ge=0, description="Memory to hand out, in GiB.")
    container_runtimes: list[Literal["docker", "podman"]] = Field(
        ["docker", "podman"],
        description="The container CLIs tried in order for a task with an image (SkyPilot's image_id); "
        "none that works is a PRECHECK failure.",
    )
    image_pull_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long the pull of a task's image (and the login to its private registry) may take "
        "before the task fails as a PRECHECK failure that names the image and what the runtime said; an image "
        "the runtime already has is not pulled again.",
    )
    run_as: Literal["auto", "mesh", "org"] = Field(
        "auto",
        description="Whose account tasks run under. `org`: one unprivileged user per organization "
        "(`tdm-<org>`, created on first use; needs the scheduler to run as root), in a bubblewrap sandbox "
        "where bubblewrap is installed, so a task can read neither the mesh's state (keys, databases) nor "
        "another organization's tasks, volumes or processes. `mesh`: the scheduler's own account, which can "
        "read all of that, so the backend serves one organization only (the first that launches). `auto`: "
        "`org` where it isolates (root, and bubblewrap or a Python environment other users can reach), "
        "else `mesh`; the scheduler says at start-up which it chose and why.",
    )
    sandbox: Literal["auto", "bwrap", "off"] = Field(
        "auto",
        description="Under `run_as = org`: `bwrap` runs each task in a bubblewrap sandbox (its own /proc, "
        "the mesh's state folder empty, Tandem's Python reachable); `off` only switches the user; `auto`: "
        "`bwrap` where it works here.",
    )


class SlurmSettings(BaseModel):
    """The Slurm backend (`sbatch`, `squeue`, `sacct`, `scancel` on the scheduler's PATH)."""

    enabled: bool = Field(False, description="Run jobs on Slurm too (adds `slurm` to `backends`).")
    partition: str = Field("", description="Default `--partition`; a spec's `slurm.partition` wins.")
    account: str = Field("", description="Default `--account`.")
    qos: str = Field("", description="Default `--qos`.")
    cluster: str = Field("", description="`--clusters` for a multi-cluster setup; empty for the default.")
    container_runtime: Literal["pyxis", "apptainer"] = Field(
        "pyxis",
        description="How a task with an image (SkyPilot's image_id) runs: pyxis/enroot's srun "
        "--container-image, or apptainer exec; a cluster without it is a PRECHECK failure.",
    )
    preemptible_qos: str = Field(
        "", description="The QoS of preemptible (use_spot) attempts; empty keeps the usual QoS."
    )
    conf: Path | None = Field(
        None, description="`SLURM_CONF` for the Slurm commands; unset: Slurm's default."
    )
    run_as: Literal["auto", "mesh", "org"] = Field(
        "auto",
        description="Whose account jobs run under. `org`: the organization's own unprivileged user "
        "(`tdm-<org>`, as on the local backend; `sbatch --uid`, so the scheduler runs as root, and every node "
        "must know the user by the same uid), which owns the job's folders and cannot read the mesh's "
        "state. `mesh`: the scheduler's own account, which can read all of it: serve one organization only. "
        "`auto`: `org` where the scheduler is root and other users can reach Tandem's Python environment "
        "(install it outside a private home, e.g. under /opt), else `mesh`, said at start-up.",
    )


class KubernetesSettings(BaseModel):
    """The Kubernetes backend (kubeconfig or in-cluster credentials)."""

    enabled: bool = Field(False, description="Run jobs on Kubernetes too (adds `kubernetes` to `backends`).")
    image: str = Field("", description="The container image tasks run in (Tandem installed).")
    namespace: str = Field("default", description="Namespace for the Jobs the scheduler creates.")
    namespaces: list[str] = Field(
        default_factory=list,
        description="Other namespaces a job's `kubernetes.namespace` may name (the scheduler needs the same "
        "rights in each); any other is refused.",
    )
    service_account: str = Field("", description="Service account of the task pods; empty for the default.")
    kubeconfig: str = Field(
        "",
        description="A kubeconfig file to reach the cluster with; empty: the pod's in-cluster credentials, "
        "else $KUBECONFIG or ~/.kube/config.",
    )
    context: str = Field(
        "",
        description="The kubeconfig's context to reach the cluster through; empty: its current context (in "
        "a pod without a kubeconfig, the pod's own cluster, `in-cluster` as SkyPilot calls it). A job's "
        "`infra: k8s/CONTEXT` must name this one.",
    )
    run_as_user: int | None = Field(
        10001,
        ge=1,
        description="The uid (and gid) task containers run as, the trainer image's by default; unset: the "
        "image's own user, which must be numeric and not root (pods always run as non-root).",
    )
    allowed_capabilities: list[str] = Field(
        default_factory=list,
        description="Linux capabilities a task's SkyPilot `config.kubernetes.pod_config` may add to its "
        'containers (`securityContext.capabilities.add`), e.g. ["IPC_LOCK"]; any other refuses the launch. '
        "Empty: none (the task containers drop every capability).",
    )
    network_policy: bool = Field(
        False,
        description="Give each attempt a NetworkPolicy letting the pods of one job reach each other; with "
        "deploy/kubernetes/base/networkpolicy.yaml (DNS and the services a job calls) applied, a task pod "
        "reaches nothing else.",
    )


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TANDEM_SCHEDULER_", env_nested_delimiter="__", extra="ignore"
    )

    backends: list[BackendName] = Field(
        default_factory=lambda: list[BackendName](["local"]),
        description="The backends jobs may run on. `slurm` needs the Slurm settings of its backend; "
        "`kubernetes` a kubeconfig or in-cluster credentials.",
    )
    local: LocalSettings = Field(default_factory=LocalSettings)
    slurm: SlurmSettings = Field(default_factory=SlurmSettings)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    default_backend: BackendName = Field("local", description="Where a spec without `backend` runs.")
    work_dir: Path | None = Field(
        None,
        description="Folder for task logs, trainer configs and outputs (on storage the nodes share for "
        "Slurm). Default state_dir/scheduler.",
    )
    pass_interval_s: float = Field(0.2, gt=0, description="Seconds between reconcile passes.")
    cancel_grace_s: float = Field(10.0, ge=0, description="SIGTERM to SIGKILL when a job is cancelled.")
    aux_stop_grace_s: float = Field(30.0, ge=0, description="SIGTERM to SIGKILL when an auxiliary stops.")
    token_ttl_s: float = Field(
        3600.0, gt=0, description="Lifetime of a job token; RefreshJobToken extends it."
    )
    aging_s_per_point: float = Field(
        30.0, ge=0, description="A queued job gains one priority point per this many seconds; 0 disables."
    )
    preemption: bool = Field(
        False,
        description="Let a higher-priority job that does not fit preempt lower-priority running jobs (they "
        "are requeued as PREEMPTED and resume from their checkpoints). Off by default: the v1 contract "
        "says priority never preempts a running job.",
    )
    health_timeout_s: float = Field(2.0, gt=0, description="Deadline of one SERVICE health check.")
    bucket_sync_interval_s: float = Field(
        30.0,
        gt=0,
        description="Seconds between uploads of what a task wrote to its MOUNT and MOUNT_CACHED buckets "
        "(and once more when it ends).",
    )

    def enabled_backends(self) -> list[BackendName]:
        names: list[BackendName] = list(dict.fromkeys(self.backends))
        if self.slurm.enabled and "slurm" not in names:
            names.append("slurm")
        if self.kubernetes.enabled and "kubernetes" not in names:
            names.append("kubernetes")
        return names
