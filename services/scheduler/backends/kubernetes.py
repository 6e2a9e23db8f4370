"""The Kubernetes job backend: one Indexed `batch/v1` Job per task attempt (and a headless Service for tasks
on several nodes), through the official `kubernetes` client.

Usage (the scheduler builds it from its settings; tests point `configuration.host` at a stand-in server):

    backend = KubernetesBackend(namespace="tandem-jobs", image="ghcr.io/acme/tandem-trainer:1.4")
    handle = await backend.launch(spec)      # idempotent per spec.key
    observed = await backend.poll(handle)

What one attempt becomes (details and the reasons in `services/scheduler/KUBERNETES.md`):

- A Job named from the attempt key (`tdm-<key, sanitised>-<hash>`, so a second `launch` of the key meets
  the first Job and returns its handle), `completionMode: Indexed`, `completions = parallelism =
  num_nodes`, `backoffLimit: 0` (the scheduler owns restarts), `activeDeadlineSeconds` from the time limit.
- Labels `app.kubernetes.io/managed-by: tandem`, `tandem.dev/{job,task,attempt,key}` on the Job, its pods
  and its Service (label values are sanitised; the exact job name and key are also annotations), so `find`
  is a label selector.
- Each pod runs `bash -euo pipefail -c <command>`; its rank is the completion index
  (`TANDEM_NODE_RANK` / `SKYPILOT_NODE_RANK` through the downward API). Several nodes get a headless Service
  named like the Job, so rank r is `<job>-<r>.<service>`: those names are `TANDEM_NODE_IPS` /
  `SKYPILOT_NODE_IPS` (newline-separated, rank order). One node gets its pod IP.
- A task of a job group with sibling host names (`LaunchSpec.sibling_tasks`) joins the group's headless
  Service, named as the group and owned by every attempt Job of it, whose EndpointSlice `{group}.{task}`
  `poll` keeps naming the task's pods `{task}-{rank}` (so `{task}-{rank}.{group}` resolves, as on the other
  backends); the pods wait for their siblings' names before their command (`group_hosts.wait_script`).
- GPUs as `nvidia.com/gpu` limits, CPU and memory as requests, the GPU model as a node selector on
  `gpu_type_label`; the priority as one of four PriorityClasses (`PRIORITY_BANDS`), created if missing.
- Secrets: the pod gets `TANDEM_JOB_TOKEN` (in the task's env) and `TANDEM_SECRETS=ENV=name,...` (names
  only) and starts through `services.scheduler.backends.task_secrets`, which opens them from the vault in
  the pod. No value is ever written into a pod spec. The one Kubernetes Secret is an image's private
  registry login (`LaunchSpec.registry_login`, SkyPilot's SKYPILOT_DOCKER_* secrets, opened by the engine
  with the attempt's job token): a `kubernetes.io/dockerconfigjson` Secret named like the Job and owned by
  it (deleted with it), in the pods' `imagePullSecrets`.

A job's `kubernetes` block (`LaunchSpec.options`) wins for its attempts: `namespace` (one of the
deployment's `namespaces`; another is refused), `priority_class_name` (instead of the band's class) and
`node_selector.<label>` entries (over the backend's node selector). Its `context` (SkyPilot's
`infra: k8s/CONTEXT`) must be the context this backend reaches its cluster through; another is refused.

`cancel` marks the Job (a `tandem.dev/cancelled` annotation), deletes its pods with the grace period and
puts the Job past a one-second deadline; the Job stays, Failed, so polls read the end (EXITED, 143) until
its TTL removes it.

`logs()` returns `<log_dir>/rank-<r>.log`, a file this backend refreshes from the pods' logs through the
API (on each `logs()` call, at most every `log_refresh_s`, in the background; and once more when `poll`
sees the attempt end or `cancel` stops it), appending only what is new so byte offsets stay valid.

The client is synchronous; every call runs in `asyncio.to_thread`. An unreachable API server (connection
refused, timeout, 5xx, 429) raises `BackendUnavailable`; a refusal of `launch` (400/403/409 conflict with
another key/422) raises `LaunchRefused` carrying the API's message.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import urllib3
from kubernetes import client as k8s

from services.scheduler.backends import group_hosts
from services.scheduler.backends.base import (
    IPS_VARIABLES,
    NODE_SELECTOR_OPTION,
    POD_HOME,
    RANK_VARIABLES,
    BackendUnavailable,
    Handle,
    LaunchRefused,
    LaunchSpec,
    NodeAssignment,
    NodeInventory,
    Observed,
    Phase,
    RegistryLogin,
)
from services.scheduler.backends.pod_config import (
    KUEUE_QUEUE_LABEL,
    merge_pod,
    mismatched_shapes,
    overridden_own_parts,
    pod_config_problems,
)
from services.scheduler.backends.task_image import with_server
from services.scheduler.backends.task_secrets import SECRETS_ENV, format_secrets

log = logging.getLogger(__name__)

T = TypeVar("T")
Json = dict[str, Any]

MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB = "tandem.dev/job"
LABEL_TASK = "tandem.dev/task"
LABEL_ATTEMPT = "tandem.dev/attempt"
LABEL_KEY = "tandem.dev/key"
ANNOTATION_KEY = "tandem.dev/key"
ANNOTATION_JOB = "tandem.dev/job"
ANNOTATION_CANCELLED = "tandem.dev/cancelled"  # set by cancel: the attempt's end reads as cancelled
ANNOTATION_LOG_DIR = "tandem.dev/log-dir"  # the scheduler's folder for the attempt's logs, for `find`
ANNOTATION_GROUP = "tandem.dev/group"  # on a Job whose pods have sibling host names: the group's Service
ANNOTATION_TASK = "tandem.dev/task"  # the task's exact name, the first part of its host names
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # an EndpointSlice's Service
SLICE_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SLICE_MANAGER = "tandem.dev/scheduler"  # not the EndpointSlice controller's: it leaves these slices alone
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CONTAINER = "task"
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # what the other backends accept, too
GPU_RESOURCE = "nvidia.com/gpu"
TASK_UID = 10001  # the trainer image's user (deploy/docker/trainer.Dockerfile)
SCRATCH = "/tmp"  # noqa: S108 - an emptyDir of the pod's own, not the host's /tmp
IN_CLUSTER_CONTEXT = "in-cluster"  # SkyPilot's name for the cluster the scheduler's own pod runs in


@dataclass(frozen=True)
class PriorityBand:
    name: str
    lowest: int  # the smallest spec priority (-1000..1000) in the band
    value: int  # the PriorityClass value


# Spec priority (-1000..1000; below 0 is low) -> PriorityClass. Every band has preemptionPolicy Never:
# priority orders the kube-scheduler's queue (higher first) but never evicts a running pod, as the contract
# promises for v1.
PRIORITY_BANDS: tuple[PriorityBand, ...] = (
    PriorityBand("tandem-critical", 750, 4000),
    PriorityBand("tandem-high", 500, 3000),
    PriorityBand("tandem-normal", 250, 2000),
    PriorityBand("tandem-low", 0, 1000),
)


# SkyPilot's `use_spot`: below every band, so the kube-scheduler queues it after every other Tandem pod.
PREEMPTIBLE_BAND = PriorityBand("tandem-preemptible", -1, 500)


def priority_band(priority: int) -> PriorityBand:
    """The band a spec priority falls in (below 0 counts as low, above 1000 as critical)."""
    for band in PRIORITY_BANDS:
        if priority >= band.lowest:
            return band
    return PRIORITY_BANDS[-1]


def priority_class(band: PriorityBand) -> Json:
    """The PriorityClass object for a band."""
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": band.name, "labels": {MANAGED_BY: "tandem"}},
        "value": band.value,
        "globalDefault": False,
        "preemptionPolicy": "Never",
        "description": f"Tandem jobs with priority {band.lowest} and up (next band excluded); never preempts.",
    }


_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def _digest(text: str, length: int = 10) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def label_value(text: str) -> str:
    """`text` itself when it is a valid label value, else a sanitised prefix and a hash of it."""
    if len(text) <= 63 and _LABEL_VALUE.match(text):
        return text
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:48].strip("-_.")
    return f"{base}-{_digest(text)}" if base else _digest(text)


def object_name(key: str) -> str:
    """The Job (and Service) name for an attempt key: a DNS-1035 label, at most 55 characters, so the pods'
    hostnames `<name>-<rank>` stay within 63."""
    base = re.sub(r"[^a-z0-9]+", "-", key.lower()).strip("-")[:40].rstrip("-")
    return f"tdm-{base}-{_digest(key)}" if base else f"tdm-{_digest(key)}"


def pod_image(spec: LaunchSpec) -> str:
    """The task's image (SkyPilot's `image_id`), its private registry's server in front unless it starts
    with it, as SkyPilot's `format_image` writes it."""
    return with_server(spec.image, spec.registry_login) if spec.image else ""


