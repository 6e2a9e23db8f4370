"""A checked task -> what a backend runs: the shell script (`LaunchSpec.command`) and the task's environment.

Pure functions over a `TaskSpec` that passed `spec.check_spec`; nothing here touches the disk or a backend.

The script a backend runs on every node of an attempt (with `bash -euo pipefail`):

- `command` tasks: `setup`, then `run`, each in a `bash` of its own, as SkyPilot runs them (a `cd` or an
  `export` in `setup` does not reach `run`). A failing `setup` exits with `SETUP_FAILED_EXIT`, which the
  engine classifies as a PRECHECK failure (never recovered); any other exit is `run`'s.
- `service` tasks: the same, with `TANDEM_SERVICE_PORT` exported as the spec's port, so `run` can say
  `--port "$TANDEM_SERVICE_PORT"`; the engine probes that port (and `health_path`) for readiness.
- `online_rl` tasks: `setup`, then the trainer launch, `python -m trainer --config FILE --output DIR
  --gpus N [--inference-gpus K] [--tensor-parallel-size T] [--reference none|stacked|own]` (flags of
  `trainer/launch.py`). FILE is the config: the engine writes an inline `config_toml` into the attempt's
  folder and passes that path; a `config_path` is used as it is. DIR is the task's output folder, the same
  on every attempt, so a restarted trainer resumes from the newest complete checkpoint under
  `DIR/checkpoints` (the trainer does that by itself). `output_dir_for` picks it: the task's first
  read-write volume mount when it has one (checkpoints on shared storage that other tasks mount, as the
  eval-watcher example does), else the folder the engine keeps for the task. When the spec sets `run`, it
  replaces the launch; `TANDEM_TRAINER_CONFIG`, `TANDEM_TRAINER_OUTPUT` and `TANDEM_TRAINER_ARGS` (the
  placement flags) are exported for it.

The environment the engine provides (`task_env`, plus `node_env` per node rank, which backends add):

| variable | value |
|---|---|
| `TANDEM_JOB` | the job's name, `orgs/{org}/jobs/{job}` |
| `TANDEM_TASK` | the task's name |
| `TANDEM_TASK_DISPLAY_NAME` | the task's name as written (`My_Task`), where not `TANDEM_TASK`; a host name too |
| `TANDEM_NUM_NODES`, `SKYPILOT_NUM_NODES` | the task's node count |
| `TANDEM_NODE_RANK`, `SKYPILOT_NODE_RANK`, `SKYPILOT_SETUP_NODE_RANK` | this node's rank, 0 first (`node_env`) |
| `TANDEM_NODE_IPS`, `SKYPILOT_NODE_IPS`, `SKYPILOT_SETUP_NODE_IPS` | the nodes' addresses, one a line, rank 0 first |
| `SKYPILOT_NUM_GPUS_PER_NODE`, `SKYPILOT_SETUP_NUM_GPUS_PER_NODE` | the GPUs each node of the task holds, `0` without |
| `SKYPILOT_TASK_ID` | `{org}_{job}-{index}`, `index` the task's place in the group; the same on every attempt |
| `SKYPILOT_TASK_IDS` | every task's `SKYPILOT_TASK_ID`, one a line, in the group's order |
| `SKYPILOT_JOBGROUP_NAME` | the job's id (`{job}`), the domain of the group's host names (`group_hosts`) |
| `SKYPILOT_CLUSTER_INFO` | SkyPilot's JSON: `cluster_name` the job's id, `cloud` the backend, `region` / `zone` null |
| `SKYPILOT_USER` | who submitted the job (its `creator`), when known |
| `SKYPILOT_USER_ID` | `user_id` of it: 8 hex digits, the same for every job of that submitter |
| `SKYPILOT_MANAGED_JOB_ID` | the job's id (`{job}`) |
| `SKYPILOT_ROOT_JOB_ID` | the job's id, in a group of more than one task run in parallel (SkyPilot's job tree) |
| `TANDEM_RESTART_COUNT` | the attempt number, 0 on the first start |
| `TANDEM_RESUME_FROM` | the newest complete checkpoint folder of the task's output, when there is one |
| `TANDEM_JOB_TOKEN` | the task's short-lived job token (opens its secrets, publishes events) |

and the spec's `envs`; `secrets` are injected at run time from the vault (`secret_env`), never written
into the environment a backend stores.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import shlex
from collections.abc import Callable, Sequence

from tandem.scheduler.v1 import job_spec_pb2 as js

from services.scheduler.backends.base import IPS_VARIABLES, POD_HOME, RANK_VARIABLES
from services.scheduler.backends.task_buckets import BucketMount
from services.scheduler.backends.task_workdir import IGNORE_FILES
from services.scheduler.spec import home_relative, port_range, secret_env_name, trainer_config

SETUP_FAILED_EXIT = 223  # `setup` failed: a PRECHECK failure, never recovered
USER_ID_LENGTH = 8  # SkyPilot's USER_HASH_LENGTH
_REFERENCES = {
    js.PlacementOptions.REFERENCE_PLACEMENT_NONE: "none",
    js.PlacementOptions.REFERENCE_PLACEMENT_STACKED: "stacked",
    js.PlacementOptions.REFERENCE_PLACEMENT_OWN: "own",
}


def command_for(
    task: js.TaskSpec,
    *,
    job: str,
    gpus_granted: int,
    config_file: str = "",
    output_dir: str = "",
    python: str = "python",
) -> str:
    """The script every node of `task` runs. `gpus_granted` is the GPUs this node holds for the task;
    `config_file` and `output_dir` are required for online_rl tasks (see the module docstring); `python` is
    the interpreter that runs the trainer."""
    lines = [
        f"# tandem: job {job}, task {task.name}",
        *workdir_lines(task, python=python),
        *secret_file_lines(task),
    ]
    if task.setup.strip():
        lines.append(f"bash -c {shlex.quote(task.setup)} || exit {SETUP_FAILED_EXIT}")
    if task.kind == js.TaskSpec.KIND_ONLINE_RL:
        config = task.online_rl.config_path or config_file
        if not config or not output_dir:
            raise ValueError("an online_rl task needs config_file (unless it has config_path) and output_dir")
        args = trainer_args(task, gpus_granted=gpus_granted)
        if task.run.strip():
            lines.append(f"export TANDEM_TRAINER_CONFIG={shlex.quote(config)}")
            lines.append(f"export TANDEM_TRAINER_OUTPUT={shlex.quote(output_dir)}")
            lines.append(f"export TANDEM_TRAINER_ARGS={shlex.quote(shlex.join(args))}")
        else:
            launch = [python, "-m", "trainer", "--config", config, "--output", output_dir, *args]
            lines.append(f"exec {shlex.join(launch)}")
            return "\n".join(lines) + "\n"
    elif task.kind == js.TaskSpec.KIND_SERVICE:
        lines.append(f"export TANDEM_SERVICE_PORT={task.service.port}")
    lines.append(f"exec bash -c {shlex.quote(task.run)}")
    return "\n".join(lines) + "\n"


def secret_file_lines(task: js.TaskSpec) -> list[str]:
    """SkyPilot's managed secrets with a `mount_path`: each value, already in its variable (the secrets
    wrapper put it there), also written to its file, 0600 in a folder made 0700. The value stays out of every
    command line: `printf` is bash's own."""
    lines: list[str] = []
    for binding in task.secrets:
        if not binding.file:
            continue
        path = shlex.quote(binding.file)
        folder = shlex.quote(posixpath.dirname(binding.file) or "/")
        variable = secret_env_name(binding)
        failed = shlex.quote(f"[tandem] cannot write the secret {binding.secret} to {binding.file}")
        lines.append(
            f"(umask 077 && mkdir -p {folder} && printf '%s' \"${{{variable}}}\" > {path}) "
            f"|| {{ echo {failed} >&2; exit {SETUP_FAILED_EXIT}; }}"
        )
    return lines


