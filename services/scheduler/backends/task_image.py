"""Pull a task's image within a time bound, then run the task in it: the in-task half of SkyPilot's
`image_id: docker:IMAGE` on the local backend.

    python -m services.scheduler.backends.task_image IMAGE RUN-OPTION... -- bash -euo pipefail -c SCRIPT

The local backend's rank runs this (inside the secrets wrapper, so the task's vault secrets are already in
the environment) with the docker or podman CLI it chose in `TANDEM_CONTAINER_RUNTIME`, the bound in
`TANDEM_IMAGE_PULL_TIMEOUT_S` (the scheduler's `local.image_pull_timeout_s`) and the attempt's private folder
in `TANDEM_ATTEMPT_DIR`. Then:

1. The image reference: a private registry's `SKYPILOT_DOCKER_SERVER` goes in front of an image that does
   not start with it (SkyPilot's `DockerLoginConfig.format_image`), and a short Docker Hub name is written
   out in full (`ubuntu:22.04` is `docker.io/library/ubuntu:22.04`), so podman resolves it as docker does.
2. An image the runtime already has is used as it is (docker's own `run` pulls only a missing one too).
   Otherwise, when the task's secrets hold `SKYPILOT_DOCKER_USERNAME`, `SKYPILOT_DOCKER_PASSWORD` and
   `SKYPILOT_DOCKER_SERVER`, the runtime logs in to the server first with `login --password-stdin`, into an
   auth file of its own in a fresh 0700 folder of the attempt's folder (`--authfile` for podman, a
   `DOCKER_CONFIG` folder for docker), never the machine's own configuration; the password goes through a
   pipe, never a command line, a log or a file elsewhere. Then the image is pulled with that file, and the
   folder is removed.
3. A login or pull that fails, or does not end within the bound (its process is killed), exits with
   `PRECHECK_EXIT` (223, the code of a failed `setup`, a PRECHECK failure) after one line on stderr naming
   the image, `could not be pulled in N s` and the last lines the runtime wrote, which the task's failure
   message shows. A pull that ends in time runs the task: `RUNTIME run RUN-OPTION... --pull never IMAGE
   COMMAND`, this process replaced by the runtime's, so signals reach it as before.

The Slurm batch shell runs its other form before the srun step of a task whose image comes from a private
registry (the whole step runs in the image there, so the login must be in place before it starts):

    python -m services.scheduler.backends.task_image --slurm pyxis|apptainer --secrets ENV=name,...
        --folder FOLDER --image IMAGE -- srun ...

It opens the three secrets from the vault with the job's token, writes enroot's `.credentials` into FOLDER
(the job's own 0700 folder, removed when the batch job ends) as `ENROOT_CONFIG_PATH`, or sets Apptainer's
`APPTAINER_DOCKER_USERNAME` / `_PASSWORD`, gives the image argument its server, and replaces itself with
srun. Pulling is then pyxis's or Apptainer's, with their own time bounds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.scheduler.backends.base import RegistryLogin

RUNTIME_ENV = "TANDEM_CONTAINER_RUNTIME"  # the docker or podman CLI (a path), set by the local backend
PULL_TIMEOUT_ENV = "TANDEM_IMAGE_PULL_TIMEOUT_S"  # the bound of login and pull together, in seconds
ATTEMPT_DIR_ENV = "TANDEM_ATTEMPT_DIR"  # the attempt's private folder, where the auth file lives a while
# The runtime's own configuration as the operator sets it for the scheduler (a containers.conf, registries,
# storage, a docker daemon's address): the runtime runs with it for a task as for the backend's `info` check,
# so a runtime found working is the one the task gets.
RUNTIME_CONFIG_ENVS = (
    "CONTAINERS_CONF",
    "CONTAINERS_REGISTRIES_CONF",
    "CONTAINERS_STORAGE_CONF",
    "DOCKER_HOST",
    "DOCKER_CONTEXT",
    "DOCKER_CERT_PATH",
    "DOCKER_TLS_VERIFY",
)
DEFAULT_PULL_TIMEOUT_S = 600.0
PRECHECK_EXIT = 223  # services.scheduler.expand.SETUP_FAILED_EXIT: a PRECHECK failure
USERNAME_ENV = "SKYPILOT_DOCKER_USERNAME"
PASSWORD_ENV = "SKYPILOT_DOCKER_PASSWORD"  # noqa: S105 - a variable name, not a password
SERVER_ENV = "SKYPILOT_DOCKER_SERVER"
LOGIN_ENVS = (USERNAME_ENV, PASSWORD_ENV, SERVER_ENV)  # SkyPilot's DOCKER_LOGIN_ENV_VARS
TAIL_LINES = 5


class PullFailed(Exception):
    """The image could not be pulled (or the registry logged in to) within the bound; the message says why."""


Login = RegistryLogin  # username, password, server


def login_from(environ: Mapping[str, str]) -> Login | None:
    """The registry login of SkyPilot's three variables, when all three are set; None otherwise."""
    values = [environ.get(name, "") for name in LOGIN_ENVS]
    return Login(*values) if all(values) else None


