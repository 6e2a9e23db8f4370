"""The contracts are usable outside Python: `tandem up` runs as a subprocess and tests/node/client.mjs drives
it from Node.js with @grpc/grpc-js and @grpc/proto-loader, given nothing but the .proto files (a health
check, the public GetServerInfo, and an unauthenticated PutSecret whose ErrorInfo reason it decodes)."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "tests" / "node" / "client.mjs"
READY_LINE = "Press Ctrl-C to stop."
PORT_SETTINGS = ("GATEWAY", "VAULT", "SCHEDULER", "TASKAPP_PROXY", "EVENTS")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


def _node_or_skip() -> str:
    """The node binary; in CI (CI set) a missing toolchain fails the test rather than skipping it."""
    node = shutil.which("node")
    missing = []
    if node is None:
        missing.append("`node` (Node.js 20) on PATH")
    if (
        not (REPO / "node_modules" / "@grpc" / "grpc-js").is_dir()
        or not (REPO / "node_modules" / "@grpc" / "proto-loader").is_dir()
    ):
        missing.append("node_modules/@grpc/grpc-js and @grpc/proto-loader (run `npm ci` in the repo root)")
    if missing:
        message = "the Node.js client test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    assert node is not None
    return node


def _google_protos_dir() -> Path:
    """The folder holding google/rpc/status.proto: googleapis-common-protos ships the .proto sources."""
    spec = importlib.util.find_spec("google.rpc.status_pb2")  # found, not imported: no stubs needed
    assert spec is not None and spec.origin, "googleapis-common-protos is not installed"
    root = Path(spec.origin).resolve().parent.parent.parent
    for name in ("status.proto", "error_details.proto"):
        assert (root / "google" / "rpc" / name).is_file(), f"googleapis-common-protos lacks {name}"
    return root


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on: bound to 0 together so they differ, then released for the mesh."""
    with ExitStack() as stack:
        sockets = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)
        ]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


class Mesh:
    """`tandem up` in a subprocess; its output is collected on a thread so the pipe never fills."""

    def __init__(self, state_dir: Path, ports: dict[str, int]) -> None:
        env = dict(os.environ)
        env.update({f"TANDEM_PORTS__{name}": str(port) for name, port in ports.items()})
        env["PYTHONUNBUFFERED"] = "1"
        self.ports = ports
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "up", "--state-dir", str(state_dir)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.process.stdout is not None
        self._reader = threading.Thread(target=_pump, args=(self.process.stdout, self._lines), daemon=True)
        self._reader.start()

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the mesh did not print {READY_LINE!r} within {timeout_s}s:\n{self.text()}")
            if line is None:
                self.process.wait(timeout=5)
                pytest.fail(f"the mesh exited with {self.process.returncode} before ready:\n{self.text()}")
            self.output.append(line)
            if line.strip() == READY_LINE:
                return

    def stop(self, timeout_s: float) -> int:
        """Ctrl-C, as a person stops `tandem up`; returns the exit status."""
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        while not self._lines.empty():
            line = self._lines.get_nowait()
            if line is not None:
                self.output.append(line)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)

    def text(self) -> str:
        return "".join(self.output)


@contextmanager
def running_mesh(state_dir: Path) -> Iterator[Mesh]:
    ports = dict(zip(PORT_SETTINGS, _free_ports(len(PORT_SETTINGS)), strict=True))
    mesh = Mesh(state_dir, ports)
    try:
        yield mesh
    finally:
        mesh.kill()


def _run_client(node: str, mesh: Mesh) -> subprocess.CompletedProcess[str]:
    """Runs tests/node/client.mjs against the mesh, with the repo's protos and googleapis' as includes."""
    return subprocess.run(
        [
            node,
            str(CLIENT),
            "--gateway",
            mesh.target("GATEWAY"),
            "--vault",
            mesh.target("VAULT"),
            "--protos",
            str(REPO / "protos"),
            "--google-protos",
            str(_google_protos_dir()),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(120)
def test_node_client_drives_the_mesh_from_the_protos_alone(tmp_path: Path) -> None:
    node = _node_or_skip()
    with running_mesh(tmp_path / "state") as mesh:
        mesh.wait_ready(START_TIMEOUT_S)
        result = _run_client(node, mesh)
        report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\nmesh:\n{mesh.text()}"
        assert result.returncode == 0, report
        lines = result.stdout.strip().splitlines()
        for check in ("ok health", "ok server_info", "ok error_model"):
            assert any(line.startswith(check) for line in lines), report
        summary: dict[str, Any] = json.loads(lines[-1])
        assert summary["ok"] is True, report
        assert summary["health"] == "SERVING"
        assert summary["server_info"]["components"] == [
            "gateway",
            "vault",
            "scheduler",
            "taskapp-proxy",
            "events",
        ]
        error = summary["error_model"]
        assert (error["code"], error["reason"], error["domain"]) == (
            "UNAUTHENTICATED",
            "MISSING_CREDENTIALS",
            "tandem.dev",
        )

        assert mesh.stop(STOP_TIMEOUT_S) == 0, mesh.text()
        assert "Tandem stopped." in mesh.text()
