"""LoRA updates into vLLM on a GPU (marker `gpu`; skipped where no GPU or no vLLM is present): the CPU tests'
check (tests/vllm/test_vllm_lora.py) on CUDA, where vLLM's LoRA kernels are punica's GPU ones. A worker serving
a small bfloat16 model with `TANDEM_WORKER_MAX_LORA_RANK` takes a peft adapter from this process (the
trainer, gloo into the worker process); its adapter checksums must equal the trainer's and its greedy output
that of a fresh worker started on the adapter's saved folder."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from tandem.trainer.v1 import config_pb2
from transformers import AutoModelForCausalLM

from tests.gpu.conftest import GPU_VLLM_MARKS, VLLM_ON_GPU
from tests.support.workers import Worker, start_worker, stop_worker, worker_stub
from tests.vllm.conftest import greedy
from trainer import lora
from trainer.inference.publisher import WeightPublisher
from trainer.models import build_tiny_model

pytestmark = GPU_VLLM_MARKS
VLLM = VLLM_ON_GPU
PROMPTS = ([11, 42, 7, 300, 5], list(range(20, 60, 3)))


@contextmanager
def vllm_worker(
    model: Path, folder: Path, mesh_key: str, extra: Mapping[str, str] | None = None
) -> Iterator[Worker]:
    """A vLLM worker on the GPU (a start bound of 600 s: CUDA graphs and compilation on a cold cache)."""
    started = start_worker(model, folder, mesh_key, {**VLLM, **(extra or {})}, timeout_s=600)
    try:
        yield started
    finally:
        stop_worker(started)


async def test_a_lora_update_into_vllm_on_cuda_serves_what_a_fresh_vllm_serves_from_its_folder(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=256, heads=4, dtype="bfloat16")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = lora.wrap(base, lora.spec_of(config_pb2.LoraConfig(rank=8)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in lora.adapter_parameters(policy):
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    named = lora.adapter_weights(policy, torch.bfloat16)
    mesh_key = secrets.token_hex(32)
    with vllm_worker(model_dir, tmp_path / "w", mesh_key, {"TANDEM_WORKER_MAX_LORA_RANK": "8"}) as w:
        channel, stub = worker_stub(w, mesh_key)
        async with channel:
            before = [await greedy(stub, list(p)) for p in PROMPTS]
            publisher = WeightPublisher(
                [stub], backend="gloo", transfer_timeout_s=120, mode="lora", lora=lora.resolved(policy)
            )
            report = await publisher.publish(1, named)
            assert report.mode == "lora"
            await publisher.verify(named)
            served = [await greedy(stub, list(p)) for p in PROMPTS]
    folder = tmp_path / "adapter"
    folder.mkdir()
    policy.peft_config[lora.ADAPTER].base_model_name_or_path = str(model_dir)
    lora.save_checkpoint(policy, folder, torch.bfloat16, merged=False)
    with vllm_worker(folder, tmp_path / "fresh", mesh_key) as fresh:
        channel, stub = worker_stub(fresh, mesh_key)
        async with channel:
            expected = [await greedy(stub, list(p)) for p in PROMPTS]
    assert expected != before
    assert served == expected