def docker_config(login: RegistryLogin) -> bytes:
    """`.dockerconfigjson` for `login`: Docker Hub's under its classic key, any other server under its host."""
    server = login.server.split("://", 1)[-1].rstrip("/")
    if server in ("docker.io", "index.docker.io", "registry-1.docker.io"):
        server = "https://index.docker.io/v1/"
    auth = base64.b64encode(f"{login.username}:{login.password}".encode()).decode()
    entry = {"username": login.username, "password": login.password, "auth": auth}
    return json.dumps({"auths": {server: entry}}, sort_keys=True).encode()


_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def group_of(job: str) -> str:
    """The job group's name, `SKYPILOT_JOBGROUP_NAME` (expand.group_name): the job's id."""
    return job.rsplit("/", 1)[-1]


def task_ports(ports: Sequence[str]) -> list[int]:
    """Every port of `LaunchSpec.ports` (`"8080"`, `"10000-10010"`), in order, each once."""
    out: dict[int, None] = {}
    for text in ports:
        first, _, last = text.partition("-")
        out.update(dict.fromkeys(range(int(first), int(last or first) + 1)))
    return list(out)


def _quantity_cpu(cpus: float) -> str:
    return f"{round(cpus * 1000)}m"


def _quantity_memory(gib: float) -> str:
    return f"{round(gib * 1024)}Mi"