GIT_TOKEN_ENV = "GIT_TOKEN"  # noqa: S105 - the variable's name; SkyPilot's secret for a private HTTPS git workdir
GIT_SSH_KEY_ENV = "GIT_SSH_KEY"  # the secret with a private key's text, for an SSH one
GIT_KEY_FILE = ".git/tandem-ssh-key"  # GIT_SSH_KEY for the fetch, removed after it


def git_credentials(task: js.TaskSpec) -> list[str]:
    """With the task's secret GIT_TOKEN, git's options that answer an HTTPS server's request for credentials
    with it (as the password; the helper's own shell reads the variable, so the token is on no command line).
    None without it: git then fails at once rather than prompting (GIT_TERMINAL_PROMPT=0)."""
    if GIT_TOKEN_ENV not in {secret_env_name(b) for b in task.secrets}:
        return []
    helper = f'!f() {{ echo username=x-access-token; echo "password=${{{GIT_TOKEN_ENV}}}"; }}; f'
    return ["-c", "credential.helper=", "-c", f"credential.helper={helper}"]


def git_fetch(task: js.TaskSpec, fetch: list[str]) -> str:
    """The fetch as a shell command: never prompting, and with the task's secret GIT_SSH_KEY written to a
    private file of the new repository for ssh to use alone (as SkyPilot's git_clone.sh does), removed after."""
    command = f"GIT_TERMINAL_PROMPT=0 {shlex.join(fetch)}"
    if GIT_SSH_KEY_ENV not in {secret_env_name(b) for b in task.secrets}:
        return command
    ssh = f"ssh -i {GIT_KEY_FILE} -o IdentitiesOnly=yes -o StrictHostKeyChecking=accept-new"
    return (
        f"(umask 077 && printf '%s\\n' \"${{{GIT_SSH_KEY_ENV}}}\" > {GIT_KEY_FILE})"
        f" && {{ GIT_SSH_COMMAND={shlex.quote(ssh)} {command}; fetched=$?; rm -f {GIT_KEY_FILE}; "
        '[ "$fetched" = 0 ]; }'
    )


