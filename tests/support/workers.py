"""Inference worker processes for tests: started as the job launcher starts them, with a mesh key shared
with the test so its service tokens are accepted."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import grpc
from tandem.inference.v1 import inference_service_pb2_grpc

from mesh.clients import open_channel
from mesh.identity import TokenSigner
from mesh.settings import Settings
from trainer.inference.process import Worker, start_worker, stop_worker

__all__ = [
    "Worker",
    "open_stubs",
    "running_worker",
    "running_workers",
    "start_worker",
    "stop_worker",
    "stub_at",
    "worker_stub",
]


@contextmanager
def running_worker(
    model_dir: Path, folder: Path, mesh_key: str, extra: Mapping[str, str] | None = None
) -> Iterator[Worker]:
    worker = start_worker(model_dir, folder, mesh_key, extra)
    try:
        yield worker
    finally:
        stop_worker(worker)


@contextmanager
def running_workers(model_dir: Path, folders: list[Path], mesh_key: str) -> Iterator[list[Worker]]:
    """One worker per folder; every worker in the list when it ends is stopped (a test that replaces one
    puts the replacement in the list)."""
    started = [start_worker(model_dir, folder, mesh_key) for folder in folders]
    try:
        yield started
    finally:
        for worker in started:
            stop_worker(worker)


@asynccontextmanager
async def open_stubs(
    workers: list[Worker], mesh_key: str
) -> AsyncIterator[list[inference_service_pb2_grpc.InferenceServiceStub]]:
    """A stub per worker, their channels closed at the end."""
    opened = [worker_stub(w, mesh_key) for w in workers]
    try:
        yield [stub for _, stub in opened]
    finally:
        for channel, _ in opened:
            await channel.close()


def worker_stub(
    worker: Worker, mesh_key: str
) -> tuple[grpc.aio.Channel, inference_service_pb2_grpc.InferenceServiceStub]:
    """A channel carrying a service token signed by the shared mesh key, and the worker's stub on it."""
    return stub_at(worker.grpc_address, mesh_key)


def stub_at(
    address: str, mesh_key: str
) -> tuple[grpc.aio.Channel, inference_service_pb2_grpc.InferenceServiceStub]:
    """`worker_stub` by the worker's gRPC address, for a process that holds only the address."""
    import nacl.signing  # noqa: PLC0415

    settings = Settings(mesh_key=mesh_key)
    signer = TokenSigner(nacl.signing.SigningKey(bytes.fromhex(mesh_key)))
    channel = open_channel(address, settings, signer=signer, subject="trainer")
    return channel, inference_service_pb2_grpc.InferenceServiceStub(channel)