class KubernetesBackend:
    """Runs task attempts as Indexed Jobs in one namespace; see the module docstring."""

    name = "kubernetes"

    def __init__(
        self,
        *,
        image: str,
        namespace: str = "default",
        namespaces: Sequence[str] = (),
        service_account: str = "",
        image_pull_policy: str = "IfNotPresent",
        image_pull_secrets: Sequence[str] = (),
        configuration: k8s.Configuration | None = None,
        node_selector: Mapping[str, str] | None = None,
        gpu_type_label: str = "nvidia.com/gpu.product",
        manage_priority_classes: bool = True,
        termination_grace_s: int = 30,
        ttl_after_finished_s: int | None = 86400,
        request_timeout_s: float = 30.0,
        log_refresh_s: float = 2.0,
        run_as_user: int | None = TASK_UID,
        read_only_root_filesystem: bool = True,
        network_policy: bool = False,
        context: str = "",
        allowed_capabilities: Sequence[str] = (),
    ) -> None:
        """
        image: the container image every task runs in (Tandem installed for secrets and the trainer).
        namespace: where Jobs, Services and pods are created.
        namespaces: other namespaces a job may choose (`kubernetes.namespace`); the scheduler needs the same
            rights in each, and `find` looks in each.
        service_account: the pods' ServiceAccount; empty means the namespace's default.
        image_pull_policy: Always, IfNotPresent or Never.
        image_pull_secrets: names of existing docker-registry Secrets for pulling `image`.
        configuration: the client configuration; None loads the in-cluster config when running in a pod,
            else the local kubeconfig.
        node_selector: node labels every pod must match (e.g. a GPU node pool).
        gpu_type_label: the node label whose value is a spec's `gpu_type` (GPU feature discovery's
            `nvidia.com/gpu.product` by default); also what `inventory` reports as the GPU type.
        manage_priority_classes: create the PRIORITY_BANDS PriorityClasses when missing (needs a
            ClusterRole); False assumes they exist (deploy/kubernetes creates them).
        termination_grace_s: the pods' terminationGracePeriodSeconds (SIGTERM to SIGKILL when Kubernetes
            itself stops a pod); `cancel` passes its own grace.
        ttl_after_finished_s: finished Jobs are removed this long after they end; None keeps them.
        request_timeout_s: the deadline of every API call.
        log_refresh_s: the shortest interval between two log refreshes of one node rank.
        run_as_user: the uid (and gid, fsGroup) the task containers run as, the trainer image's own by
            default; None keeps the image's user, which must then be a numeric one other than 0. Either way
            the pods run as non-root (`runAsNonRoot`), with the RuntimeDefault seccomp profile, no privilege
            escalation, every capability dropped and no ServiceAccount token.
        read_only_root_filesystem: the container's root filesystem read-only; the task writes to its
            working folder and /tmp (emptyDir volumes, HOME the working folder) and its mounts.
        network_policy: give each attempt a NetworkPolicy that lets its pods and the other pods of the
            same job (ranks, inference workers) reach each other. On its own a task pod may then reach
            nothing else: deploy/kubernetes/base/networkpolicy.yaml adds DNS and the services a job
            calls, so turn this on with that manifest applied.
        context: the name of the kubeconfig context `configuration` reaches the cluster through (`connect`
            finds it): a job's `kubernetes.context` (SkyPilot's `infra: k8s/CONTEXT`) must be it, else its
            launch is refused (PRECHECK) naming both; empty refuses every job that names a context.
        allowed_capabilities: the Linux capabilities a task's `config.kubernetes.pod_config` may add to its
            containers (`securityContext.capabilities.add`); any other refuses the launch (PRECHECK) naming it.
        """
        if configuration is None:
            configuration, found = connect()
            context = context or found
        self.context = context
        self.namespace = namespace
        self.namespaces = (namespace, *[n for n in dict.fromkeys(namespaces) if n != namespace])
        self.image = image
        self.service_account = service_account
        self.image_pull_policy = image_pull_policy
        self.image_pull_secrets = tuple(image_pull_secrets)
        self.node_selector = dict(node_selector or {})
        self.gpu_type_label = gpu_type_label
        self.manage_priority_classes = manage_priority_classes
        self.termination_grace_s = termination_grace_s
        self.ttl_after_finished_s = ttl_after_finished_s
        self.request_timeout_s = request_timeout_s
        self.log_refresh_s = log_refresh_s
        self.run_as_user = run_as_user
        self.read_only_root_filesystem = read_only_root_filesystem
        self.network_policy = network_policy
        self.allowed_capabilities = tuple(allowed_capabilities)
        self._api_client = k8s.ApiClient(configuration)
        self._batch = k8s.BatchV1Api(self._api_client)
        self._core = k8s.CoreV1Api(self._api_client)
        self._scheduling = k8s.SchedulingV1Api(self._api_client)
        self._networking = k8s.NetworkingV1Api(self._api_client)
        self._discovery = k8s.DiscoveryV1Api(self._api_client)
        self._published: dict[str, tuple[str, list[Json]]] = {}  # slice -> (attempt, endpoints) last written
        self._priority_classes_ready: set[str] = set()
        self._log_refreshed: dict[tuple[str, int], float] = {}
        self._log_tasks: set[asyncio.Task[None]] = set()
        self._log_locks: dict[str, asyncio.Lock] = {}

    # -- the objects ---------------------------------------------------------------------------------------

    def labels(self, spec: LaunchSpec) -> dict[str, str]:
        return {
            MANAGED_BY: "tandem",
            LABEL_JOB: label_value(spec.job),
            LABEL_TASK: label_value(spec.task),
            LABEL_ATTEMPT: str(spec.attempt),
            LABEL_KEY: label_value(spec.key),
        }

    async def option_problems(self, options: Mapping[str, str]) -> dict[str, str]:
        """A job for a context other than this backend's (its `kubernetes.context`, SkyPilot's
        `infra: k8s/CONTEXT`), naming both. (A namespace it does not run jobs in refuses the launch.)"""
        wanted = options.get("context", "")
        if not wanted or wanted == self.context:
            return {}
        known = f"the context {self.context!r}" if self.context else "no named context"
        return {
            "context": f"the job is for the Kubernetes context {wanted!r} (kubernetes.context, as in infra: "
            f"k8s/{wanted}), and this scheduler reaches its cluster through {known}"
        }

    def namespace_for(self, spec: LaunchSpec) -> str:
        """Where the attempt's objects go: the job's `kubernetes.namespace` when it is one of ours."""
        chosen = spec.options.get("namespace") or self.namespace
        if chosen not in self.namespaces:
            raise LaunchRefused(
                f"namespace {chosen!r} is not one this scheduler runs jobs in ({', '.join(self.namespaces)})"
            )
        return chosen

    def job_object(self, spec: LaunchSpec) -> Json:
        """The Job for one attempt, as sent to the API."""
        name = object_name(spec.key)
        nodes = max(1, spec.num_nodes)
        labels = self.labels(spec)
        annotations = {ANNOTATION_KEY: spec.key, ANNOTATION_JOB: spec.job}
        if spec.sibling_tasks:
            annotations.update({ANNOTATION_GROUP: group_of(spec.job), ANNOTATION_TASK: spec.task})
        security: Json = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        if self.run_as_user is not None:
            uid = self.run_as_user
            security.update(runAsUser=uid, runAsGroup=uid, fsGroup=uid)
        pod_spec: Json = {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": self.termination_grace_s,
            "securityContext": security,
            "automountServiceAccountToken": False,  # a task has no business with the Kubernetes API
            "containers": [self._container(spec, name, nodes)],
        }
        if nodes > 1:
            pod_spec["subdomain"] = name
        if self.service_account:
            pod_spec["serviceAccountName"] = self.service_account
        pull_secrets = [*self.image_pull_secrets, *([name] if spec.registry_login else [])]
        if pull_secrets:  # the deployment's, and the attempt's own for its image's private registry
            pod_spec["imagePullSecrets"] = [{"name": secret} for secret in pull_secrets]
        node_selector = dict(self.node_selector)
        if spec.resources.gpu_type:
            node_selector[self.gpu_type_label] = spec.resources.gpu_type
        node_selector.update(
            {
                k.removeprefix(NODE_SELECTOR_OPTION): v
                for k, v in spec.options.items()
                if k.startswith(NODE_SELECTOR_OPTION)
            }
        )
        if node_selector:
            pod_spec["nodeSelector"] = node_selector
        pod_spec["priorityClassName"] = spec.options.get("priority_class_name") or self.band(spec).name
        volumes = self._volumes(spec)
        if volumes:
            pod_spec["volumes"] = volumes
        job_spec: Json = {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": 0,
            "template": {
                # the task's own labels (SkyPilot's `labels`) never override Tandem's, which `find` reads
                "metadata": {"labels": {**spec.labels, **labels}, "annotations": dict(annotations)},
                "spec": pod_spec,
            },
        }
        job_spec["template"] = self._with_task_config(spec, job_spec["template"], labels, annotations)
        if spec.time_limit_s > 0:
            job_spec["activeDeadlineSeconds"] = max(1, round(spec.time_limit_s))
        if self.ttl_after_finished_s is not None:
            job_spec["ttlSecondsAfterFinished"] = self.ttl_after_finished_s
        if _has_log_dir(spec.log_dir):
            annotations[ANNOTATION_LOG_DIR] = str(spec.log_dir)
        job_labels = {**spec.custom_labels, **labels}
        if spec.queue_name:  # Kueue admits the Job from this LocalQueue (it suspends it until then)
            job_labels[KUEUE_QUEUE_LABEL] = spec.queue_name
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "namespace": self.namespace_for(spec),
                "labels": job_labels,
                "annotations": {**spec.custom_annotations, **annotations},
            },
            "spec": job_spec,
        }

    def _with_task_config(
        self, spec: LaunchSpec, template: Json, labels: Mapping[str, str], annotations: Mapping[str, str]
    ) -> Json:
        """The pod template with the task's `config.kubernetes`: its partial Pod merged in by SkyPilot's rule
        (checked again here, with this deployment's allowed capabilities: LaunchRefused naming each field),
        its labels and annotations; Tandem's own labels and annotations, which `find` reads, win."""
        problems = pod_config_problems(dict(spec.pod_config), self.allowed_capabilities)
        problems += overridden_own_parts(template, spec.pod_config)
        problems += mismatched_shapes(template, spec.pod_config)
        if problems:
            raise LaunchRefused(
                "; ".join(f"config.kubernetes.pod_config.{path}: {why}" for path, why in problems)
            )
        override = {k: v for k, v in spec.pod_config.items() if k in ("metadata", "spec")}
        merged = merge_pod(template, override) if override else template
        metadata = merged.setdefault("metadata", {})
        metadata["labels"] = {**spec.custom_labels, **(metadata.get("labels") or {}), **labels}
        metadata["annotations"] = {
            **spec.custom_annotations,
            **(metadata.get("annotations") or {}),
            **annotations,
        }
        return merged

    def band(self, spec: LaunchSpec) -> PriorityBand:
        return PREEMPTIBLE_BAND if spec.preemptible else priority_band(spec.priority)

    def service_object(self, spec: LaunchSpec, owner_uid: str = "") -> Json:
        """The Service of an attempt on several nodes (headless: the pods' DNS names) or with `ports`
        (SkyPilot's: the ports the task exposes, reachable at the Service's name); both for both."""
        name = object_name(spec.key)
        metadata: Json = {
            "name": name,
            "namespace": self.namespace_for(spec),
            "labels": self.labels(spec),
            "annotations": {ANNOTATION_KEY: spec.key, ANNOTATION_JOB: spec.job},
        }
        if owner_uid:  # deleted with the Job by the garbage collector
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": name,
                    "uid": owner_uid,
                    "blockOwnerDeletion": True,
                }
            ]
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata,
            "spec": self._service_spec(spec),
        }

    def _service_spec(self, spec: LaunchSpec) -> Json:
        body: Json = {"selector": {LABEL_KEY: label_value(spec.key), MANAGED_BY: "tandem"}}
        if max(1, spec.num_nodes) > 1:
            body["clusterIP"] = "None"
            body["publishNotReadyAddresses"] = True  # ranks resolve each other before they are ready
        ports = task_ports(spec.ports)
        if ports:
            body["ports"] = [
                {"name": f"tcp-{p}", "port": p, "targetPort": p, "protocol": "TCP"} for p in ports
            ]
        return body

    def pull_secret_object(self, spec: LaunchSpec, owner_uid: str = "") -> Json:
        """The attempt's image pull Secret (`kubernetes.io/dockerconfigjson`) of its `registry_login`, named
        like its Job and owned by it, so it goes when the Job does."""
        login = spec.registry_login
        if login is None:
            raise ValueError("the attempt has no registry login")
        metadata = self.service_object(spec, owner_uid)["metadata"]
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/dockerconfigjson",
            "metadata": metadata,
            "data": {".dockerconfigjson": base64.b64encode(docker_config(login)).decode()},
        }

    def network_policy_object(self, spec: LaunchSpec, owner_uid: str = "") -> Json:
        """The attempt's NetworkPolicy: its pods and the other pods of its job may reach each other, in both
        directions (deploy/kubernetes/base/networkpolicy.yaml allows the rest a task needs)."""
        metadata = self.service_object(spec, owner_uid)["metadata"]
        same_job = {"podSelector": {"matchLabels": {MANAGED_BY: "tandem", LABEL_JOB: label_value(spec.job)}}}
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": metadata,
            "spec": {
                "podSelector": {"matchLabels": {MANAGED_BY: "tandem", LABEL_KEY: label_value(spec.key)}},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": [same_job]}, *self._open_ports(spec)],
                "egress": [{"to": [same_job]}],
            },
        }

    def group_service_object(self, spec: LaunchSpec, owner: tuple[str, str] = ("", "")) -> Json:
        """The job group's headless Service, named as the group (`SKYPILOT_JOBGROUP_NAME`): its DNS names
        `{task}-{rank}.{group}` are the EndpointSlices' hostnames (`group_slice_object`), written by `poll`
        from the pods it sees, since an Indexed Job's pods are named `<job>-<rank>` whatever the template
        says. No selector: the EndpointSlice controller leaves it to us. Every attempt Job of the group that
        has sibling names owns it (`owner`, its name and uid, added by each launch), so the garbage
        collector removes it once the last of them is gone, and a task's retry keeps it."""
        group = group_of(spec.job)
        metadata: Json = {
            "name": group,
            "namespace": self.namespace_for(spec),
            "labels": {MANAGED_BY: "tandem", LABEL_JOB: label_value(spec.job)},
            "annotations": {ANNOTATION_JOB: spec.job},
        }
        if owner[1]:
            metadata["ownerReferences"] = [_job_owner(*owner)]
        # publishNotReadyAddresses: the names resolve while the tasks start, before anything is ready
        body = {"clusterIP": "None", "publishNotReadyAddresses": True}
        return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": body}

    def group_slice_object(
        self, namespace: str, job: str, task: str, key: str, endpoints: Sequence[Json], service_uid: str = ""
    ) -> Json:
        """The EndpointSlice of one task in its group's Service: `{task}-{rank}` for each rank's pod (see
        `sibling_endpoints`), owned by the Service; `key` is the attempt that wrote it."""
        group = group_of(job)
        metadata: Json = {
            "name": f"{group}.{task}",  # neither has a dot: one slice per task, never another's
            "namespace": namespace,
            "labels": {
                SERVICE_NAME_LABEL: group,
                SLICE_MANAGED_BY: SLICE_MANAGER,
                MANAGED_BY: "tandem",
                LABEL_JOB: label_value(job),
                LABEL_TASK: label_value(task),
            },
            "annotations": {ANNOTATION_KEY: key, ANNOTATION_JOB: job},
        }
        if service_uid:
            metadata["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Service", "name": group, "uid": service_uid}
            ]
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": metadata,
            "addressType": _address_type(endpoints),
            "endpoints": list(endpoints),
        }

    def _open_ports(self, spec: LaunchSpec) -> list[Json]:
        """SkyPilot's `ports` are the task's to expose: open to any peer, as a range where there is one."""
        rules = []
        for text in spec.ports:
            first, _, last = text.partition("-")
            rule: Json = {"protocol": "TCP", "port": int(first)}
            if last and int(last) != int(first):
                rule["endPort"] = int(last)
            rules.append(rule)
        return [{"ports": rules}] if rules else []

    def _resources(self, spec: LaunchSpec) -> Json:
        """CPU, memory and disk requests; GPU and disk limits (a pod over its disk limit is evicted)."""
        resources: Json = {}
        requests: dict[str, str] = {}
        if spec.resources.cpus > 0:
            requests["cpu"] = _quantity_cpu(spec.resources.cpus)
        if spec.resources.memory_gib > 0:
            requests["memory"] = _quantity_memory(spec.resources.memory_gib)
        limits: dict[str, str] = {}
        if spec.resources.disk_gib > 0:  # SkyPilot's disk_size: the pod's own disk, asked and capped
            requests["ephemeral-storage"] = limits["ephemeral-storage"] = _quantity_memory(
                spec.resources.disk_gib
            )
        if requests:
            resources["requests"] = requests
        if spec.resources.gpus > 0:
            limits[GPU_RESOURCE] = str(spec.resources.gpus)
        if limits:
            resources["limits"] = limits
        return resources

    def _container(self, spec: LaunchSpec, name: str, nodes: int) -> Json:
        env: list[Json] = []
        own = {*RANK_VARIABLES, *IPS_VARIABLES, SECRETS_ENV}
        fixed = {
            "TANDEM_NUM_NODES": str(nodes),
            "SKYPILOT_NUM_NODES": str(nodes),
            "TANDEM_RESTART_COUNT": str(spec.attempt),
        }
        if self.read_only_root_filesystem:  # the writable places are its volumes: HOME is one of them
            fixed["HOME"] = str(spec.workdir) if spec.workdir is not None else SCRATCH
        for variable, value in sorted({**fixed, **spec.env}.items()):
            if variable not in own:
                env.append({"name": variable, "value": value})
        rank_ref = {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}
        env += [{"name": variable, "valueFrom": rank_ref} for variable in RANK_VARIABLES]
        if nodes > 1:
            hosts = "\n".join(f"{name}-{rank}.{name}" for rank in range(nodes))
            env += [{"name": variable, "value": hosts} for variable in IPS_VARIABLES]
        else:
            ip_ref = {"fieldRef": {"fieldPath": "status.podIP"}}
            env += [{"name": variable, "valueFrom": ip_ref} for variable in IPS_VARIABLES]
        command = spec.command
        if spec.sibling_tasks:  # the siblings' names, from the cluster's DNS once `poll` published them
            env.append({"name": group_hosts.TASKS_ENV, "value": " ".join(spec.sibling_tasks)})
            if spec.sibling_hosts_required:
                env.append({"name": group_hosts.REQUIRED_ENV, "value": "1"})
            command = group_hosts.wait_script(spec.sibling_tasks, group_of(spec.job)) + command
        script = ["bash", "-euo", "pipefail", "-c", command]
        if spec.secret_env:
            env.append({"name": SECRETS_ENV, "value": format_secrets(spec.secret_env)})
            script = ["python", "-m", "services.scheduler.backends.task_secrets", *script]
        resources = self._resources(spec)
        container: Json = {
            "name": CONTAINER,
            "image": pod_image(spec) or self.image,
            "imagePullPolicy": self.image_pull_policy,
            "command": script,
            "env": env,
            "resources": resources,
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
                "readOnlyRootFilesystem": self.read_only_root_filesystem,
            },
        }
        if spec.workdir is not None:
            container["workingDir"] = str(spec.workdir)
        if spec.ports:
            container["ports"] = [{"containerPort": p, "protocol": "TCP"} for p in task_ports(spec.ports)]
        mounts = self._volume_mounts(spec)
        if mounts:
            container["volumeMounts"] = mounts
        return container

    def _scratch(self, spec: LaunchSpec) -> list[tuple[str, str]]:
        """(emptyDir volume, mount path) the task writes in: with a read-only root filesystem /tmp and its
        working folder; the pod's home when the task mounts under ~/ (HOME is there, its mounts inside it);
        each unless a mount of the spec is already there."""
        taken = {path.rstrip("/") for path, _source, _read_only in spec.file_mounts}
        wanted: list[tuple[str, str]] = []
        if self.read_only_root_filesystem:
            wanted.append(("tandem-tmp", SCRATCH))
            if spec.workdir is not None:
                wanted.append(("tandem-work", str(spec.workdir)))
        if any(path.startswith(POD_HOME + "/") for path in taken):
            wanted.append(("tandem-home", POD_HOME))
        return [(volume, path) for volume, path in wanted if path.rstrip("/") not in taken]

    def _volume_mounts(self, spec: LaunchSpec) -> list[Json]:
        mounts: list[Json] = []
        for index, (path, source, read_only) in enumerate(spec.file_mounts):
            # a bucket's folder is written by the copy down, whatever the task may do
            mount: Json = {
                "name": f"mount-{index}",
                "mountPath": path,
                "readOnly": read_only and bool(source),
            }
            if source and not source.startswith("/") and "/" in source:
                mount["subPath"] = source.split("/", 1)[1]  # a volume's sub_path
            mounts.append(mount)
        return mounts + [{"name": volume, "mountPath": path} for volume, path in self._scratch(spec)]

    def _volumes(self, spec: LaunchSpec) -> list[Json]:
        volumes: list[Json] = [{"name": volume, "emptyDir": {}} for volume, _path in self._scratch(spec)]
        for index, (_path, source, read_only) in enumerate(spec.file_mounts):
            if not source:  # a folder of the pod's own (a bucket's, filled by task_buckets)
                volumes.append({"name": f"mount-{index}", "emptyDir": {}})
            elif source.startswith("/"):
                volumes.append({"name": f"mount-{index}", "hostPath": {"path": source}})
            else:  # a named volume is a PersistentVolumeClaim in the namespace (`NAME/SUB` mounts SUB of it)
                claim = {"claimName": source.split("/", 1)[0], "readOnly": read_only}
                volumes.append({"name": f"mount-{index}", "persistentVolumeClaim": claim})
        return volumes

    # -- the interface ---------------------------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> Handle:
        if not KEY_PATTERN.fullmatch(spec.key):
            raise LaunchRefused(f"attempt key {spec.key!r} must match {KEY_PATTERN.pattern}")
        if spec.num_nodes < 1:
            raise LaunchRefused(f"num_nodes must be at least 1, not {spec.num_nodes}")
        if spec.sibling_tasks:
            _check_host_names(spec)
        if _has_log_dir(spec.log_dir):  # logs() copies the pods' logs here
            await asyncio.to_thread(Path(spec.log_dir).mkdir, parents=True, exist_ok=True)
        problems = await self.option_problems(spec.options)
        if problems:
            raise LaunchRefused("; ".join(problems.values()))
        namespace = self.namespace_for(spec)
        if self.manage_priority_classes and not spec.options.get("priority_class_name"):
            await self._ensure_priority_class(self.band(spec))
        job = self.job_object(spec)
        name = job["metadata"]["name"]
        try:
            created = await self._call(
                self._batch.create_namespaced_job, namespace, job, refusal=True, conflict_ok=True
            )
        except _Conflict:
            created = await self._call(self._batch.read_namespaced_job, name, namespace)
            if created["metadata"].get("annotations", {}).get(ANNOTATION_KEY) != spec.key:
                raise LaunchRefused(f"Job {name} exists and belongs to another attempt") from None
        uid = str(created["metadata"].get("uid", ""))
        await self._create_attempt_objects(spec, namespace, uid)
        service = ""
        if max(1, spec.num_nodes) > 1 or spec.ports:
            service = name
            await self._create_owned(
                self._core.create_namespaced_service, namespace, self.service_object(spec, uid)
            )
        group = ""
        if spec.sibling_tasks:
            group = await self._join_group(spec, namespace, name, uid)
        handle = self._handle(spec.key, name, uid, max(1, spec.num_nodes), service, spec.log_dir, namespace)
        if group:
            handle.update(group=group, task=spec.task, tandem_job=spec.job)
        return handle

    async def _create_attempt_objects(self, spec: LaunchSpec, namespace: str, uid: str) -> None:
        """What the attempt's Job owns besides its pods: the image pull Secret and the NetworkPolicy."""
        if spec.registry_login is not None:  # the kubelet retries a pull that came before it
            await self._create_owned(
                self._core.create_namespaced_secret, namespace, self.pull_secret_object(spec, uid)
            )
        if self.network_policy:
            await self._create_owned(
                self._networking.create_namespaced_network_policy,
                namespace,
                self.network_policy_object(spec, uid),
            )

    async def _join_group(self, spec: LaunchSpec, namespace: str, job_name: str, job_uid: str) -> str:
        """The group's Service, created by the first of its tasks to launch, with this attempt's Job among
        its owners (this task's EndpointSlice in it comes with `poll`, once its pods have addresses)."""
        body = self.group_service_object(spec, (job_name, job_uid))
        group = str(body["metadata"]["name"])
        try:
            service = await self._call(
                self._core.create_namespaced_service, namespace, body, refusal=True, conflict_ok=True
            )
        except _Conflict:
            service = await self._call(self._core.read_namespaced_service, group, namespace)
            metadata = service.get("metadata", {})
            if (metadata.get("annotations") or {}).get(ANNOTATION_JOB) != spec.job:
                raise LaunchRefused(
                    f"Service {group} exists in {namespace} and is not job {spec.job}'s: its tasks' host "
                    f"names `TASK-RANK.{group}` cannot be given there"
                ) from None
            owners = metadata.get("ownerReferences") or []
            if all(ref.get("uid") != job_uid for ref in owners):
                patch = (
                    [
                        {
                            "op": "add",
                            "path": "/metadata/ownerReferences/-",
                            "value": _job_owner(job_name, job_uid),
                        }
                    ]
                    if owners
                    else [
                        {
                            "op": "add",
                            "path": "/metadata/ownerReferences",
                            "value": [_job_owner(job_name, job_uid)],
                        }
                    ]
                )
                await self._call(self._core.patch_namespaced_service, group, namespace, patch, refusal=True)
        return group

    async def _publish_siblings(self, handle: Handle, pods: list[Json], ended: bool) -> None:
        """Make the task's EndpointSlice name its pods (none once the attempt ended), when that changed. The
        slice is created with the first addresses (its address family is theirs, and immutable); an ended
        attempt empties it only while it is still the one that wrote it, so a retry's names stay."""
        namespace, task, key = _namespace(handle, self.namespace), str(handle["task"]), str(handle["key"])
        name = f"{handle['group']}.{task}"
        endpoints = [] if ended else sibling_endpoints(task, pods, namespace)
        slot = f"{namespace}/{name}"
        if self._published.get(slot) == (key, endpoints):
            return
        read = self._discovery.read_namespaced_endpoint_slice
        try:
            try:
                current: Json | None = await self._call(read, name, namespace, missing_ok=True)
            except _Missing:
                current = None
            writer = ((current or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_KEY)
            if current is None and endpoints:
                await self._create_slice(handle, namespace, endpoints)
            elif current is not None and (writer == key or not ended):
                if endpoints and current.get("addressType") != _address_type(endpoints):
                    await self._call(self._discovery.delete_namespaced_endpoint_slice, name, namespace)
                    await self._create_slice(handle, namespace, endpoints)
                else:
                    patch = [  # `add` replaces: an empty list may read back as null
                        {"op": "add", "path": "/endpoints", "value": endpoints},
                        {
                            "op": "add",
                            "path": f"/metadata/annotations/{_pointer(ANNOTATION_KEY)}",
                            "value": key,
                        },
                    ]
                    await self._call(self._discovery.patch_namespaced_endpoint_slice, name, namespace, patch)
        except _Missing:  # the group's Service is gone (its Jobs were all removed): nothing to name
            pass
        except (BackendUnavailable, LaunchRefused) as error:
            log.warning("kubernetes: could not publish the host names of %s: %s", handle.get("job"), error)
            return
        self._published[slot] = (key, endpoints)

    async def _create_slice(self, handle: Handle, namespace: str, endpoints: list[Json]) -> None:
        """The task's EndpointSlice, owned by the group's Service (which must be there)."""
        group = str(handle["group"])
        service = await self._call(self._core.read_namespaced_service, group, namespace, missing_ok=True)
        body = self.group_slice_object(
            namespace,
            str(handle["tandem_job"]),
            str(handle["task"]),
            str(handle["key"]),
            endpoints,
            str(service.get("metadata", {}).get("uid", "")),
        )
        await self._call(self._discovery.create_namespaced_endpoint_slice, namespace, body, refusal=True)

    async def _create_owned(self, create: Callable[..., Any], namespace: str, body: Json) -> None:
        """An object the attempt's Job owns; one already there was made by an earlier launch of this key."""
        with contextlib.suppress(_Conflict):
            await self._call(create, namespace, body, refusal=True, conflict_ok=True)

    async def find(self, key: str) -> Handle | None:
        for namespace in self.namespaces:
            found = await self._find_in(namespace, key)
            if found is not None:
                return found
        return None

    async def _find_in(self, namespace: str, key: str) -> Handle | None:
        listed = await self._call(
            self._batch.list_namespaced_job, namespace, label_selector=self._selector(key)
        )
        for job in listed.get("items", []):
            metadata = job.get("metadata", {})
            annotations = metadata.get("annotations") or {}
            if annotations.get(ANNOTATION_KEY) != key:
                continue
            spec = job.get("spec", {})
            nodes = int(spec.get("completions") or 1)
            pod_spec = spec.get("template", {}).get("spec", {})
            log_dir = annotations.get(ANNOTATION_LOG_DIR)
            handle = self._handle(
                key,
                str(metadata["name"]),
                str(metadata.get("uid", "")),
                nodes,
                str(pod_spec.get("subdomain", "")),
                Path(log_dir) if log_dir else None,
                namespace,
            )
            if annotations.get(ANNOTATION_GROUP):
                handle.update(
                    group=annotations[ANNOTATION_GROUP],
                    task=annotations.get(ANNOTATION_TASK, ""),
                    tandem_job=annotations.get(ANNOTATION_JOB, ""),
                )
            return handle
        return None

    async def poll(self, handle: Handle) -> Observed:
        name, namespace = str(handle["job"]), _namespace(handle, self.namespace)
        try:
            job = await self._call(self._batch.read_namespaced_job, name, namespace, missing_ok=True)
        except _Missing:
            return Observed(Phase.LOST, message=f"Job {name} no longer exists (deleted)")
        pods = await self._pods(handle)
        observed = _observe(job, pods, int(handle.get("num_nodes", 1)))
        if handle.get("group"):
            await self._publish_siblings(handle, pods, observed.phase in (Phase.EXITED, Phase.LOST))
        if observed.phase in (Phase.EXITED, Phase.LOST) and handle.get("log_dir"):
            await self._refresh_logs(handle, pods)
        return observed

    async def cancel(self, handle: Handle, grace_s: float = 10.0) -> None:
        """Mark the Job cancelled, delete its pods with `grace_s` (SIGTERM now, SIGKILL after the grace),
        then put it past its deadline, so the Job controller fails it and creates no pods. The Job stays,
        Failed, so `poll` reports the end (EXITED, 143 unless a container said otherwise) until its
        ttlSecondsAfterFinished removes it with its Service. A suspended (never started) Job has no pods
        and no deadline clock: it is deleted in the foreground instead."""
        name, namespace = str(handle["job"]), _namespace(handle, self.namespace)
        grace = max(0, round(grace_s))
        if handle.get("log_dir"):  # the pods' logs go with the pods: keep what they wrote so far
            with contextlib.suppress(BackendUnavailable):
                await self._refresh_logs(handle, await self._pods(handle))
        try:
            job = await self._call(self._batch.read_namespaced_job, name, namespace, missing_ok=True)
        except _Missing:
            job = None
        if job is not None and job.get("spec", {}).get("suspend"):
            options = {"propagationPolicy": "Foreground", "gracePeriodSeconds": grace}
            with contextlib.suppress(_Missing):
                await self._call(
                    self._batch.delete_namespaced_job, name, namespace, body=options, missing_ok=True
                )
            return
        running = job is not None and not _condition(job, "Complete") and not _condition(job, "Failed")
        # JSON Patches (list bodies): every client version sends them as application/json-patch+json. The
        # Jobs this backend creates always carry annotations, so the first path's parent exists.
        mark = [
            {
                "op": "add",
                "path": f"/metadata/annotations/{_pointer(ANNOTATION_CANCELLED)}",
                "value": str(grace),
            }
        ]
        deadline = [{"op": "add", "path": "/spec/activeDeadlineSeconds", "value": 1}]
        if running:  # first, so that however the Job ends from here, it reads as cancelled
            await self._patch_job(name, namespace, mark)
        # Our own deletion first: the Job controller, once past the deadline, would stop the pods with their
        # terminationGracePeriodSeconds rather than this call's grace.
        await self._call(
            self._core.delete_collection_namespaced_pod,
            namespace,
            label_selector=self._selector(str(handle["key"])),
            grace_period_seconds=grace,
        )
        if running:  # a deleted pod counts as failed (backoffLimit 0); the deadline makes sure of the end
            await self._patch_job(name, namespace, deadline)

    async def _patch_job(self, name: str, namespace: str, patch: list[Json]) -> None:
        with contextlib.suppress(_Missing):
            await self._call(self._batch.patch_namespaced_job, name, namespace, patch, missing_ok=True)

    def logs(self, handle: Handle, node_rank: int = 0) -> Path | None:
        log_dir = handle.get("log_dir")
        if not log_dir:
            return None
        path = Path(log_dir) / f"rank-{node_rank}.log"
        self._schedule_log_refresh(handle, node_rank)
        return path if path.exists() else None

    async def inventory(self) -> list[NodeInventory]:
        nodes = await self._call(self._core.list_node)
        pods = await self._call(
            self._core.list_pod_for_all_namespaces,
            field_selector="status.phase!=Succeeded,status.phase!=Failed",
        )
        used: dict[str, list[float]] = {}
        for pod in pods.get("items", []):
            node = pod.get("spec", {}).get("nodeName")
            if not node:
                continue
            totals = used.setdefault(node, [0.0, 0.0, 0.0])
            for container in pod.get("spec", {}).get("containers", []):
                resources = container.get("resources") or {}
                requests = resources.get("requests") or {}
                limits = resources.get("limits") or {}
                totals[0] += _parse_quantity(str(limits.get(GPU_RESOURCE, requests.get(GPU_RESOURCE, 0))))
                totals[1] += _parse_quantity(str(requests.get("cpu", 0)))
                totals[2] += _parse_quantity(str(requests.get("memory", 0))) / 2**30
        result = []
        for node in nodes.get("items", []):
            metadata = node.get("metadata", {})
            status = node.get("status", {})
            allocatable = status.get("allocatable") or {}
            labels = dict(metadata.get("labels") or {})
            gpus = int(_parse_quantity(str(allocatable.get(GPU_RESOURCE, 0))))
            cpus = _parse_quantity(str(allocatable.get("cpu", 0)))
            memory = _parse_quantity(str(allocatable.get("memory", 0))) / 2**30
            gpus_used, cpus_used, memory_used = used.get(str(metadata.get("name")), [0.0, 0.0, 0.0])
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
            )
            address = next(
                (a["address"] for a in status.get("addresses") or [] if a.get("type") == "InternalIP"), ""
            )
            result.append(
                NodeInventory(
                    name=str(metadata.get("name", "")),
                    address=address,
                    gpus=gpus,
                    gpus_free=max(0, gpus - int(gpus_used)),
                    gpu_type=labels.get(self.gpu_type_label, ""),
                    cpus=cpus,
                    cpus_free=max(0.0, cpus - cpus_used),
                    memory_gib=memory,
                    memory_free_gib=max(0.0, memory - memory_used),
                    labels=labels,
                    up=ready and not node.get("spec", {}).get("unschedulable", False),
                )
            )
        return result

    async def close(self) -> None:
        for task in list(self._log_tasks):
            task.cancel()
        await asyncio.gather(*self._log_tasks, return_exceptions=True)
        await asyncio.to_thread(self._api_client.close)

    # -- helpers ---------------------------------------------------------------------------------------------

    def _handle(
        self, key: str, name: str, uid: str, nodes: int, service: str, log_dir: Path | None, namespace: str
    ) -> Handle:
        handle: Handle = {
            "backend": self.name,
            "namespace": namespace,
            "key": key,
            "job": name,
            "uid": uid,
            "num_nodes": nodes,
            "service": service,
        }
        if log_dir is not None and _has_log_dir(log_dir):
            handle["log_dir"] = str(log_dir)
        return handle

    async def _ensure_priority_class(self, band: PriorityBand) -> None:
        if band.name in self._priority_classes_ready:
            return
        try:
            await self._call(
                self._scheduling.read_priority_class, band.name, missing_ok=True, forbidden_ok=True
            )
        except _Missing:
            with contextlib.suppress(_Conflict):
                await self._call(
                    self._scheduling.create_priority_class,
                    priority_class(band),
                    refusal=True,
                    conflict_ok=True,
                )
        except _Forbidden:  # no cluster-wide rights: the deployment is expected to have created them
            log.warning("kubernetes: may not read PriorityClass %s; assuming it exists", band.name)
        self._priority_classes_ready.add(band.name)

    @staticmethod
    def _selector(key: str) -> str:
        return f"{MANAGED_BY}=tandem,{LABEL_KEY}={label_value(key)}"

    async def _pods(self, handle: Handle) -> list[Json]:
        namespace, selector = _namespace(handle, self.namespace), self._selector(str(handle["key"]))
        listed = await self._call(self._core.list_namespaced_pod, namespace, label_selector=selector)
        return list(listed.get("items", []))

    def _schedule_log_refresh(self, handle: Handle, node_rank: int) -> None:
        now = time.monotonic()
        slot = (str(handle["job"]), node_rank)
        if now - self._log_refreshed.get(slot, -self.log_refresh_s) < self.log_refresh_s:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop to refresh on; the next poll or logs() call from the scheduler's loop will
        if any(not task.done() and task.get_name() == repr(slot) for task in self._log_tasks):
            return  # one refresh of a file at a time; the next call starts another
        self._log_refreshed[slot] = now
        task = loop.create_task(self._refresh_logs(handle, None, only_rank=node_rank), name=repr(slot))
        self._log_tasks.add(task)
        task.add_done_callback(self._log_tasks.discard)

    async def _refresh_logs(
        self, handle: Handle, pods: list[Json] | None, only_rank: int | None = None
    ) -> None:
        """Append what is new in each rank's pod log to `<log_dir>/rank-<r>.log`."""
        lock = self._log_locks.setdefault(str(handle["job"]), asyncio.Lock())
        async with lock:  # two refreshes of one file at once would both append the same tail
            await self._refresh_logs_locked(handle, pods, only_rank)

    async def _refresh_logs_locked(
        self, handle: Handle, pods: list[Json] | None, only_rank: int | None
    ) -> None:
        log_dir = Path(str(handle["log_dir"]))
        try:
            if pods is None:
                pods = await self._pods(handle)
            for rank, item in _latest_pod_per_rank(pods).items():
                if only_rank is not None and rank != only_rank:
                    continue
                pod_name = str(item["metadata"]["name"])
                try:
                    text = await self._call(
                        self._core.read_namespaced_pod_log,
                        pod_name,
                        _namespace(handle, self.namespace),
                        container=CONTAINER,
                        raw=True,
                        missing_ok=True,
                    )
                except (_Missing, BackendUnavailable):
                    continue
                await asyncio.to_thread(_append_new, log_dir / f"rank-{rank}.log", text)
        except BackendUnavailable as error:
            log.warning("kubernetes: could not refresh logs of %s: %s", handle.get("job"), error)

    async def _call(
        self,
        method: Callable[..., Any],
        *args: Any,
        refusal: bool = False,
        conflict_ok: bool = False,
        missing_ok: bool = False,
        forbidden_ok: bool = False,
        raw: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Run one API call on a thread and map its failures (see the module docstring)."""

        def call() -> Any:
            response = method(
                *args, _preload_content=False, _request_timeout=self.request_timeout_s, **kwargs
            )
            data = response.data
            if raw:
                return bytes(data)
            return json.loads(data) if data else {}

        try:
            return await asyncio.to_thread(call)
        except k8s.ApiException as error:
            status = int(error.status or 0)
            message = _api_message(error)
            if status == 404 and missing_ok:
                raise _Missing(message) from None
            if status == 409 and conflict_ok:
                raise _Conflict(message) from None
            if status == 403 and forbidden_ok:
                raise _Forbidden(message) from None
            if status in {0, 429} or status >= 500:
                raise BackendUnavailable(f"Kubernetes API: {message}") from None
            if refusal:
                raise LaunchRefused(f"Kubernetes API refused ({status}): {message}") from None
            raise BackendUnavailable(f"Kubernetes API answered {status}: {message}") from None
        except pydantic.ValidationError as error:  # the client checks bodies against its models first
            if refusal:
                raise LaunchRefused(f"the Kubernetes client refused the object: {error}") from None
            raise
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise BackendUnavailable(f"Kubernetes API unreachable: {error}") from None


def _job_owner(name: str, uid: str) -> Json:
    """An ownerReference to an attempt's Job: its dependents go with it (with the last of them, when several
    Jobs own one object)."""
    return {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid, "blockOwnerDeletion": True}


def _check_host_names(spec: LaunchSpec) -> None:
    """The group's name must be a Service's name and `{task}-{rank}` a host name (DNS labels)."""
    group = group_of(spec.job)
    if not _DNS_1035.match(group):
        raise LaunchRefused(
            f"job id {group!r} cannot name the job group's Service (a DNS label: a lowercase letter, then at "
            "most 62 lowercase letters, digits or hyphens, not ending in one); the tasks' host names "
            f"`TASK-RANK.{group}` need it"
        )
    last = f"{spec.task}-{max(1, spec.num_nodes) - 1}"
    if not _DNS_1035.match(last):
        raise LaunchRefused(
            f"host name {last!r} of task {spec.task!r} is not a DNS label (at most 63 lowercase letters, "
            "digits or hyphens): a shorter task name gives its ranks names in the group"
        )


def _address_type(endpoints: Sequence[Json]) -> str:
    return "IPv6" if any(":" in a for e in endpoints for a in e.get("addresses", [])) else "IPv4"


def sibling_endpoints(task: str, pods: list[Json], namespace: str) -> list[Json]:
    """The endpoints of `{task}-{rank}` in the group's Service: each rank's newest pod that has an address
    and has not ended, by rank. A pod's addresses are of one family (its first, `podIP`)."""
    endpoints = []
    for rank, pod in sorted(_latest_pod_per_rank(pods).items()):
        status, metadata = pod.get("status", {}), pod.get("metadata", {})
        address = str(status.get("podIP") or "")
        if not address or _pod_phase(pod) not in ("Pending", "Running") or metadata.get("deletionTimestamp"):
            continue
        endpoint: Json = {
            "addresses": [address],
            "hostname": f"{task}-{rank}",
            "conditions": {"ready": True},
            "targetRef": {
                "kind": "Pod",
                "name": str(metadata.get("name", "")),
                "namespace": namespace,
                "uid": str(metadata.get("uid", "")),
            },
        }
        if pod.get("spec", {}).get("nodeName"):
            endpoint["nodeName"] = str(pod["spec"]["nodeName"])
        endpoints.append(endpoint)
    family = _address_type(endpoints[:1])
    return [e for e in endpoints if _address_type([e]) == family]