def workdir_lines(task: js.TaskSpec, *, python: str = "python") -> list[str]:
    """SkyPilot's `workdir`, filled into the working directory the script starts in (the task's folder):
    a folder's contents copied over what an earlier attempt left, without what its `.skyignore` (else
    `.gitignore`) names (backends/task_workdir.py, run with `python`, where the folder has either file), or a
    repository fetched and checked out. Either failing exits with SETUP_FAILED_EXIT, a PRECHECK failure."""
    which = task.workdir.WhichOneof("source") if task.HasField("workdir") else None
    if which == "path":
        folder = task.workdir.path.rstrip("/") or "/"
        source = shlex.quote(folder + "/.")
        rules = " || ".join(f"[ -f {shlex.quote(f'{folder}/{name}')} ]" for name in IGNORE_FILES)
        helper = shlex.join([python, "-m", "services.scheduler.backends.task_workdir", folder, "."])
        fill = f"if {rules}; then {helper}; else cp -R -p -- {source} .; fi"
        what = task.workdir.path
    elif which == "git_url":
        url, ref = task.workdir.git_url, task.workdir.git_ref
        fetch = [
            "git",
            *git_credentials(task),
            "fetch",
            "-q",
            "--depth",
            "1",
            "--",
            url,
            *([ref] if ref else []),
        ]
        fill = (
            f"git init -q . && {git_fetch(task, fetch)}"
            " && git -c advice.detachedHead=false checkout -q -f FETCH_HEAD"
        )
        what = f"{url} at {ref}" if ref else url
    else:
        return []
    failed = shlex.quote(f"[tandem] cannot fill the workdir from {what}")
    return [f"{{ {fill}; }} || {{ echo {failed} >&2; exit {SETUP_FAILED_EXIT}; }}"]


def trainer_args(task: js.TaskSpec, *, gpus_granted: int) -> list[str]:
    """The placement flags of the trainer launch: the granted GPUs and the spec's split, where it sets one."""
    placement = task.online_rl.placement
    args = ["--gpus", str(gpus_granted)]
    if placement.inference_gpus:
        args += ["--inference-gpus", str(placement.inference_gpus)]
    if placement.tensor_parallel_size:
        args += ["--tensor-parallel-size", str(placement.tensor_parallel_size)]
    if placement.reference_placement in _REFERENCES:
        args += ["--reference", _REFERENCES[placement.reference_placement]]
    return args


def output_dir_for(task: js.TaskSpec, default: str) -> str:
    """Where an online_rl task's trainer writes checkpoints: its first read-write volume mount, else
    `default` (a folder the engine keeps for the task across attempts)."""
    for mount in task.file_mounts:
        if mount.WhichOneof("source") == "volume" and not mount.read_only:
            return mount.path
    return default


