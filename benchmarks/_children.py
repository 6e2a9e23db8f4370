"""Child processes for the benchmarks: the system under test and its baseline run in processes of their own,
so neither shares the measuring client's event loop. Imported as `_children` by the scripts beside it."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system, all threads) of this process, or of child `pid` from /proc (Linux)."""
    if pid is None:
        return time.process_time()
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    fields = stat.rsplit(")", 1)[1].split()  # fields[11], fields[12]: utime and stime in clock ticks
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc (Linux)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *descendants(child)]
    return found


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit the set from theirs)."""
    for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(task.name), cpus)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")


@contextlib.contextmanager
def child_process(
    name: str,
    argv: Sequence[str],
    env: dict[str, str],
    folder: Path,
    *,
    port: int = 0,
    stop_timeout_s: float = 20,
) -> Iterator[Child]:
    """Start a child with its output in a log file; always stop it (SIGINT, then SIGKILL)."""
    log_path = folder / f"{name}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield Child(name, proc, log_path, port)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def serve_until_signal(server: grpc.aio.Server, port: int) -> None:
    """Run a baseline gRPC server on loopback until SIGINT or SIGTERM."""
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)
