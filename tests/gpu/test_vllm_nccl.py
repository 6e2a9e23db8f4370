"""NCCL weight transfer into two vLLM workers (marker `gpu`; needs three GPUs and the `gpu` extra).

This process is the trainer on GPU 0 (rank 0 of vLLM's stateless NCCL group, `WeightPublisher` with the nccl
backend); each worker serves a small locally built model with vLLM on a GPU of its own (NCCL refuses two
ranks of one group on the same device, so a machine with fewer than three GPUs skips this file and
`scripts/gpu_check.sh` says so). After versions 1 and 2 every worker's checksums equal the trainer's
(`WeightPublisher.verify`, which on a GPU hashes the parameters vLLM serves), and a fresh vLLM loaded from
the trainer's weights of that version on disk reports the same digest.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tandem.inference.v1 import inference_service_pb2 as pb
from tandem.inference.v1 import weights_pb2

from tests.gpu.conftest import GPU_VLLM_MARKS
from tests.support.workers import Worker, start_worker, stop_worker, worker_stub
from trainer.inference.publisher import WeightPublisher
from trainer.models import build_tiny_model

pytestmark = [
    *GPU_VLLM_MARKS,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 3,
        reason="NCCL into two vLLM workers needs three GPUs: the trainer's and one per worker",
    ),
]


def worker_env(device: int) -> dict[str, str]:
    return {
        "TANDEM_WORKER_ENGINE": "vllm",
        "TANDEM_WORKER_TRANSFER_BACKEND": "nccl",
        "TANDEM_WORKER_GPU_MEMORY_UTILIZATION": "0.3",
        "CUDA_VISIBLE_DEVICES": str(device),
    }


@pytest.fixture(scope="module")
def mesh_key() -> str:
    return secrets.token_hex(32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("nccl") / "tiny", hidden_size=256, heads=4, dtype="bfloat16"
    )


@pytest.fixture(scope="module")
def workers(
    model_dir: Path, mesh_key: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    folder = tmp_path_factory.mktemp("nccl-workers")
    started: list[Worker] = []
    try:
        for device in (1, 2):
            started.append(start_worker(model_dir, folder / f"w{device}", mesh_key, worker_env(device), 600))
        yield started
    finally:
        for worker in started:
            stop_worker(worker)


def saved(model_dir: Path, target: Path, named: list[tuple[str, torch.Tensor]]) -> Path:
    target.mkdir()
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    save_file({name: tensor.cpu() for name, tensor in named}, str(target / "model.safetensors"))
    return target


async def test_two_vllm_workers_serve_exactly_each_version_broadcast_over_nccl(
    workers: list[Worker], model_dir: Path, mesh_key: str, tmp_path: Path
) -> None:
    torch.cuda.set_device(0)
    base = load_file(str(model_dir / "model.safetensors"))
    opened = [worker_stub(w, mesh_key) for w in workers]
    stubs = [stub for _, stub in opened]
    publisher = WeightPublisher(
        stubs, backend="nccl", bucket_size_bytes=1 << 20, transfer_timeout_s=120, rpc_timeout_s=120
    )
    try:
        for version in (1, 2):
            generator = torch.Generator().manual_seed(version)
            named = [
                (name, (t.float() + 0.01 * torch.randn(t.shape, generator=generator)).to(t.dtype).cuda())
                for name, t in base.items()
            ]
            report = await publisher.publish(version, named)
            assert report.workers == 2 and report.buckets > 1
            digest = await publisher.verify(named)
            for stub in stubs:
                info = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info
                assert info.weight_version == version
                assert info.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY
        request = pb.ComputeWeightChecksumsRequest(
            algorithm=weights_pb2.CHECKSUM_ALGORITHM_SHA256, names=[name for name, _ in named]
        )
        served = {c.name: c.checksum for c in (await stubs[0].ComputeWeightChecksums(request)).checksums}
        checkpoint = saved(model_dir, tmp_path / "v2", named)
        fresh = start_worker(checkpoint, tmp_path / "fresh", mesh_key, worker_env(1), 600)
        channel, stub = worker_stub(fresh, mesh_key)
        try:
            loaded = {c.name: c.checksum for c in (await stub.ComputeWeightChecksums(request)).checksums}
        finally:
            await channel.close()
            stop_worker(fresh)
        assert digest and loaded == served and len(served) == len(named)
    finally:
        publisher.close()
        for channel, _ in opened:
            await channel.close()
        torch.cuda.empty_cache()
