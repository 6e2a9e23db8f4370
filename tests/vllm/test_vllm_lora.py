"""LoRA updates into a vLLM worker on a CPU (`TANDEM_WORKER_MAX_LORA_RANK`, trainer/inference/vllm_lora.py):
this process is the trainer (`WeightPublisher` in mode "lora" over gloo), holding a peft adapter on the
worker's base model; each update is loaded by vLLM as a new adapter version.

The proof is behaviour, as for whole updates: after each version the worker's greedy output equals that of a
fresh vLLM worker started on the base model and that version's adapter folder (peft's saved files, what
`vllm serve --lora-modules` loads), and the adapter's checksums on the worker equal the trainer's. A request
admitted before an update keeps its adapter to its end across the pause, and the old adapter is dropped once
that request finished; a worker with a LoRA adapter refuses whole-weight updates and adapters it cannot
serve, before any byte moves, and keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from tandem.inference.v1 import generation_pb2, weights_pb2
from tandem.inference.v1 import inference_service_pb2 as pb
from tandem.trainer.v1 import config_pb2
from transformers import AutoModelForCausalLM

from mesh.status import RpcError
from tests.support.postgres import free_port
from tests.support.workers import Worker, start_worker, stop_worker, worker_stub
from tests.vllm.conftest import START_S, VLLM_CPU, fresh_outputs, greedy, weight_info
from trainer import lora
from trainer.inference.publisher import WeightPublisher
from trainer.models import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
PROMPTS = ([11, 42, 7, 300, 5], list(range(20, 60, 3)), [400, 2, 2, 2, 99, 100])
RANK = 4
# the trainer's dtype (vLLM's CPU build serves a float32 checkpoint in bfloat16 by default)
SERVED = {**VLLM_CPU, "TANDEM_WORKER_DTYPE": "float32"}
WORKER_ENV = {
    **SERVED,
    "TANDEM_WORKER_PAUSE_QUEUE_S": "30",
    "TANDEM_WORKER_TRANSFER_TIMEOUT_S": "30",
    "TANDEM_WORKER_MAX_LORA_RANK": "8",
}


class Served:
    """A vLLM worker serving LoRA adapters over a small base model, and the trainer's peft policy on it."""

    def __init__(self, model_dir: Path, worker: Worker, tmp: Path) -> None:
        self.model_dir = model_dir
        self.worker = worker
        self.tmp = tmp
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.policy = lora.wrap(base, lora.spec_of(config_pb2.LoraConfig(rank=RANK)))
        self.spec = lora.resolved(self.policy)

    def move(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """Set the policy's adapter to seeded values (B non-zero, so it changes what the model says) and
        return what a LoRA update sends."""
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for _, parameter in lora.adapter_parameters(self.policy):
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
        return lora.adapter_weights(self.policy, torch.float32)

    def save(self, version: int) -> Path:
        """The adapter folder of `version`, as a LoRA job's checkpoint holds it."""
        folder = self.tmp / f"adapter-v{version}"
        folder.mkdir()
        self.policy.peft_config[lora.ADAPTER].base_model_name_or_path = str(self.model_dir)
        lora.save_checkpoint(self.policy, folder, torch.float32, merged=False)
        return folder

    def base_weights(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.model_dir / "model.safetensors"))

    async def settled(self) -> int:
        """The adapter versions held once the worker's event loop has removed the unused ones (a request's
        end removes the adapter it held just after its last answer is sent): polled up to 5 s."""
        for _ in range(50):
            if len(self.adapter_folders()) == 1:
                break
            await asyncio.sleep(0.1)
        return len(self.adapter_folders())

    def publisher(self, stub: object) -> WeightPublisher:
        """A trainer's publisher of this adapter's LoRA updates to the worker, over gloo."""
        return WeightPublisher([stub], backend="gloo", transfer_timeout_s=60, mode="lora", lora=self.spec)

    def adapter_folders(self) -> list[Path]:
        """The adapter versions the worker's vLLM holds (each a folder in the worker's temp directory)."""
        return sorted(self.tmp.glob("worker-tmp/tandem-vllm-lora-*/v*"))


