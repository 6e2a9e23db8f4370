"""The local backend's isolation, against the real backend and bubblewrap: under `run_as = org` a task runs as
its organization's user in a sandbox (its own /proc, the mesh's state folder empty but for its own folders,
no capability, Tandem's Python reachable), keeps the backend's contract (exit codes, cancel with a grace
period, reattach after a restart), and mounts nothing of the scheduler's that is not its own; where no
isolation is possible the backend serves one organization only; a setting that cannot hold is an error naming
it. The attack on a whole mesh is tests/security/test_isolation.py."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mesh.settings import SettingsError, settings_problem
from services.scheduler.backends import sandbox
from services.scheduler.backends.base import Handle, LaunchRefused, LaunchSpec, Observed, Phase
from services.scheduler.backends.local import LocalBackend, org_account
from services.scheduler.config import SchedulerSettings
from services.scheduler.servicer import make_backends, resolve_run_as

WAIT_S = 60.0  # a bound so a broken sandbox fails the test instead of hanging it; never a timing claim

needs_root_and_bwrap = pytest.mark.skipif(
    os.geteuid() != 0 or bool(sandbox.problem()),
    reason="the sandbox needs root and a working bubblewrap (.ci/run installs it and runs as root)",
)


@pytest.fixture
def state() -> Iterator[Path]:
    """A mesh-like state folder outside pytest's own (which is 0700 to other users), with a key in it."""
    folder = Path(tempfile.mkdtemp(prefix="tandem-sandbox-"))
    folder.chmod(0o711)
    (folder / "mesh.key").write_text("the-mesh-signing-key")
    (folder / "mesh.key").chmod(0o600)
    (folder / "readable.txt").write_text("readable by everyone, were it not hidden")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def spec(
    work: Path, command: str, org: str = "acme", env: dict[str, str] | None = None, **kwargs: object
) -> LaunchSpec:
    job = f"j{uuid.uuid4().hex[:8]}"
    key = f"orgs-{org}-jobs-{job}.main.0"
    task_dir = work / "jobs" / f"orgs-{org}-jobs-{job}" / "main"
    task_dir.mkdir(parents=True)
    return LaunchSpec(
        key=key,
        job=f"orgs/{org}/jobs/{job}",
        task="main",
        attempt=0,
        command=command,
        env={"TANDEM_JOB": f"orgs/{org}/jobs/{job}", **(env or {})},
        log_dir=task_dir / "logs",
        workdir=task_dir,
        **kwargs,  # type: ignore[arg-type]
    )


def backend(state: Path, **kwargs: object) -> LocalBackend:
    return LocalBackend(state / "scheduler" / "local", gpus=0, failure_grace_s=2.0, hide=[state], **kwargs)  # type: ignore[arg-type]


async def wait_until(b: LocalBackend, handle: Handle, done: Callable[[Observed], bool]) -> Observed:
    deadline = time.monotonic() + WAIT_S
    while True:
        observed = await b.poll(handle)
        if done(observed):
            return observed
        assert time.monotonic() < deadline, f"still {observed} after {WAIT_S}s"
        await asyncio.sleep(0.05)


def ended(o: Observed) -> bool:
    return o.phase in (Phase.EXITED, Phase.LOST)


def log_of(handle: Handle) -> str:
    return (Path(handle["log_dir"]) / "rank-0.log").read_text(errors="replace")