def _pointer(key: str) -> str:
    """`key` as one JSON Pointer segment (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _namespace(handle: Handle, default: str) -> str:
    return str(handle.get("namespace") or default)


class _Missing(Exception):
    pass


class _Conflict(Exception):
    pass


class _Forbidden(Exception):
    pass


def _has_log_dir(log_dir: Path) -> bool:
    return str(log_dir) not in ("", ".")


def load_configuration(kubeconfig: str = "", context: str = "") -> k8s.Configuration:
    """The client configuration (see `connect`)."""
    return connect(kubeconfig, context)[0]


def connect(kubeconfig: str = "", context: str = "") -> tuple[k8s.Configuration, str]:
    """The client configuration and the name of the context it reaches the cluster through: the `kubeconfig`
    file's when one is named, else the pod's in-cluster credentials when running in one (the context
    SkyPilot calls `in-cluster`), else the default kubeconfig's ($KUBECONFIG or ~/.kube/config); `context`
    picks one of a kubeconfig's contexts, empty its current one."""
    from kubernetes import config  # noqa: PLC0415

    configuration = k8s.Configuration()
    if not kubeconfig and not context:
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            pass
        else:
            return configuration, IN_CLUSTER_CONTEXT
    file = kubeconfig or None
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=file, context=context or None, client_configuration=configuration
    )
    if not context:
        _contexts, active = config.list_kube_config_contexts(config_file=file)  # type: ignore[no-untyped-call]
        context = str((active or {}).get("name", ""))
    return configuration, context


