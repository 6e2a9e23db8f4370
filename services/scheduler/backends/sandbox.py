"""The sandbox a local task runs in under `run_as = org`: bubblewrap (`bwrap`, Debian's `bubblewrap`) around
the switch to the organization's own user.

    bash -c 'trap "" TERM INT HUP; exec bwrap "$@"' - --dev-bind / / <mounts> --unshare-pid --proc /proc \
        --chdir <cwd> -- env --default-signal=TERM,INT,HUP setpriv --reuid U --regid G --clear-groups \
        --no-new-privs -- <the rank's wrapper>

What the task sees:

- **Its own processes only.** A PID namespace with its own `/proc`: no other organization's command lines or
  environments, and not the mesh's processes (so not `/proc/<mesh>/root` or `/fd` either).
- **None of the mesh's state.** The mesh's state folder and the scheduler's work folder are empty
  (a tmpfs over each); the task's own folders (its attempt folder, working folder, log folder and the
  volumes it mounts, read-only where the spec says so) are bound back at their paths, so every path the
  scheduler hands the task still holds. The backend refuses a mount of anything else there.
- **The Python environment Tandem runs in**, even where it lies under a folder others may not enter (a
  virtual environment under `/root`, say): each such folder is a tmpfs others may enter but not list, with
  only the environment's own folders bound back, read-only. One of those that others may not enter itself
  (a checkout made by `mktemp -d`) is made enter-only too, and its entries are bound back one by one.
- The rest of the machine as the organization's user finds it: files readable by everyone stay readable,
  devices (GPUs) stay usable, the network is the host's.

No capability survives: `setpriv` leaves root for the organization's user (which drops them all) with
`no_new_privs`, so no setuid program raises it back, and mounts made by root cannot be undone by it.

Signals: the backend signals the rank's process group. bubblewrap itself ignores SIGTERM, SIGINT and SIGHUP
(it only waits for the task and exits with its status), so a rank stays alive until the task has handled
the signal and ended; the task gets the default dispositions back before it starts. SIGKILL ends bubblewrap,
which ends the namespace and everything in it.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

RESET_SIGNALS = "TERM,INT,HUP"
SOURCE = (
    Path(__file__).resolve().parents[3]
)  # Tandem's own code: a checkout, or the environment's site-packages


def bwrap_path() -> str | None:
    """bubblewrap's executable on PATH, or None."""
    return shutil.which("bwrap")


@functools.cache
def problem() -> str:
    """Empty when bubblewrap can build the sandbox here (it is on PATH and may create mount and PID
    namespaces), else why not."""
    bwrap = bwrap_path()
    if bwrap is None:
        return "bubblewrap (bwrap, Debian's package bubblewrap) is not installed"
    probe = [bwrap, "--dev-bind", "/", "/", "--unshare-pid", "--proc", "/proc", "--", "true"]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap cannot run: {error}"
    if result.returncode != 0:
        return f"bubblewrap cannot create namespaces here: {result.stderr.strip() or result.returncode}"
    return ""


def runtime_paths() -> list[Path]:
    """The folders a task needs to run Tandem's Python: the environment, its base interpreter, Tandem's own
    code (a checkout, for an editable install) and the folders on `sys.path` inside those. Nothing else: not
    the folder the scheduler was started from, which `python -m` puts on `sys.path` (a home folder, say)."""
    roots = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent, SOURCE]
    found = [r.resolve() for r in roots if r.is_dir()]
    for entry in sys.path:
        path = Path(entry).resolve() if entry else None
        if path is not None and path.is_dir() and any(path.is_relative_to(r) for r in found):
            found.append(path)
    # The executable's own chain of links (a venv's python links to the base interpreter's).
    target = Path(sys.executable)
    for _ in range(8):
        if not target.is_symlink():
            break
        target = (target.parent / os.readlink(target)).resolve()
        found.append(target.parent)
    return list(dict.fromkeys(found))


def closed_ancestors(paths: Iterable[Path]) -> list[Path]:
    """The topmost folders above (or at) `paths` that others may not enter, each once: a task running as
    another user reaches nothing under them unless the sandbox opens them."""
    closed: list[Path] = []
    for path in paths:
        for folder in (*reversed(path.parents), path):
            try:
                mode = folder.stat().st_mode
            except OSError:
                break
            if not mode & stat.S_IXOTH:
                if not any(folder == c or folder.is_relative_to(c) for c in closed):
                    closed.append(folder)
                break
    return closed


def unreachable(paths: Iterable[Path]) -> list[Path]:
    """Those of `paths` another user cannot reach without the sandbox (a folder on the way it may not
    enter)."""
    return [path for path in paths if closed_ancestors([path])]


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


