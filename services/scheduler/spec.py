"""The job spec: a job group as a researcher writes it in YAML, as `tandem.scheduler.v1.JobSpec`.

`parse_yaml` reads SkyPilot's vocabulary (a `tasks:` list, SkyPilot's multi-document form: a header
document, then one document per task, or SkyPilot's single-task file) into the contract's `JobSpec`, with
SkyPilot's meaning for the keys it shares (accelerators, `N+` amounts, envs given at submission, secrets as
references) and a reason for each SkyPilot key it refuses (`_SKY_*_KEYS`); `check_spec` checks a spec that
arrived as a proto (CreateJob). Both run the same rules: the contract's field rules (`mesh.validation`)
and the rules that span fields, so a YAML file and the equivalent proto are refused for the same fields.
YAML refusals name the YAML key (`name`, `tasks[0].resources.memory`, `tasks[1].file_mounts["/ckpt"]`);
proto refusals name the proto field (`display_name`, `tasks[0].resources.memory_gib`,
`tasks[1].file_mounts[0].path`). `check_placement` and `check_fits` are the two CreateJob checks that
follow: the online-RL GPU split (PLACEMENT_INVALID) and whether any node could ever run each task
(RESOURCES_UNSATISFIABLE). SPEC.md beside this file documents every key.

The inline trainer config of an `online_rl` task is validated by `tandem_jobs.config.parse_job` and split by
`tandem_jobs.placement.plan`: both modules are torch-free (they say so, and a test checks that importing this
module loads no torch), so the trainer and the scheduler share one set of config rules. No grpc here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import posixpath
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml
from google.protobuf import duration_pb2
from tandem.common.v1 import types_pb2
from tandem.scheduler.v1 import job_spec_pb2 as js
from tandem.trainer.v1 import config_pb2

from mesh.errors import FailedPrecondition, FieldViolation, InvalidArgument, R
from mesh.validation import violations
from services.scheduler import task_config
from services.scheduler.backends.base import NodeInventory, Resources
from services.scheduler.lifecycle import gpu_type_matches
from tandem_jobs.config import Job, parse_job
from tandem_jobs.placement import GB, Memory, ReferencePlacement, plan

JobSpec = js.JobSpec
TaskSpec = js.TaskSpec

HOUR_S = 3600.0
DEFAULT_INITIAL_BACKOFF_S = 10.0
DEFAULT_MAX_BACKOFF_S = 300.0
DEFAULT_READINESS_TIMEOUT_S = 600.0
MAX_ENV_VALUE_BYTES = 32 * 1024
MAX_GPUS_PER_NODE = 1024
MAX_GPU_ALTERNATIVES = 8
MAX_POD_LABELS = 16
RESERVED_LABEL_PREFIXES = frozenset(
    {"tandem.dev", "app.kubernetes.io"}
)  # the Kubernetes backend's own labels
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000  # SkyPilot's range; higher is admitted first, 0 the default
# Set by the scheduler on every node; a spec may not set them itself (TANDEM_* is reserved as a whole).
RESERVED_ENVS = frozenset(
    {
        "SKYPILOT_NUM_NODES",
        "SKYPILOT_NODE_RANK",
        "SKYPILOT_NODE_IPS",
        "SKYPILOT_SETUP_NODE_RANK",
        "SKYPILOT_SETUP_NODE_IPS",
        "SKYPILOT_NUM_GPUS_PER_NODE",
        "SKYPILOT_SETUP_NUM_GPUS_PER_NODE",
        "SKYPILOT_TASK_ID",
        "SKYPILOT_TASK_IDS",
        "SKYPILOT_JOBGROUP_NAME",
        "SKYPILOT_CLUSTER_INFO",
        "SKYPILOT_USER",
        "SKYPILOT_USER_ID",
        "SKYPILOT_MANAGED_JOB_ID",
        "SKYPILOT_ROOT_JOB_ID",
    }
)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_GPU_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_GPUS = re.compile(r"^(?:(?P<type>[^:]+):)?(?P<count>[0-9]+)$")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_MEMORY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)$")
_MEMORY_UNITS = {  # in GiB
    "": 1.0,
    "gi": 1.0,
    "gib": 1.0,
    "g": 1e9 / 2**30,
    "gb": 1e9 / 2**30,
    "mi": 1 / 1024,
    "mib": 1 / 1024,
    "m": 1e6 / 2**30,
    "mb": 1e6 / 2**30,
    "ti": 1024.0,
    "tib": 1024.0,
    "t": 1e12 / 2**30,
    "tb": 1e12 / 2**30,
}
_LABEL_KEY = re.compile(
    r"^(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")

_BACKENDS = {
    "local": js.BACKEND_LOCAL,
    "slurm": js.BACKEND_SLURM,
    "kubernetes": js.BACKEND_KUBERNETES,
}
_KINDS = {
    "command": TaskSpec.KIND_COMMAND,
    "online_rl": TaskSpec.KIND_ONLINE_RL,
    "service": TaskSpec.KIND_SERVICE,
}
_ROLES = {"primary": TaskSpec.ROLE_PRIMARY, "auxiliary": TaskSpec.ROLE_AUXILIARY}
_SCOPES = {"group": js.RecoveryPolicy.SCOPE_GROUP, "task": js.RecoveryPolicy.SCOPE_TASK}
_REFERENCES = {
    "none": js.PlacementOptions.REFERENCE_PLACEMENT_NONE,
    "stacked": js.PlacementOptions.REFERENCE_PLACEMENT_STACKED,
    "own": js.PlacementOptions.REFERENCE_PLACEMENT_OWN,
}
_REFERENCE_NAMES: dict[int, ReferencePlacement] = {
    js.PlacementOptions.REFERENCE_PLACEMENT_NONE: "none",
    js.PlacementOptions.REFERENCE_PLACEMENT_STACKED: "stacked",
    js.PlacementOptions.REFERENCE_PLACEMENT_OWN: "own",
}
_KIND_NAMES: dict[int, str] = {number: name for name, number in _KINDS.items()}
_BACKEND_NAMES: dict[int, str] = {number: name for name, number in _BACKENDS.items()}


def _invalid(found: list[FieldViolation], what: str = "invalid job spec") -> InvalidArgument:
    names = ", ".join(f"{v.field} ({v.description})" for v in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    return InvalidArgument(f"{what}: {names}{more}", reason=R.ERROR_REASON_INVALID_JOB_SPEC, violations=found)


# -- the public API -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BucketUpload:
    """Local files SkyPilot uploads into a bucket at launch (`/data: {name: NAME, source: ./data}`): the
    submitting client's to do, before the job is created (`services.scheduler.bucket_uploads`)."""

    url: str  # s3://NAME
    sources: tuple[str, ...]  # absolute local paths
    listed: bool = (
        False  # `source` was a list: each lands under its own name, else a folder's files at the root
    )
    endpoint_url: str = ""  # the task's AWS_ENDPOINT_URL(_S3), so the upload goes where the task reads
    region: str = ""  # the task's AWS_REGION / AWS_DEFAULT_REGION


def s3_location(envs: Mapping[str, str]) -> tuple[str, str]:
    """The S3 endpoint and region a task's `envs` name (`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`,
    `AWS_REGION` / `AWS_DEFAULT_REGION`); empty where they name none."""
    endpoint = envs.get("AWS_ENDPOINT_URL_S3") or envs.get("AWS_ENDPOINT_URL", "")
    return endpoint, envs.get("AWS_REGION") or envs.get("AWS_DEFAULT_REGION", "")