def task_env(
    task: js.TaskSpec,
    *,
    job: str,
    attempt: int,
    node_ips: Sequence[str] = (),
    resume_from: str = "",
    job_token: str = "",
    gpus_per_node: int = 0,
    task_index: int = 0,
    group_size: int = 1,
    backend: str = "",
    user: str = "",
    serial: bool = False,
) -> dict[str, str]:
    """The environment of every node of one attempt: the spec's `envs`, then the scheduler's variables
    (which win; the spec cannot set them anyway). `task_index` is the task's place among the group's
    `group_size` tasks (`serial`: a pipeline's). `user` is who submitted the job (its `creator`). Per-node
    variables come from `node_env`."""
    nodes = str(max(task.num_nodes, 1))
    group = group_name(job)
    env = dict(task.envs)
    env.update(
        {
            "TANDEM_JOB": job,
            "TANDEM_TASK": task.name,
            "TANDEM_NUM_NODES": nodes,
            "SKYPILOT_NUM_NODES": nodes,
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus_per_node),
            "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": str(gpus_per_node),
            "SKYPILOT_TASK_ID": task_id(job, task_index),
            "SKYPILOT_TASK_IDS": "\n".join(task_id(job, index) for index in range(max(group_size, 1))),
            "SKYPILOT_JOBGROUP_NAME": group,
            "SKYPILOT_CLUSTER_INFO": json.dumps(
                {"cluster_name": group, "cloud": backend, "region": None, "zone": None}
            ),
            "TANDEM_RESTART_COUNT": str(attempt),
            "TANDEM_RESUME_FROM": resume_from,
            "TANDEM_JOB_TOKEN": job_token,
            "SKYPILOT_MANAGED_JOB_ID": group,
        }
    )
    if task.display_name:
        env["TANDEM_TASK_DISPLAY_NAME"] = task.display_name
    if group_size > 1 and not serial:  # SkyPilot's rule: a job group's tasks are a job tree, rooted at it
        env["SKYPILOT_ROOT_JOB_ID"] = group
    if user:
        env.update(SKYPILOT_USER=user, SKYPILOT_USER_ID=user_id(user))
    if node_ips:
        env.update(ips_env(node_ips))
    if task.resources.ports:
        env["TANDEM_PORTS"] = ",".join(task.resources.ports)
    return env


_PORT_CHECK = """\
import socket, sys
for port in map(int, sys.argv[1:]):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            sys.exit(f"[tandem] port {port} (resources.ports) is in use on {socket.gethostname()}")
"""


def port_check(task: js.TaskSpec, *, python: str) -> str:
    """For a backend whose tasks share the node's network (local, Slurm): a first line that exits with
    SETUP_FAILED_EXIT (PRECHECK) when one of the task's `ports` is taken on the node it landed on."""
    ports = [str(p) for text in task.resources.ports for p in port_range(text)]
    return f"{shlex.join([python, '-c', _PORT_CHECK, *ports])} || exit {SETUP_FAILED_EXIT}\n"


def in_container(
    task: js.TaskSpec,
    command: str,
    *,
    image: str,
    env_names: Sequence[str],
    folders: Sequence[str],
    python: str = "python",
) -> str:
    """The local backend's run of `command` in the task's image, through the docker or podman CLI the
    backend chose (`$TANDEM_CONTAINER_RUNTIME`), started by `backends/task_image.py`, which first pulls the
    image within the scheduler's bound (logging in with the task's registry secrets) and fails the task as a
    PRECHECK failure when it cannot: the node's network (so `ports` and the mesh are where they are), the
    caller's uid, the working directory and every mount folder at its own path, the task's variables by name
    (their values, secrets included, pass from this process's environment, never a file), and the task's
    GPUs. The container goes with the command (`--rm`); SIGTERM reaches it. The task's SkyPilot
    `config.docker.run_options` (an allow-list, task_config.py) follow Tandem's own options."""
    names = sorted({*env_names, "TANDEM_NODE_RANK", "SKYPILOT_NODE_RANK", "CUDA_VISIBLE_DEVICES"})
    names = [n for n in names if n not in ("PATH", "HOME")]  # the image's own
    args = ["--rm", "--init", "--network", "host", "--workdir", '"$PWD"', "--volume", '"$PWD:$PWD"']
    if task.workdir.WhichOneof("source") == "path":
        folders = [*folders, task.workdir.path]
    for folder in dict.fromkeys(folders):
        args += ["--volume", f"{shlex.quote(folder)}:{shlex.quote(folder)}"]
    for name in names:
        args += ["--env", name]
    args += task.config.container_run_options
    gpus = '--gpus "device=$CUDA_VISIBLE_DEVICES"' if task.resources.gpus.strip() else ""
    quoted = " ".join(a if "$PWD" in a else shlex.quote(a) for a in args)
    return (
        f"exec {shlex.quote(python)} -m services.scheduler.backends.task_image {shlex.quote(image)} "
        f'{quoted} --user "$(id -u):$(id -g)" {gpus} -- bash -euo pipefail -c {shlex.quote(command)}\n'
    )