@pytest.fixture(scope="module")
def served(mesh_key: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = build_tiny_model(tmp / "base", tie_embeddings=False)
    (tmp / "worker-tmp").mkdir()
    env = {**WORKER_ENV, "TMPDIR": str(tmp / "worker-tmp")}
    worker = start_worker(model_dir, tmp / "worker", mesh_key, env, timeout_s=START_S)
    try:
        yield Served(model_dir, worker, tmp)
    finally:
        stop_worker(worker)


@pytest.fixture
async def stub(served: Served, mesh_key: str) -> AsyncIterator[object]:
    channel, opened = worker_stub(served.worker, mesh_key)
    try:
        yield opened
    finally:
        await channel.close()


async def test_each_adapter_version_serves_what_a_fresh_vllm_serves_from_its_folder(
    served: Served, stub: object, mesh_key: str
) -> None:
    info = (await stub.GetWorkerInfo(pb.GetWorkerInfoRequest())).worker_info  # type: ignore[attr-defined]
    assert list(info.weight_update_modes) == [weights_pb2.WEIGHT_UPDATE_MODE_LORA]
    assert list(info.weight_transfer_backends) == [weights_pb2.WEIGHT_TRANSFER_BACKEND_GLOO]
    assert info.weight_transfer_ranks == 1  # the worker process receives, whatever vLLM's tensor parallelism
    base = [await greedy(stub, list(p)) for p in PROMPTS]
    current = (await weight_info(stub)).weight_version
    publisher = served.publisher(stub)
    base_bytes = sum(t.numel() * t.element_size() for t in served.base_weights().values())
    for version in (current + 1, current + 2):
        named = served.move(version)
        report = await publisher.publish(version, named)
        assert report.mode == "lora" and 0 < report.bytes < 0.2 * base_bytes
        await publisher.verify(named)  # the worker's adapter is the trainer's, bit for bit
        adapter = served.save(version)
        expected = await fresh_outputs(
            adapter, adapter.parent / f"fresh-{adapter.name}", mesh_key, SERVED, PROMPTS
        )
        assert expected != base  # the adapter changes what greedy decoding says
        held = await weight_info(stub)
        assert held.weight_version == version
        assert held.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY
        assert [await greedy(stub, list(p)) for p in PROMPTS] == expected
        assert await served.settled() == 1  # the version it replaced is gone


async def test_a_request_keeps_its_adapter_across_an_update_and_the_old_one_goes_when_it_ends(
    served: Served, stub: object
) -> None:
    publisher = served.publisher(stub)
    first = (await weight_info(stub)).weight_version + 1
    await publisher.publish(first, served.move(first))
    prompt = list(PROMPTS[0])
    long = 400  # at most: greedy decoding of this model runs long before any end-of-sequence token
    alone = await greedy(stub, prompt, max_tokens=long)
    assert len(alone) > 100
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, sampling=generation_pb2.SamplingParams(max_tokens=long, temperature=0.0)
    )
    items: list[pb.GenerateResponse] = []
    started = asyncio.Event()

    async def listen() -> None:
        async for item in stub.Generate(request):  # type: ignore[attr-defined]
            items.append(item)
            started.set()

    listening = asyncio.ensure_future(listen())
    await asyncio.wait_for(started.wait(), timeout=60)
    await publisher.publish(first + 1, served.move(first + 1))  # pauses (KEEP) with the request in flight
    held_during = len(served.adapter_folders())
    await asyncio.wait_for(listening, timeout=120)
    tokens = [t for item in items if item.HasField("delta") for t in item.delta.token_ids]
    finished = [item.finished for item in items if item.HasField("finished")]
    assert tokens == alone  # the whole request ran with the adapter it was admitted with
    assert {item.delta.weight_version for item in items if item.HasField("delta")} == {first}
    assert (finished[0].weight_version, finished[0].last_weight_version) == (first, first)
    assert held_during == 2  # the old adapter stayed while the request used it
    newer = await greedy(stub, prompt, max_tokens=long)
    assert newer != alone
    assert await served.settled() == 1


