"""The vLLM engine on a GPU (marker `gpu`; skipped where no GPU or no vLLM is present).

Run them with `scripts/gpu_check.sh` on a machine with one NVIDIA GPU and the `gpu` extra installed. A worker
process serves a small locally built model with vLLM; this process plays the trainer on the same GPU and
pushes new weights over CUDA IPC; a second worker loaded from those weights on disk must then report the
same checksums as the updated one, which proves the update put exactly the trainer's weights in service.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from tandem.inference.v1 import generation_pb2
from tandem.inference.v1 import inference_service_pb2 as pb

from tests.gpu.conftest import GPU_VLLM_MARKS, VLLM_ON_GPU
from tests.support.workers import Worker, start_worker, stop_worker, worker_stub
from trainer.inference.publisher import WeightPublisher
from trainer.models import build_tiny_model

pytestmark = GPU_VLLM_MARKS
VLLM = {**VLLM_ON_GPU, "TANDEM_WORKER_TRANSFER_BACKEND": "ipc"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64: every attention backend vLLM picks on current GPUs supports it.
    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", hidden_size=256, heads=4, dtype="bfloat16"
    )


def copy_model(source: Path, target: Path, weights: dict[str, torch.Tensor]) -> Path:
    """The model directory at `target` with `weights` in place of its own."""
    target.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    save_file(weights, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def mesh_key() -> str:
    return secrets.token_hex(32)


@pytest.fixture
async def worker(model_dir: Path, mesh_key: str, tmp_path: Path) -> AsyncIterator[Worker]:
    started = start_worker(model_dir, tmp_path / "w", mesh_key, VLLM, timeout_s=600)
    try:
        yield started
    finally:
        stop_worker(started)


async def test_vllm_generates_with_sampler_logprobs_and_records_the_trace(
    worker: Worker, mesh_key: str
) -> None:
    channel, stub = worker_stub(worker, mesh_key)
    try:
        request = pb.GenerateRequest(
            correlation_id="gpu-ep-1",
            messages=[generation_pb2.ChatMessage(role="user", content="hello")],
            sampling=generation_pb2.SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9),
        )
        items = [item async for item in stub.Generate(request)]
        tokens = [t for i in items if i.HasField("delta") for t in i.delta.token_ids]
        logprobs = [p for i in items if i.HasField("delta") for p in i.delta.logprobs]
        assert tokens and len(logprobs) == len(tokens) and all(p <= 0 for p in logprobs)
        trace = (await stub.FinishTrace(pb.FinishTraceRequest(correlation_id="gpu-ep-1"))).trace
        assert list(trace.turns[0].completion_token_ids) == tokens
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            answer = (await http.post(f"{worker.openai_base_url}/chat/completions", json=body)).json()
            assert answer["choices"][0]["message"]["content"] is not None
    finally:
        await channel.close()


async def test_an_ipc_update_puts_exactly_the_trainers_weights_in_service(
    worker: Worker, model_dir: Path, mesh_key: str, tmp_path: Path
) -> None:
    weights = load_file(str(model_dir / "model.safetensors"))
    named = [(name, (tensor.float() * 1.01).to(tensor.dtype).cuda()) for name, tensor in weights.items()]
    channel, stub = worker_stub(worker, mesh_key)
    publisher = WeightPublisher([stub], backend="ipc", transfer_timeout_s=120, rpc_timeout_s=120)
    try:
        report = await publisher.publish(1, named)
        assert report.version == 1
        updated = await stub.ComputeWeightChecksums(pb.ComputeWeightChecksumsRequest())
        assert updated.weight_version == 1
    finally:
        publisher.close()
        await channel.close()
    # A second worker loaded from the same tensors on disk holds exactly the same parameters.
    saved = copy_model(model_dir, tmp_path / "updated", {name: tensor.cpu() for name, tensor in named})
    fresh = start_worker(saved, tmp_path / "fresh", mesh_key, VLLM, timeout_s=600)
    fresh_channel, fresh_stub = worker_stub(fresh, mesh_key)
    try:
        loaded = await fresh_stub.ComputeWeightChecksums(pb.ComputeWeightChecksumsRequest())
        assert loaded.digest == updated.digest
    finally:
        await fresh_channel.close()
        stop_worker(fresh)
        torch.cuda.empty_cache()