def node_env(rank: int, node_ips: Sequence[str] = ()) -> dict[str, str]:
    """The variables that differ per node: its rank (and the address list once a backend knows it)."""
    env = dict.fromkeys(RANK_VARIABLES, str(rank))
    if node_ips:
        env.update(ips_env(node_ips))
    return env


def ips_env(node_ips: Sequence[str]) -> dict[str, str]:
    """The address-list variables, SkyPilot's format: one address a line, rank 0 first."""
    return dict.fromkeys(IPS_VARIABLES, "\n".join(node_ips))


def group_name(job: str) -> str:
    """`SKYPILOT_JOBGROUP_NAME`: the job's id, the last segment of `orgs/{org}/jobs/{job}`. Unlike SkyPilot
    (the group's `name` as written) it is unique among running jobs, so two runs of one file never share host
    names; a script that builds them from the variable runs unchanged."""
    return job.rsplit("/", 1)[-1]


def user_id(user: str) -> str:
    """`SKYPILOT_USER_ID`: a stable 8-hex-digit hash of the user's name, the shape of SkyPilot's user hash
    (`sky/utils/common_utils.py`: the first 8 hex digits of an MD5, here of the name alone)."""
    return hashlib.md5(user.encode(), usedforsecurity=False).hexdigest()[:USER_ID_LENGTH]


def task_id(job: str, index: int) -> str:
    """`SKYPILOT_TASK_ID`: `{org}_{job}-{index}`, the same on every attempt; like SkyPilot's, its part after
    the last `-` is the task's index in the group."""
    parts = job.split("/")
    org = parts[1] if len(parts) == 4 else ""
    return f"{org}_{group_name(job)}-{index}"


def sibling_host(task: str, rank: int, job: str) -> str:
    """The host name of node `rank` of `task` in `job`'s group: SkyPilot's `{task}-{rank}.{group}`
    (`sky/jobs/job_group_networking.py`)."""
    return f"{task}-{rank}.{group_name(job)}"


def task_apps(org: str, task: js.TaskSpec) -> list[str]:
    """The Task Apps a task's job token may play rollouts on: an online_rl task's config's app. A config read
    from a file in the task (`config_path`) is unknown here, so that token may use any of the organization's
    apps (`orgs/{org}/taskApps/*`); other tasks play none."""
    if task.WhichOneof("kind_options") != "online_rl":
        return []
    config = trainer_config(task)
    return [config.task_app.name] if config is not None else [f"orgs/{org}/taskApps/*"]


def secret_env(task: js.TaskSpec) -> dict[str, str]:
    """`LaunchSpec.secret_env`: variable name -> vault secret id, for each of the task's secrets."""
    return {secret_env_name(binding): binding.secret for binding in task.secrets}


def file_mounts(task: js.TaskSpec) -> list[tuple[str, str, bool]]:
    """`LaunchSpec.file_mounts`: (path in the task, source, read-only). A source starting with `/` is a
    host path; an empty one is an empty folder of the task's own (a bucket's, filled by `task_buckets`);
    anything else is a volume name, with its `sub_path` after a `/` (the contract's patterns keep them
    apart)."""
    out: list[tuple[str, str, bool]] = []
    for mount in task.file_mounts:
        which = mount.WhichOneof("source")
        source = mount.local_path if which == "local_path" else mount.volume if which == "volume" else ""
        if which == "volume" and mount.sub_path:  # `VOLUME/SUB/PATH`: the folder inside the volume
            source = f"{source}/{mount.sub_path}"
        out.append((mount.path, source, mount.read_only))
    return out


_BUCKET_MODES = {
    js.Bucket.MODE_UNSPECIFIED: "mount",
    js.Bucket.MODE_MOUNT: "mount",
    js.Bucket.MODE_COPY: "copy",
    js.Bucket.MODE_MOUNT_CACHED: "mount_cached",
}


