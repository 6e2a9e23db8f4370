"""SkyPilot's task-level `config:` (the part of SkyPilot's own configuration a task may set for itself) as the
contract's `TaskConfig`, and the rules that keep it inside the task's organization.

What has a meaning on Tandem's backends is honoured, with SkyPilot's meaning:

- `kubernetes.pod_config`: a partial Pod merged into the task's pods (backends/pod_config.py, SkyPilot's rule:
  objects key by key, Kubernetes' list maps item by item by their key, other lists appended, `null` clearing a
  field). What would reach past the task's organization is refused naming the field: the
  node's network, PIDs, IPC or folders, privileged containers, root, a service account, Tandem's own labels,
  and added capabilities beyond the deployment's `kubernetes.allowed_capabilities`.
- `kubernetes.custom_metadata` (labels and annotations of the task's Job and pods, never Tandem's own) and
  `kubernetes.kueue.local_queue_name` / `kubernetes.quota.queue` (the Job's Kueue LocalQueue).
- `docker.run_options`: options of the local backend's `docker run` / `podman run`, from an allow-list
  (`run_options`): resource limits, shared memory, variables, a private IPC namespace; anything that could
  reach the host (volumes, devices, capabilities, the host's namespaces, another user) is refused naming it.
- `slurm.sbatch_options` (`account`, `qos` and their short forms), `slurm.quota.queue` / `.account` and
  `slurm.cpu_partition` (for a task without GPUs): the job's `slurm:` options (`apply_slurm`).

Every other key is refused naming it and why (a public cloud's settings, SkyPilot's SSH node pools, its jobs
and serve controllers, ...). Nothing here imports grpc or a backend's client library.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.scheduler.v1 import job_spec_pb2 as js

from mesh.errors import FieldViolation
from services.scheduler.backends.pod_config import RESERVED_PREFIXES, pod_config_problems

Json = dict[str, Any]

_CONFIG_KEYS = ("kubernetes", "docker", "slurm")
_PUBLIC_CLOUD = "sets {what}, a public cloud's; Tandem runs on its own local, Slurm and Kubernetes backends"
_SKY_CONFIG_KEYS = {
    "gcp": _PUBLIC_CLOUD.format(what="Google Cloud's instances and networks"),
    "azure": _PUBLIC_CLOUD.format(what="Azure's identities and networks"),
    "aws": _PUBLIC_CLOUD.format(what="AWS's instances and networks"),
    "vast": _PUBLIC_CLOUD.format(what="Vast.ai's instances"),
    "ssh": "configures SkyPilot's SSH node pools, which Tandem does not run (its nodes are the local "
    "machine, a Slurm cluster or a Kubernetes cluster)",
    "nvidia_gpus": "turns ECC off on a VM's GPUs at boot, which needs root on the node; Tandem's nodes keep "
    "the settings the deployment gave them",
    "active_workspace": "chooses a SkyPilot workspace; a Tandem job runs in the organization it is submitted "
    "to",
    "hooks": "runs commands when SkyPilot stops, preempts or tears down a cluster; nodes are not kept as "
    "clusters here (a task's nodes are released when it ends)",
    "jobs": "configures SkyPilot's managed-jobs controller, which Tandem's scheduler replaces (the job's "
    "recovery, priority and backend are its own keys)",
    "serve": "configures SkyServe's controller, which Tandem does not run",
    "api_server": "configures the client's SkyPilot API server; there is none here",
    "allowed_clouds": "chooses among public clouds; a Tandem job runs on one of the deployment's backends",
    "admin_policy": "is a setting of a SkyPilot API server's administrator, not a task's",
}
_KUBERNETES_KEYS = ("pod_config", "custom_metadata", "kueue", "quota")
_SKY_KUBERNETES_KEYS = {
    "provision_timeout": "is how long SkyPilot waits for pods before it tries another cloud; here a pending "
    "pod waits for its cluster (the job's max_duration ends it)",
    "dws": "asks GKE's Dynamic Workload Scheduler for nodes; the nodes here are the cluster's",
    "remote_identity": "chooses the pods' service account, which would give a task the rights of "
    "another identity in the cluster; the pods run without Kubernetes credentials",
    "enable_docker": "runs a Docker daemon inside the pod, which needs a privileged container",
    "set_pod_resource_limits": "sets the pods' limits from their requests; the limits here are Tandem's "
    "(what the task asks for)",
}
_SKY_KUEUE_KEYS = {
    "admission_timeout": "fails a job Kueue has not admitted in time; here a queued job waits (the job's "
    "max_duration ends it)",
}
_SLURM_KEYS = ("sbatch_options", "quota", "cpu_partition")
# sbatch's long and short options that mean one of the job's `slurm:` options (a short one's case counts:
# `-a` is --array)
_SBATCH_OPTIONS = {"account": "account", "A": "account", "qos": "qos", "q": "qos"}
_SBATCH_REFUSED = {
    "partition": "is an option SkyPilot sets itself and ignores here; name the partition as SkyPilot does, "
    "with infra: slurm/CLUSTER/PARTITION (or the job's slurm.partition)",
    "p": "is an option SkyPilot sets itself and ignores here; name the partition as SkyPilot does, with "
    "infra: slurm/CLUSTER/PARTITION (or the job's slurm.partition)",
    "time": "bounds the job; write the job's max_duration",
    "t": "bounds the job; write the job's max_duration",
}

# docker / podman `run` options that keep the task in its sandbox, and the values each takes (None: any).
_RUN_OPTIONS: dict[str, Any] = {
    "--shm-size": None,
    "--ulimit": None,
    "--env": None,
    "--ipc": ("private", "shareable", "none"),
    "--memory": None,
    "--memory-swap": None,
    "--cpus": None,
    "--pids-limit": None,
    "--tmpfs": None,
    "--label": None,
    "--stop-signal": None,
    "--stop-timeout": None,
}
_RUN_SHORT = {"-e": "--env", "-m": "--memory", "-l": "--label"}
_RUN_FLAGS = ("--read-only",)  # options without a value
_RUN_REFUSED = (
    "reaches past the task's sandbox (the host's folders, devices, namespaces or users, capabilities, the "
    "network, another security profile) or sets what Tandem sets for the container"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_KEY = re.compile(
    r"^(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_QUEUE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class Parsed:
    """What one task's `config:` says: its `TaskConfig`, the job's Slurm options it names (`slurm`), the
    problems found (YAML paths) and which proto path stands for which YAML path (`aliases`)."""

    def __init__(self) -> None:
        self.config = js.TaskConfig()
        self.slurm: dict[str, str] = {}
        self.found: list[FieldViolation] = []
        self.aliases: dict[str, str] = {}


def parse(value: Any, at: str, *, has_gpus: bool) -> Parsed:
    """A task's SkyPilot `config:` (at YAML path `at`, e.g. `tasks[0].config`) -> `Parsed`. `has_gpus`: the
    task asks for GPUs (SkyPilot's `slurm.cpu_partition` is for a task without)."""
    out = Parsed()
    doc = _table(value, at, _CONFIG_KEYS, _SKY_CONFIG_KEYS, out.found)
    if doc is None:
        return out
    if "kubernetes" in doc:
        _kubernetes(doc["kubernetes"], f"{at}.kubernetes", out)
    if "docker" in doc:
        docker = _table(doc["docker"], f"{at}.docker", ("run_options",), {}, out.found)
        if docker is not None and "run_options" in docker:
            where = f"{at}.docker.run_options"
            out.aliases[f"{at}.container_run_options"] = where
            out.config.container_run_options.extend(run_options(docker["run_options"], where, out.found))
    if "slurm" in doc:
        _slurm(doc["slurm"], f"{at}.slurm", out, has_gpus=has_gpus)
    return out


def _kubernetes(value: Any, at: str, out: Parsed) -> None:
    doc = _table(value, at, _KUBERNETES_KEYS, _SKY_KUBERNETES_KEYS, out.found)
    if doc is None:
        return
    config = out.config
    if "pod_config" in doc:
        pod = doc["pod_config"]
        if not isinstance(pod, dict):
            out.found.append(FieldViolation(f"{at}.pod_config", "must be a table: a partial Pod manifest"))
        else:
            try:
                text = json.dumps(pod, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as exc:
                out.found.append(FieldViolation(f"{at}.pod_config", f"is not a Kubernetes object: {exc}"))
            else:
                config.pod_config_json = text
                out.aliases[f"{at.rsplit('.', 1)[0]}.pod_config_json"] = f"{at}.pod_config"
    if "custom_metadata" in doc:
        _custom_metadata(doc["custom_metadata"], at, out)
    _queue(doc, at, out)


def _custom_metadata(value: Any, at: str, out: Parsed) -> None:
    """`kubernetes.custom_metadata`: labels and annotations of the task's Job and pods."""
    config = out.config
    where = f"{at}.custom_metadata"
    metadata = _table(
        value,
        where,
        ("labels", "annotations"),
        dict.fromkeys(
            ("name", "namespace"),
            "is Tandem's: the task's objects are named after its attempt, in the job's namespace",
        ),
        out.found,
    )
    for key in ("labels", "annotations"):
        if metadata is None or key not in metadata:
            continue
        items = _table(metadata[key], f"{where}.{key}", None, {}, out.found) or {}
        target = config.labels if key == "labels" else config.annotations
        for name, item in items.items():
            if isinstance(item, bool) or not isinstance(item, str | int | float):
                out.found.append(FieldViolation(f"{where}.{key}[{_quoted(name)}]", "must be a string"))
            else:
                target[name] = str(item)
        out.aliases[f"{at.rsplit('.', 1)[0]}.{key}"] = f"{where}.{key}"


def _queue(doc: Mapping[str, Any], at: str, out: Parsed) -> None:
    """`kubernetes.quota.queue` or `kubernetes.kueue.local_queue_name`: the Job's Kueue LocalQueue."""
    queues: list[tuple[str, Any]] = []
    if "quota" in doc:
        quota = _table(doc["quota"], f"{at}.quota", ("queue",), {}, out.found)
        if quota is not None and "queue" in quota:
            queues.append((f"{at}.quota.queue", quota["queue"]))
    if "kueue" in doc:
        kueue = _table(doc["kueue"], f"{at}.kueue", ("local_queue_name",), _SKY_KUEUE_KEYS, out.found)
        if kueue is not None and "local_queue_name" in kueue:
            queues.append((f"{at}.kueue.local_queue_name", kueue["local_queue_name"]))
    if queues:  # SkyPilot's order: quota.queue wins over kueue.local_queue_name
        where, queue = queues[0]
        if not isinstance(queue, str) or not _QUEUE.fullmatch(queue):
            out.found.append(FieldViolation(where, f"{queue!r} is not a Kueue LocalQueue's name"))
        else:
            out.config.kueue_queue = queue
            out.aliases[f"{at.rsplit('.', 1)[0]}.kueue_queue"] = where


def _slurm(value: Any, at: str, out: Parsed, *, has_gpus: bool) -> None:
    doc = _table(value, at, _SLURM_KEYS, {}, out.found)
    if doc is None:
        return
    if "sbatch_options" in doc:
        options = _table(doc["sbatch_options"], f"{at}.sbatch_options", None, {}, out.found) or {}
        for key, item in options.items():
            where = f"{at}.sbatch_options.{key}"
            normal = key.replace("_", "-")  # SkyPilot's spelling of sbatch's options
            if normal in _SBATCH_REFUSED:
                out.found.append(FieldViolation(where, _SBATCH_REFUSED[normal]))
            elif normal not in _SBATCH_OPTIONS:
                out.found.append(
                    FieldViolation(
                        where,
                        "is an sbatch option Tandem does not pass on (it sets the job's own from the "
                        "task's resources); the ones it takes are account (-A) and qos (-q)",
                    )
                )
            elif item is not None and item is not False:
                _slurm_value(out, _SBATCH_OPTIONS[normal], item, where)
    if "quota" in doc:  # SkyPilot's: these win over the sbatch_options spellings
        quota = _table(doc["quota"], f"{at}.quota", ("queue", "account"), {}, out.found) or {}
        for key, option in (("queue", "qos"), ("account", "account")):
            if key in quota:
                _slurm_value(out, option, quota[key], f"{at}.quota.{key}", override=True)
    if "cpu_partition" in doc:
        where = f"{at}.cpu_partition"
        if has_gpus:
            out.found.append(
                FieldViolation(
                    where,
                    "is SkyPilot's partition for a task without GPUs, and this task asks for GPUs; name "
                    "its partition with infra: slurm/CLUSTER/PARTITION",
                )
            )
        else:
            _slurm_value(out, "partition", doc["cpu_partition"], where)


def _slurm_value(out: Parsed, option: str, value: Any, at: str, *, override: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, str | int) or not _SLURM_NAME.fullmatch(str(value)):
        out.found.append(FieldViolation(at, f"{value!r} is not a Slurm {option} name"))
        return
    if override or option not in out.slurm:
        out.slurm[option] = str(value)
        out.aliases[f"slurm.{option}"] = at


def apply_slurm(spec: js.JobSpec, asked: Sequence[tuple[str, Mapping[str, str]]]) -> list[FieldViolation]:
    """The Slurm options the tasks' `config.slurm` name (each with its YAML path), into the job's `slurm:`;
    they take the job on Slurm, and must agree with what the job's own options (or `infra:`) say."""
    found: list[FieldViolation] = []
    for at, options in asked:
        if spec.backend != js.BACKEND_SLURM or spec.WhichOneof("backend_options") == "kubernetes":
            found.append(
                FieldViolation(
                    at,
                    "sets the job's Slurm options, which take the job on Slurm (backend: slurm, or infra: slurm)",
                )
            )
            continue
        for option, value in options.items():
            current = getattr(spec.slurm, option)
            if current and current != value:
                found.append(
                    FieldViolation(at, f"names the {option} {value!r}, and the job's is {current!r}")
                )
                continue
            spec.slurm.SetInParent()
            setattr(spec.slurm, option, value)
    return found


def run_options(value: Any, at: str, found: list[FieldViolation]) -> list[str]:
    """SkyPilot's `docker.run_options` (a string or a list of strings, each split as a shell would) -> the
    allowed options as `--OPTION=VALUE` / `--FLAG`; each other option is a violation naming it."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        found.append(FieldViolation(at, "must be a string or a list of strings"))
        return []
    out: list[str] = []
    for index, item in enumerate(items):
        where = f"{at}[{index}]" if isinstance(value, list) else at
        try:
            tokens = shlex.split(item)
        except ValueError as exc:
            found.append(FieldViolation(where, str(exc)))
            continue
        out += _run_tokens(tokens, where, found)
    return out


def _run_tokens(tokens: Sequence[str], at: str, found: list[FieldViolation]) -> list[str]:
    out: list[str] = []
    position = 0
    while position < len(tokens):
        token = tokens[position]
        position += 1
        if token[:2] in _RUN_SHORT and len(token) > 2:  # docker's `-eNAME=VALUE`, `-m2g`
            name, has_value, given = _RUN_SHORT[token[:2]], "=", token[2:]
        else:
            name, has_value, given = token.partition("=")
            name = _RUN_SHORT.get(name, name)
        if name in _RUN_FLAGS and not has_value:
            out.append(name)
            continue
        if name not in _RUN_OPTIONS:
            found.append(FieldViolation(at, f"{token.split('=', 1)[0]} {_RUN_REFUSED}"))
            if not has_value and position < len(tokens) and not tokens[position].startswith("-"):
                position += 1  # its value
            continue
        if not has_value:
            if position >= len(tokens):
                found.append(FieldViolation(at, f"{name} needs a value"))
                continue
            given = tokens[position]
            position += 1
        problem = _run_value_problem(name, given)
        if problem:
            found.append(FieldViolation(at, f"{name}={given} {problem}"))
        else:
            out.append(f"{name}={given}")
    return out


def _run_value_problem(name: str, value: str) -> str:
    choices = _RUN_OPTIONS[name]
    if choices is not None and value not in choices:
        return f"is refused: {name} takes {', '.join(choices)} here (the host's would reach past the sandbox)"
    if name == "--env" and not _ENV_NAME.fullmatch(value.split("=", 1)[0]):
        return "does not name a variable"
    if name == "--tmpfs" and not value.startswith("/"):
        return "must name an absolute path in the container"
    if not value or "\n" in value:
        return "is empty or spans lines"
    return ""


# -- the rules a TaskConfig obeys, for a proto too ----------------------------------------------------------


def config_rules(task: js.TaskSpec, at: str, backend: int) -> list[FieldViolation]:
    """What a task's `config` must be on the job's `backend`, with proto paths under `at` (`tasks[0]`)."""
    if not task.HasField("config"):
        return []
    config = task.config
    where = f"{at}.config"
    found: list[FieldViolation] = []
    kubernetes = {
        "pod_config_json": bool(config.pod_config_json),
        "labels": bool(config.labels),
        "annotations": bool(config.annotations),
        "kueue_queue": bool(config.kueue_queue),
    }
    for field, given in kubernetes.items():
        if given and backend != js.BACKEND_KUBERNETES:
            found.append(
                FieldViolation(
                    f"{where}.{field}",
                    "is for the task's Kubernetes pods; it takes the job on Kubernetes (backend: kubernetes, "
                    "or infra: k8s)",
                )
            )
    if config.pod_config_json:
        found.extend(_pod_config_rules(config.pod_config_json, f"{where}.pod_config_json"))
    for field, items in (("labels", config.labels), ("annotations", config.annotations)):
        found.extend(_metadata_rules(items, f"{where}.{field}", labels=field == "labels"))
    if config.container_run_options:
        options = f"{where}.container_run_options"
        if backend in (js.BACKEND_SLURM, js.BACKEND_KUBERNETES):
            runs = "pyxis or Apptainer" if backend == js.BACKEND_SLURM else "the kubelet"
            found.append(
                FieldViolation(
                    options,
                    f"are options of the local backend's docker or podman run; on this job's backend {runs} "
                    "runs the image",
                )
            )
        if not task.resources.image:
            found.append(
                FieldViolation(options, "are options of the task's container, and the task has no image_id")
            )
        for index, option in enumerate(config.container_run_options):
            bad: list[FieldViolation] = []
            if _run_tokens([option], f"{options}[{index}]", bad) != [option]:
                found.extend(bad or [FieldViolation(f"{options}[{index}]", "is not --OPTION=VALUE")])
    return found


def _metadata_rules(items: Mapping[str, str], at: str, *, labels: bool) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    for key, value in sorted(items.items()):
        where = f"{at}[{_quoted(key)}]"
        if not _LABEL_KEY.fullmatch(key):
            found.append(FieldViolation(where, "is not a Kubernetes label or annotation key"))
        elif key.startswith(RESERVED_PREFIXES):
            found.append(FieldViolation(where, "is under a prefix Tandem's own labels use (or Kueue's)"))
        elif labels and not _LABEL_VALUE.fullmatch(value):
            found.append(FieldViolation(where, f"{value!r} is not a label value"))
    return found


def _pod_config_rules(text: str, at: str) -> list[FieldViolation]:
    try:
        pod = json.loads(text)
    except ValueError as exc:
        return [FieldViolation(at, f"is not JSON: {exc}")]
    if not isinstance(pod, dict):
        return [FieldViolation(at, "must be an object: a partial Pod manifest")]
    return [FieldViolation(f"{at}.{path}" if path else at, why) for path, why in pod_config_problems(pod)]


# -- values --------------------------------------------------------------------------------------------------


def _table(
    value: Any, at: str, keys: Sequence[str] | None, refused: Mapping[str, str], found: list[FieldViolation]
) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        found.append(FieldViolation(at, "must be a table of keys"))
        return None
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            found.append(FieldViolation(f"{at}.{key}", "keys must be strings"))
        elif keys is not None and key not in keys:
            found.append(FieldViolation(f"{at}.{key}", _unknown(key, keys, refused)))
        else:
            out[key] = item
    return out


def _unknown(key: str, known: Sequence[str], refused: Mapping[str, str]) -> str:
    if key in refused:
        return refused[key]
    near = difflib.get_close_matches(key, [*known, *refused], n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    return (
        f"is not a key Tandem takes here; {hint}(it takes: {', '.join(known)}; SkyPilot's other settings "
        "are its own configuration's, or another cloud's)"
    )


def _quoted(key: object) -> str:
    return json.dumps(str(key))
