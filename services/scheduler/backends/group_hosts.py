"""Sibling host names on the host backends (local, Slurm): each task of a job group reaches the others as
`{task}-{rank}.{group}`, the names SkyPilot job groups use (`expand.sibling_host`).

    python -m services.scheduler.backends.group_hosts COMMAND [ARG...]

SkyPilot writes those names into every node's `/etc/hosts`. On Tandem's host backends a task may not own the
node's `/etc/hosts` (it runs as its user, beside other jobs), so each node of a task, started through this
module:

1. publishes its own entry, `ADDRESS {task}-{rank}.{group}`, as the file `{task}-{rank}` in the job's hosts
   folder (`TANDEM_GROUP_HOSTS_DIR`, shared by the group's tasks: the scheduler's work folder, on shared
   storage for Slurm); the address is its line of `SKYPILOT_NODE_IPS`, resolved to IPv4 where it is a name;
2. waits until every sibling task named in `TANDEM_GROUP_TASKS` has published rank 0, at most
   `TANDEM_GROUP_HOSTS_WAIT_S` seconds (SkyPilot's tasks wait for their siblings' names too), then goes on;
3. writes the node's `/etc/hosts` plus every published entry to its own view file (`TANDEM_GROUP_HOSTS_FILE`)
   and keeps that file current from a small background process while the task runs, so a sibling that
   starts later or restarts elsewhere is found;
4. runs the command in a private mount namespace (util-linux `unshare`; a user namespace as well when not
   root, mapped back to the caller's uid and gid) where the view file is bind-mounted over `/etc/hosts`, so
   every resolver (glibc, Python, curl, NCCL's bootstrap) finds the names. The namespace is the task's
   alone: the node's `/etc/hosts` is never written.

Where the kernel refuses user namespaces (some clusters turn them off) or `unshare` is missing, the command
runs without the names and a line in the task's log says so; `TANDEM_GROUP_HOSTS_FILE` still lists them.
A group that asks for the names (SkyPilot's `inter_connection: true`, `TANDEM_GROUP_HOSTS_REQUIRED=1`) fails
instead, with `REQUIRED_EXIT` (a PRECHECK failure), as it does when a sibling's name is still missing after
the wait: SkyPilot fails such a group too.

On Kubernetes the cluster's DNS serves the same names (backends/kubernetes.py); `wait_script` is the pod's
step 2 there, before its command.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

DIR_ENV = "TANDEM_GROUP_HOSTS_DIR"
TASKS_ENV = "TANDEM_GROUP_TASKS"  # the sibling tasks to wait for, space-separated; empty: wait for none
WAIT_ENV = "TANDEM_GROUP_HOSTS_WAIT_S"
FILE_ENV = "TANDEM_GROUP_HOSTS_FILE"
REQUIRED_ENV = "TANDEM_GROUP_HOSTS_REQUIRED"  # "1": no names, no run (SkyPilot's inter_connection: true)
REQUIRED_EXIT = 223  # expand.SETUP_FAILED_EXIT: a PRECHECK failure, never recovered
DEFAULT_WAIT_S = 300.0
REFRESH_S = 1.0
SYSTEM_HOSTS = Path("/etc/hosts")


def own_entry(env: Mapping[str, str]) -> tuple[str, str]:
    """(file name, hosts line) of this node: `{task}-{rank}` and `ADDRESS {task}-{rank}.{group}`, with the
    name as the file wrote it (`My_Task-0.{group}`, SkyPilot's host name for it) as an alias where it differs."""
    task, group = env["TANDEM_TASK"], env["SKYPILOT_JOBGROUP_NAME"]
    written = env.get("TANDEM_TASK_DISPLAY_NAME", "")
    rank = int(env.get("SKYPILOT_NODE_RANK", "0") or 0)
    ips = [line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]
    address = ips[rank] if rank < len(ips) else "127.0.0.1"
    with contextlib.suppress(OSError):  # an address the resolver does not know stays as it is
        address = socket.gethostbyname(address)
    alias = f" {written}-{rank}.{group}" if written and written != task else ""
    return f"{task}-{rank}", f"{address} {task}-{rank}.{group}{alias}\n"


def compose(folder: Path, system: Path = SYSTEM_HOSTS) -> str:
    """The view: the node's hosts file, then every entry published in `folder`, in name order."""
    base = system.read_text() if system.is_file() else "127.0.0.1 localhost\n"
    if not base.endswith("\n"):
        base += "\n"
    entries = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return base + "# tandem: this job group's tasks\n" + "".join(p.read_text() for p in entries)


def publish(folder: Path, name: str, line: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f".{name}.{os.getpid()}"
    part.write_text(line)
    part.replace(folder / name)


def wait_for(folder: Path, tasks: Sequence[str], timeout_s: float) -> list[str]:
    """Wait until `{task}-0` of each of `tasks` is published, at most `timeout_s`; the ones still missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [task for task in tasks if not (folder / f"{task}-0").is_file()]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


def write_in_place(path: Path, text: str) -> None:
    """Rewrite the view without replacing the file: a bind mount holds the file itself, not its name."""
    with path.open("r+" if path.exists() else "w") as out:
        out.seek(0)
        out.write(text)
        out.truncate()


def keep_current(view: Path, folder: Path, parent: int) -> None:
    """In a child process: refresh the view until the task (the process that forked it) is gone."""
    if os.fork() != 0:
        return
    with contextlib.suppress(OSError):  # not in the task's foreground: a terminal's ^C is the task's
        os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # hold no pipe or log of the task open after it ends
        os.dup2(null, fd)
    shown = view.read_text()
    while os.getppid() == parent:
        time.sleep(REFRESH_S)
        try:
            text = compose(folder)
        except OSError:
            continue
        if text != shown:
            write_in_place(view, text)
            shown = text
    os._exit(0)


def namespace_command(view: Path, argv: Sequence[str]) -> list[str] | None:
    """The command that runs `argv` with `view` mounted over /etc/hosts, or None where that cannot work."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    mount = 'mount --bind "$0" /etc/hosts && exec "$@"'
    if os.geteuid() == 0:
        prefix = [unshare, "--mount", "--propagation", "private", "sh", "-c", mount, str(view)]
    else:  # root of a user namespace mounts, then the command runs as the caller again
        back = f"--map-user={os.getuid()} --map-group={os.getgid()}"
        inner = f'mount --bind "$0" /etc/hosts && exec {unshare} --user {back} -- "$@"'
        prefix = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", inner, str(view)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, check=False)
    return [*prefix, *argv] if probe.returncode == 0 else None


def required(env: Mapping[str, str]) -> bool:
    return env.get(REQUIRED_ENV, "") == "1"


def wait_script(tasks: Sequence[str], group: str) -> str:
    """Bash that waits until `{task}-0.{group}` of each of `tasks` resolves, at most `$TANDEM_GROUP_HOSTS_WAIT_S`
    seconds (DEFAULT_WAIT_S), then goes on; with `$TANDEM_GROUP_HOSTS_REQUIRED` = 1 it exits REQUIRED_EXIT
    instead. It asks the resolver through `getent`, else `python3`; an image with neither is not waited for."""
    hosts = " ".join(f"{task}-0.{group}" for task in tasks)
    if not hosts:
        return ""
    return f"""\
_tandem_resolves() {{
  if command -v getent >/dev/null 2>&1; then getent hosts "$1" >/dev/null 2>&1
  elif command -v python3 >/dev/null 2>&1; then
    python3 -c 'import socket, sys; socket.getaddrinfo(sys.argv[1], None)' "$1" >/dev/null 2>&1
  else return 0; fi
}}
_tandem_wait=${{{WAIT_ENV}:-{DEFAULT_WAIT_S:g}}}
_tandem_wait=${{_tandem_wait%%.*}}  # whole seconds: bash counts no fractions
_tandem_until=$((SECONDS + ${{_tandem_wait:-0}}))
_tandem_missing=""
for _tandem_host in {hosts}; do
  until _tandem_resolves "$_tandem_host"; do
    if [ "$SECONDS" -ge "$_tandem_until" ]; then _tandem_missing="$_tandem_missing $_tandem_host"; break; fi
    sleep 1
  done
done
if [ -n "$_tandem_missing" ]; then
  echo "[tandem] after ${{_tandem_wait:-0}}s, no host name yet for$_tandem_missing" >&2
  if [ "${{{REQUIRED_ENV}:-}}" = 1 ]; then
    echo "[tandem] the job group needs its host names (inter_connection: true); failing" >&2
    exit {REQUIRED_EXIT}
  fi
fi
unset _tandem_wait _tandem_until _tandem_missing _tandem_host
unset -f _tandem_resolves
"""


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m services.scheduler.backends.group_hosts COMMAND [ARG...]", file=sys.stderr)
        return 2
    folder = Path(os.environ[DIR_ENV])
    name, line = own_entry(os.environ)
    publish(folder, name, line)
    wait_s = float(os.environ.get(WAIT_ENV, "") or DEFAULT_WAIT_S)
    missing = wait_for(folder, os.environ.get(TASKS_ENV, "").split(), wait_s)
    if missing:
        print(f"[tandem] after {wait_s:g}s, no host name yet for {' '.join(missing)}", file=sys.stderr)
        if required(os.environ):
            print(
                "[tandem] the job group needs its host names (inter_connection: true); failing",
                file=sys.stderr,
            )
            return REQUIRED_EXIT
    view = folder / f".view-{name}-{os.getpid()}"
    write_in_place(view, compose(folder))
    os.environ[FILE_ENV] = str(view)
    command = namespace_command(view, argv)
    if command is None and required(os.environ):
        print(
            "[tandem] the job group needs its host names (inter_connection: true), and this node cannot"
            " give them (no user namespace); failing",
            file=sys.stderr,
        )
        return REQUIRED_EXIT
    if command is None:
        print(
            f"[tandem] sibling host names are not in /etc/hosts here (no user namespace); see {view}",
            file=sys.stderr,
        )
        command = list(argv)
    sys.stderr.flush()
    keep_current(view, folder, os.getpid())
    os.execvp(command[0], command)  # noqa: S606 - the task's own command, by design


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
