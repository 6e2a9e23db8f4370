"""Inference worker processes: `python -m trainer.inference.worker` with its settings in the environment, on
a free port, started by the job launcher (and the tests) and stopped without leaving orphans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = (
    Path(__file__).resolve().parents[2]
)  # the checkout; workers run as `python -m trainer.inference.worker`


def die_with_parent() -> None:
    """In a child before exec: Linux sends it SIGTERM when the process that started it dies, however it dies
    (a SIGKILLed launcher leaves no orphan workers). Elsewhere a no-op."""
    if sys.platform != "linux":
        return
    import ctypes  # noqa: PLC0415
    import signal  # noqa: PLC0415

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    grpc_address: str
    openai_base_url: str
    incarnation: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def worker_env(
    model_dir: Path, folder: Path, mesh_key: str, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    # The worker's own settings, not the caller's; the OTLP collector (when one is set) is shared.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") or k == "TANDEM_OTLP_ENDPOINT"}
    env.update(
        {
            "TANDEM_STATE_DIR": str(folder / "state"),
            "TANDEM_MESH_KEY": mesh_key,
            "TANDEM_PORTS__INFERENCE": "0",
            "TANDEM_WORKER_MODEL_PATH": str(model_dir),
            "TANDEM_WORKER_READY_FILE": str(folder / "ready.json"),
            "TANDEM_WORKER_TRANSFER_TIMEOUT_S": "20",
            "OMP_NUM_THREADS": "1",
        }
    )
    env.update(extra or {})
    return env


def start_worker(
    model_dir: Path,
    folder: Path,
    mesh_key: str,
    extra: Mapping[str, str] | None = None,
    timeout_s: float = 90.0,
) -> Worker:
    """Start a worker and wait until it wrote its ready file; raises with the worker's log if it exits."""
    folder.mkdir(parents=True, exist_ok=True)
    ready = folder / "ready.json"
    ready.unlink(missing_ok=True)
    log_path = folder / "worker.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.inference.worker"],
            cwd=ROOT,
            env=worker_env(model_dir, folder, mesh_key, extra or {}),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only sets the parent-death signal
        )
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(
                f"worker exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"worker not ready in {timeout_s} s:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return Worker(proc, info["grpc"], info["openai_base_url"], info["incarnation"], log_path)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM a child we started, SIGKILL it after `grace_s`, and reap it; nothing if it has ended."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_worker(worker: Worker, timeout_s: float = 20.0) -> None:
    stop_process(worker.proc, timeout_s)
