"""An online-RL job from a trainer config: validate it as the contract's `TrainerConfig` and wrap it in a
one-task ONLINE_RL job group for the scheduler.

The config is validated by `tandem_jobs.config.parse_job` (the trainer's own parser, torch-free), so a config
the gateway accepts is exactly one the trainer accepts. A typed config (CreateRlJob) is written out as
TOML and parsed back the same way, so both paths check the same rules and the scheduler always receives
TOML (`OnlineRlOptions.config_toml`).
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format
from tandem.scheduler.v1 import job_spec_pb2 as js
from tandem.taskapp.v1 import task_app_pb2
from tandem.trainer.v1 import config_pb2

from mesh.errors import FailedPrecondition, FieldViolation, InvalidArgument, NotFound, R
from tandem_jobs.config import parse_job

TASK_NAME = "trainer"
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_REFERENCE = {
    config_pb2.REFERENCE_PLACEMENT_NONE: js.PlacementOptions.REFERENCE_PLACEMENT_NONE,
    config_pb2.REFERENCE_PLACEMENT_STACKED: js.PlacementOptions.REFERENCE_PLACEMENT_STACKED,
    config_pb2.REFERENCE_PLACEMENT_OWN: js.PlacementOptions.REFERENCE_PLACEMENT_OWN,
}


def _invalid_config(message: str, found: Sequence[FieldViolation]) -> InvalidArgument:
    return InvalidArgument(message, reason=R.ERROR_REASON_INVALID_CONFIG, violations=list(found))


def parse_toml(text: str, field: str) -> config_pb2.TrainerConfig:
    """TOML text -> a validated TrainerConfig; INVALID_CONFIG naming each bad field under `field`."""
    try:
        document = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:  # or nested past the parser's depth
        why = str(exc) if isinstance(exc, tomllib.TOMLDecodeError) else "it is nested too deeply"
        raise _invalid_config(
            f"{field} is not valid TOML: {why}", [FieldViolation(field, f"is not valid TOML: {why}")]
        ) from None
    try:
        return parse_job(document)
    except InvalidArgument as error:
        found = [FieldViolation(f"{field}.{v.field}", v.description) for v in error.violations]
        raise _invalid_config(error.message, found or [FieldViolation(field, error.message)]) from None


def to_toml(config: config_pb2.TrainerConfig) -> str:
    """The config as TOML in the trainer's schema (proto field names, enums by name)."""
    document = json_format.MessageToDict(config, preserving_proto_field_name=True)
    return _dump(document)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_scalar(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _dump(table: Mapping[str, Any], path: tuple[str, ...] = ()) -> str:
    lines: list[str] = []
    nested: list[tuple[str, Mapping[str, Any]]] = []
    for key, value in table.items():
        if isinstance(value, Mapping) and value:
            nested.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_scalar(value)}")
    out = "\n".join(lines)
    for key, value in nested:
        header = ".".join(_key(part) for part in (*path, key))
        out += f"\n\n[{header}]\n" + _dump(value, (*path, key))
    return out.strip("\n") + "\n"


def task_app_of(config: config_pb2.TrainerConfig) -> str:
    """The registered Task App the config names, `orgs/{org}/taskApps/{app}`; empty for a bare base_url."""
    return config.task_app.name


_APP_ID = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


def bare_app_id(job_id: str, token: str) -> str:
    """The id a config's bare `base_url` app is registered under: `job-{job_id}`, or `job-{token}` when the
    job has no id (yet) or that would not be a valid app id."""
    wanted = f"job-{job_id}"
    return wanted if job_id and _APP_ID.fullmatch(wanted) else f"job-{token}"


def naming(config: config_pb2.TrainerConfig, app: str) -> config_pb2.TrainerConfig:
    """`config` with its Task App given by the registered name `app` instead of `base_url` + `secret_name`
    (the registration holds both)."""
    named = config_pb2.TrainerConfig()
    named.CopyFrom(config)
    named.task_app.ClearField("base_url")
    named.task_app.ClearField("secret_name")
    named.task_app.name = app
    return named


def check_task_app(org: str, app: str) -> None:
    """A config may name only its own organization's apps; another's answers exactly as a missing one of
    its own does (NOT_FOUND / TASK_APP_NOT_FOUND, the proxy's words), whether it exists or not."""
    if app and app.split("/")[1] != org:
        raise NotFound(f"{app} not found", reason=R.ERROR_REASON_TASK_APP_NOT_FOUND)


def refuse_failed_checks(app: str, field: str, checks: Sequence[task_app_pb2.CheckResult]) -> None:
    failed = [c for c in checks if not c.passed]
    if not failed:
        return
    names = ", ".join(f"{c.check} ({c.detail})" if c.detail else c.check for c in failed)
    raise FailedPrecondition(
        f"{app} failed its checks: {names}",
        reason=R.ERROR_REASON_TASK_APP_CHECK_FAILED,
        metadata={"task_app": app, "failed_checks": ",".join(c.check for c in failed)},
        violations=[FieldViolation(field, f"check {c.check} failed: {c.detail}") for c in failed],
    )


def job_spec(
    config: config_pb2.TrainerConfig,
    config_toml: str,
    *,
    display_name: str = "",
    backend: int = 0,
    priority: int = 0,
    recovery: js.RecoveryPolicy | None = None,
    max_duration: Any = None,
    file_mounts: Sequence[js.FileMount] = (),
    secrets: Sequence[js.SecretBinding] = (),
) -> js.JobSpec:
    """A one-task ONLINE_RL job group: the trainer task with the config's GPUs and placement."""
    topology = config.topology
    task = js.TaskSpec(
        name=TASK_NAME,
        kind=js.TaskSpec.KIND_ONLINE_RL,
        role=js.TaskSpec.ROLE_PRIMARY,
        file_mounts=list(file_mounts),
        secrets=list(secrets),
        online_rl=js.OnlineRlOptions(config_toml=config_toml),
    )
    if topology.gpus:
        task.resources.gpus = str(topology.gpus)
    placement = task.online_rl.placement
    if topology.HasField("inference_gpus"):
        placement.inference_gpus = topology.inference_gpus
    if topology.HasField("tensor_parallel_size"):
        placement.tensor_parallel_size = topology.tensor_parallel_size
    placement.reference_placement = _REFERENCE.get(
        topology.reference_placement, js.PlacementOptions.REFERENCE_PLACEMENT_UNSPECIFIED
    )
    if not task.online_rl.placement.ListFields():
        task.online_rl.ClearField("placement")
    spec = js.JobSpec(
        display_name=display_name or "online-rl",
        execution=js.JobSpec.EXECUTION_PARALLEL,
        priority=priority,
        backend=backend,  # type: ignore[arg-type]
        tasks=[task],
    )
    if recovery is not None:
        spec.recovery.CopyFrom(recovery)
    if max_duration is not None:
        spec.max_duration.CopyFrom(max_duration)
    return spec