async def test_a_lora_worker_refuses_what_it_cannot_serve_and_keeps_serving(
    served: Served, stub: object
) -> None:
    # One update first: in whatever order the module's tests ran, the worker's transfer is then up and an
    # adapter is in service, so each refusal below is the request's own and not a missing group's.
    publisher = served.publisher(stub)
    first = (await weight_info(stub)).weight_version + 1
    await publisher.publish(first, served.move(first))
    held = await weight_info(stub)
    before = [await greedy(stub, list(p)) for p in PROMPTS]
    version = held.weight_version + 1
    named = served.move(version)
    specs = [weights_pb2.TensorSpec(name=n, dtype="float32", shape=list(t.shape)) for n, t in named]
    whole = [
        weights_pb2.TensorSpec(name=n, dtype="float32", shape=list(t.shape))
        for n, t in served.base_weights().items()
    ]
    other_rank = weights_pb2.LoraAdapterSpec(
        rank=RANK * 2, alpha=served.spec.alpha, target_modules=served.spec.target_modules
    )
    wrong = [weights_pb2.TensorSpec(name=named[0][0], dtype="float32", shape=[1, 2])]
    mode = weights_pb2.WEIGHT_UPDATE_MODE_LORA
    await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_KEEP))  # type: ignore[attr-defined]
    cases = [
        ({"manifest": whole}, "WEIGHT_UPDATE_MODE_UNSUPPORTED"),  # whole weights: the base is fixed
        ({"manifest": specs, "mode": mode, "lora": other_rank}, "WEIGHT_UPDATE_MODE_UNSUPPORTED"),
        ({"manifest": wrong, "mode": mode, "lora": served.spec}, "WEIGHT_MANIFEST_MISMATCH"),
    ]
    for fields, reason in cases:
        with pytest.raises(RpcError) as refused:
            await stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(weight_version=version, **fields))  # type: ignore[attr-defined]
        assert refused.value.reason == reason, fields
    await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
    after = await weight_info(stub)
    assert after.weight_version == held.weight_version
    assert after.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY
    assert [await greedy(stub, list(p)) for p in PROMPTS] == before


async def test_vllm_serve_loads_a_lora_checkpoint_and_says_what_the_worker_says(
    served: Served, stub: object, tmp_path: Path
) -> None:
    """The adapter folder of a LoRA job's checkpoint, served by vLLM's own OpenAI server (`vllm serve BASE
    --enable-lora --lora-modules name=folder`) and asked through the `openai` client, gives the greedy
    completions the Tandem worker gives with that adapter version."""
    import openai  # noqa: PLC0415 - vLLM's own requirement

    version = (await weight_info(stub)).weight_version + 1
    publisher = served.publisher(stub)
    await publisher.publish(version, served.move(version))
    folder = served.save(version)
    worker_says = [await greedy(stub, list(p)) for p in PROMPTS]
    port = free_port()
    log = (tmp_path / "vllm-serve.log").open("w")
    # `vllm serve`'s server; the CPU build's `vllm` command cannot read its own version (the package is named
    # vllm-cpu), so it is started as the module that command runs.
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(served.model_dir),
        "--enable-lora",
        "--lora-modules",
        f"tandem-adapter={folder}",
        "--max-lora-rank",
        "8",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--port",
        str(port),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": VLLM_CPU["VLLM_CPU_KVCACHE_SPACE"]}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)  # noqa: ASYNC220
    try:
        base_url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as http:
            for _ in range(int(START_S)):
                assert server.poll() is None, (tmp_path / "vllm-serve.log").read_text()[-4000:]
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{base_url}/health")).status_code == 200:
                        break
                await asyncio.sleep(1)
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
        listed = {model.id for model in (await client.models.list()).data}
        assert "tandem-adapter" in listed
        vllm_says = []
        for prompt in PROMPTS:
            answer = await client.completions.create(
                model="tandem-adapter",
                prompt=list(prompt),
                max_tokens=12,
                temperature=0.0,
                extra_body={"return_token_ids": True},
            )
            vllm_says.append(list(answer.choices[0].token_ids or []))  # type: ignore[attr-defined]
        await client.close()
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert vllm_says == worker_says