def processes_of(key: str) -> list[str]:
    """The pids whose environment names the attempt key (every process of the attempt's has it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if key.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def owner_of(path: Path) -> int:
    return path.stat().st_uid


PROBE = """
import json, os, sys
from pathlib import Path
import mesh, trainer  # Tandem's own Python, reachable though it may lie under a folder others cannot enter
state = Path(sys.argv[1])
status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
print(json.dumps({
    "uid": os.getuid(),
    "state": sorted(p.name for p in state.iterdir()) if os.access(state, os.R_OK) else "unlistable",
    "key": (state / "mesh.key").exists(),
    "own": Path.cwd().is_dir() and os.access(Path.cwd(), os.W_OK),
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "cap_eff": status["CapEff"].strip(),
    "no_new_privs": status["NoNewPrivs"].strip(),
}))
"""


@needs_root_and_bwrap
async def test_a_sandboxed_task_sees_its_own_folders_and_processes_only(state: Path) -> None:
    b = backend(state, run_as="org")
    assert b.sandbox
    # The state folder is hidden: the script reaches the task through its environment.
    task = spec(state / "scheduler", f'{sys.executable} -c "$PROBE" {state}', env={"PROBE": PROBE})
    handle = await b.launch(task)
    observed = await wait_until(b, handle, ended)
    assert observed.exit_code == 0, log_of(handle)
    seen = json.loads(log_of(handle).strip().splitlines()[-1])
    assert seen["uid"] == org_account("acme").pw_uid
    assert (
        seen["state"] == "unlistable" and seen["key"] is False
    )  # enter-only, and nothing of the mesh's there
    assert seen["own"] is True
    assert 1 in seen["pids"] and len(seen["pids"]) <= 4  # bubblewrap, the rank's wrappers, the probe
    assert seen["cap_eff"] == "0000000000000000" and seen["no_new_privs"] == "1"


@needs_root_and_bwrap
async def test_cancel_waits_for_the_task_to_handle_sigterm(state: Path) -> None:
    b = backend(state, run_as="org")
    command = (
        "trap 'echo cleaning up; sleep 0.5; echo clean > bye; exit 3' TERM; echo started; sleep 60 & wait"
    )
    handle = await b.launch(spec(state / "scheduler", command))
    await wait_until(b, handle, lambda o: "started" in log_of(handle) or ended(o))
    await b.cancel(handle, grace_s=20.0)
    observed = await wait_until(b, handle, ended)
    # The task's own code, not a signal's: bubblewrap outlived the SIGTERM until the task had ended.
    assert observed.phase is Phase.EXITED and observed.exit_code == 3, (observed, log_of(handle))
    assert (Path(handle["log_dir"]).parent / "bye").read_text().strip() == "clean"


@needs_root_and_bwrap
async def test_cancel_kills_a_task_that_ignores_sigterm_and_a_restarted_backend_reattaches(
    state: Path,
) -> None:
    b = backend(state, run_as="org")
    finished = await b.launch(spec(state / "scheduler", "echo hi; sleep 1; exit 5"))
    stubborn = await b.launch(spec(state / "scheduler", "trap '' TERM; echo started; sleep 60"))
    restarted = backend(state, run_as="org")  # not the parent of either
    observed = await wait_until(restarted, json.loads(json.dumps(finished)), ended)
    assert observed.phase is Phase.EXITED and observed.exit_code == 5, observed
    await wait_until(restarted, stubborn, lambda o: "started" in log_of(stubborn) or ended(o))
    await restarted.cancel(stubborn, grace_s=0.5)
    observed = await wait_until(restarted, stubborn, ended)
    assert observed.phase is Phase.EXITED and observed.exit_code != 0, observed
    assert processes_of(stubborn["key"]) == [], "a process of the cancelled task survived"


@needs_root_and_bwrap
async def test_mounts_are_the_organizations_own_or_refused(state: Path) -> None:
    b = backend(state, run_as="org")
    work = state / "scheduler"
    volume = work / "volumes" / "acme" / "data"
    volume.mkdir(parents=True)
    (volume / "set.txt").write_text("rows")
    read_only = spec(
        work,
        f"cat {volume}/set.txt; touch {volume}/new && echo wrote",
        file_mounts=[(str(volume), str(volume), True)],
    )
    handle = await b.launch(read_only)
    observed = await wait_until(b, handle, ended)
    assert observed.exit_code != 0 and "rows" in log_of(handle) and "wrote" not in log_of(handle)
    assert "Read-only file system" in log_of(handle)

    # globex's folder, the mesh's state folder, and a folder of the scheduler's nobody owns: refused, untouched
    theirs = spec(work, "true", org="globex")
    await wait_until(b, await b.launch(theirs), ended)
    globex_dir = Path(str(theirs.workdir))
    owner = owner_of(globex_dir)
    for path in (globex_dir, state, work / "jobs"):
        with pytest.raises(LaunchRefused, match="mount of"):
            await b.launch(spec(work, "true", file_mounts=[(str(path), str(path), True)]))
    assert owner_of(globex_dir) == owner == org_account("globex").pw_uid


async def test_without_isolation_the_backend_serves_one_organization(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path / "scheduler" / "local", gpus=0, one_organization=True)
    first = await b.launch(spec(tmp_path / "scheduler", "true", org="acme"))
    await wait_until(b, first, ended)
    await wait_until(b, await b.launch(spec(tmp_path / "scheduler", "true", org="acme")), ended)
    with pytest.raises(LaunchRefused, match=r"serves one organization only \(acme\), not globex"):
        await b.launch(spec(tmp_path / "scheduler", "true", org="globex"))
    restarted = LocalBackend(tmp_path / "scheduler" / "local", gpus=0, one_organization=True)
    with pytest.raises(LaunchRefused, match="one organization only"):  # the claim outlives the scheduler
        await restarted.launch(spec(tmp_path / "scheduler", "true", org="globex"))


def test_the_default_isolates_where_it_can_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TANDEM_SCHEDULER_LOCAL__RUN_AS")
    with caplog.at_level("INFO"):
        local = make_backends(SchedulerSettings(), tmp_path, hide=[tmp_path])["local"]
    assert isinstance(local, LocalBackend)
    if os.geteuid() == 0 and not sandbox.problem():
        assert (local.run_as, local.sandbox, local.one_organization) == ("org", True, False)
        assert "in a bubblewrap sandbox" in caplog.text
    # Not root: the mesh's own account, one organization, said at start-up.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    caplog.clear()
    with caplog.at_level("WARNING"):
        local = make_backends(SchedulerSettings(), tmp_path)["local"]
    assert isinstance(local, LocalBackend)
    assert (local.run_as, local.one_organization) == ("mesh", True)
    assert "serves one organization only" in caplog.text and "not root" in caplog.text
    assert resolve_run_as("local", "mesh", "auto")[0] == "mesh"  # explicitly: every organization, trusted


def test_a_choice_that_cannot_hold_is_a_setting_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SettingsError) as org:
        resolve_run_as("local", "org", "auto")
    assert settings_problem(org.value) == str(org.value)
    assert "TANDEM_SCHEDULER_LOCAL__RUN_AS=org needs the scheduler to run as root" in str(org.value)
    with pytest.raises(SettingsError, match="TANDEM_SCHEDULER_SLURM__RUN_AS=org"):
        resolve_run_as("slurm", "org")
    monkeypatch.setattr(sandbox, "problem", lambda: "bubblewrap (bwrap) is not installed")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SettingsError, match="TANDEM_SCHEDULER_LOCAL__SANDBOX=bwrap, but bubblewrap"):
        resolve_run_as("local", "auto", "bwrap")


def test_the_sandbox_opens_only_what_tandem_runs_from() -> None:
    account = pwd.getpwnam("nobody")
    closed = Path(tempfile.mkdtemp(prefix="tandem-closed-"))  # 0700, as /root is
    try:
        runtime = closed / "env" / "lib"
        runtime.mkdir(parents=True)
        argv = sandbox.command(["true"], account, cwd=Path("/"), hide=[], own=[], runtime=[runtime])
        joined = " ".join(argv)
        assert f"--perms 0711 --tmpfs {closed}" in joined and f"--ro-bind {runtime} {runtime}" in joined
        assert f"--perms 0711 --dir {closed / 'env'}" in joined
        assert sandbox.unreachable([runtime]) == [runtime] and sandbox.closed_ancestors([runtime]) == [closed]
    finally:
        shutil.rmtree(closed)


def test_tandem_up_refuses_a_sandbox_it_cannot_build(tmp_path: Path) -> None:
    """`bwrap` asked for where no bubblewrap is on PATH: exit 2 and the setting's name, not a traceback."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "TANDEM_SCHEDULER_LOCAL__SANDBOX": "bwrap"}
    env.pop("TANDEM_SCHEDULER_LOCAL__RUN_AS")
    # Ports the system picks: a default port may be another process's ephemeral one (50054 once was).
    env.update(
        {
            f"TANDEM_PORTS__{name}": "0"
            for name in ("GATEWAY", "VAULT", "SCHEDULER", "TASKAPP_PROXY", "EVENTS")
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "up", "--state-dir", str(tmp_path / "state")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "TANDEM_SCHEDULER_LOCAL__SANDBOX=bwrap, but bubblewrap" in done.stderr
    assert "Traceback" not in done.stderr and "bug" not in done.stderr


def environment_with_a_tool(env: Path) -> Path:
    """`env`/bin holding `tool`, a program anyone may run that prints "tool ran"; returns the bin folder."""
    env_bin = env / "bin"
    env_bin.mkdir(parents=True)
    (env_bin / "tool").write_text("#!/bin/sh\necho tool ran\n")
    (env_bin / "tool").chmod(0o755)
    return env_bin


def readable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o644)


@needs_root_and_bwrap
def test_the_task_reaches_its_folders_under_a_folder_others_cannot_enter() -> None:
    """The mesh's state folder inside a private folder (a home), the environment too: the task still runs
    its environment's program and writes its own folder, and finds nothing else of either folder."""
    account = org_account("acme")
    closed = Path(tempfile.mkdtemp(prefix="tandem-home-"))  # 0700
    try:
        env_bin = environment_with_a_tool(closed / "env")
        readable(closed / "notes.txt", "the owner's")  # readable, were the folder not private
        state = closed / "state"
        own = state / "scheduler" / "jobs" / "orgs-acme-jobs-j1" / "main"
        own.mkdir(parents=True)
        os.chown(own, account.pw_uid, account.pw_gid)
        script = f"{env_bin}/tool; touch {own}/written; cat {closed}/notes.txt || echo no notes"
        argv = sandbox.command(
            ["sh", "-c", script], account, cwd=own, hide=[state, state / "scheduler"], own=[own],
            runtime=[closed / "env"],
        )  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert "tool ran" in done.stdout and "no notes" in done.stdout, done.stdout + done.stderr
        assert (own / "written").exists()
    finally:
        shutil.rmtree(closed)


@needs_root_and_bwrap
def test_a_checkout_others_cannot_enter_is_opened_for_the_task_without_the_state_inside_it() -> None:
    """Tandem run from a checkout that is itself private (made by `mktemp -d`, or a home): binding the
    checkout back whole would bring back its 0700, so the task could not start Tandem's own Python. The
    checkout's entries are bound back one by one instead, a link as a link; the mesh's state inside it stays
    empty."""
    account = org_account("acme")
    checkout = Path(tempfile.mkdtemp(prefix="tandem-checkout-"))  # 0700
    try:
        env_bin = environment_with_a_tool(checkout / ".venv")
        readable(checkout / "Makefile", "the checkout's")
        (checkout / "tool-link").symlink_to(env_bin / "tool")
        private = checkout / "private"
        private.mkdir(mode=0o700)
        (private / "inner").mkdir()
        readable(private / "inner" / "code.py", "inside a private folder of the checkout")
        state = checkout / ".tandem"
        (state / "vault").mkdir(parents=True)
        (state / "vault" / "master.key").write_text("the mesh's")
        own = state / "scheduler" / "jobs" / "orgs-acme-jobs-j1" / "main"
        own.mkdir(parents=True)
        os.chown(own, account.pw_uid, account.pw_gid)
        script = (
            f"{env_bin}/tool; {checkout}/tool-link; cat {checkout}/Makefile; echo;"
            f" cat {private}/inner/code.py; echo; touch {own}/written;"
            f" ls -A {state}/vault | wc -l; test -e {state}/vault/master.key || echo no key"
        )
        argv = sandbox.command(
            ["sh", "-c", script], account, cwd=own, hide=[state, state / "scheduler"], own=[own],
            runtime=[checkout, checkout / ".venv"],
        )  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[:4] == [
            "tool ran",
            "tool ran",
            "the checkout's",
            "inside a private folder of the checkout",
        ]
        assert lines[4:] == ["0", "no key"], done.stdout + done.stderr
        assert (own / "written").exists()
        joined = " ".join(argv)
        assert f"--ro-bind {checkout} {checkout}" not in joined  # its entries, not the folder
        assert f"--symlink {env_bin / 'tool'} {checkout / 'tool-link'}" in joined
    finally:
        shutil.rmtree(checkout)