def buckets(task: js.TaskSpec, folders: Sequence[str]) -> list[BucketMount]:
    """The task's bucket mounts for `task_buckets`, each landing in `folders[i]` (the i-th of the task's file
    mounts as the backend places it: the mount path on Kubernetes, a folder of the task's on the host)."""
    return [
        BucketMount(
            url=mount.bucket.url,
            folder=folder,
            mode=_BUCKET_MODES[mount.bucket.mode],
            create=mount.bucket.create,
            read_only=mount.read_only,
        )
        for mount, folder in zip(task.file_mounts, folders, strict=True)
        if mount.WhichOneof("source") == "bucket"
    ]


def mount_env_name(path: str) -> str:
    """`TANDEM_MOUNT_<NAME>` for a mount path: its last segment, upper-cased, other characters as `_`
    (`/ckpt` -> `TANDEM_MOUNT_CKPT`, `/data/shared-set` -> `TANDEM_MOUNT_SHARED_SET`)."""
    last = path.rstrip("/").rsplit("/", 1)[-1] or "ROOT"
    return "TANDEM_MOUNT_" + "".join(c if c.isalnum() else "_" for c in last.upper())


def host_mounts(
    mounts: Sequence[tuple[str, str, bool]], volume_dir: Callable[[str], str]
) -> tuple[list[tuple[str, str, bool]], dict[str, str]]:
    """Mounts for a backend that runs tasks on the host as they are (local processes, Slurm), where a path
    cannot be mounted elsewhere: each mount becomes its source folder at its own path (a volume is the
    folder `volume_dir(name)`, shared by every task that names it), and `TANDEM_MOUNT_<NAME>` tells the
    task where that is. On Kubernetes the same variables hold the mount paths, so a script that reads
    them runs unchanged on every backend."""
    placed: list[tuple[str, str, bool]] = []
    env: dict[str, str] = {}
    for path, source, read_only in mounts:
        folder = source if source.startswith("/") else volume_dir(source)
        placed.append((folder, folder, read_only))
        env[mount_env_name(path)] = folder
    return placed, env


def pod_path(path: str) -> str:
    """A mount path in a pod (Kubernetes): `~/PATH` is `POD_HOME/PATH`, under the pod's home; others as written."""
    rest = home_relative(path)
    return path if rest is None else f"{POD_HOME}/{rest}"


def pod_home_mounts(mounts: Sequence[tuple[str, str, bool]]) -> tuple[list[tuple[str, str, bool]], bool]:
    """For a backend that really mounts (Kubernetes): each mount at its `pod_path`, and whether one was under
    `~/` (then HOME is `POD_HOME`)."""
    placed = [(pod_path(path), source, read_only) for path, source, read_only in mounts]
    return placed, any(home_relative(path) is not None for path, _source, _read_only in mounts)


def home_link_lines(
    mounts: Sequence[tuple[str, str, bool]], placed: Sequence[tuple[str, str, bool]]
) -> list[str]:
    """For the host backends (local, Slurm), where a mount is a folder of its own: `$HOME/PATH` linked to the
    folder of each `~/PATH` mount (`placed[i]` is `mounts[i]` as placed), at the task's start, in the HOME the
    task runs with. Something else already at that path (not a link) fails the task, PRECHECK."""
    lines: list[str] = []
    for (path, _source, _read_only), (folder, _folder, _ro) in zip(mounts, placed, strict=True):
        rest = home_relative(path)
        if rest is None:
            continue
        link = f'"$HOME"/{shlex.quote(rest)}'
        failed = shlex.quote(f"[tandem] cannot link ~/{rest} to its mount {folder}: something else is there")
        lines.append(
            f'{{ mkdir -p "$(dirname {link})" && {{ [ ! -e {link} ] || [ -L {link} ]; }} '
            f"&& ln -sfn {shlex.quote(folder)} {link}; }} || {{ echo {failed} >&2; exit {SETUP_FAILED_EXIT}; }}"
        )
    return lines


def mount_env(mounts: Sequence[tuple[str, str, bool]]) -> dict[str, str]:
    """`TANDEM_MOUNT_<NAME>` for backends that really mount (Kubernetes): the path in the task itself."""
    return {mount_env_name(path): path for path, _source, _read_only in mounts}