def load_yaml(
    path: Path, *, envs: Mapping[str, str] | None = None, uploads: list[BucketUpload] | None = None
) -> JobSpec:
    """Parse the job file at `path`; an online_rl task's `config_file` is read relative to its folder.
    `envs` are the values given at submission (SkyPilot's `--env`), see `parse_yaml`; `uploads`, when given,
    takes the local folders the file uploads into buckets (refused without it)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(
            f"cannot read the job file {path.name}: {exc.strerror}", reason=R.ERROR_REASON_INVALID_JOB_SPEC
        ) from None
    return parse_yaml(text, base_dir=path.parent, envs=envs, uploads=uploads)


def parse_yaml(
    text: str,
    *,
    base_dir: Path | None = None,
    envs: Mapping[str, str] | None = None,
    uploads: list[BucketUpload] | None = None,
) -> JobSpec:
    """A YAML job group -> a checked JobSpec; InvalidArgument / INVALID_JOB_SPEC naming every bad key.

    `base_dir` is where `online_rl.config_file` paths are read from (the job file's folder); without it a
    `config_file` is refused, so a server never reads files a spec names. `envs` are environment values given
    at submission, as SkyPilot's `--env NAME=VALUE`: each is set in every task, over the file's own value, and
    a variable the file declares without a value (`NAME: null`) must be among them. `uploads` takes the
    buckets the file fills from local folders (SkyPilot's `{name, source: ./folder}`), which the submitting
    client uploads; without it they are refused, so a server never reads a folder a spec names."""
    try:
        documents = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise _invalid(
            [FieldViolation("(yaml)", f"{where}{problem}")], "the job file is not valid YAML"
        ) from None
    reader = _Reader(base_dir, envs or {}, uploads)
    spec = reader.job(documents)
    if reader.found:
        raise _invalid([FieldViolation(reader.shown(v.field), v.description) for v in reader.found])
    found = spec_violations(spec)
    if found:
        raise _invalid(
            [FieldViolation(reader.shown(reader.yaml_path(v.field)), v.description) for v in found]
        )
    return spec


def check_spec(spec: JobSpec) -> None:
    """The checks `parse_yaml` runs, for a spec that arrived as a proto; InvalidArgument / INVALID_JOB_SPEC."""
    found = spec_violations(spec)
    if found:
        raise _invalid(found)


def spec_violations(spec: JobSpec) -> list[FieldViolation]:
    """Every broken rule of `spec`, with proto field paths: the contract's rules, then those across fields."""
    found = violations(spec)
    found.extend(_job_rules(spec))
    found.extend(_serial_rules(spec))
    for index, task in enumerate(spec.tasks):
        found.extend(_task_rules(task, f"tasks[{index}]"))
        found.extend(task_config.config_rules(task, f"tasks[{index}]", spec.backend))
    return found


def check_placement(spec: JobSpec) -> None:
    """Refuse online_rl tasks whose GPUs cannot be split as asked: the trainer would refuse the flags the
    scheduler launches it with (`expand.trainer_args`). FailedPrecondition / PLACEMENT_INVALID. Run after
    `check_spec`; a `config_path` config is read at launch, so only the split itself is checked for it."""
    found: list[FieldViolation] = []
    for index, task in enumerate(spec.tasks):
        if task.kind == TaskSpec.KIND_ONLINE_RL:
            found.extend(_placement(task, f"tasks[{index}]"))
    if found:
        names = ", ".join(f"{v.field} ({v.description})" for v in found[:5])
        raise FailedPrecondition(
            f"the GPU placement cannot be satisfied: {names}",
            reason=R.ERROR_REASON_PLACEMENT_INVALID,
            violations=found,
        )


def check_fits(spec: JobSpec, nodes: Sequence[NodeInventory]) -> None:
    """Refuse a group that no set of `nodes` could run even when all of them are idle: a task asking more
    GPUs, CPUs or memory per node than any node has, a GPU type no node has, more nodes than fit, or a
    group asking more GPUs at once than the nodes hold together. Capacity counts, not what is free now, and
    down or draining nodes count too (they come back). A node reporting 0 CPUs or 0 GiB did not report
    them, so they constrain nothing; an empty inventory checks nothing. FailedPrecondition /
    RESOURCES_UNSATISFIABLE naming each field."""
    if not nodes:
        return
    found: list[FieldViolation] = []
    for index, task in enumerate(spec.tasks):
        # A task with GPU alternatives fits when one of them does; the first choice's reasons otherwise.
        tried = [_fits(task, f"tasks[{index}]", nodes, want) for want in resource_choices(task)]
        if all(tried):
            found.extend(tried[0])
    if not found:
        total = sum(n.gpus for n in nodes)
        asked = sum(min(r.gpus for r in resource_choices(t)) * max(t.num_nodes, 1) for t in spec.tasks)
        if asked > total:
            found.append(
                FieldViolation(
                    "tasks", f"the group needs {asked} GPUs at once; the nodes have {total} in all"
                )
            )
    if found:
        names = ", ".join(f"{v.field} ({v.description})" for v in found[:5])
        raise FailedPrecondition(
            f"no node can run this job: {names}",
            reason=R.ERROR_REASON_RESOURCES_UNSATISFIABLE,
            violations=found,
        )


def resources_of(task: TaskSpec) -> Resources:
    """What one node of the task needs; the spec must have passed `check_spec` (gpus well formed)."""
    count, gpu_type = parse_gpus(task.resources.gpus)
    return Resources(
        gpus=count,
        gpu_type=gpu_type,
        cpus=task.resources.cpus,
        memory_gib=task.resources.memory_gib,
        disk_gib=task.resources.disk_gib,
    )


def resource_choices(task: TaskSpec) -> list[Resources]:
    """`resources_of(task)`, then one per GPU alternative in order (its GPUs and type; the same CPUs,
    memory and disk): what placement tries, first to last."""
    first = resources_of(task)
    choices = [first]
    for alternative in task.resources.gpu_alternatives:
        count, gpu_type = parse_gpus(alternative)
        choices.append(dataclasses.replace(first, gpus=count, gpu_type=gpu_type))
    return choices


def parse_gpus(text: str) -> tuple[int, str]:
    """`"H100:8"` -> (8, "H100"); `"8"` -> (8, ""); `""` -> (0, ""). ValueError for anything else."""
    text = text.strip()
    if not text:
        return 0, ""
    match = _GPUS.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not TYPE:COUNT or COUNT (e.g. H100:8 or 8)")
    count, gpu_type = int(match["count"]), (match["type"] or "").strip()
    if match["type"] is not None and not _GPU_TYPE.fullmatch(gpu_type):
        raise ValueError(f"{gpu_type!r} is not a GPU type (letters, digits, '_', '.', '-'; at most 64)")
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise ValueError(f"the count must be 1 to {MAX_GPUS_PER_NODE} per node, not {count}")
    return count, gpu_type


def secret_env_name(binding: js.SecretBinding) -> str:
    """The variable a secret lands in: `env`, else the id upper-cased with hyphens as underscores."""
    return binding.env or binding.secret.upper().replace("-", "_")


def secret_names(spec: JobSpec) -> list[str]:
    """Every vault secret id the spec names (task secrets, Task App keys), sorted: what CreateJob must find
    in the organization's vault (NOT_FOUND / SECRET_NOT_FOUND otherwise)."""
    names = {b.secret for t in spec.tasks for b in t.secrets}
    names.update(
        t.service.register_task_app.api_key_secret
        for t in spec.tasks
        if t.WhichOneof("kind_options") == "service" and t.service.register_task_app.api_key_secret
    )
    return sorted(names)


def trainer_config(task: TaskSpec) -> config_pb2.TrainerConfig | None:
    """An online_rl task's inline trainer config, parsed and validated; None for `config_path` or other kinds."""
    if (
        task.WhichOneof("kind_options") != "online_rl"
        or task.online_rl.WhichOneof("trainer_config") != "config_toml"
    ):
        return None
    return parse_job(tomllib.loads(task.online_rl.config_toml))


def seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def restart_delay_s(policy: js.RecoveryPolicy, restart: int) -> float:
    """The wait before restart number `restart` (from 1): `initial_backoff` doubled per further restart, at
    most `max_backoff`, with the contract's defaults for unset fields."""
    initial = (
        seconds(policy.initial_backoff) if policy.HasField("initial_backoff") else DEFAULT_INITIAL_BACKOFF_S
    )
    ceiling = _max_backoff_s(policy)
    return float(min(initial * 2 ** max(restart - 1, 0), ceiling))


def readiness_timeout_s(options: js.ServiceOptions) -> float:
    if options.HasField("readiness_timeout"):
        return seconds(options.readiness_timeout)
    return DEFAULT_READINESS_TIMEOUT_S


# -- rules across fields (proto paths) ----------------------------------------------------------------------


def _serial_rules(spec: JobSpec) -> list[FieldViolation]:
    if spec.execution != JobSpec.EXECUTION_SERIAL:
        return []
    return [
        FieldViolation(
            f"tasks[{index}].role",
            "a serial group (a pipeline) runs every task to its end, one after another: no auxiliary tasks",
        )
        for index, task in enumerate(spec.tasks)
        if task.role == TaskSpec.ROLE_AUXILIARY
    ]


def _job_rules(spec: JobSpec) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    if spec.tasks and not any(t.role != TaskSpec.ROLE_AUXILIARY for t in spec.tasks):
        found.append(FieldViolation("tasks", "needs at least one primary task (the job ends when they end)"))
    first: dict[str, int] = {}
    for index, task in enumerate(spec.tasks):
        if task.name in first:
            other = spec.tasks[first[task.name]]
            written = [t.display_name for t in (other, task) if t.display_name]
            found.append(
                FieldViolation(
                    f"tasks[{index}].name",
                    f"{task.name!r} is also tasks[{first[task.name]}]"
                    if not written
                    else f"{task.display_name or task.name!r} and tasks[{first[task.name]}]'s "
                    f"{other.display_name or other.name!r} are both the task name {task.name!r} (Tandem's task "
                    "names are lowercase, with hyphens for '_' and '.'): rename one",
                )
            )
        first.setdefault(task.name, index)
    apps: dict[str, int] = {}
    for index, task in enumerate(spec.tasks):
        app = task.service.register_task_app.app_id if task.WhichOneof("kind_options") == "service" else ""
        if app and app in apps:
            found.append(
                FieldViolation(
                    f"tasks[{index}].service.register_task_app.app_id",
                    f"{app!r} is also tasks[{apps[app]}]'s",
                )
            )
        apps.setdefault(app, index)
    found.extend(_backend_rules(spec))
    if spec.HasField("max_duration"):
        found.extend(_duration(spec.max_duration, "max_duration", low=0.001, high=math.inf))
    if spec.HasField("recovery"):
        found.extend(_recovery(spec.recovery))
    return found


def _backend_rules(spec: JobSpec) -> list[FieldViolation]:
    """The `slurm` / `kubernetes` blocks and pod labels: for the job's backend, in Kubernetes' syntax."""
    found: list[FieldViolation] = []
    options = spec.WhichOneof("backend_options")
    wanted = {"slurm": js.BACKEND_SLURM, "kubernetes": js.BACKEND_KUBERNETES}
    if options is not None and spec.backend != wanted[options]:
        current = _BACKEND_NAMES.get(spec.backend, "the default")
        found.append(FieldViolation(options, f"is for backend {options}, and the backend is {current}"))
    if options == "kubernetes":
        for key, value in spec.kubernetes.node_selector.items():
            if not _LABEL_KEY.fullmatch(key):
                found.append(
                    FieldViolation(f"kubernetes.node_selector[{_key(key)}]", "is not a Kubernetes label key")
                )
            elif not _LABEL_VALUE.fullmatch(value):
                found.append(
                    FieldViolation(
                        f"kubernetes.node_selector[{_key(key)}]", f"{value!r} is not a label value"
                    )
                )
    for index, task in enumerate(spec.tasks):
        found.extend(_pod_labels(task.resources.labels, f"tasks[{index}].resources.labels", spec.backend))
    return found


def _pod_labels(labels: Mapping[str, str], at: str, backend: int) -> list[FieldViolation]:
    """SkyPilot's `labels`: the task's pods' labels, so only on Kubernetes, never over Tandem's own."""
    if not labels:
        return []
    if backend != js.BACKEND_KUBERNETES:
        return [FieldViolation(at, "are Kubernetes pod labels; they take `infra: k8s` (the job's backend)")]
    found: list[FieldViolation] = []
    if len(labels) > MAX_POD_LABELS:
        found.append(FieldViolation(at, f"at most {MAX_POD_LABELS} labels"))
    for key, value in sorted(labels.items()):
        where = f"{at}[{_key(key)}]"
        if not _LABEL_KEY.fullmatch(key):
            found.append(FieldViolation(where, "is not a Kubernetes label key"))
        elif key.split("/", 1)[0] in RESERVED_LABEL_PREFIXES and "/" in key:
            found.append(FieldViolation(where, "is under a prefix Tandem's own labels use"))
        elif not _LABEL_VALUE.fullmatch(value):
            found.append(FieldViolation(where, f"{value!r} is not a label value"))
    return found


def _max_backoff_s(policy: js.RecoveryPolicy) -> float:
    if policy.HasField("max_backoff"):
        return seconds(policy.max_backoff)
    initial = seconds(policy.initial_backoff) if policy.HasField("initial_backoff") else 0.0
    return max(DEFAULT_MAX_BACKOFF_S, initial)  # an unset max never undercuts the initial wait


def _recovery(policy: js.RecoveryPolicy) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    if policy.HasField("initial_backoff"):
        found.extend(_duration(policy.initial_backoff, "recovery.initial_backoff", low=0.0, high=HOUR_S))
    if policy.HasField("max_backoff"):
        bad = _duration(policy.max_backoff, "recovery.max_backoff", low=0.0, high=HOUR_S)
        found.extend(bad)
        initial = (
            seconds(policy.initial_backoff)
            if policy.HasField("initial_backoff")
            else DEFAULT_INITIAL_BACKOFF_S
        )
        if not bad and seconds(policy.max_backoff) < initial:
            found.append(
                FieldViolation(
                    "recovery.max_backoff",
                    f"{_show_s(seconds(policy.max_backoff))} is below initial_backoff ({_show_s(initial)})",
                )
            )
    return found


def _task_rules(task: TaskSpec, at: str) -> list[FieldViolation]:  # noqa: PLR0912 - one rule per branch
    found: list[FieldViolation] = []
    options = task.WhichOneof("kind_options")
    needs = {TaskSpec.KIND_ONLINE_RL: "online_rl", TaskSpec.KIND_SERVICE: "service"}.get(task.kind)
    kind = _KIND_NAMES.get(task.kind, "")
    if kind:
        if needs is not None and options != needs:
            found.append(FieldViolation(f"{at}.{needs}", f"is required for {kind} tasks"))
        if options is not None and options != needs:
            found.append(FieldViolation(f"{at}.{options}", f"is for {options} tasks; this task is {kind}"))
    # A command task may be setup only, or nothing (SkyPilot's run is optional); a service is its run.
    if task.kind == TaskSpec.KIND_SERVICE and not task.run.strip():
        found.append(FieldViolation(f"{at}.run", f"is required for {kind} tasks"))
    if task.HasField("termination_delay"):
        if task.role != TaskSpec.ROLE_AUXILIARY:
            found.append(FieldViolation(f"{at}.termination_delay", "is for auxiliary tasks only"))
        else:
            found.extend(_duration(task.termination_delay, f"{at}.termination_delay", low=0.0, high=HOUR_S))
    if task.display_name and (
        not _SKY_TASK_NAME.fullmatch(task.display_name) or default_task_name(task.display_name) != task.name
    ):
        found.append(
            FieldViolation(
                f"{at}.display_name",
                f"{task.display_name!r} must be a SkyPilot task name (letters, digits, and '.', '_', '-' "
                f"between them) whose normal form is the task's name, {default_task_name(task.display_name)!r}",
            )
        )
    found.extend(_resources(task.resources, f"{at}.resources"))
    found.extend(_envs(task, at))
    found.extend(_mounts(task, at))
    if task.HasField("workdir"):
        found.extend(_workdir(task.workdir, f"{at}.workdir"))
    if options == "online_rl" and task.kind == TaskSpec.KIND_ONLINE_RL:
        if task.num_nodes > 1:
            found.append(
                FieldViolation(f"{at}.num_nodes", "online_rl tasks run on one node (the trainer's launcher)")
            )
        found.extend(_online_rl(task.online_rl, f"{at}.online_rl"))
    if options == "service" and task.kind == TaskSpec.KIND_SERVICE:
        service = task.service
        if service.HasField("readiness_timeout"):
            found.extend(
                _duration(service.readiness_timeout, f"{at}.service.readiness_timeout", low=1.0, high=HOUR_S)
            )
        key = service.register_task_app.api_key_secret
        if service.HasField("register_task_app"):
            if task.num_nodes > 1:
                found.append(FieldViolation(f"{at}.num_nodes", "a registered Task App runs on one node"))
            if key and key not in {b.secret for b in task.secrets}:
                found.append(
                    FieldViolation(
                        f"{at}.service.register_task_app.api_key_secret",
                        f"{key!r} must also be in the task's secrets, so the app can check the key the proxy sends",
                    )
                )
    return found


def _resources(resources: types_pb2.Resources, at: str) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    try:
        parse_gpus(resources.gpus)
    except ValueError as exc:
        found.append(FieldViolation(f"{at}.gpus", str(exc)))
    if resources.gpu_alternatives and not resources.gpus.strip():
        found.append(FieldViolation(f"{at}.gpus", "is required with gpu_alternatives: the first choice"))
    if len(resources.gpu_alternatives) > MAX_GPU_ALTERNATIVES:
        found.append(FieldViolation(f"{at}.gpu_alternatives", f"at most {MAX_GPU_ALTERNATIVES} alternatives"))
    for index, alternative in enumerate(resources.gpu_alternatives):
        try:
            count, gpu_type = parse_gpus(alternative)
        except ValueError as exc:
            found.append(FieldViolation(f"{at}.gpu_alternatives[{index}]", str(exc)))
            continue
        if not count or not gpu_type:
            found.append(
                FieldViolation(f"{at}.gpu_alternatives[{index}]", "must be TYPE:COUNT (e.g. A100:8)")
            )
    found.extend(_ports(resources.ports, f"{at}.ports"))
    if resources.image and (len(resources.image) > 512 or any(c.isspace() for c in resources.image)):
        found.append(FieldViolation(f"{at}.image", "is not an image reference (at most 512, no spaces)"))
    for name in ("cpus", "memory_gib", "disk_gib"):
        value = getattr(resources, name)
        if not math.isfinite(value) or value < 0:
            found.append(
                FieldViolation(f"{at}.{name}", f"must be 0 (the backend default) or more, not {value}")
            )
    return found


def _ports(ports: Sequence[str], at: str) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    if len(ports) > MAX_PORTS:
        found.append(FieldViolation(at, f"at most {MAX_PORTS} ports or ranges"))
    for index, port in enumerate(ports):
        try:
            port_range(port)
        except ValueError as exc:
            found.append(FieldViolation(f"{at}[{index}]", str(exc)))
    return found


def port_range(text: str) -> range:
    """`"8080"` -> range(8080, 8081); `"10000-10010"` -> range(10000, 10011). ValueError otherwise."""
    match = _PORT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a port or a range such as 10000-10010")
    first = int(match[1])
    last = int(match[2]) if match[2] else first
    if not 1 <= first <= last <= 65535:
        raise ValueError(f"{text!r}: ports are 1 to 65535, the first of a range not above the last")
    if last - first >= 1024:
        raise ValueError(f"{text!r}: a range spans at most 1024 ports")
    return range(first, last + 1)


def _envs(task: TaskSpec, at: str) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    for name, value in sorted(task.envs.items()):
        where = f"{at}.envs[{_key(name)}]"
        if not _ENV_NAME.fullmatch(name):
            found.append(FieldViolation(where, "is not a variable name ([A-Za-z_][A-Za-z0-9_]*)"))
        elif name.startswith("TANDEM_") or name in RESERVED_ENVS:
            found.append(
                FieldViolation(
                    where, "is set by the scheduler (TANDEM_* and the SKYPILOT_* variables SkyPilot sets)"
                )
            )
        if len(value.encode()) > MAX_ENV_VALUE_BYTES:
            found.append(FieldViolation(where, f"the value is over {MAX_ENV_VALUE_BYTES // 1024} KiB"))
    seen: dict[str, int] = {}
    for index, binding in enumerate(task.secrets):
        env = secret_env_name(binding)
        where = f"{at}.secrets[{index}]"
        if env.startswith("TANDEM_") or env in RESERVED_ENVS:
            found.append(FieldViolation(f"{where}.env", f"{env} is set by the scheduler"))
        elif env in seen:
            found.append(
                FieldViolation(f"{where}.env", f"{env} is also the variable of secrets[{seen[env]}]")
            )
        elif env in task.envs:
            found.append(FieldViolation(f"{where}.env", f"{env} is also set in envs"))
        seen.setdefault(env, index)
        if binding.file and (
            not binding.file.startswith("/") or "\n" in binding.file or binding.file.endswith("/")
        ):
            found.append(FieldViolation(f"{where}.file", "must be an absolute path of a file in the task"))
    return found


def _mounts(task: TaskSpec, at: str) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    seen: dict[str, int] = {}
    for index, mount in enumerate(task.file_mounts):
        where = f"{at}.file_mounts[{index}]"
        if mount.WhichOneof("source") is None:
            found.append(FieldViolation(f"{where}.source", "set local_path, volume or bucket"))
        if mount.path.startswith("~") and not home_relative(mount.path):
            found.append(FieldViolation(f"{where}.path", _mount_path_problem(mount.path)))
            continue
        if not mount.path.startswith(("/", "~/")):
            continue  # the contract's pattern already says so
        if ".." in mount.path.split("/"):
            found.append(FieldViolation(f"{where}.path", "must not contain '..'"))
        if mount.WhichOneof("source") == "local_path" and ".." in mount.local_path.split("/"):
            found.append(FieldViolation(f"{where}.local_path", "must not contain '..'"))
        if mount.sub_path and mount.WhichOneof("source") != "volume":
            found.append(FieldViolation(f"{where}.sub_path", "is only for a volume"))
        elif {".", ".."} & set(mount.sub_path.split("/")):
            found.append(FieldViolation(f"{where}.sub_path", "must not contain '.' or '..'"))
        path = posixpath.normpath(mount.path)
        if path in seen:
            found.append(FieldViolation(f"{where}.path", f"{path} is also file_mounts[{seen[path]}]"))
        seen.setdefault(path, index)
    return found


def _workdir(workdir: js.Workdir, at: str) -> list[FieldViolation]:
    which = workdir.WhichOneof("source")
    if which is None:
        return [FieldViolation(f"{at}.path", "set path or git_url")]
    if which == "path" and ".." in workdir.path.split("/"):
        return [FieldViolation(f"{at}.path", "must not contain '..'")]
    if which == "git_url" and not _GIT_URL.match(workdir.git_url):
        return [
            FieldViolation(f"{at}.git_url", f"{workdir.git_url!r} is not a git URL (https://, ssh://, ...)")
        ]
    if workdir.git_ref and which != "git_url":
        return [FieldViolation(f"{at}.git_ref", "is for a git_url workdir")]
    if workdir.git_ref.startswith("-"):
        return [FieldViolation(f"{at}.git_ref", "a ref does not start with '-'")]
    return []


def _online_rl(options: js.OnlineRlOptions, at: str) -> list[FieldViolation]:
    which = options.WhichOneof("trainer_config")
    if which is None:
        return [FieldViolation(f"{at}.config_toml", "is required: the trainer config, inline TOML or a path")]
    if which != "config_toml":
        return []
    try:
        document = tomllib.loads(options.config_toml)
    except tomllib.TOMLDecodeError as exc:
        return [FieldViolation(f"{at}.config_toml", f"is not valid TOML: {exc}")]
    except RecursionError:
        return [FieldViolation(f"{at}.config_toml", "is not valid TOML: it is nested too deeply")]
    try:
        parse_job(document)
    except InvalidArgument as error:
        if not error.violations:
            return [FieldViolation(f"{at}.config_toml", error.message)]
        return [FieldViolation(f"{at}.config_toml.{v.field}", v.description) for v in error.violations]
    return []


def _placement(task: TaskSpec, at: str) -> list[FieldViolation]:
    gpus = resources_of(task).gpus
    placement = task.online_rl.placement
    reference = _REFERENCE_NAMES.get(placement.reference_placement)
    overrides: dict[str, Any] = {"gpus": gpus}
    origin = {"topology.gpus": f"{at}.resources.gpus"}
    if placement.inference_gpus:
        overrides["inference_gpus"] = placement.inference_gpus
        origin["topology.inference_gpus"] = f"{at}.online_rl.placement.inference_gpus"
    if placement.tensor_parallel_size:
        overrides["tensor_parallel_size"] = placement.tensor_parallel_size
        origin["topology.tensor_parallel_size"] = f"{at}.online_rl.placement.tensor_parallel_size"
    if reference is not None:
        overrides["reference_placement"] = f"REFERENCE_PLACEMENT_{reference.upper()}"
        origin["topology.reference_placement"] = f"{at}.online_rl.placement.reference_placement"
    memory: Memory | None = None  # checked here when the job states its model's size and its GPUs' memory
    if task.online_rl.WhichOneof("trainer_config") == "config_toml":
        document = tomllib.loads(task.online_rl.config_toml)
        topology = document.setdefault("topology", {})
        if isinstance(topology, dict):
            topology.update(overrides)
        try:
            job = Job(parse_job(document))
        except InvalidArgument as error:
            return [
                FieldViolation(origin.get(v.field, f"{at}.online_rl.config_toml.{v.field}"), v.description)
                for v in error.violations
            ] or [FieldViolation(f"{at}.online_rl", error.message)]
        reference = job.reference
        stated = job.config.topology
        if stated.HasField("model_parameters") and stated.HasField("gpu_memory_gb"):
            memory = Memory(stated.model_parameters, stated.gpu_memory_gb * GB, job.sharding)
    try:
        plan(
            gpus,
            placement.inference_gpus or "auto",
            placement.tensor_parallel_size or 1,
            reference or "none",
            memory,
        )
    except InvalidArgument as error:
        return [FieldViolation(f"{at}.online_rl.placement", error.message)]
    return []


def _fits(task: TaskSpec, at: str, nodes: Sequence[NodeInventory], want: Resources) -> list[FieldViolation]:
    typed = [n for n in nodes if gpu_type_matches(want.gpu_type, n.gpu_type)] if want.gpus else list(nodes)
    if not typed:
        kinds = sorted({n.gpu_type for n in nodes if n.gpu_type}) or ["none"]
        return [
            FieldViolation(
                f"{at}.resources.gpus", f"no node has {want.gpu_type} GPUs (types: {', '.join(kinds)})"
            )
        ]
    found: list[FieldViolation] = []
    most = max(n.gpus for n in typed)
    if want.gpus > most:
        found.append(
            FieldViolation(
                f"{at}.resources.gpus", f"asks {want.gpus} GPUs per node; the largest node has {most}"
            )
        )
    reported = [n.cpus for n in typed if n.cpus > 0]
    if want.cpus and reported and want.cpus > max(reported):
        found.append(
            FieldViolation(
                f"{at}.resources.cpus", f"asks {want.cpus:g} CPUs; the largest node has {max(reported):g}"
            )
        )
    memory = [n.memory_gib for n in typed if n.memory_gib > 0]
    if want.memory_gib and memory and want.memory_gib > max(memory):
        found.append(
            FieldViolation(
                f"{at}.resources.memory_gib",
                f"asks {want.memory_gib:g} GiB; the largest node has {max(memory):g} GiB",
            )
        )
    if found:
        return found
    fit = [n for n in typed if _node_fits(want, n)]
    needed = max(task.num_nodes, 1)
    if needed > len(fit):
        found.append(
            FieldViolation(
                f"{at}.num_nodes", f"needs {needed} nodes with these resources; {len(fit)} have them"
            )
        )
    return found


def _node_fits(want: Resources, node: NodeInventory) -> bool:
    return (
        node.gpus >= want.gpus
        and (not want.cpus or node.cpus <= 0 or node.cpus >= want.cpus)
        and (not want.memory_gib or node.memory_gib <= 0 or node.memory_gib >= want.memory_gib)
    )


def _duration(value: duration_pb2.Duration, at: str, *, low: float, high: float) -> list[FieldViolation]:
    if abs(value.nanos) >= 1_000_000_000 or (
        value.seconds and value.nanos and (value.seconds > 0) != (value.nanos > 0)
    ):
        return [FieldViolation(at, "is not a valid duration")]
    total = seconds(value)
    if total < low or total > high:
        limit = "no limit" if math.isinf(high) else _show_s(high)
        return [FieldViolation(at, f"must be {_show_s(low)} to {limit}, not {_show_s(total)}")]
    return []


def _show_s(value: float) -> str:
    return f"{value:g}s"


# -- YAML -> JobSpec ----------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML would keep the last silently)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} appears twice in one mapping", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)

_JOB_KEYS = (
    "name",
    "execution",
    "priority",
    "recovery",
    "backend",
    "max_duration",
    "slurm",
    "kubernetes",
    "tasks",
)
_TASK_KEYS = (
    "name",
    "kind",
    "role",
    "termination_delay",
    "resources",
    "num_nodes",
    "envs",
    "secrets",
    "file_mounts",
    "workdir",
    "setup",
    "run",
    "online_rl",
    "service",
    "volumes",
    "managed_secrets",
    "config",
)
_RESOURCE_KEYS = (
    "gpus",
    "accelerators",
    "cpus",
    "memory",
    "cloud",
    "infra",
    "disk_size",
    "ports",
    "use_spot",
    "image_id",
    "any_of",
    "ordered",
    "job_recovery",
    "priority",
    "priority_class",
    "ephemeral_storage",
    "labels",
    "disk_tier",
    "network_tier",
)
# SkyPilot's tiers; on Kubernetes and Slurm it takes them and they choose nothing (no cloud disk or network
# product to pick), which is what they mean here too.
_DISK_TIERS = ("low", "medium", "high", "ultra", "best")
_NETWORK_TIERS = ("standard", "best")

# SkyPilot's keys (its task and resources schema) that Tandem does not take, each with the reason; SPEC.md has
# the whole table. A key here is refused naming why; any other unknown key names the nearest known one.
_GROUP_KEYS = (
    "primary_tasks",
    "termination_delay",
    "inter_connection",
    "placement",
)  # SkyPilot's job-group header keys
_SKY_JOB_KEYS = {
    "primary_tasks": "names the primary tasks of a job group; a one-task file's task is its primary",
    "inter_connection": "says whether a job group's tasks reach each other by host name; a one-task file's "
    "task has no siblings to reach",
}
_SKY_TASK_KEYS = {
    "accelerators": "belongs under `resources:` (`resources: {accelerators: A100:8}`)",
    "event_callback": "runs a command on SkyPilot's jobs controller at each status change; Tandem's scheduler "
    "serves many organizations and runs no command outside a task: follow the job's events "
    "(`tandem logs`, the events stream)",
    "pool": "SkyPilot's worker pools have no counterpart here",
    "inputs": "is a data-size hint for SkyPilot's cloud optimizer, which has no counterpart here",
    "outputs": "is a data-size hint for SkyPilot's cloud optimizer, which has no counterpart here",
    "volume_mounts": "is SkyPilot's own resolved form of `volumes`, which it writes itself; write `volumes`",
    "api_server_access": "there is no SkyPilot API server here; a task reaches the mesh with its job token",
    "file_mounts_mapping": "is SkyPilot's internal bookkeeping",
    "_metadata": "is SkyPilot's internal bookkeeping",
}
_DOCKER_LOGIN = (
    "SKYPILOT_DOCKER_USERNAME",
    "SKYPILOT_DOCKER_PASSWORD",
    "SKYPILOT_DOCKER_SERVER",
)  # a registry login
_CLOUD_ONLY = "names a public cloud's {what}; Tandem runs on its own local, Slurm and Kubernetes backends"
_SKY_RESOURCE_KEYS = {
    "region": _CLOUD_ONLY.format(what="region"),
    "zone": _CLOUD_ONLY.format(what="zone"),
    "instance_type": _CLOUD_ONLY.format(what="instance type") + "; ask for cpus, memory and accelerators",
    "max_hourly_cost": "there are no prices here",
    "accelerator_args": "configures Google Cloud TPUs; Tandem places NVIDIA GPUs",
    "autostop": "nodes are not kept as clusters here: a task's nodes are released when it ends",
    "local_disk": "asks for a cloud instance's local NVMe or SSD, which SkyPilot does not offer on Kubernetes or "
    "Slurm either; the nodes here have the disks the deployment gave them (ask for space with disk_size)",
    "volumes": "attaches a public cloud's disks to its instances (SkyPilot's older form); mount the "
    "deployment's volumes with the task's `volumes: {/path: name}`",
    "_no_missing_accel_warnings": "is SkyPilot's internal setting",
    "_docker_login_config": "is SkyPilot's internal setting",
    "_is_image_managed": "is SkyPilot's internal setting",
    "_requires_fuse": "is SkyPilot's internal setting",
    "_cluster_config_overrides": "is SkyPilot's internal setting",
}
_SKYSERVE = (
    "is SkyServe's (replicas behind SkyPilot's load balancer), which Tandem does not run; Tandem's `service:` "
    "takes port, health_path, readiness_timeout and register_task_app"
)
_SKY_SERVICE_KEYS = dict.fromkeys(
    (
        "readiness_probe",
        "replicas",
        "replica_policy",
        "load_balancing_policy",
        "load_balancer",
        "ports",
        "tls",
        "pool",
        "workers",
    ),
    _SKYSERVE,
)
# SkyPilot's recovery strategies (its registry's names); each means "relaunch on the cluster" here.
_STRATEGIES = ("EAGER_NEXT_REGION", "FAILOVER")
_ELASTIC = (
    "DYNAMIC_NODE_SET and its min_nodes come from a SkyPilot server plugin (elastic recovery on fewer nodes), "
    "not from SkyPilot itself, whose jobs controller knows only EAGER_NEXT_REGION and FAILOVER and refuses "
    "any other strategy; here a task is placed and recovered on all its num_nodes"
)
_ELASTIC_KEYS = {"min_nodes": _ELASTIC}
_SKY_VOLUME_KEYS = {
    "size": "asks SkyPilot to create a volume for the task; the volumes here are the deployment's, named by "
    "`name` (for scratch space ask for disk_size)",
}
# The task keys SkyPilot fills the task's envs into (`$NAME` and `${NAME}`, for the names the task has).
_FILLED = frozenset({"file_mounts", "workdir", "volumes"})
_ENV_REFERENCE = re.compile(r"\$\{?\b([a-zA-Z_][a-zA-Z0-9_]*)\b\}?")
_BUCKET_SCHEMES = (
    "names a public cloud's own object store (Google Cloud Storage, Azure Blob, IBM COS, OCI, Nebius, ...), "
    "which Tandem does not open; it opens S3 buckets: s3://, or any S3-compatible store (MinIO, Ceph, "
    "Cloudflare R2, ...; also r2:// and minio://) at the endpoint the task's AWS_ENDPOINT_URL names"
)
# SkyPilot's stores that speak S3 at an endpoint of the user's own (its client reads the endpoint from a
# file of its own: ~/.cloudflare/accountid for R2, its MinIO settings): S3 buckets here, at the endpoint the
# task's AWS_ENDPOINT_URL names.
_S3_COMPATIBLE = {
    "r2": "Cloudflare R2 (https://ACCOUNT_ID.r2.cloudflarestorage.com)",
    "minio": "MinIO (the server's URL)",
}
_ENV_IN_MOUNT = "is none of the task's envs; SkyPilot fills only those into mount paths"
_SKY_MOUNT_KEYS = {
    "_is_sky_managed": "is SkyPilot's internal bookkeeping",
    "_bucket_sub_path": "is SkyPilot's internal bookkeeping",
    "_force_delete": "is SkyPilot's internal bookkeeping",
}
_RCLONE = (
    "tunes rclone's cache, which Tandem does not run: a MOUNT_CACHED bucket is copied whole to the node and "
    "synced every interval (SPEC.md, Buckets)"
)
_SKY_MOUNT_CONFIG_KEYS = {
    **dict.fromkeys(
        ("disk_size", "disk_tier", "storage_type", "attach_mode"),
        "sizes a cloud volume (SkyPilot's `store: volume`); the volumes here are the deployment's",
    ),
}
_HF_MOUNT = {
    "hf_mount_args": "passes flags to hf-mount, for Hugging Face stores, which Tandem does not mount"
}
# SkyPilot's MOUNT_CACHED presets (`type`): their read-only part is honoured; the rest tunes rclone.
_MOUNT_TYPES = {
    "model_checkpoint_ro": True,
    "model_checkpoint_rw": False,
    "dataset_ro": True,
    "dataset_rw": False,
}
_MODES = {
    "mount": js.Bucket.MODE_MOUNT,
    "copy": js.Bucket.MODE_COPY,
    "mount_cached": js.Bucket.MODE_MOUNT_CACHED,
}
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_GIT_URL = re.compile(r"^(?:(?:https?|ssh|git|file)://\S+|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:\S+)$")
_PORT = re.compile(r"^([0-9]{1,5})(?:-([0-9]{1,5}))?$")
MAX_PORTS = 16
_EXECUTIONS = {"parallel": js.JobSpec.EXECUTION_PARALLEL, "serial": js.JobSpec.EXECUTION_SERIAL}
# Keys only a task document has: a first document with one of them is a task, not a header.
_SKY_TASK_ONLY = frozenset(
    {"run", "setup", "resources", "envs", "num_nodes", "file_mounts", "secrets", "workdir"}
)
# `cloud:` and the first part of `infra:` that name one of Tandem's backends; any other names a public cloud.
_CLOUD_BACKENDS: dict[str, js.Backend.ValueType] = {
    "kubernetes": js.BACKEND_KUBERNETES,
    "k8s": js.BACKEND_KUBERNETES,
    "slurm": js.BACKEND_SLURM,
    "local": js.BACKEND_LOCAL,
}
_TASK_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
_SKY_TASK_NAME = re.compile(r"[a-zA-Z0-9]+(?:[._-]{1,2}[a-zA-Z0-9]+)*")  # the names SkyPilot's tasks take
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def _unfilled(*texts: Any) -> str:
    """The variables `texts` still name after SkyPilot's filling, as a message's subject: `$A` or `$A, $B`
    (`a variable` where a `$` names none)."""
    names = dict.fromkeys(n for t in texts if isinstance(t, str) for n in _ENV_REFERENCE.findall(t))
    return ", ".join(f"${n}" for n in names) or "a variable"


def parse_infra(text: str) -> tuple[js.Backend.ValueType, dict[str, str]]:
    """SkyPilot's `infra:` (also `tandem launch --infra`): the backend it names and what it says of that
    backend's options. `slurm/CLUSTER/PARTITION` and `slurm/CLUSTER` give the `slurm` options' `cluster` and
    `partition` (`*` for either is any), `k8s/CONTEXT` (the rest of the string, slashes and all, as SkyPilot
    reads it) the `kubernetes` options' `context`. BACKEND_UNSPECIFIED for `*`, any infrastructure.
    ValueError, saying why, for anything else: a public cloud, a region, a malformed path."""
    text = text.strip().strip("/")
    parts = [part.strip() for part in text.split("/")]
    if "" in parts:
        raise ValueError(
            f"{text!r} has an empty part (SkyPilot's form is CLOUD, CLOUD/REGION or CLOUD/REGION/ZONE)"
        )
    first, rest = parts[0], parts[1:]
    if first == "*":
        if rest:
            raise ValueError(f"{text!r} names a region of any cloud; write * alone, or the backend first")
        return js.BACKEND_UNSPECIFIED, {}  # any infrastructure: the scheduler's default backend
    backend = _CLOUD_BACKENDS.get(first.lower())
    if backend is None:
        raise ValueError(f"{first!r} " + _CLOUD_ONLY.format(what="name"))
    options: dict[str, str] = {}
    if backend == js.BACKEND_KUBERNETES and rest:
        context = "/".join(rest)
        if context != "*":
            options["context"] = context
    elif backend == js.BACKEND_SLURM and rest:
        if len(rest) > 2:
            raise ValueError(f"{text!r}: Slurm's form is slurm, slurm/CLUSTER or slurm/CLUSTER/PARTITION")
        for key, value in zip(("cluster", "partition"), rest, strict=False):
            if value == "*":
                continue
            if not _SLURM_NAME.fullmatch(value):
                raise ValueError(f"{value!r} is not a Slurm {key} name (1 to 128 of A-Z a-z 0-9 _ . -)")
            options[key] = value
    elif rest:
        raise ValueError(f"{text!r}: the local backend is this machine; write `infra: local`")
    return backend, options


def set_backend_options(spec: JobSpec, backend: js.Backend.ValueType, options: Mapping[str, str]) -> None:
    """Writes what `parse_infra` found into the job's `slurm` or `kubernetes` block, over what is there."""
    if not options:
        return
    block = spec.slurm if backend == js.BACKEND_SLURM else spec.kubernetes
    block.SetInParent()
    for key, value in options.items():
        setattr(block, key, value)


def default_task_name(name: str) -> str:
    """A name in Tandem's task-name shape (`[a-z][a-z0-9-]{0,62}`) from a SkyPilot name such as `My_Train`:
    lower-cased, each run of other characters a hyphen, leading non-letters dropped; "task" if nothing is
    left."""
    cleaned = re.sub(r"[^a-z0-9]+", "-", name.lower())
    cleaned = re.sub(r"^[^a-z]+", "", cleaned)[:63].rstrip("-")
    return cleaned or "task"


def _secret_id(env: str) -> str:
    """The vault secret id for a variable SkyPilot names a secret by: `HF_TOKEN` -> `hf-token`."""
    return env.lower().replace("_", "-")


class _Stop(Exception):
    """A value that cannot be read any further; its violation is already recorded."""


class _Reader:
    """Builds a JobSpec from YAML documents, recording each problem with its YAML path and, for keys
    renamed on the way, which proto path stands for which YAML path (`aliases`)."""

    def __init__(
        self, base_dir: Path | None, envs: Mapping[str, str], uploads: list[BucketUpload] | None = None
    ) -> None:
        self.base_dir = base_dir
        self.given_envs = envs
        self.uploads = uploads
        self.task_envs: Mapping[str, str] = {}  # the task being read's envs, with the values given
        self.found: list[FieldViolation] = []
        self.aliases: dict[str, str] = {"display_name": "name"}
        self.single = False  # a file that is one SkyPilot task: its keys are at the top, not under tasks[0]
        self.documents = False  # SkyPilot's multi-document form: a header, then one document per task
        self.primary: list[str] | None = None  # a group header's `primary_tasks`
        self.delays: dict[str, duration_pb2.Duration] = {}  # its `termination_delay`, by task ("default")
        self.named: set[int] = set()  # the tasks whose file gives a name
        self.unset_envs: dict[int, list[str]] = {}  # per task, the variables declared without a value
        # SkyPilot's per-task `job_recovery`, `priority` and `priority_class`: the job's here, by their path
        self.job_values: dict[str, list[tuple[str, Any]]] = {}
        self.backends: list[
            tuple[str, js.Backend.ValueType]
        ] = []  # the backends `cloud:` / `infra:` name, with their path
        self.infra_options: list[tuple[str, dict[str, str]]] = []  # what each `infra:` says of its backend
        self.config_slurm: list[tuple[str, dict[str, str]]] = []  # what each task's `config.slurm` says

    def shown(self, path: str) -> str:
        """How a path is shown for this file: a one-task file's keys are at the top (`run`, not tasks[0].run)."""
        if self.single and path.startswith("tasks[0]."):
            return path[len("tasks[0].") :]
        return path

    def yaml_path(self, proto_path: str) -> str:
        """The YAML spelling of a proto path, by its longest aliased prefix."""
        best = ""
        for prefix in self.aliases:
            if len(prefix) > len(best) and (
                proto_path == prefix or proto_path.startswith((prefix + ".", prefix + "["))
            ):
                best = prefix
        return self.aliases[best] + proto_path[len(best) :] if best else proto_path

    def fail(self, at: str, description: str) -> NoReturn:
        self.found.append(FieldViolation(at, description))
        raise _Stop

    def job(self, documents: list[Any]) -> JobSpec:
        spec = JobSpec()
        if not documents:
            self.found.append(FieldViolation("tasks", "the job file is empty"))
            return spec
        head = documents[0]
        if len(documents) == 1 and isinstance(head, dict) and "tasks" not in head:
            self.single_task(spec, head)  # SkyPilot's most common file: one task, its keys at the top
            return spec
        tasks: Any
        if len(documents) > 1:  # SkyPilot's form: a header document, then one document per task
            if isinstance(head, dict) and "tasks" in head:
                self.found.append(
                    FieldViolation("tasks", "write the tasks either as `tasks:` or as documents, not both")
                )
            if isinstance(head, dict) and head.keys() & _SKY_TASK_ONLY:
                return self.pipeline(spec, documents)
            tasks = documents[1:]
            self.documents = True
            if isinstance(head, dict) and "execution" not in head:  # SkyPilot's rule: then it is a pipeline
                spec.execution = js.JobSpec.EXECUTION_SERIAL
        else:
            tasks = head.get("tasks") if isinstance(head, dict) else None
        try:
            document = self.table(head, "", (*_JOB_KEYS, *_GROUP_KEYS), _SKY_JOB_KEYS)
        except _Stop:
            return spec
        self.guard(lambda: self.header(spec, document))
        self.guard(lambda: self.group_header(document))
        if tasks is None:
            self.found.append(FieldViolation("tasks", "is required: a list of tasks"))
        elif not isinstance(tasks, list):
            self.found.append(FieldViolation("tasks", "must be a list of tasks"))
        else:
            for index, task in enumerate(tasks):
                self.guard(lambda t=task, i=index: self.task(spec.tasks.add(), t, f"tasks[{i}]"))
        self.finish(spec)
        return spec

    def pipeline(self, spec: JobSpec, documents: list[Any]) -> JobSpec:
        """SkyPilot's pipeline without a header: every document is a task, run one after another."""
        spec.execution = js.JobSpec.EXECUTION_SERIAL
        for index, task in enumerate(documents):
            self.guard(lambda t=task, i=index: self.task(spec.tasks.add(), t, f"tasks[{i}]"))
        self.finish(spec)
        return spec

    def single_task(self, spec: JobSpec, head: dict[str, Any]) -> None:
        """One SkyPilot task: the job's keys and the task's side by side; `name` names both (SkyPilot's rule),
        the task's in the shape task names take."""
        self.single = True
        keys = tuple(dict.fromkeys((*_JOB_KEYS, *_TASK_KEYS)))
        try:
            document = self.table(
                head, "", [k for k in keys if k != "tasks"], {**_SKY_JOB_KEYS, **_SKY_TASK_KEYS}
            )
        except _Stop:
            return
        self.guard(lambda: self.header(spec, {k: v for k, v in document.items() if k in _JOB_KEYS}))
        task = spec.tasks.add()
        self.guard(
            lambda: self.task(
                task, {k: v for k, v in document.items() if k in _TASK_KEYS and k != "name"}, "tasks[0]"
            )
        )
        if spec.display_name:
            task.name = default_task_name(spec.display_name)
            if _SKY_TASK_NAME.fullmatch(spec.display_name) and task.name != spec.display_name:
                task.display_name = spec.display_name  # the task's name as SkyPilot has it
            self.named.add(0)
        self.finish(spec)

    def group_header(self, doc: dict[str, Any]) -> None:
        """SkyPilot's job-group keys: `primary_tasks` (the others are auxiliary) and `termination_delay` (one
        duration, or one per task name with a `default`), applied to the tasks in `finish`."""
        if "placement" in doc:  # SkyPilot's SAME_INFRA: every task on one infrastructure, as a group is here
            placement = doc["placement"]
            if not isinstance(placement, str) or placement.upper() != "SAME_INFRA":
                self.fail(
                    "placement", f"must be SAME_INFRA (a job group runs on one backend), not {placement!r}"
                )
        if "primary_tasks" in doc:
            names = doc["primary_tasks"]
            if not isinstance(names, list):
                self.fail("primary_tasks", "must be a list of task names")
            self.primary = [self.text(n, f"primary_tasks[{i}]") for i, n in enumerate(names)] or None
        if "termination_delay" in doc:
            value = doc["termination_delay"]
            if isinstance(value, dict):
                for key, item in value.items():
                    where = f"termination_delay[{_key(key)}]"
                    self.guard(
                        lambda k=key, v=item, w=where: self.delays.update({str(k): self.duration(v, w)})
                    )
            else:
                self.delays["default"] = self.duration(value, "termination_delay")

    def roles(self, spec: JobSpec) -> None:
        """`primary_tasks` and `termination_delay` name tasks as SkyPilot does (`My_Task`), or by `name`."""
        names = {n for t in spec.tasks for n in (t.name, t.display_name) if n}
        for index, name in enumerate(self.primary or []):
            if name not in names:
                self.found.append(FieldViolation(f"primary_tasks[{index}]", f"{name!r} is no task's name"))
        for index, task in enumerate(spec.tasks):
            called = [n for n in (task.display_name, task.name) if n]
            if self.primary is not None:
                listed = bool(set(called) & set(self.primary))
                if task.role == (TaskSpec.ROLE_AUXILIARY if listed else TaskSpec.ROLE_PRIMARY):
                    self.found.append(FieldViolation(f"tasks[{index}].role", "disagrees with primary_tasks"))
                task.role = TaskSpec.ROLE_PRIMARY if listed else TaskSpec.ROLE_AUXILIARY
            delay = next((self.delays[n] for n in called if n in self.delays), self.delays.get("default"))
            if (
                delay is not None
                and task.role == TaskSpec.ROLE_AUXILIARY
                and not task.HasField("termination_delay")
            ):
                task.termination_delay.CopyFrom(delay)
        for key in self.delays:
            if key != "default" and key not in names:
                self.found.append(
                    FieldViolation(f"termination_delay[{_key(key)}]", f"{key!r} is no task's name")
                )

    def finish(self, spec: JobSpec) -> None:
        """What spans the tasks: default names, SkyPilot's group roles and delays, the values given at
        submission, the backend `cloud:` names."""
        stem = default_task_name(spec.display_name) if spec.display_name else "task"
        self.job_group_names(spec)
        for index, task in enumerate(spec.tasks):
            if index not in self.named:  # SkyPilot's rule: a group's unnamed tasks are NAME-0, NAME-1, ...
                task.name = stem if len(spec.tasks) == 1 else f"{stem[: 62 - len(str(index))]}-{index}"
        self.roles(spec)
        for index, task in enumerate(spec.tasks):
            for name, value in self.given_envs.items():
                task.envs[name] = value
            for name in self.unset_envs.get(index, []):
                if name not in self.given_envs:
                    self.found.append(
                        FieldViolation(
                            f"tasks[{index}].envs[{_key(name)}]",
                            "has no value: give it when the job is submitted (load_yaml's envs, as "
                            f'SkyPilot\'s --env {name}=VALUE), or write {name}: "" for an empty one',
                        )
                    )
        named = {backend for _, backend in self.backends}
        if len(named) > 1:
            self.found.extend(
                FieldViolation(at, "the tasks name different backends; a job group runs on one")
                for at, _ in self.backends
            )
        elif named:
            (backend,) = named
            if spec.backend == js.BACKEND_UNSPECIFIED:
                spec.backend = backend
            elif spec.backend != backend:
                self.found.extend(
                    FieldViolation(
                        at,
                        f"names backend {_BACKEND_NAMES[backend]}; the job's is "
                        f"{_BACKEND_NAMES[spec.backend]}",
                    )
                    for at, _ in self.backends
                )
        if len(named) == 1 and spec.backend in named:
            self.apply_infra_options(spec, spec.backend)
        self.found.extend(task_config.apply_slurm(spec, self.config_slurm))
        self.job_values_of_tasks(spec)

    def job_group_names(self, spec: JobSpec) -> None:
        """SkyPilot's multi-document job group takes no dots in its task names, as its loader checks."""
        if not self.documents or spec.execution == js.JobSpec.EXECUTION_SERIAL:
            return
        for index, task in enumerate(spec.tasks):
            if "." in task.display_name:
                self.found.append(
                    FieldViolation(
                        f"tasks[{index}].name",
                        f"Invalid job name: {task.display_name!r}. Name must contain only alphanumeric "
                        "characters, hyphens, and underscores.",
                    )
                )

    def apply_infra_options(self, spec: JobSpec, backend: js.Backend.ValueType) -> None:
        """Each `infra:`'s cluster, partition or context into the job's options, where nothing else there
        (the file's `slurm:` / `kubernetes:`, another task's `infra:`) names another."""
        which = "slurm" if backend == js.BACKEND_SLURM else "kubernetes"
        if spec.WhichOneof("backend_options") not in (None, which):
            return  # the other backend's block: refused as such (`_job_rules`)
        block: js.SlurmOptions | js.KubernetesOptions = getattr(spec, which)
        for at, options in self.infra_options:
            for key, value in options.items():
                current = getattr(block, key)
                if current and current != value:
                    self.found.append(
                        FieldViolation(at, f"names the {key} {value!r}, and the job's is {current!r}")
                    )
                    continue
                block.SetInParent()
                setattr(block, key, value)

    def guard(self, step: Any) -> None:
        with contextlib.suppress(_Stop):
            step()

    def header(self, spec: JobSpec, doc: dict[str, Any]) -> None:
        if "name" in doc:
            spec.display_name = self.text(doc["name"], "name")
        if "execution" in doc:
            self.guard(
                lambda: setattr(spec, "execution", self.choice(doc["execution"], "execution", _EXECUTIONS))
            )
        if "priority" in doc:
            self.guard(
                lambda: setattr(
                    spec, "priority", self.integer(doc["priority"], "priority", -(2**31), 2**31 - 1)
                )
            )
        if "backend" in doc:
            self.guard(lambda: setattr(spec, "backend", self.choice(doc["backend"], "backend", _BACKENDS)))
        if "inter_connection" in doc:  # a group header's: whether the tasks reach each other by host name
            self.guard(
                lambda: setattr(
                    spec, "inter_connection", self.boolean(doc["inter_connection"], "inter_connection")
                )
            )
        if "max_duration" in doc:
            self.guard(lambda: spec.max_duration.CopyFrom(self.duration(doc["max_duration"], "max_duration")))
        if "recovery" in doc:
            self.guard(lambda: self.recovery(spec.recovery, doc["recovery"]))
        if "slurm" in doc:
            self.guard(lambda: self.slurm(spec.slurm, doc["slurm"]))
        if "kubernetes" in doc:
            self.guard(lambda: self.kubernetes(spec.kubernetes, doc["kubernetes"]))

    def recovery(self, policy: js.RecoveryPolicy, value: Any) -> None:
        doc = self.table(
            value,
            "recovery",
            ("max_restarts_on_errors", "recover_on_exit_codes", "initial_backoff", "max_backoff", "scope"),
        )
        policy.SetInParent()
        if "max_restarts_on_errors" in doc:
            policy.max_restarts_on_errors = self.integer(
                doc["max_restarts_on_errors"], "recovery.max_restarts_on_errors", 0, 2**32 - 1
            )
        if "recover_on_exit_codes" in doc:
            codes = doc["recover_on_exit_codes"]
            if not isinstance(codes, list):
                self.fail("recovery.recover_on_exit_codes", "must be a list of exit codes")
            for index, code in enumerate(codes):
                self.guard(
                    lambda c=code, i=index: policy.recover_on_exit_codes.append(
                        self.integer(c, f"recovery.recover_on_exit_codes[{i}]", -(2**31), 2**31 - 1)
                    )
                )
        for key in ("initial_backoff", "max_backoff"):
            if key in doc:
                self.guard(lambda k=key: getattr(policy, k).CopyFrom(self.duration(doc[k], f"recovery.{k}")))
        if "scope" in doc:
            policy.scope = self.choice(doc["scope"], "recovery.scope", _SCOPES)

    def slurm(self, options: js.SlurmOptions, value: Any) -> None:
        doc = self.table(value, "slurm", ("partition", "account", "qos", "cluster"))
        options.SetInParent()
        for key, item in doc.items():
            setattr(options, key, self.text(item, f"slurm.{key}"))

    def kubernetes(self, options: js.KubernetesOptions, value: Any) -> None:
        doc = self.table(
            value, "kubernetes", ("namespace", "node_selector", "priority_class_name", "context")
        )
        options.SetInParent()
        for key in ("namespace", "priority_class_name", "context"):
            if key in doc:
                setattr(options, key, self.text(doc[key], f"kubernetes.{key}"))
        if "node_selector" in doc:
            labels = self.table(doc["node_selector"], "kubernetes.node_selector", None)
            for key, item in labels.items():
                options.node_selector[str(key)] = self.scalar_text(
                    item, f"kubernetes.node_selector[{_key(key)}]"
                )

    def task(self, task: TaskSpec, value: Any, at: str) -> None:
        doc = self.table(value, at, _TASK_KEYS, _SKY_TASK_KEYS)
        if "name" in doc:
            self.task_name(task, self.text(doc["name"], f"{at}.name"))
            self.named.add(_index(at))
        self.guard(lambda: setattr(task, "kind", self.kind(doc, at)))
        if "role" in doc:
            self.guard(lambda: setattr(task, "role", self.choice(doc["role"], f"{at}.role", _ROLES)))
        if "termination_delay" in doc:
            self.guard(
                lambda: task.termination_delay.CopyFrom(
                    self.duration(doc["termination_delay"], f"{at}.termination_delay")
                )
            )
        if "resources" in doc:
            self.guard(lambda: self.resources(task.resources, doc["resources"], f"{at}.resources"))
        if "num_nodes" in doc:
            self.guard(
                lambda: setattr(
                    task, "num_nodes", self.integer(doc["num_nodes"], f"{at}.num_nodes", 0, 2**32 - 1)
                )
            )
        if "envs" in doc:
            self.guard(lambda: self.envs(task, doc["envs"], f"{at}.envs"))
        if "secrets" in doc:
            self.guard(lambda: self.secrets(task, doc["secrets"], f"{at}.secrets"))
        if "managed_secrets" in doc:
            self.guard(lambda: self.managed_secrets(task, doc["managed_secrets"], f"{at}.managed_secrets"))
        self.registry_login(task, at)
        # SkyPilot fills the task's envs (with the values given at submission) into its mounts and workdir.
        values = {**task.envs, **self.given_envs}
        self.task_envs = values
        self.files(task, {k: _fill_envs(v, values) if k in _FILLED else v for k, v in doc.items()}, at)
        for key in ("setup", "run"):
            if key in doc:
                self.guard(lambda k=key: setattr(task, k, self.text(doc[k], f"{at}.{k}")))
        if "online_rl" in doc:
            self.guard(lambda: self.online_rl(task.online_rl, doc["online_rl"], f"{at}.online_rl"))
        if "service" in doc:
            self.guard(lambda: self.service(task.service, doc["service"], f"{at}.service"))
        self.task_config(task, doc, at)

    def task_config(self, task: TaskSpec, doc: dict[str, Any], at: str) -> None:
        """SkyPilot's task-level `config:` (task_config.py); its Slurm options are the job's, set in `finish`."""
        if "config" not in doc:
            return
        parsed = task_config.parse(doc["config"], f"{at}.config", has_gpus=bool(task.resources.gpus))
        task.config.CopyFrom(parsed.config)
        self.found.extend(parsed.found)
        self.aliases.update(parsed.aliases)
        if parsed.slurm:
            self.config_slurm.append((f"{at}.config.slurm", parsed.slurm))

    @staticmethod
    def task_name(task: TaskSpec, written: str) -> None:
        """A task's name as written: in Tandem's shape as it is; a SkyPilot name outside it (`My_Task`) kept
        in `display_name`, `name` its normal form (`my-task`). Anything else stays, for the name's rule to
        refuse."""
        task.name = written
        if not _TASK_NAME.fullmatch(written) and _SKY_TASK_NAME.fullmatch(written) and len(written) <= 128:
            task.name = default_task_name(written)
            task.display_name = written

    def registry_login(self, task: TaskSpec, at: str) -> None:
        """SkyPilot's private registry login (SKYPILOT_DOCKER_USERNAME, _PASSWORD, _SERVER): the three
        together, as SkyPilot checks, and from the vault (`secrets`), never values in `envs`."""
        in_envs = [name for name in _DOCKER_LOGIN if name in task.envs]
        in_secrets = {secret_env_name(b) for b in task.secrets} & set(_DOCKER_LOGIN)
        if in_envs:
            self.found.append(
                FieldViolation(
                    f"{at}.envs[{_key(in_envs[0])}]",
                    "is a registry login in the job file; Tandem takes SKYPILOT_DOCKER_USERNAME, _PASSWORD and "
                    "_SERVER from the vault: store them there (tandem secrets put skypilot-docker-password) and "
                    "write them under secrets as NAME: null",
                )
            )
        elif in_secrets and len(in_secrets) != len(_DOCKER_LOGIN):
            missing = sorted(set(_DOCKER_LOGIN) - in_secrets)
            self.found.append(
                FieldViolation(
                    f"{at}.secrets",
                    f"Docker login variables must be specified together in secrets. Missing from secrets: {missing}",
                )
            )

    def files(self, task: TaskSpec, doc: dict[str, Any], at: str) -> None:
        """What the task finds on its nodes: `file_mounts` and SkyPilot's `workdir`."""
        if "file_mounts" in doc:
            self.guard(lambda: self.mounts(task, doc["file_mounts"], f"{at}.file_mounts"))
        if "workdir" in doc:
            self.guard(lambda: self.workdir(task, doc["workdir"], f"{at}.workdir"))
        if "volumes" in doc:
            self.guard(lambda: self.volumes(task, doc["volumes"], f"{at}.volumes"))

    def volumes(self, task: TaskSpec, value: Any, at: str) -> None:
        """SkyPilot's task `volumes`: `{/path: NAME}` or `{/path: {name: NAME}}` mounts a volume the deployment
        defines (a `file_mounts: {/path: {volume: NAME}}`); `{host_path: /src}` binds a folder of the node."""
        doc = self.table(value, at, None)
        for path, value_of_path in doc.items():
            where = f"{at}[{_key(path)}]"
            proto = f"file_mounts[{len(task.file_mounts)}]"
            item = value_of_path
            if isinstance(item, dict):
                item = self.table(
                    item, where, ("name", "host_path", "read_only", "sub_path"), _SKY_VOLUME_KEYS
                )
                if ("name" in item) == ("host_path" in item):
                    self.found.append(FieldViolation(where, "set exactly one of name and host_path"))
                    continue
            elif not isinstance(item, str):
                self.found.append(FieldViolation(where, f"must be a volume's name, not {_type(item)}"))
                continue
            mount = task.file_mounts.add()
            mount.path = str(path)
            self.aliases[f"{at.rsplit('.', 1)[0]}.{proto}"] = where
            if not mount.path.startswith("/") and not home_relative(mount.path):
                self.found.append(FieldViolation(where, _mount_path_problem(str(path))))
            if isinstance(item, str):
                mount.volume = item
                continue
            if "name" in item:
                self.guard(
                    lambda m=mount, i=item, w=where: setattr(m, "volume", self.text(i["name"], f"{w}.name"))
                )
            else:
                self.guard(
                    lambda m=mount, i=item, w=where: setattr(
                        m, "local_path", self.text(i["host_path"], f"{w}.host_path")
                    )
                )
                if not mount.local_path.startswith("/"):
                    self.found.append(
                        FieldViolation(f"{where}.host_path", "the node's path must be absolute")
                    )
            if "read_only" in item:
                self.guard(
                    lambda m=mount, i=item, w=where: setattr(
                        m, "read_only", self.boolean(i["read_only"], f"{w}.read_only")
                    )
                )
            if "sub_path" in item:
                self.aliases[f"{at.rsplit('.', 1)[0]}.{proto}.sub_path"] = f"{where}.sub_path"
                self.guard(
                    lambda m=mount, i=item, w=where: setattr(
                        m, "sub_path", self.text(i["sub_path"], f"{w}.sub_path")
                    )
                )

    def managed_secrets(self, task: TaskSpec, value: Any, at: str) -> None:
        """SkyPilot's `managed_secrets: [NAME, {NAME: {mount_path: /path}}, ...]`: each a vault secret in the
        variable NAME, as the `secrets:NAME` references of `secrets` are; with `mount_path` also written to
        that file in the task."""
        if not isinstance(value, list):
            self.fail(at, "must be a list of secret names")
        for index, item in enumerate(value):
            where = f"{at}[{index}]"
            if isinstance(item, dict):
                self.guard(lambda i=item, w=where: self.secret_file(task, i, w))
                continue
            if not isinstance(item, str):
                self.found.append(FieldViolation(where, f"must be a secret's name, not {_type(item)}"))
                continue
            self.aliases[f"{at.rsplit('.', 1)[0]}.secrets[{len(task.secrets)}]"] = where
            self.name_secret(task.secrets.add(), item.removeprefix("secrets:"), where)

    def kind(self, doc: dict[str, Any], at: str) -> Any:
        """The explicit `kind`, else the one the options block implies (SkyPilot tasks have no kind)."""
        if "kind" in doc:
            return self.choice(doc["kind"], f"{at}.kind", _KINDS)
        if "online_rl" in doc:
            return TaskSpec.KIND_ONLINE_RL
        return TaskSpec.KIND_SERVICE if "service" in doc else TaskSpec.KIND_COMMAND

    def resources(self, resources: types_pb2.Resources, value: Any, at: str) -> None:
        if value is None:  # SkyPilot takes `resources:` with nothing under it as no request
            return
        doc = self.table(value, at, _RESOURCE_KEYS, _SKY_RESOURCE_KEYS)
        resources.SetInParent()
        self.lift_keys(doc, at)
        if "any_of" in doc or "ordered" in doc:
            self.alternatives(resources, doc, at)
            return
        if "gpus" in doc and "accelerators" in doc:
            self.found.append(FieldViolation(f"{at}.accelerators", "set one of gpus and accelerators"))
        if "gpus" in doc:
            gpus = doc["gpus"]
            if isinstance(gpus, bool) or not isinstance(gpus, str | int):
                self.fail(f"{at}.gpus", 'must be "TYPE:COUNT" (e.g. "H100:8") or a count')
            resources.gpus = str(gpus)
        elif "accelerators" in doc:
            self.aliases[f"{at}.gpus"] = f"{at}.accelerators"
            self.aliases[f"{at}.gpu_alternatives"] = f"{at}.accelerators"
            self.guard(lambda: self.accelerators(resources, doc["accelerators"], f"{at}.accelerators"))
        if "cpus" in doc:
            self.guard(lambda: setattr(resources, "cpus", self.number(doc["cpus"], f"{at}.cpus", plus=True)))
        if "memory" in doc:
            self.aliases[f"{at}.memory_gib"] = f"{at}.memory"
            self.guard(
                lambda: setattr(
                    resources, "memory_gib", self.memory(doc["memory"], f"{at}.memory", plus=True)
                )
            )
        for key in ("cloud", "infra"):
            if key in doc:
                self.guard(lambda k=key: self.cloud(doc[k], f"{at}.{k}", infra=k == "infra"))
        self.placement_keys(resources, doc, at)

    def lift_keys(self, doc: dict[str, Any], at: str) -> None:
        """Takes out of a resources table what is not a node's request: `job_recovery`, `priority` and
        `priority_class` (the job's here), and renames SkyPilot's older `ephemeral_storage` to `disk_size`."""
        for key in ("job_recovery", "priority", "priority_class"):
            if key in doc:
                self.guard(lambda k=key: self.job_value(k, doc.pop(k), f"{at}.{k}"))
        for key, tiers in (("disk_tier", _DISK_TIERS), ("network_tier", _NETWORK_TIERS)):
            if key in doc:  # checked as SkyPilot checks it, then it chooses nothing (see _DISK_TIERS)
                value = doc.pop(key)
                if not isinstance(value, str) or value.lower() not in tiers:
                    self.found.append(
                        FieldViolation(f"{at}.{key}", f"must be one of {', '.join(tiers)}, not {value!r}")
                    )
        if "ephemeral_storage" in doc:
            if "disk_size" in doc:
                self.found.append(
                    FieldViolation(f"{at}.ephemeral_storage", "set one of disk_size and ephemeral_storage")
                )
            doc["disk_size"] = doc.pop("ephemeral_storage")
            self.aliases[f"{at}.disk_gib"] = f"{at}.ephemeral_storage"

    def alternatives(self, resources: types_pb2.Resources, doc: dict[str, Any], at: str) -> None:
        """SkyPilot's `any_of` / `ordered`: a list of resource tables, each over the keys beside it. Here the
        alternatives are GPU requests (the rest of a request is one), tried in the order written, the first
        the cluster can satisfy placed, as `accelerators: [A100:8, H100:8]` is; where none names accelerators
        they may differ in `use_spot` alone. SkyPilot's `any_of` picks the
        cheapest; there are no prices here, so it is read in order too."""
        if "any_of" in doc and "ordered" in doc:
            self.fail(f"{at}.ordered", "set one of any_of and ordered")
        key = "any_of" if "any_of" in doc else "ordered"
        items = doc[key]
        base = {k: v for k, v in doc.items() if k != key}
        if not isinstance(items, list) or not items:
            self.fail(f"{at}.{key}", "must be a list of resource tables")
        choices: list[types_pb2.Resources] = []
        places: list[tuple[str, ...]] = []
        for index, item in enumerate(items):
            where = f"{at}.{key}[{index}]"
            if not isinstance(item, dict):
                self.fail(where, f"must be a table of resources, not {_type(item)}")
            nested = item.keys() & {"any_of", "ordered"}
            if nested:
                self.fail(f"{where}.{min(nested)}", "alternatives do not nest")
            choice = types_pb2.Resources()
            self.resources(choice, {**base, **item}, where)
            choices.append(choice)
            places.append(tuple(str({**base, **item}.get(k, "")) for k in ("cloud", "infra")))
        first = choices[0]
        for index, choice in enumerate(choices):
            where = f"{at}.{key}[{index}]"
            if places[index] != places[0]:
                self.found.append(
                    FieldViolation(
                        where,
                        f"differs from {key}[0] in where it runs (cloud, infra); a job runs on one backend",
                    )
                )
            if not choice.gpus and any(c.gpus for c in choices):
                self.found.append(
                    FieldViolation(
                        where,
                        "names no accelerators where another alternative does; alternatives are GPU requests "
                        "(or, with none naming accelerators, spot or not)",
                    )
                )
            rest, rest_first = types_pb2.Resources(), types_pb2.Resources()
            rest.CopyFrom(choice)
            rest_first.CopyFrom(first)
            for r in (rest, rest_first):
                r.ClearField("gpus")
                r.ClearField("gpu_alternatives")
                r.ClearField("preemptible")
            if rest != rest_first:
                differ = sorted(
                    f.name
                    for f in types_pb2.Resources.DESCRIPTOR.fields
                    if getattr(rest, f.name) != getattr(rest_first, f.name)
                )
                self.found.append(
                    FieldViolation(
                        where,
                        f"differs from {key}[0] in {', '.join(differ)}; alternatives here differ in their "
                        "accelerators only (one request for the rest)",
                    )
                )
        resources.CopyFrom(first)
        # spot or not: `any_of` takes the cheapest (SkyPilot's rule), which is spot where any may be; `ordered`
        # the first
        resources.preemptible = any(c.preemptible for c in choices) if key == "any_of" else first.preemptible
        requests = list(dict.fromkeys(g for c in choices for g in (c.gpus, *c.gpu_alternatives) if g))
        del resources.gpu_alternatives[:]
        resources.gpu_alternatives.extend(requests[1:])
        self.aliases[f"{at}.gpus"] = f"{at}.{key}[0].accelerators"
        self.aliases[f"{at}.gpu_alternatives"] = f"{at}.{key}"

    def job_value(self, key: str, value: Any, at: str) -> None:
        """A task's `job_recovery`, `priority` or `priority_class`: SkyPilot's per task, the job's here
        (`finish` checks that the tasks agree)."""
        if key == "job_recovery":
            parsed: Any = self.job_recovery(value, at)
        elif key == "priority":
            parsed = self.integer(value, at, MIN_PRIORITY, MAX_PRIORITY)
        else:
            parsed = self.text(value, at)
        self.job_values.setdefault(key, []).append((at, parsed))

    def job_recovery(self, value: Any, at: str) -> js.RecoveryPolicy:
        """SkyPilot's `job_recovery`: a strategy name or `{strategy, max_restarts_on_errors,
        recover_on_exit_codes}`. A strategy chooses where a recovered job goes among clouds and regions; here
        it comes back on the same cluster, so every strategy means the same."""
        policy = js.RecoveryPolicy()
        doc = (
            {"strategy": value}
            if isinstance(value, str)
            else self.table(
                value, at, ("strategy", "max_restarts_on_errors", "recover_on_exit_codes"), _ELASTIC_KEYS
            )
        )
        strategy = doc.get("strategy")
        if strategy is not None and self.text(strategy, f"{at}.strategy").upper() == "DYNAMIC_NODE_SET":
            self.fail(f"{at}.strategy", _ELASTIC)
        if strategy is not None and self.text(strategy, f"{at}.strategy").upper() not in _STRATEGIES:
            self.fail(f"{at}.strategy", f"must be one of {', '.join(_STRATEGIES)}, not {strategy!r}")
        if "max_restarts_on_errors" in doc:
            policy.max_restarts_on_errors = self.integer(
                doc["max_restarts_on_errors"], f"{at}.max_restarts_on_errors", 0, 2**32 - 1
            )
        if "recover_on_exit_codes" in doc:
            codes = doc["recover_on_exit_codes"]
            for index, code in enumerate(codes if isinstance(codes, list) else [codes]):
                where = f"{at}.recover_on_exit_codes" + (f"[{index}]" if isinstance(codes, list) else "")
                policy.recover_on_exit_codes.append(self.integer(code, where, 0, 255))
        return policy

    def job_values_of_tasks(self, spec: JobSpec) -> None:
        """The tasks' `job_recovery`, `priority` and `priority_class` become the job's, where they agree with
        each other and with the job's own keys."""
        targets: dict[str, tuple[str, Any]] = {
            "job_recovery": ("recovery", spec.recovery if spec.HasField("recovery") else None),
            "priority": ("priority", spec.priority or None),
            "priority_class": ("kubernetes.priority_class_name", spec.kubernetes.priority_class_name or None),
        }
        for key, found in self.job_values.items():
            job_key, mine = targets[key]
            (first_at, first), *rest = found
            for at, other in rest:
                if other != first:
                    self.found.append(
                        FieldViolation(
                            at, f"differs from {first_at}; Tandem's {job_key} is one for the whole job"
                        )
                    )
            if key == "priority_class" and spec.backend != js.BACKEND_KUBERNETES:
                self.found.append(
                    FieldViolation(
                        first_at, "is a Kubernetes PriorityClass; it takes `infra: k8s` (the job's backend)"
                    )
                )
                continue
            if mine is not None and mine != first:
                self.found.append(FieldViolation(first_at, f"disagrees with the job's `{job_key}`"))
                continue
            if key == "job_recovery":
                spec.recovery.CopyFrom(first)
            elif key == "priority":
                spec.priority = first
            else:
                spec.kubernetes.priority_class_name = first

    def placement_keys(self, resources: types_pb2.Resources, doc: dict[str, Any], at: str) -> None:
        """SkyPilot's `disk_size`, `ports`, `use_spot` and `image_id` (SPEC.md says what each backend does)."""
        if "disk_size" in doc:  # SkyPilot's GB are GiB, a bare number
            self.aliases[f"{at}.disk_gib"] = f"{at}.disk_size"
            self.guard(
                lambda: setattr(resources, "disk_gib", self.memory(doc["disk_size"], f"{at}.disk_size"))
            )
        if "ports" in doc:
            self.guard(lambda: self.ports(resources, doc["ports"], f"{at}.ports"))
        if "use_spot" in doc:
            self.aliases[f"{at}.preemptible"] = f"{at}.use_spot"
            self.guard(
                lambda: setattr(resources, "preemptible", self.boolean(doc["use_spot"], f"{at}.use_spot"))
            )
        if "image_id" in doc:
            self.aliases[f"{at}.image"] = f"{at}.image_id"
            where = str(doc.get("infra") or doc.get("cloud") or "").split("/", 1)[0].lower()
            container = _CLOUD_BACKENDS.get(where) == js.BACKEND_KUBERNETES
            self.guard(lambda: self.image(resources, doc["image_id"], f"{at}.image_id", container=container))
        if "labels" in doc:
            labels = self.table(doc["labels"], f"{at}.labels", None)
            for key, item in labels.items():
                resources.labels[str(key)] = self.scalar_text(item, f"{at}.labels[{_key(key)}]")

    def ports(self, resources: types_pb2.Resources, value: Any, at: str) -> None:
        """SkyPilot's forms: a port (`8080` or `"8080"`), a range (`"10000-10010"`) or a list of those."""
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            where = f"{at}[{index}]" if isinstance(value, list) else at
            if isinstance(item, bool) or not isinstance(item, int | str):
                self.fail(where, f"must be a port or a range such as 10000-10010, not {_type(item)}")
            resources.ports.append(str(item).strip())

    def image(self, resources: types_pb2.Resources, value: Any, at: str, *, container: bool = False) -> None:
        """`docker:IMAGE` is a container image, and so is any image id of a task on Kubernetes (`container`),
        as SkyPilot reads it there; any other (a cloud's machine image, a table by region) names a public
        cloud's."""
        if isinstance(value, dict):
            self.fail(at, _CLOUD_ONLY.format(what="machine images by region"))
        text = self.text(value, at).strip()
        if container and not text.startswith("docker:"):
            text = f"docker:{text}"
        if not text.startswith("docker:"):
            self.fail(at, f"{text!r} " + _CLOUD_ONLY.format(what="machine image") + "; write docker:IMAGE")
        resources.image = text.removeprefix("docker:").strip()

    def accelerators(self, resources: types_pb2.Resources, value: Any, at: str) -> None:
        """SkyPilot's forms: `A100:8` (a bare type is 1), `{A100: 8}`, a list of alternatives in order, or a
        set (`{A100:8, H100:8}`, YAML keys without values), kept in the order written. The first is `gpus`."""
        items = self.accelerator_items(value, at)
        if not items:
            self.fail(at, "names no accelerator")
        requests = [self.accelerator(item, at) for item in items]
        resources.gpus = requests[0]
        resources.gpu_alternatives.extend(requests[1:])

    def accelerator_items(self, value: Any, at: str) -> list[str]:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{") and text.endswith("}"):  # a set written as one string
                return [part.strip() for part in text[1:-1].split(",") if part.strip()]
            return [text]
        items: list[str] = []
        if isinstance(value, dict):
            for name, count in value.items():
                if count is not None and (isinstance(count, bool) or not isinstance(count, int | float)):
                    self.fail(f"{at}[{_key(name)}]", f"the count must be a number, not {_type(count)}")
                items.append(str(name) if count is None else f"{name}:{count}")
            return items
        if not isinstance(value, list):
            self.fail(
                at, f"must be TYPE:COUNT (A100:8), a {{TYPE: COUNT}} table or a list, not {_type(value)}"
            )
        for index, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(f"{at}[{index}]", f"must be a string such as A100:8, not {_type(item)}")
            items.append(item)
        return items

    def accelerator(self, item: str, at: str) -> str:
        name, _, count_text = item.strip().partition(":")
        name = name.strip()
        if name.lower().startswith("tpu"):
            self.fail(at, f"{name} is a Google Cloud TPU; Tandem places NVIDIA GPUs")
        if name.lower().startswith(("inferentia", "trainium")):
            self.fail(at, f"{name} is an AWS Neuron accelerator, only on AWS; Tandem places NVIDIA GPUs")
        try:
            count = float(count_text) if count_text.strip() else 1.0
        except ValueError:
            self.fail(at, f"{item!r} is not TYPE:COUNT (e.g. A100:8)")
        if not math.isfinite(count) or count != int(count):
            self.fail(at, f"{item!r}: fractional GPUs are not supported; a task has whole GPUs")
        text = f"{name}:{int(count)}"
        try:
            parse_gpus(text)
        except ValueError as exc:
            self.fail(at, f"{item!r}: {exc}")
        return text

    def cloud(self, value: Any, at: str, *, infra: bool) -> None:
        """`cloud: kubernetes` / `infra: k8s` choose a backend, `infra: slurm/CLUSTER/PARTITION` and
        `infra: k8s/CONTEXT` its options too (`parse_infra`); any other cloud cannot mean anything here."""
        text = self.text(value, at).strip()
        if not infra:
            backend = _CLOUD_BACKENDS.get(text.lower())
            if text == "*":
                return
            if backend is None:
                self.fail(at, f"{text!r} " + _CLOUD_ONLY.format(what="name"))
            self.backends.append((at, backend))
            return
        try:
            backend, options = parse_infra(text)
        except ValueError as error:
            self.fail(at, str(error))
        if backend == js.BACKEND_UNSPECIFIED:
            return
        self.backends.append((at, backend))
        if options:
            self.infra_options.append((at, options))

    def envs(self, task: TaskSpec, value: Any, at: str) -> None:
        doc = self.table(value, at, None)
        for name, item in doc.items():
            if item is None:  # SkyPilot's variable that must be given at submission (`--env NAME=VALUE`)
                self.unset_envs.setdefault(_index(at), []).append(str(name))
                continue
            task.envs[str(name)] = self.scalar_text(item, f"{at}[{_key(name)}]")

    def secrets(self, task: TaskSpec, value: Any, at: str) -> None:
        if isinstance(value, dict):
            self.secret_map(task, value, at)
            return
        if not isinstance(value, list):
            self.fail(at, "must be a list of secret names or {secret, env} tables, or a table of NAME: null")
        for index, item in enumerate(value):
            where = f"{at}[{index}]"
            binding = task.secrets.add()
            if isinstance(item, str) and item.startswith("secrets:"):  # SkyPilot's reference to a secret
                self.name_secret(binding, item.removeprefix("secrets:"), where)
                continue
            if isinstance(item, str):
                binding.secret = item
                self.aliases[f"{where}.secret"] = where
                continue
            self.guard(lambda b=binding, i=item, w=where: self.binding(b, i, w))

    def secret_map(self, task: TaskSpec, value: dict[Any, Any], at: str) -> None:
        """SkyPilot's table of secrets: `NAME: null` is the vault secret `name` (`HF_TOKEN` -> `hf-token`) in
        the variable NAME; `NAME: ""`, an empty secret, is the variable set empty; any other value written in
        the file is refused, as no secret is kept in a job spec."""
        for index, (name, item) in enumerate(value.items()):
            where = f"{at}[{_key(name)}]"
            self.aliases[f"{at}[{index}]"] = where
            variable = str(name).removeprefix("secrets:")
            if item == "" and _ENV_NAME.fullmatch(variable):
                # SkyPilot's empty secret holds nothing to keep: the variable is set, empty (a secret given
                # at launch, `tandem launch --secret NAME`, takes its place)
                if variable in task.envs:
                    self.found.append(FieldViolation(where, f"{variable} is also set in envs"))
                task.envs[variable] = ""
                self.aliases[f"{at.rsplit('.', 1)[0]}.envs[{_key(variable)}]"] = where
                continue
            if item is not None:
                self.found.append(
                    FieldViolation(
                        where,
                        "is a secret's value in the job file; Tandem opens secrets from the vault: store it "
                        f"there (tandem secrets put {_secret_id(variable)}) and write {variable}: null",
                    )
                )
                continue
            self.name_secret(task.secrets.add(), variable, where)

    def secret_file(self, task: TaskSpec, value: dict[Any, Any], at: str) -> None:
        if len(value) != 1:
            self.fail(at, "must be one {NAME: {mount_path: /path}} table")
        ((name, options),) = value.items()
        where = f"{at}[{_key(name)}]"
        doc = self.table(options, where, ("mount_path",))
        binding = task.secrets.add()
        self.name_secret(binding, str(name).removeprefix("secrets:"), where)
        if "mount_path" in doc:
            binding.file = self.text(doc["mount_path"], f"{where}.mount_path")
            self.aliases[f"{at.rsplit('.', 1)[0]}.secrets[{len(task.secrets) - 1}].file"] = (
                f"{where}.mount_path"
            )

    def name_secret(self, binding: js.SecretBinding, variable: str, at: str) -> None:
        if not _ENV_NAME.fullmatch(variable):
            self.found.append(FieldViolation(at, f"{variable!r} is not a variable name"))
            return
        binding.secret = _secret_id(variable)
        if secret_env_name(binding) != variable:
            binding.env = variable
        self.aliases[f"{at}.secret"] = at

    def binding(self, binding: js.SecretBinding, value: Any, at: str) -> None:
        doc = self.table(value, at, ("secret", "env"))
        if "secret" not in doc:
            self.fail(f"{at}.secret", "is required")
        binding.secret = self.text(doc["secret"], f"{at}.secret")
        if "env" in doc:
            binding.env = self.text(doc["env"], f"{at}.env")

    def mounts(self, task: TaskSpec, value: Any, at: str) -> None:
        doc = self.table(value, at, None)
        for index, (path, source) in enumerate(doc.items()):
            where = f"{at}[{_key(path)}]"
            proto = f"{at}[{index}]"
            mount = task.file_mounts.add()
            mount.path = str(path)
            if "$" in mount.path or (isinstance(source, str) and "$" in source):
                self.found.append(FieldViolation(where, f"{_unfilled(mount.path, source)} {_ENV_IN_MOUNT}"))
            if not mount.path.startswith("/") and not home_relative(mount.path):
                self.found.append(FieldViolation(where, _mount_path_problem(str(path))))
            self.aliases[f"{proto}.path"] = where
            self.aliases[proto] = where
            if isinstance(source, str):
                if "://" in source:  # SkyPilot: a bucket URI as the value is copied down (COPY)
                    self.aliases[f"{proto}.bucket"] = self.aliases[f"{proto}.bucket.url"] = where
                    self.guard(lambda m=mount, s=source, w=where: self.bucket_url(m, s, w))
                    mount.bucket.mode = js.Bucket.MODE_COPY
                    continue
                self.aliases[f"{proto}.local_path"] = where
                self.guard(lambda m=mount, s=source, w=where: setattr(m, "local_path", self.host_path(s, w)))
                continue
            self.guard(lambda m=mount, s=source, w=where, p=proto: self.mount(m, s, w, p))

    def mount(self, mount: js.FileMount, value: Any, at: str, proto: str) -> None:
        doc = self.table(
            value,
            at,
            ("volume", "source", "read_only", "name", "store", "mode", "persistent", "type", "config"),
            _SKY_MOUNT_KEYS,
        )
        source = doc.get("source")
        if isinstance(source, list) and not _bucket_name(doc):
            self.fail(f"{at}.name", "Storage name must be specified if the source is local.")
        if doc.keys() & {"name", "store", "mode", "persistent", "type", "config"} or (
            isinstance(source, str) and "://" in source
        ):
            self.aliases[f"{proto}.bucket"] = at
            self.aliases[f"{proto}.bucket.url"] = f"{at}.name" if _bucket_name(doc) else f"{at}.source"
            self.storage(mount, doc, at)
        elif ("volume" in doc) == ("source" in doc):
            self.fail(at, "set exactly one of volume and source")
        elif "volume" in doc:
            mount.volume = self.text(doc["volume"], f"{at}.volume")
        else:
            self.aliases[f"{proto}.local_path"] = f"{at}.source"
            mount.local_path = self.host_path(self.text(doc["source"], f"{at}.source"), f"{at}.source")
        if "read_only" in doc:
            mount.read_only = self.boolean(doc["read_only"], f"{at}.read_only")

    def storage(self, mount: js.FileMount, doc: dict[str, Any], at: str) -> None:
        """SkyPilot's storage mount: `source: s3://bucket/prefix`, or `name` (+ `store`) for a bucket of that
        name, created when missing; `mode` MOUNT (the default), COPY or MOUNT_CACHED."""
        if "volume" in doc:
            self.fail(f"{at}.volume", "is not taken with a bucket's keys (name, store, mode, persistent)")
        if "store" in doc:
            store = self.text(doc["store"], f"{at}.store")
            if store.lower() in _S3_COMPATIBLE:
                self.s3_endpoint(store.lower(), f"{at}.store")
            elif store.lower() != "s3":
                self.fail(f"{at}.store", f"{store!r}: {_BUCKET_SCHEMES}")
        self.bucket_source(mount, doc, at)
        if "mode" in doc:
            mount.bucket.mode = self.choice(doc["mode"], f"{at}.mode", _MODES)
        if "type" in doc or "config" in doc:
            self.guard(lambda: self.mount_tuning(mount, doc, at))
        if "persistent" in doc and not self.boolean(doc["persistent"], f"{at}.persistent"):
            if not mount.bucket.create:
                self.fail(
                    f"{at}.persistent",
                    "false deletes a bucket the job makes (`name`); a `source` bucket is someone's own and kept",
                )
            mount.bucket.delete_at_end = True

    def bucket_source(self, mount: js.FileMount, doc: dict[str, Any], at: str) -> None:
        """The bucket's URL: `name` (created when missing, filled from a local `source`) or a `source` URI."""
        source = doc.get("source")
        if _bucket_name(doc):  # SkyPilot's `name: null` or `name: ""` is no name
            name = self.text(doc["name"], f"{at}.name")
            if source is not None and "://" in str(source):
                self.fail(f"{at}.name", "a bucket is named by either `name` or a `source` URI, not both")
            self.bucket_url(mount, f"s3://{name}", f"{at}.name")
            mount.bucket.create = True
            if source is not None:
                self.upload(mount.bucket.url, source, f"{at}.source")
        elif source is None:  # SkyPilot's own refusals, as its storage check words them
            copy = str(doc.get("mode", "")).upper() == "COPY"
            self.fail(
                at,
                "New storage object: source must be specified when using COPY mode."
                if copy
                else "Storage source or storage name must be specified.",
            )
        elif isinstance(source, list) or "://" not in self.text(source, f"{at}.source"):
            self.fail(f"{at}.name", "Storage name must be specified if the source is local.")
        else:
            self.bucket_url(mount, self.text(source, f"{at}.source"), f"{at}.source")

    def mount_tuning(self, mount: js.FileMount, doc: dict[str, Any], at: str) -> None:
        """SkyPilot's `type` (MOUNT_CACHED presets) and `config` (`mount` / `mount_cached` settings): what is
        read-only is honoured; the rest tunes rclone's cache or a cloud volume, which have no counterpart here.
        Each only with its mode, as SkyPilot checks."""
        mode = mount.bucket.mode or js.Bucket.MODE_MOUNT
        if "type" in doc:
            if mode != js.Bucket.MODE_MOUNT_CACHED:
                self.fail(f"{at}.type", "can only be given with mode MOUNT_CACHED (SkyPilot's rule)")
            if self.choice(doc["type"], f"{at}.type", _MOUNT_TYPES):
                mount.read_only = True
        if "config" not in doc:
            return
        config = self.table(doc["config"], f"{at}.config", ("mount", "mount_cached"), _SKY_MOUNT_CONFIG_KEYS)
        for key, wanted in (("mount", js.Bucket.MODE_MOUNT), ("mount_cached", js.Bucket.MODE_MOUNT_CACHED)):
            if key not in config:
                continue
            where = f"{at}.config.{key}"
            if mode != wanted:
                self.fail(where, f"can only be given with mode {key.upper()} (SkyPilot's rule)")
            settings = (
                self.table(config[key], where, ("read_only",), _HF_MOUNT)
                if key == "mount"
                else self.table(config[key], where, None)
            )
            if key == "mount_cached":
                for name in [n for n in settings if n != "read_only"]:
                    self.found.append(FieldViolation(f"{where}.{name}", _RCLONE))
            if "read_only" in settings and self.boolean(settings["read_only"], f"{where}.read_only"):
                mount.read_only = True

    def host_path(self, text: str, at: str) -> str:
        """A host path mount's source: absolute, or (in a job file on disk) relative to the current directory
        or `~`, as `sky launch` reads it."""
        path = Path(text).expanduser() if self.base_dir is not None else Path(text)
        if path.is_absolute():
            return posixpath.normpath(str(path))
        if self.base_dir is None:
            self.fail(
                at, "the local path must be absolute (a relative one is read only from a job file on disk)"
            )
        return posixpath.normpath(str(Path.cwd() / path))

    def upload(self, url: str, source: Any, at: str) -> None:
        """SkyPilot's local `source` of a named bucket: uploaded into it at launch, by the submitting client
        (a folder's files at the bucket's root; each of a list under its own name), then mounted."""
        if self.uploads is None:
            self.fail(
                at,
                "is a local folder, uploaded into the bucket by the client that submits the job: submit the "
                "file with `tandem launch`, which uploads it first",
            )
        items = source if isinstance(source, list) else [source]
        if not items:
            self.fail(at, "names no local folder")
        paths: list[str] = []
        for index, item in enumerate(items):
            where = f"{at}[{index}]" if isinstance(source, list) else at
            text = self.text(item, where)
            if "://" in text:
                self.fail(where, "a bucket is filled from local folders only; copy between buckets first")
            path = Path(text).expanduser()
            path = path if path.is_absolute() else Path.cwd() / path  # as `sky launch` reads it
            if not path.exists():
                self.fail(where, f"{text!r} is not a local file or folder")
            paths.append(posixpath.normpath(str(path)))
        endpoint_url, region = s3_location(self.task_envs)
        self.uploads.append(BucketUpload(url, tuple(paths), isinstance(source, list), endpoint_url, region))

    def bucket_url(self, mount: js.FileMount, url: str, at: str) -> None:
        scheme, _, rest = url.partition("://")
        if scheme.lower() in _S3_COMPATIBLE:
            self.s3_endpoint(scheme.lower(), at)
        elif scheme.lower() != "s3":
            self.fail(at, f"{scheme}://: {_BUCKET_SCHEMES}")
        bucket = rest.split("/", 1)[0]
        if not _BUCKET_NAME.fullmatch(bucket):
            self.fail(at, f"{bucket!r} is not an S3 bucket name (3 to 63 of a-z, 0-9, '.' and '-')")
        mount.bucket.url = f"s3://{rest.rstrip('/')}"

    def s3_endpoint(self, store: str, at: str) -> None:
        """SkyPilot's `r2://` and `minio://` (or `store: r2` / `minio`): S3 at the user's own endpoint, which
        the task's envs must name, as for any S3-compatible store here; refused, saying so, where they do not."""
        if not s3_location(self.task_envs)[0]:
            self.fail(
                at,
                f"{store}:// is {_S3_COMPATIBLE[store]}, an S3-compatible store: SkyPilot's client reads its "
                "endpoint from its own settings; here the task names it in envs as AWS_ENDPOINT_URL (its "
                "credentials as the secrets AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)",
            )

    def workdir(self, task: TaskSpec, value: Any, at: str) -> None:
        """SkyPilot's `workdir`: a folder (relative to the current directory, as `sky launch` reads it, when
        the file is loaded from disk) or a git repository `{url, ref}`."""
        if isinstance(value, dict):
            doc = self.table(value, at, ("url", "ref"))
            if "url" not in doc:
                self.fail(f"{at}.url", "is required: the repository to clone")
            task.workdir.git_url = self.text(doc["url"], f"{at}.url")
            self.aliases[f"{at}.git_url"] = f"{at}.url"
            self.aliases[f"{at}.git_ref"] = f"{at}.ref"
            if "ref" in doc:
                task.workdir.git_ref = self.text(doc["ref"], f"{at}.ref")
            return
        text = self.text(value, at)
        self.aliases[f"{at}.path"] = at
        if "$" in text:
            self.fail(at, f"{_unfilled(text)} is none of the task's envs; SkyPilot fills only those in")
        folder = Path(text).expanduser()
        if not folder.is_absolute():
            if self.base_dir is None:
                self.fail(
                    at, "a relative workdir is read only from a job file on disk; write an absolute path"
                )
            folder = Path.cwd() / folder
        if self.base_dir is not None and not folder.is_dir():
            self.fail(at, f"{text!r} is not a folder")
        task.workdir.path = posixpath.normpath(str(folder))

    def online_rl(self, options: js.OnlineRlOptions, value: Any, at: str) -> None:
        doc = self.table(value, at, ("config", "config_file", "config_path", "placement"))
        options.SetInParent()
        given = [k for k in ("config", "config_file", "config_path") if k in doc]
        if len(given) > 1:
            self.fail(at, f"set one of config, config_file and config_path, not {' and '.join(given)}")
        self.aliases[f"{at}.config_toml"] = f"{at}.config"
        if "config" in doc:
            options.config_toml = self.text(doc["config"], f"{at}.config")
        elif "config_file" in doc:
            options.config_toml = self.config_file(doc["config_file"], f"{at}.config_file")
            self.aliases[f"{at}.config_toml"] = f"{at}.config_file"
        elif "config_path" in doc:
            options.config_path = self.text(doc["config_path"], f"{at}.config_path")
        if "placement" in doc:
            placement = self.table(
                doc["placement"],
                f"{at}.placement",
                ("inference_gpus", "tensor_parallel_size", "reference_placement"),
            )
            options.placement.SetInParent()
            for key in ("inference_gpus", "tensor_parallel_size"):
                if key in placement:
                    setattr(
                        options.placement,
                        key,
                        self.integer(placement[key], f"{at}.placement.{key}", 0, 2**32 - 1),
                    )
            if "reference_placement" in placement:
                options.placement.reference_placement = self.choice(
                    placement["reference_placement"], f"{at}.placement.reference_placement", _REFERENCES
                )

    def config_file(self, value: Any, at: str) -> str:
        name = self.text(value, at)
        if self.base_dir is None:
            self.fail(at, "is read only from a job file on disk; inline the TOML as `config` instead")
        path = self.base_dir / name
        try:
            return path.read_text()
        except OSError as exc:
            self.fail(at, f"cannot read {name}: {exc.strerror}")

    def service(self, options: js.ServiceOptions, value: Any, at: str) -> None:
        doc = self.table(
            value, at, ("port", "health_path", "readiness_timeout", "register_task_app"), _SKY_SERVICE_KEYS
        )
        options.SetInParent()
        if "port" in doc:
            options.port = self.integer(doc["port"], f"{at}.port", 0, 2**32 - 1)
        if "health_path" in doc:
            options.health_path = self.text(doc["health_path"], f"{at}.health_path")
        if "readiness_timeout" in doc:
            options.readiness_timeout.CopyFrom(
                self.duration(doc["readiness_timeout"], f"{at}.readiness_timeout")
            )
        if "register_task_app" in doc:
            register = self.table(
                doc["register_task_app"], f"{at}.register_task_app", ("app_id", "api_key_secret")
            )
            options.register_task_app.SetInParent()
            for key, item in register.items():
                setattr(options.register_task_app, key, self.text(item, f"{at}.register_task_app.{key}"))

    # -- values

    def table(
        self, value: Any, at: str, keys: Iterable[str] | None, refused: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """A mapping's known keys; each other key is a violation: a key in `refused` (SkyPilot's that mean
        nothing here, or not yet) with its reason, a typo with the nearest known key."""
        if not isinstance(value, dict):
            self.fail(at or "(document)", "must be a table of keys")
        out: dict[str, Any] = {}
        allowed = None if keys is None else tuple(keys)
        for key, item in value.items():
            if not isinstance(key, str):
                self.found.append(FieldViolation(_join(at, str(key)), "keys must be strings"))
            elif allowed is not None and key not in allowed:
                self.found.append(FieldViolation(_join(at, key), _unknown(key, allowed, refused or {})))
            else:
                out[key] = item
        return out

    def text(self, value: Any, at: str) -> str:
        if not isinstance(value, str):
            self.fail(at, f"must be a string, not {_type(value)}")
        return value

    def scalar_text(self, value: Any, at: str) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str | int | float):
            return str(value)
        self.fail(at, f"must be a string or a number, not {_type(value)}")

    def integer(self, value: Any, at: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(at, f"must be an integer, not {_type(value)}")
        if not low <= value <= high:
            self.fail(at, f"{value} is out of range")
        return value

    def number(self, value: Any, at: str, *, plus: bool = False) -> float:
        if isinstance(value, str):
            if plus and value.strip().endswith("+"):  # SkyPilot's "at least": what a request is here
                value = value.strip()[:-1]
            try:
                value = float(value)
            except ValueError:
                self.fail(at, f"{value!r} is not a number")
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(at, f"must be a number, not {_type(value)}")
        return float(value)

    def boolean(self, value: Any, at: str) -> bool:
        if not isinstance(value, bool):
            self.fail(at, f"must be true or false, not {_type(value)}")
        return value

    def choice(self, value: Any, at: str, choices: Mapping[str, int]) -> Any:
        if not isinstance(value, str) or value.lower() not in choices:
            self.fail(at, f"must be one of {', '.join(choices)}, not {value!r}")
        return choices[value.lower()]

    def duration(self, value: Any, at: str) -> duration_pb2.Duration:
        total: float
        if isinstance(value, bool):
            self.fail(at, "must be a duration such as 10s, 5m or 1h30m")
        if isinstance(value, int | float):
            total = float(value)
        elif isinstance(value, str) and re.fullmatch(rf"(?:{_DURATION_PART.pattern})+", value.strip()):
            total = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(value.strip()))
        else:
            self.fail(at, f"{value!r} is not a duration such as 10s, 5m or 1h30m")
        if not math.isfinite(total) or total < 0 or total > 10 * 365 * 86400:
            self.fail(at, f"{value!r} is out of range")
        out = duration_pb2.Duration()
        out.seconds = int(total)
        out.nanos = round((total - int(total)) * 1e9)
        return out

    def memory(self, value: Any, at: str, *, plus: bool = False) -> float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if plus and isinstance(value, str) and value.strip().endswith("+"):  # SkyPilot's "at least"
            value = value.strip()[:-1]
        match = _MEMORY.fullmatch(value.strip()) if isinstance(value, str) else None
        if match is None or match[2].lower() not in _MEMORY_UNITS:
            self.fail(at, f"{value!r} is not an amount of memory such as 64Gi, 32GB or 512Mi")
        return float(match[1]) * _MEMORY_UNITS[match[2].lower()]


def home_relative(path: str) -> str | None:
    """The part of a mount path under the task's own home (`~/data` -> `data`), None for any other path."""
    return path[2:].rstrip("/") if path.startswith("~/") else None


def _mount_path_problem(path: str) -> str:
    if path.rstrip("/") == "~" or home_relative(path) == "":
        return "is the task's home itself; mount a folder under it (~/PATH) or at an absolute path"
    if path.startswith("~"):
        return (
            f"{path.split('/', 1)[0]} is another user's home; a mount goes under the task's own home (~/PATH) "
            "or at an absolute path"
        )
    return "the path inside the task must be absolute, or ~/PATH under the task's home"


def _bucket_name(doc: Mapping[str, Any]) -> bool:
    """Whether a storage mount names its bucket: SkyPilot reads `name: null` and `name: ""` as no name."""
    return doc.get("name") not in (None, "")


def _fill_envs(value: Any, envs: Mapping[str, str]) -> Any:
    """SkyPilot's substitution: each `$NAME` / `${NAME}` in the strings (keys too) of a YAML value becomes the
    task's env NAME; a name the task does not have stays as written."""
    if isinstance(value, str):
        return _ENV_REFERENCE.sub(lambda m: envs.get(m.group(1), m.group(0)), value)
    if isinstance(value, dict):
        return {_fill_envs(k, envs): _fill_envs(v, envs) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_envs(item, envs) for item in value]
    return value


def _key(key: object) -> str:
    """A map key in a field path, quoted as JSON: `envs["HF_HOME"]`, `file_mounts["/ckpt"]`."""
    return json.dumps(str(key))


def _unknown(key: str, known: Sequence[str], refused: Mapping[str, str]) -> str:
    if key in refused:
        return refused[key]
    near = difflib.get_close_matches(key, [*known, *refused], n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    return f"is not a known key; {hint}(known: {', '.join(known)})"


def _index(at: str) -> int:
    """The task index of a path under `tasks[i]`."""
    match = re.match(r"tasks\[([0-9]+)\]", at)
    return int(match[1]) if match else 0


def _join(at: str, key: str) -> str:
    return f"{at}.{key}" if at else key


def _type(value: Any) -> str:
    return {dict: "a table", list: "a list", type(None): "nothing"}.get(type(value), type(value).__name__)