class _Mounts:
    """bubblewrap's mount options for one sandbox, in order: the host's root, then folders made in tmpfses."""

    def __init__(self) -> None:
        self.options: list[str] = ["--dev-bind", "/", "/"]
        self._made: set[Path] = set()
        self._covered: list[Path] = []  # runtime paths bound back whole

    def enterable(self, path: Path, under: Sequence[Path]) -> None:
        """The folders between the first of `under` holding `path` and it, made enterable inside that tmpfs
        (bubblewrap would make them for root alone)."""
        top = next(r for r in under if _inside(path, [r]))
        for folder in reversed(path.parents):
            if folder.is_relative_to(top) and folder != top and folder not in self._made:
                self._made.add(folder)
                self.options.extend(["--perms", "0711", "--dir", str(folder)])

    def bind(self, path: Path, under: Sequence[Path], option: str) -> None:
        self.enterable(path, under)
        self.options.extend([option, str(path), str(path)])

    def bind_runtime(self, path: Path, opened: Sequence[Path]) -> None:
        """`path`, inside one of the `opened` tmpfses, bound back read-only. A folder others may not enter
        itself (a checkout in a private folder, whose bind would bring its mode back) is made an enter-only
        folder instead, and what it holds bound back the same way, each entry at its path; a link is made
        again as a link."""
        try:
            mode = path.lstat().st_mode
        except OSError:
            return  # gone since it was listed: nothing to open
        if _inside(path, self._covered):
            return
        if stat.S_ISLNK(mode):
            self.enterable(path, opened)
            self.options.extend(["--symlink", os.readlink(path), str(path)])
        elif stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            if path not in opened and path not in self._made:
                self.enterable(path, opened)
                self._made.add(path)
                self.options.extend(["--perms", "0711", "--dir", str(path)])
            for entry in sorted(path.iterdir()):
                self.bind_runtime(entry, opened)
        else:
            self.bind(path, opened, "--ro-bind")
            self._covered.append(path)


def command(
    argv: Sequence[str],
    account: pwd.struct_passwd,
    *,
    cwd: Path,
    hide: Sequence[Path],
    own: Sequence[Path],
    mounts: Sequence[tuple[Path, bool]] = (),
    runtime: Sequence[Path] | None = None,
) -> list[str]:
    """`argv` run as `account` in the sandbox: `hide` are empty, `own` (the task's folders) and `mounts`
    (its volumes: path, read-only) bound back, the `runtime` folders reachable read-only."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise OSError("bubblewrap (bwrap) is not installed")
    runtime = runtime_paths() if runtime is None else runtime
    resolved = [p.resolve() for p in hide]
    hidden = [p for p in resolved if not any(p != q and p.is_relative_to(q) for q in resolved)]
    made = _Mounts()
    # Folders others may not enter above the runtime or the hidden folders (a home; pytest's temporary root,
    # which any pytest run shuts again): an enter-only tmpfs each, holding only what is bound back into it.
    opened = closed_ancestors([*runtime, *(h.parent for h in hidden)])
    for folder in opened:  # others may enter, not list; only the runtime's folders inside
        made.options += ["--perms", "0711", "--tmpfs", str(folder)]
    for path in runtime:
        if _inside(path, opened) and not _inside(path, hidden):
            made.bind_runtime(path, opened)
    bound_runtime = [r for r in runtime if _inside(r, opened)]
    for folder in hidden:
        if _inside(folder, opened) and not _inside(folder, bound_runtime):  # its mount point: enterable too
            made.enterable(folder, opened)
        made.options += ["--perms", "0711", "--tmpfs", str(folder)]
    bound = {p.resolve(): False for p in own}
    for path, read_only in mounts:
        bound.setdefault(path.resolve(), read_only)
    for path, read_only in bound.items():  # elsewhere the task finds a mount as its user may
        if _inside(path, hidden):
            made.bind(path, hidden, "--ro-bind" if read_only else "--bind")
    drop = [
        "env",
        f"--default-signal={RESET_SIGNALS}",
        "setpriv",
        f"--reuid={account.pw_uid}",
        f"--regid={account.pw_gid}",
        "--clear-groups",
        "--no-new-privs",
        "--",
    ]
    sandbox = [*made.options, "--unshare-pid", "--proc", "/proc", "--chdir", str(cwd), "--", *drop, *argv]
    # bubblewrap outlives the signals the task handles (see the module's text); `exec` keeps its pid the rank's.
    return ["bash", "-c", f'trap "" {RESET_SIGNALS.replace(",", " ")}; exec "$0" "$@"', bwrap, *sandbox]
