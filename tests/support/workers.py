"""Inference worker processes for tests: `python -m trainer.inference.worker` on free ports, as a launcher
starts them, with a mesh key shared with the test so its service tokens are accepted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from tandem.inference.v1 import inference_service_pb2_grpc

from mesh.clients import open_channel
from mesh.identity import TokenSigner
from mesh.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
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


def stop_worker(worker: Worker, timeout_s: float = 20.0) -> None:
    if worker.proc.poll() is None:
        worker.proc.terminate()
        try:
            worker.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()


@contextmanager
def running_worker(
    model_dir: Path, folder: Path, mesh_key: str, extra: Mapping[str, str] | None = None
) -> Iterator[Worker]:
    worker = start_worker(model_dir, folder, mesh_key, extra)
    try:
        yield worker
    finally:
        stop_worker(worker)


def worker_stub(
    worker: Worker, mesh_key: str
) -> tuple[grpc.aio.Channel, inference_service_pb2_grpc.InferenceServiceStub]:
    """A channel carrying a service token signed by the shared mesh key, and the worker's stub on it."""
    import nacl.signing  # noqa: PLC0415

    settings = Settings(mesh_key=mesh_key)
    signer = TokenSigner(nacl.signing.SigningKey(bytes.fromhex(mesh_key)))
    channel = open_channel(worker.grpc_address, settings, signer=signer, subject="trainer")
    return channel, inference_service_pb2_grpc.InferenceServiceStub(channel)
