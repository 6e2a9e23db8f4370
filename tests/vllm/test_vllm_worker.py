"""A vLLM inference worker on a CPU, as a real process: what it reports, generation with the log-probs of the
sampling distribution, the three pause modes, traces through the OpenAI-compatible endpoint, and the inputs it
must refuse with an error naming the setting (never a hang)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from tandem.inference.v1 import generation_pb2, weights_pb2, worker_pb2
from tandem.inference.v1 import inference_service_pb2 as pb

from mesh.status import RpcError
from tests.support.workers import Worker, start_worker, stop_worker, worker_stub
from tests.vllm.conftest import START_S, VLLM_CPU, greedy
from trainer.models import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def worker(model_dir: Path, mesh_key: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    started = start_worker(
        model_dir,
        tmp_path_factory.mktemp("worker"),
        mesh_key,
        {**VLLM_CPU, "TANDEM_WORKER_PAUSE_QUEUE_S": "60"},
        timeout_s=START_S,
    )
    try:
        yield started
    finally:
        stop_worker(started)


@pytest.fixture
async def stub(worker: Worker, mesh_key: str) -> AsyncIterator[object]:
    channel, opened = worker_stub(worker, mesh_key)
    try:
        yield opened
    finally:
        await channel.close()


def chat(max_tokens: int, correlation_id: str = "", **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        correlation_id=correlation_id,
        messages=[generation_pb2.ChatMessage(role="user", content="count to three")],
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


async def collect(stub: object, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [item async for item in stub.Generate(request)]  # type: ignore[attr-defined]


async def first_delta(
    stub: object, request: pb.GenerateRequest
) -> tuple[asyncio.Task[list[pb.GenerateResponse]], int]:
    """Start a generation and return once its first tokens arrived: (the task collecting the rest, the number
    of tokens already received)."""
    arrived = asyncio.Event()
    seen: list[pb.GenerateResponse] = []

    async def run() -> list[pb.GenerateResponse]:
        async for item in stub.Generate(request):  # type: ignore[attr-defined]
            seen.append(item)
            arrived.set()
        return seen

    task = asyncio.ensure_future(run())
    await asyncio.wait_for(arrived.wait(), 120)
    return task, len(seen)


async def test_the_worker_reports_vllm_on_the_cpu_with_the_gloo_transfer(stub: object) -> None:
    info = (await stub.GetWorkerInfo(pb.GetWorkerInfoRequest())).worker_info  # type: ignore[attr-defined]
    assert info.engine_kind == worker_pb2.ENGINE_KIND_VLLM
    assert info.device == "cpu"
    assert info.engine_version.startswith("0.")
    assert info.dtype == "bfloat16"  # vLLM's "auto" for a float32 checkpoint on a CPU
    assert list(info.weight_transfer_backends) == [weights_pb2.WEIGHT_TRANSFER_BACKEND_GLOO]
    assert info.max_context_tokens == 512


async def test_log_probs_are_those_of_the_sampling_distribution(stub: object) -> None:
    # top_p this small keeps only the most likely token: its processed log-prob is 0, its raw one is not.
    nucleus = await collect(stub, chat(12, temperature=1.0, top_p=1e-4, seed=1))
    tokens = [t for i in nucleus if i.HasField("delta") for t in i.delta.token_ids]
    logprobs = [p for i in nucleus if i.HasField("delta") for p in i.delta.logprobs]
    assert tokens and len(logprobs) == len(tokens)
    assert all(abs(p) < 1e-5 for p in logprobs)
    # A sampled token's log-prob at temperature 1 is below 0, and the top candidates include it.
    sampled = await collect(stub, chat(12, temperature=1.0, seed=2, top_logprobs=3))
    deltas = [i.delta for i in sampled if i.HasField("delta")]
    logprobs = [p for d in deltas for p in d.logprobs]
    assert len(logprobs) == sum(len(d.token_ids) for d in deltas) and all(p <= 0 for p in logprobs)
    assert any(p < -1e-3 for p in logprobs)
    for delta in deltas:
        for token, lp, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs, strict=True):
            assert 1 <= len(top.candidates) <= 3
            best = max(c.logprob for c in top.candidates)
            assert lp <= best + 1e-5
            if token in [c.token_id for c in top.candidates]:
                assert any(c.token_id == token and abs(c.logprob - lp) < 1e-4 for c in top.candidates)
    # Greedy is deterministic.
    prompt = list(range(5, 25))
    assert await greedy(stub, prompt) == await greedy(stub, prompt)


async def test_a_traced_generation_records_the_turn(stub: object) -> None:
    items = await collect(stub, chat(8, "vllm-ep-1", temperature=0.7, top_p=0.9, seed=3))
    tokens = [t for i in items if i.HasField("delta") for t in i.delta.token_ids]
    logprobs = [p for i in items if i.HasField("delta") for p in i.delta.logprobs]
    trace = (await stub.FinishTrace(pb.FinishTraceRequest(correlation_id="vllm-ep-1"))).trace  # type: ignore[attr-defined]
    turn = trace.turns[0]
    assert list(turn.completion_token_ids) == tokens
    assert list(turn.sampler_logprobs) == pytest.approx(logprobs)
    assert turn.temperature == pytest.approx(0.7) and turn.top_p == pytest.approx(0.9)


async def test_an_episode_over_the_openai_endpoint_becomes_one_trace(worker: Worker, stub: object) -> None:
    base = worker.openai_base_url
    async with httpx.AsyncClient(timeout=120) as http:
        answers = []
        for content in ("hello", "and then?"):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 6,
                "temperature": 1.0,
                "logprobs": True,
            }
            response = await http.post(f"{base}/traces/vllm-openai-ep/chat/completions", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json())
        plain = await http.post(
            f"{base}/completions", json={"model": "tiny", "prompt": "one two", "max_tokens": 4}
        )
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] is not None
    trace = (await stub.FinishTrace(pb.FinishTraceRequest(correlation_id="vllm-openai-ep"))).trace  # type: ignore[attr-defined]
    assert len(trace.turns) == 2
    for turn, answer in zip(trace.turns, answers, strict=True):
        assert list(turn.completion_token_ids) == answer["tandem"]["completion_token_ids"]
        sent = [entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"]]
        assert list(turn.sampler_logprobs) == pytest.approx(sent)


async def test_the_three_pause_modes(stub: object) -> None:
    # ABORT ends the generation in flight with its partial output.
    running, _ = await first_delta(stub, chat(400, temperature=1.0, seed=4))
    paused = await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_ABORT))  # type: ignore[attr-defined]
    items = await asyncio.wait_for(running, 60)
    assert paused.aborted_generations == 1
    assert items[-1].finished.finish_reason == generation_pb2.FINISH_REASON_ABORT
    # A request made during a pause waits for the resume.
    waiting = asyncio.ensure_future(collect(stub, chat(3, temperature=0.0)))
    await asyncio.sleep(1.0)
    assert not waiting.done()
    await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
    assert (await asyncio.wait_for(waiting, 60))[-1].HasField("finished")

    # KEEP freezes it; after the resume it runs to its end, nothing lost.
    running, _ = await first_delta(stub, chat(64, temperature=1.0, seed=5))
    kept = await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_KEEP))  # type: ignore[attr-defined]
    assert kept.kept_generations == 1
    await asyncio.sleep(1.0)
    assert not running.done()
    await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
    items = await asyncio.wait_for(running, 120)
    finished = items[-1].finished
    assert finished.finish_reason != generation_pb2.FINISH_REASON_ABORT
    assert finished.completion_tokens == sum(len(i.delta.token_ids) for i in items if i.HasField("delta"))

    # WAIT returns once the generation in flight has finished, which it does normally.
    running, _ = await first_delta(stub, chat(48, temperature=1.0, seed=6))
    waited = await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_WAIT))  # type: ignore[attr-defined]
    assert waited.aborted_generations == 0
    items = await asyncio.wait_for(running, 60)
    assert items[-1].finished.finish_reason != generation_pb2.FINISH_REASON_ABORT
    await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]


async def test_a_prompt_too_long_is_refused_with_its_reason(worker: Worker, stub: object) -> None:
    request = pb.GenerateRequest(
        prompt_token_ids=[7] * 512, sampling=generation_pb2.SamplingParams(max_tokens=4)
    )
    with pytest.raises(RpcError) as refused:
        await collect(stub, request)
    assert refused.value.reason == "CONTEXT_LENGTH_EXCEEDED"
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"model": "tiny", "prompt": [7] * 600, "max_tokens": 4}
        response = await http.post(f"{worker.openai_base_url}/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "CONTEXT_LENGTH_EXCEEDED"


def refusal(model_dir: Path, folder: Path, mesh_key: str, **settings: str) -> str:
    """The log of a vLLM worker that must refuse to start: it exits by itself (start_worker raises)."""
    with pytest.raises(RuntimeError) as failed:
        start_worker(model_dir, folder, mesh_key, {**VLLM_CPU, **settings}, timeout_s=START_S)
    return str(failed.value)


def test_a_missing_model_directory_is_named(mesh_key: str, tmp_path: Path) -> None:
    log = refusal(tmp_path / "no-such-model", tmp_path / "w", mesh_key)
    assert "TANDEM_WORKER_MODEL_PATH" in log and "no-such-model" in log


def test_a_model_directory_vllm_cannot_load_is_named(model_dir: Path, mesh_key: str, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in model_dir.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut short
    log = refusal(broken, tmp_path / "w", mesh_key)
    assert "TANDEM_WORKER_MODEL_PATH" in log and str(broken) in log


def test_an_architecture_vllm_does_not_know_is_named(model_dir: Path, mesh_key: str, tmp_path: Path) -> None:
    odd = tmp_path / "odd"
    odd.mkdir()
    for item in model_dir.iterdir():
        (odd / item.name).write_bytes(item.read_bytes())
    config = (odd / "config.json").read_text().replace('"LlamaForCausalLM"', '"NoSuchModelForCausalLM"')
    (odd / "config.json").write_text(config)
    log = refusal(odd, tmp_path / "w", mesh_key)
    assert "vLLM could not load TANDEM_WORKER_MODEL_PATH" in log


def test_a_dtype_vllm_refuses_is_named(model_dir: Path, mesh_key: str, tmp_path: Path) -> None:
    log = refusal(model_dir, tmp_path / "w", mesh_key, TANDEM_WORKER_DTYPE="int8")
    assert "TANDEM_WORKER_DTYPE='int8'" in log


def test_engine_settings_out_of_range_are_named(model_dir: Path, mesh_key: str, tmp_path: Path) -> None:
    log = refusal(model_dir, tmp_path / "a", mesh_key, TANDEM_WORKER_GPU_MEMORY_UTILIZATION="1.5")
    assert "TANDEM_WORKER_GPU_MEMORY_UTILIZATION" in log
    log = refusal(model_dir, tmp_path / "b", mesh_key, TANDEM_WORKER_ENFORCE_EAGER="sometimes")
    assert "TANDEM_WORKER_ENFORCE_EAGER" in log
    log = refusal(model_dir, tmp_path / "c", mesh_key, TANDEM_WORKER_TRANSFER_BACKEND="carrier-pigeon")
    assert "TANDEM_WORKER_TRANSFER_BACKEND" in log


def test_the_gloo_transfer_without_tandems_vllm_plugin_is_named(
    model_dir: Path, mesh_key: str, tmp_path: Path
) -> None:
    # vLLM's own allowlist of plugins, leaving Tandem's out: its engine core would not know the backend.
    log = refusal(model_dir, tmp_path / "w", mesh_key, VLLM_PLUGINS="lora_filesystem_resolver")
    assert "TANDEM_WORKER_TRANSFER_BACKEND" in log and "tandem_gloo_weight_transfer" in log


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (vLLM's engine core and its worker, for a vLLM worker), from /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


async def test_a_dead_engine_core_is_a_typed_error_not_a_hang(
    model_dir: Path, mesh_key: str, tmp_path: Path
) -> None:
    started = start_worker(model_dir, tmp_path / "w", mesh_key, VLLM_CPU, timeout_s=START_S)
    channel, stub = worker_stub(started, mesh_key)
    try:
        assert await greedy(stub, list(range(5, 25)), max_tokens=2)
        below = descendants(started.proc.pid)
        assert below  # vLLM runs its engine core in processes of its own
        for pid in below:  # the test's own worker's children, by id
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(RpcError) as failed:
            await asyncio.wait_for(greedy(stub, list(range(5, 25)), max_tokens=2), 120)
        assert failed.value.code.name == "UNAVAILABLE" and failed.value.reason == "DEPENDENCY_UNAVAILABLE"
        assert "engine" in failed.value.message
    finally:
        await channel.close()
        stop_worker(started)