def with_server(image: str, login: Login | None) -> str:
    """`image` with `login`'s server in front unless it starts with it (SkyPilot's `format_image`)."""
    if login is None:
        return image
    server = login.server.split("://", 1)[-1].rstrip("/")  # a server given as a URL
    return image if image.startswith(f"{server}/") else f"{server}/{image}"


def reference(image: str, login: Login | None = None) -> str:
    """The full reference of `image`: `login`'s server in front unless it is there (`with_server`), and a
    Docker Hub short name written out (`docker.io/`, `library/` for one word)."""
    image = with_server(image, login)
    first, slash, _rest = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return image  # a registry host is named
    if not slash:
        image = f"library/{image}"
    return f"docker.io/{image}"


def enroot_credentials(login: Login) -> str:
    """enroot's `.credentials` (netrc) for `login`: the server's host, and Docker Hub's token and registry
    hosts where the server is Docker Hub's."""
    host = login.server.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    machines = [host]
    if host in ("docker.io", "index.docker.io", "registry-1.docker.io"):
        machines = ["auth.docker.io", "registry-1.docker.io"]
    return "".join(f"machine {m} login {login.username} password {login.password}\n" for m in machines)


def is_podman(runtime: str) -> bool:
    return "podman" in Path(runtime).name


def login_command(runtime: str, login: Login, auth: Path) -> tuple[list[str], dict[str, str]]:
    """The argv logging in to `login.server` into the auth file `auth` (a file in podman's terms; docker
    keeps `config.json` in the folder it is in) and the variables to add; the password goes on stdin."""
    argv = [runtime, "login", "--username", login.username, "--password-stdin"]
    if is_podman(runtime):
        return [*argv, "--authfile", str(auth), login.server], {}
    return [*argv, login.server], {"DOCKER_CONFIG": str(auth.parent)}


def pull_command(runtime: str, image: str, auth: Path | None) -> tuple[list[str], dict[str, str]]:
    """The argv pulling `image` (with the auth file `auth` where there is one) and the variables to add."""
    if auth is None:
        return [runtime, "pull", image], {}
    if is_podman(runtime):
        return [runtime, "pull", "--authfile", str(auth), image], {}
    return [runtime, "pull", image], {"DOCKER_CONFIG": str(auth.parent)}


