"""An attack job: what a task of one organization can read, searched the way an attacker would, so that the
isolation tests can look in it for the mesh's keys and another organization's state.

Run as a task's command (`python3 attack_job.py <budget seconds>`, the system's Python, standard library
only). It never knows what it looks for: it writes what it read to its working folder and the test, which
knows the secrets, searches that. In order:

1. **Guessed names.** In its working folder and every folder above it, the files the mesh's state is made of
   (`mesh.key`, `vault-master.key`, the databases, ...): a folder that cannot be listed may still be entered.
2. **Processes.** Every process's environment and command line (`/proc/<pid>/environ`, `cmdline`).
3. **Near.** The whole tree of its working folder and of every folder above it, nearest first, up to a
   folder every user may write to (`/tmp`: on a shared machine gigabytes of other people's files) or `/`.
4. **Everything else** from `/` (not `/proc`, `/sys`, `/dev` but `/dev/shm`), the shared folders first, as
   far as the budget goes.

Steps 1 to 3 write every byte read (at most `MAX_READ` a file) to `found.bin`; step 4 writes only what looks
like a key or a token (hex and base64 runs, the forms keys are stored in), since all of `/` is gigabytes.
`found.json` says what was read and listed and whether steps 3 and 4 finished within the budget (steps 1
and 2 always finish; 3 and 4 share the budget, 3 first).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

MAX_READ = 4 << 20
STATE_NAMES = (
    "mesh.key",
    "mesh.key.retired",
    "vault-master.key",
    "admin.key",
    "vault.db",
    "gateway.db",
    "scheduler.db",
    "events.db",
    "taskapp_proxy.db",
    "traces.jsonl",
    "logs/tandem.log",
)
TOKENS = re.compile(rb"[A-Za-z0-9_-]{24,}|[A-Za-z0-9+/]{40,}={0,2}")
SKIP = {"/proc", "/sys", "/dev"}
FIRST = (
    "/tmp",
    "/var/tmp",
    "/dev/shm",
    "/etc",
    "/var",
    "/run",
    "/root",
    "/home",
    "/srv",
    "/opt",
    "/mnt",
    "/media",
)


class Search:
    def __init__(self, here: Path, budget_s: float) -> None:
        self.here = here
        self.deadline = time.monotonic() + budget_s
        self.out: BinaryIO = open(here / "found.bin", "wb")  # noqa: SIM115 (closed in finish)
        self.mine = {str(here / "found.bin"), str(here / "found.json")}
        self.read: list[str] = []  # steps 1 to 3
        self.listed: list[str] = []  # entries of the folders steps 1 to 3 could list
        self.files_far = 0
        self.tokens: set[bytes] = set()
        self.walked: set[str] = set()

    def take(self, path: str, whole: bool = True) -> None:
        if path in self.mine:
            return
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            data = os.read(fd, MAX_READ)
        except OSError:
            return
        finally:
            os.close(fd)
        if whole:
            self.read.append(path)
            self.out.write(path.encode() + b"\n" + data + b"\n")
        else:
            self.files_far += 1
            self.tokens.update(TOKENS.findall(data))

    def walk(self, top: str, whole: bool) -> bool:
        """Every file under `top` it may read; False when the budget ran out first."""
        for folder, dirs, files in os.walk(top):
            if time.monotonic() > self.deadline:
                return False
            if folder in self.walked or folder in SKIP:
                dirs[:] = []
                continue
            self.walked.add(folder)
            if whole:
                self.listed += [os.path.join(folder, n) for n in (*dirs, *files)]
            for name in files:
                self.take(os.path.join(folder, name), whole)
        return True

    def finish(self, **summary: object) -> None:
        self.out.write(b"\n".join(sorted(self.tokens)))
        self.out.close()
        report = {"read": self.read, "listed": self.listed, "files_far": self.files_far, **summary}
        (self.here / "found.json").write_text(json.dumps(report))


def shared(folder: Path) -> bool:
    """Sticky and writable by everyone, as /tmp is."""
    mode = folder.stat().st_mode
    return bool(mode & stat.S_ISVTX and mode & stat.S_IWOTH)


def processes() -> Iterator[str]:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            yield from (f"/proc/{pid}/environ", f"/proc/{pid}/cmdline")


def main(budget_s: float) -> None:
    here = Path.cwd().resolve()
    search = Search(here, budget_s)
    above = [here, *here.parents]
    for folder in above:  # 1
        for name in STATE_NAMES:
            search.take(str(folder / name))
    for path in processes():  # 2
        search.take(path)
    search.out.write(b"environment\n" + json.dumps(dict(os.environ)).encode() + b"\n")
    own = [f for f in itertools.takewhile(lambda f: f != Path("/") and not shared(f), above)]
    near = all(search.walk(str(folder), True) for folder in own)  # 3
    far = near
    if near:  # 4
        tops = [*FIRST, *sorted(str(p) for p in Path("/").iterdir() if str(p) not in FIRST)]
        far = all(search.walk(top, False) for top in tops if top not in SKIP)
    commands = []
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if pid.isdigit():
                commands.append(
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
    search.finish(
        near_complete=near, far_complete=far, uid=os.getuid(), env=dict(os.environ), processes=commands
    )
    print(f"read {len(search.read)} files near, {search.files_far} further; finished: {near}, {far}")


if __name__ == "__main__":
    main(float(sys.argv[1]))
