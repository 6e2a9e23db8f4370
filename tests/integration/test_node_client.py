"""The contracts are usable outside Python: `tandem up` runs as a subprocess and tests/node/client.mjs drives
it from Node.js with @grpc/grpc-js and @grpc/proto-loader, given nothing but the .proto files (a health
check, the public GetServerInfo, and an unauthenticated PutSecret whose ErrorInfo reason it decodes);
tests/node/full_flow.mjs drives the whole flow (an organization, a sealed secret, a Task App, an online-RL
job followed to its end, its checkpoints) the same way."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import secrets
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
FULL_FLOW = REPO / "tests" / "node" / "full_flow.mjs"
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
    modules = ("@grpc/grpc-js", "@grpc/proto-loader", "libsodium-wrappers")
    if not all((REPO / "node_modules" / name).is_dir() for name in modules):
        missing.append("node_modules/" + ", ".join(modules) + " (run `npm ci` in the repo root)")
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


def _tiny_config(path: Path, org: str, model_dir: Path) -> None:
    """examples/jobs/demo.toml cut to 2 steps of 4 prompts x 4 episodes, a checkpoint each step, the model
    built in `model_dir`, the Task App of organization `org`."""
    text = (REPO / "examples" / "jobs" / "demo.toml").read_text()
    for pattern, value in {
        r"^name = .*$": f'name = "orgs/{org}/taskApps/single-turn"',
        r"^dir = .*$": f'dir = "{model_dir}"',
        r"^steps = .*$": "steps = 2",
        r"^group_size = .*$": "group_size = 4",
        r"^prompts_per_step = .*$": "prompts_per_step = 4",
        r"^checkpoint_interval = .*$": "checkpoint_interval = 1",
    }.items():
        text, count = re.subn(pattern, value, text, count=1, flags=re.MULTILINE)
        assert count == 1, pattern
    path.write_text(text)


@contextmanager
def _example_app(key: str) -> Iterator[str]:
    """The example single-turn Task App served on a free port with `key`."""
    port = _free_ports(1)[0]
    script = REPO / "examples" / "taskapps" / "single_turn.py"
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem_taskapp.serve", str(script), "--port", str(port)],
        cwd=REPO,
        env={**os.environ, "ENVIRONMENT_API_KEY": key},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert process.poll() is None and time.monotonic() < deadline, (
                "the example Task App did not start"
            )
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=STOP_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_node_client_runs_the_full_flow_from_the_protos_alone(tmp_path: Path) -> None:
    node = _node_or_skip()
    org = "node"
    config = tmp_path / "job.toml"
    _tiny_config(config, org, tmp_path / "model")
    key = secrets.token_urlsafe(24)
    state_dir = tmp_path / "state"
    with running_mesh(state_dir) as mesh, _example_app(key) as app_url:
        mesh.wait_ready(START_TIMEOUT_S)
        result = subprocess.run(
            [
                node,
                str(FULL_FLOW),
                "--gateway",
                mesh.target("GATEWAY"),
                "--state-dir",
                str(state_dir),
                "--protos",
                str(REPO / "protos"),
                "--task-app-url",
                app_url,
                "--config",
                str(config),
                "--org",
                org,
                "--job-timeout-s",
                "360",
            ],
            cwd=REPO,
            env={**os.environ, "TANDEM_ENV_KEY": key},
            capture_output=True,
            text=True,
            timeout=420,
            check=False,
        )
        report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\nmesh:\n{mesh.text()}"
        assert result.returncode == 0, report
        summary: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["org"] == f"orgs/{org}"
        assert summary["secret"] == f"orgs/{org}/secrets/single-turn-key"
        assert summary["task_app"] == f"orgs/{org}/taskApps/single-turn" and summary["checks"] > 0
        assert summary["job"] == f"orgs/{org}/jobs/node-rl"
        assert summary["terminal_state"] == "STATE_SUCCEEDED", report
        assert summary["job_states"][-1] == "STATE_SUCCEEDED", report
        # The trainer publishes its steps and checkpoints to the job's stream, in step order.
        assert summary["train_steps"] == [1, 2], report
        assert sorted(c["step"] for c in summary["checkpoints"]) == [1, 2], report
        print(json.dumps(summary))
        assert mesh.stop(STOP_TIMEOUT_S) == 0, mesh.text()