def has_image(runtime: str, image: str, timeout_s: float) -> bool:
    """Whether the runtime already holds `image` (`image inspect`, which never reaches a registry)."""
    try:
        done = subprocess.run(
            [runtime, "image", "inspect", image],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=max(1.0, timeout_s),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _tail(output: bytes) -> str:
    lines = [line.strip() for line in output.decode(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-TAIL_LINES:]) or "no output"


def _run_bounded(
    argv: Sequence[str], extra_env: Mapping[str, str], stdin: bytes | None, deadline: float
) -> tuple[int | None, bytes]:
    """(exit code, output) of `argv`; None as the code when it ran past `deadline` and was killed."""
    env = {**os.environ, **extra_env}
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
    except OSError as exc:
        return 127, str(exc).encode()
    try:
        output, _ = proc.communicate(stdin, timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        return None, output
    return proc.returncode, output


def pull(
    runtime: str, image: str, *, timeout_s: float, login: Login | None = None, private_dir: Path
) -> bool:
    """Pull `image` through `runtime` within `timeout_s` (login included), logging in first with `login`
    into an auth file in a fresh 0700 folder under `private_dir`, removed afterwards. False when the image
    was there already; PullFailed (image, bound, the runtime's last lines) when it cannot be had in time."""
    deadline = time.monotonic() + timeout_s
    if has_image(runtime, image, timeout_s):
        return False
    bound = f"{timeout_s:g} s"
    folder = Path(tempfile.mkdtemp(prefix=".registry-auth-", dir=private_dir)) if login else None
    try:
        auth = folder / "auth.json" if folder is not None else None
        if login is not None and auth is not None:
            argv, extra = login_command(runtime, login, auth)
            code, output = _run_bounded(argv, extra, login.password.encode(), deadline)
            if code != 0:
                how = "in time" if code is None else f"(exit {code})"
                raise PullFailed(
                    f"the image {image} could not be pulled in {bound}: logging in to {login.server} as "
                    f"{login.username} failed {how}: {_tail(output)}"
                )
        argv, extra = pull_command(runtime, image, auth)
        code, output = _run_bounded(argv, extra, None, deadline)
        if code is None:
            raise PullFailed(
                f"the image {image} could not be pulled in {bound} (the pull was stopped): {_tail(output)}"
            )
        if code != 0:
            raise PullFailed(
                f"the image {image} could not be pulled in {bound} (exit {code}): {_tail(output)}"
            )
        return True
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def pull_timeout(environ: Mapping[str, str]) -> float:
    try:
        value = float(environ.get(PULL_TIMEOUT_ENV, "") or DEFAULT_PULL_TIMEOUT_S)
    except ValueError:
        return DEFAULT_PULL_TIMEOUT_S
    return value if value > 0 else DEFAULT_PULL_TIMEOUT_S


def slurm_step(
    runtime: str, folder: Path, image: str, argv: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """The Slurm batch shell's srun `argv` and the variables it needs to pull `image` from the private
    registry of this process's `SKYPILOT_DOCKER_*` (just opened from the vault): for pyxis an enroot
    `.credentials` file written (0600) into `folder`, the batch job's own 0700 folder, as
    `ENROOT_CONFIG_PATH`; for Apptainer its `APPTAINER_DOCKER_USERNAME` / `_PASSWORD`. Either way the image
    argument gets the server in front (SkyPilot's `format_image`). PullFailed without all three variables."""
    from services.scheduler.backends.slurm import enroot_image  # noqa: PLC0415 - slurm imports this module

    login = login_from(os.environ)
    if login is None:
        missing = ", ".join(n for n in LOGIN_ENVS if not os.environ.get(n))
        raise PullFailed(f"the image {image} could not be pulled: the registry login lacks {missing}")
    full = with_server(image, login)
    extra: dict[str, str] = {}
    if runtime == "pyxis":
        old, new = f"--container-image={enroot_image(image)}", f"--container-image={enroot_image(full)}"
        path = folder / ".credentials"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(enroot_credentials(login))
        extra["ENROOT_CONFIG_PATH"] = str(folder)
    else:
        old, new = f"docker://{image}", f"docker://{full}"
        for prefix in ("APPTAINER", "SINGULARITY"):
            extra[f"{prefix}_DOCKER_USERNAME"] = login.username
            extra[f"{prefix}_DOCKER_PASSWORD"] = login.password
    return [new if arg == old else arg for arg in argv], extra


def _slurm_main(argv: Sequence[str]) -> int:
    """`--slurm RUNTIME --secrets ENV=name,... --folder F --image IMAGE -- srun ...` (the batch shell's)."""
    from services.scheduler.backends.task_secrets import inject, parse_secrets  # noqa: PLC0415

    split = list(argv).index("--")
    options = dict(zip(argv[0:split:2], argv[1:split:2], strict=True))
    command = list(argv[split + 1 :])
    image = options["--image"]
    try:
        asyncio.run(inject(parse_secrets(options["--secrets"])))
        command, extra = slurm_step(options["--slurm"], Path(options["--folder"]), image, command)
    except PullFailed as failed:
        print(f"[tandem] {failed}", file=sys.stderr)
        return PRECHECK_EXIT
    except Exception as exc:  # the vault unreachable or the secret gone: no login, no pull
        print(
            f"[tandem] the image {image} could not be pulled: opening its registry login failed: {exc}",
            file=sys.stderr,
        )
        return PRECHECK_EXIT
    os.environ.update(extra)
    os.execvp(command[0], command)  # noqa: S606 - srun, with the task's step


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--slurm"]:
        return _slurm_main(argv)
    if len(argv) < 3 or "--" not in argv[1:]:
        print(
            "usage: python -m services.scheduler.backends.task_image IMAGE RUN-OPTION... -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    split = argv.index("--", 1)
    image, options, command = argv[0], list(argv[1:split]), list(argv[split + 1 :])
    runtime = os.environ.get(RUNTIME_ENV, "")
    if not runtime:
        print(f"[tandem] {RUNTIME_ENV} is not set: no container runtime to run {image} with", file=sys.stderr)
        return PRECHECK_EXIT
    login = login_from(os.environ)
    full = reference(image, login)
    timeout_s = pull_timeout(os.environ)
    private = Path(os.environ.get(ATTEMPT_DIR_ENV) or tempfile.gettempdir())
    started = time.monotonic()
    try:
        if pull(runtime, full, timeout_s=timeout_s, login=login, private_dir=private):
            print(f"[tandem] pulled {full} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    except PullFailed as failed:
        print(f"[tandem] {failed}", file=sys.stderr)
        return PRECHECK_EXIT
    sys.stderr.flush()
    os.execv(runtime, [runtime, "run", *options, "--pull", "never", full, *command])  # noqa: S606


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
