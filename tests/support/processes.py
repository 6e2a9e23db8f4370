"""Start Tandem processes the way a user does, on free loopback ports, and stop them cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from mesh.launcher import MESH_SERVICES
from tests.support.postgres import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_LINE = "Press Ctrl-C to stop."


def mesh_env(state_dir: Path) -> tuple[dict[str, str], dict[str, int]]:
    ports = {name: free_port() for name in MESH_SERVICES}
    env = dict(os.environ)
    env.pop("TANDEM_CONFIG", None)
    env["TANDEM_STATE_DIR"] = str(state_dir)
    for name, port in ports.items():
        env[f"TANDEM_PORTS__{name.upper()}"] = str(port)
    return env, ports


@contextmanager
def tandem_up(
    state_dir: Path, timeout_s: float = 60.0
) -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    """`tandem up` in a child process; yields once it printed its addresses."""
    env, ports = mesh_env(state_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "up"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_line(proc, READY_LINE, timeout_s)
        yield proc, ports
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> list[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process exited ({proc.poll()}) before printing {needle!r}: {seen}")
        seen.append(line.rstrip())
        if needle in line:
            return seen
    raise AssertionError(f"no {needle!r} within {timeout_s}s: {seen}")


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT, timeout_s: float = 20.0) -> tuple[int, str]:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def run_service(
    service: str, state_dir: Path, extra_env: Sequence[tuple[str, str]] = ()
) -> tuple[subprocess.Popen[str], int]:
    env, ports = mesh_env(state_dir)
    env.update(extra_env)
    module = "gateway" if service == "gateway" else f"services.{service}"
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, ports[service]