def _api_message(error: Any) -> str:
    body = getattr(error, "body", None)
    if body:
        try:
            parsed = json.loads(body)
        except (TypeError, ValueError):
            return str(body)[:500]
        if isinstance(parsed, dict) and parsed.get("message"):
            return str(parsed["message"])
    return str(getattr(error, "reason", "") or error)


def _append_new(path: Path, text: bytes) -> None:
    """Write `text` to `path` keeping byte offsets: append the new tail when `text` extends what is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    current = path.read_bytes() if path.exists() else b""
    if text.startswith(current):
        if len(text) > len(current):
            with path.open("ab") as out:
                out.write(text[len(current) :])
    elif not current.endswith(text):  # a new pod (or a rotated log): keep the old output, add the new
        with path.open("ab") as out:
            out.write(text)
    if not path.exists():
        path.touch()


def _rank(pod: Json) -> int | None:
    metadata = pod.get("metadata", {})
    value = (metadata.get("labels") or {}).get(INDEX_LABEL) or (metadata.get("annotations") or {}).get(
        INDEX_ANNOTATION
    )
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _latest_pod_per_rank(pods: list[Json]) -> dict[int, Json]:
    latest: dict[int, Json] = {}
    for pod in pods:
        rank = _rank(pod)
        if rank is None:
            continue
        created = str(pod.get("metadata", {}).get("creationTimestamp", ""))
        if rank not in latest or created >= str(
            latest[rank].get("metadata", {}).get("creationTimestamp", "")
        ):
            latest[rank] = pod
    return latest


def _terminated(pod: Json) -> Json | None:
    for status in pod.get("status", {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER:
            state = status.get("state") or {}
            if state.get("terminated"):
                return dict(state["terminated"])
            last = status.get("lastState") or {}
            if last.get("terminated"):
                return dict(last["terminated"])
    return None


_NODE_GONE = {"DeletionByTaintManager", "DeletionByPodGC", "NodeLost"}


def _disruption(pod: Json) -> tuple[str, str]:
    """How Kubernetes itself took the pod away: ("preempted", why) for a preemption, an eviction or a node
    shutdown; ("node", why) when its node is gone; ("", "") when it did not."""
    status = pod.get("status", {})
    reason = str(status.get("reason") or "")
    if reason in _NODE_GONE:
        return "node", f"{reason}: {status.get('message') or 'the node is gone'}"
    if reason in ("Evicted", "Preempting", "Preempted", "Shutdown", "Terminated", "NodeShutdown"):
        return "preempted", f"{reason}: {status.get('message') or 'the pod was stopped by Kubernetes'}"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            why = str(condition.get("reason") or "DisruptionTarget")
            text = f"{why}: {condition.get('message') or 'disrupted'}"
            return ("node" if why in _NODE_GONE else "preempted"), text
    return "", ""


def _condition(job: Json, kind: str) -> Json | None:
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return dict(condition)
    return None


def _observe(job: Json, pods: list[Json], num_nodes: int) -> Observed:
    """Map a Job and its pods to what the scheduler sees. The verdict waits for the Job's own terminal
    condition (Complete or Failed, set once its pods have stopped), so an attempt never reads as ended while
    some of its ranks still hold their GPUs."""
    per_rank = _latest_pod_per_rank(pods)
    nodes = tuple(
        NodeAssignment(
            rank=rank,
            node=str(pod.get("spec", {}).get("nodeName") or ""),
            address=str(pod.get("status", {}).get("podIP") or ""),
        )
        for rank, pod in sorted(per_rank.items())
    )
    if _condition(job, "Complete"):
        return Observed(Phase.EXITED, exit_code=0, nodes=nodes)
    failed = _condition(job, "Failed")
    cancelled = ANNOTATION_CANCELLED in (job.get("metadata", {}).get("annotations") or {})
    if failed and cancelled:
        codes = [int(t.get("exitCode", 0)) for pod in per_rank.values() if (t := _terminated(pod))]
        code = next((c for c in codes if c != 0), 143)
        return Observed(Phase.EXITED, exit_code=code, message="cancelled", nodes=nodes)
    if failed:
        return _failure(failed, per_rank, nodes)
    if job.get("spec", {}).get("suspend"):
        return Observed(Phase.QUEUED, message="the Job is suspended (queued by a quota manager)", nodes=nodes)
    phases = [_pod_phase(pod) for pod in per_rank.values()]
    if "Unknown" in phases:
        return Observed(Phase.RUNNING, message="a pod's node stopped reporting (phase Unknown)", nodes=nodes)
    running = sum(phase in ("Running", "Succeeded", "Failed") for phase in phases)
    if running and (running >= num_nodes or "Pending" not in phases):
        message = "the Job is failing" if _condition(job, "FailureTarget") else ""
        return Observed(Phase.RUNNING, message=message, nodes=nodes)
    if job.get("metadata", {}).get("deletionTimestamp"):
        return Observed(Phase.QUEUED, message="the Job is being deleted", nodes=nodes)
    return Observed(Phase.QUEUED, message=_pending_reason(per_rank), nodes=nodes)


def _failure(failed: Json, per_rank: Mapping[int, Json], nodes: tuple[NodeAssignment, ...]) -> Observed:
    """A Failed Job: preempted, its node gone, over its deadline, or a rank's own exit code."""
    job_reason = str(failed.get("reason") or "Failed")
    job_message = f"Job {job_reason}: {failed.get('message') or ''}".rstrip(": ")
    if job_reason == "DeadlineExceeded":  # activeDeadlineSeconds: the time limit, the task's own doing
        return Observed(Phase.EXITED, exit_code=137, message=job_message, nodes=nodes)
    for rank, pod in sorted(per_rank.items()):
        kind, why = _disruption(pod)
        if kind == "node":
            return Observed(Phase.LOST, message=f"rank {rank}: {why}", nodes=nodes)
        if kind == "preempted":
            code = int((_terminated(pod) or {}).get("exitCode", 137))
            return Observed(
                Phase.EXITED, exit_code=code, message=f"rank {rank}: {why}", nodes=nodes, preempted=True
            )
    # The first rank to fail is the cause; the controller then stops the others (SIGTERM: 143). finishedAt
    # has one-second resolution, so among ties an exit of the task's own beats a signal death.
    failures = sorted(
        (str(ended.get("finishedAt") or ""), int(ended["exitCode"]) >= 128, rank, ended)
        for rank, pod in per_rank.items()
        if (ended := _terminated(pod)) and int(ended.get("exitCode", 0)) != 0
    )
    if failures:
        _finished, _signal, rank, ended = failures[0]
        code = int(ended["exitCode"])
        detail = f" ({ended['reason']})" if ended.get("reason") else ""
        return Observed(
            Phase.EXITED, exit_code=code, message=f"rank {rank} exited with {code}{detail}", nodes=nodes
        )
    # Failed with no failed container to read (the pods were removed): report the Job's own reason.
    return Observed(Phase.EXITED, exit_code=1, message=job_message, nodes=nodes)


def _pod_phase(pod: Json) -> str:
    return str(pod.get("status", {}).get("phase") or "Pending")


def _pending_reason(per_rank: Mapping[int, Json]) -> str:
    for rank, pod in sorted(per_rank.items()):
        for condition in pod.get("status", {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                return f"rank {rank}: {condition.get('reason', '')} {condition.get('message', '')}".strip()
    return "waiting for pods"


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIXES = {
    "": 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
}


def _parse_quantity(text: str) -> float:
    """A Kubernetes quantity ("500m", "64Gi", "8") as a number; unknown forms count as 0."""
    match = _QUANTITY.match(text.strip())
    if not match or match.group(2) not in _SUFFIXES:
        return 0.0
    try:
        return float(match.group(1)) * _SUFFIXES[match.group(2)]
    except ValueError:
        return 0.0
