"""Inference workers as real processes: generation over gRPC and the OpenAI-compatible endpoint, trace
attribution across turns, pause modes, and weight sync from this process (rank 0) to two workers over gloo,
with the faults the protocol must survive."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from tandem.inference.v1 import generation_pb2, trace_pb2, weights_pb2
from tandem.inference.v1 import inference_service_pb2 as pb

from mesh.errors import FailedPrecondition, R
from mesh.status import RpcError
from tests.support.workers import Worker, open_stubs, running_workers, start_worker, stop_worker, worker_stub
from trainer.inference.config import WorkerSettings
from trainer.inference.engine import EngineInfo, PauseMode, Sampling
from trainer.inference.publisher import WeightPublisher, WeightSyncError
from trainer.inference.sync import WeightSync
from trainer.inference.torch_engine import TorchEngine
from trainer.inference.vllm_engine import VllmEngine
from trainer.inference.worker import InferenceWorker
from trainer.models import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def mesh_key() -> str:
    return secrets.token_hex(32)


@pytest.fixture(scope="module")
def workers(
    model_dir: Path, mesh_key: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    with running_workers(
        model_dir, [tmp_path_factory.mktemp(f"worker{i}") for i in range(2)], mesh_key
    ) as started:
        yield started


@pytest.fixture
async def stubs(workers: list[Worker], mesh_key: str) -> AsyncIterator[list[object]]:
    async with open_stubs(workers, mesh_key) as opened:
        yield list(opened)


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def reason(error: RpcError) -> str:
    return error.reason


async def generate(
    stub: object, correlation_id: str = "", max_tokens: int = 8, **sampling: object
) -> list[object]:
    request = pb.GenerateRequest(
        correlation_id=correlation_id,
        messages=[generation_pb2.ChatMessage(role="user", content="count to three")],
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),  # type: ignore[arg-type]
    )
    return [item async for item in stub.Generate(request)]  # type: ignore[attr-defined]


async def test_generate_streams_tokens_and_records_the_turn(stubs: list[object]) -> None:
    items = await generate(stubs[0], "ep-grpc-1", max_tokens=6)
    deltas = [i.delta for i in items if i.HasField("delta")]  # type: ignore[attr-defined]
    finished = items[-1].finished  # type: ignore[attr-defined]
    tokens = [t for d in deltas for t in d.token_ids]
    assert 1 <= len(tokens) <= 6 and finished.completion_tokens == len(tokens)
    trace = (await stubs[0].GetTrace(pb.GetTraceRequest(correlation_id="ep-grpc-1"))).trace  # type: ignore[attr-defined]
    assert list(trace.turns[0].completion_token_ids) == tokens
    assert list(trace.turns[0].sampler_logprobs) == pytest.approx([p for d in deltas for p in d.logprobs])


async def test_an_episode_over_the_openai_endpoint_becomes_one_trace(
    workers: list[Worker], stubs: list[object]
) -> None:
    cid = "ep-openai-" + secrets.token_hex(4)
    url = f"{workers[0].openai_base_url}/traces/{cid}/chat/completions"
    history = [{"role": "user", "content": "hello"}]
    async with httpx.AsyncClient(timeout=30) as http:
        models = (await http.get(f"{workers[0].openai_base_url}/models")).json()
        model = models["data"][0]["id"]
        for _ in range(2):
            body = {"model": model, "messages": history, "max_tokens": 5, "temperature": 0, "logprobs": True}
            answer = (await http.post(url, json=body)).json()
            assert answer["choices"][0]["logprobs"]["content"]
            versions = answer["tandem"]["completion_weight_versions"]
            assert len(versions) == len(answer["tandem"]["completion_token_ids"])
            assert set(versions) == {answer["tandem"]["weight_version"]}
            history += [answer["choices"][0]["message"], {"role": "user", "content": "again"}]
        sealed = (await stubs[0].FinishTrace(pb.FinishTraceRequest(correlation_id=cid))).trace  # type: ignore[attr-defined]
        assert sealed.state == trace_pb2.Trace.STATE_FINISHED and len(sealed.turns) == 2
        first, second = sealed.turns
        # The second turn's prompt holds the first turn's prompt and completion (the conversation so far).
        assert list(second.prompt_token_ids[: len(first.prompt_token_ids)]) == list(first.prompt_token_ids)
        late = await http.post(url, json={"messages": history, "max_tokens": 2})
        assert late.status_code == 409 and late.json()["error"]["code"] == "TRACE_FINISHED"
        wrong = await http.post(url.replace(cid, "ep-other"), json={"model": "nope", "messages": history})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "MODEL_NOT_FOUND"
    stream = stubs[0].StreamTraces(  # type: ignore[attr-defined]
        pb.StreamTracesRequest(after=trace_pb2.TraceCursor(worker_incarnation=workers[0].incarnation, seq=0))
    )
    async for message in stream:
        if message.HasField("trace") and message.trace.correlation_id == cid:
            assert message.cursor.worker_incarnation == workers[0].incarnation
            break
    stream.cancel()


async def test_bad_requests_get_stable_reasons(workers: list[Worker], stubs: list[object]) -> None:
    long_prompt = pb.GenerateRequest(prompt_token_ids=[5] * 5000)
    with pytest.raises(RpcError) as too_long:
        [x async for x in stubs[0].Generate(long_prompt)]  # type: ignore[attr-defined]
    assert reason(too_long.value) == "CONTEXT_LENGTH_EXCEEDED"
    with pytest.raises(RpcError) as missing:
        await stubs[0].FinishTrace(pb.FinishTraceRequest(correlation_id="never-used"))  # type: ignore[attr-defined]
    assert reason(missing.value) == "TRACE_NOT_FOUND"
    with pytest.raises(RpcError) as cursor:
        stream = stubs[0].StreamTraces(  # type: ignore[attr-defined]
            pb.StreamTracesRequest(after=trace_pb2.TraceCursor(worker_incarnation="old-incarnation", seq=1))
        )
        [x async for x in stream]
    assert reason(cursor.value) == "CURSOR_COMPACTED"
    async with httpx.AsyncClient(timeout=30) as http:
        bad = await http.post(f"{workers[0].openai_base_url}/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "MALFORMED_REQUEST"


async def test_pause_modes(stubs: list[object]) -> None:
    stub = stubs[1]
    running = asyncio.ensure_future(generate(stub, max_tokens=400))
    await asyncio.sleep(0.3)
    paused = await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_ABORT))  # type: ignore[attr-defined]
    items = await running
    assert paused.aborted_generations == 1
    assert items[-1].finished.finish_reason == generation_pb2.FINISH_REASON_ABORT  # type: ignore[attr-defined]
    waiting = asyncio.ensure_future(generate(stub, max_tokens=3))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # a request during a pause waits for the resume
    await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
    assert (await waiting)[-1].HasField("finished")
    running = asyncio.ensure_future(generate(stub, max_tokens=60))
    await asyncio.sleep(0.2)
    waited = await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_WAIT))  # type: ignore[attr-defined]
    finished = (await asyncio.wait_for(running, 30))[-1].finished  # type: ignore[attr-defined]
    assert waited.aborted_generations == 0 and finished.finish_reason != generation_pb2.FINISH_REASON_ABORT
    await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]


def modified(model_dir: Path, scale: float) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor + scale) for name, tensor in checkpoint(model_dir).items()]


async def test_weights_reach_both_workers_bit_exact_and_faults_keep_the_previous_version(
    model_dir: Path, stubs: list[object]
) -> None:
    # The workers are shared by this module's tests, which run in any order: count from the version in service.
    base = max(
        [
            (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info.weight_version  # type: ignore[attr-defined]
            for stub in stubs
        ]
    )
    v1, v2, v3 = base + 1, base + 2, base + 3
    publisher = WeightPublisher(stubs, bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30)
    try:
        update = modified(model_dir, 0.01)
        report = await publisher.publish(v1, update, mode=PauseMode.KEEP)
        assert report.workers == 2 and report.buckets > 1
        await publisher.verify(update)  # every tensor on both workers equals the trainer's, bit for bit
        items = await generate(stubs[0], "ep-after-v1", max_tokens=2)
        assert items[-1].finished.weight_version == v1  # type: ignore[attr-defined]

        # A manifest that disagrees with the model is refused before any byte moves.
        for stub in stubs:
            await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_KEEP))  # type: ignore[attr-defined]
        name = update[0][0]
        bad = pb.BeginWeightUpdateRequest(
            weight_version=v2,
            manifest=[
                weights_pb2.TensorSpec(name=name, dtype="float16", shape=[3]),
                weights_pb2.TensorSpec(name="nope", dtype="float32"),
            ],
        )
        with pytest.raises(RpcError) as mismatch:
            await stubs[0].BeginWeightUpdate(bad)  # type: ignore[attr-defined]
        assert reason(mismatch.value) == "WEIGHT_MANIFEST_MISMATCH"
        assert "nope" in mismatch.value.message
        backwards = pb.BeginWeightUpdateRequest(
            weight_version=v1,
            manifest=[weights_pb2.TensorSpec(name=name, dtype="float32", shape=list(update[0][1].shape))],
        )
        with pytest.raises(RpcError) as regression:
            await stubs[0].BeginWeightUpdate(backwards)  # type: ignore[attr-defined]
        assert reason(regression.value) == "WEIGHT_VERSION_REGRESSION"
        for stub in stubs:
            await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]

        # The trainer stalls mid-update: the workers give up at their timeout and keep serving v1.
        short = WeightPublisher(stubs, bucket_size_bytes=1 << 20, transfer_timeout_s=2, rpc_timeout_s=30)
        await short.connect()
        for stub in stubs:
            await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_KEEP))  # type: ignore[attr-defined]
            begin = pb.BeginWeightUpdateRequest(
                weight_version=v2,
                manifest=[
                    weights_pb2.TensorSpec(name=n, dtype="float32", shape=list(t.shape)) for n, t in update
                ],
                bucket_size_bytes=1 << 20,
                packed=True,
            )
            await stub.BeginWeightUpdate(begin)  # type: ignore[attr-defined]
        # ... and no byte is ever sent.
        with pytest.raises(RpcError) as failed:
            await stubs[0].FinishWeightUpdate(pb.FinishWeightUpdateRequest(weight_version=v2), timeout=30)  # type: ignore[attr-defined]
        assert reason(failed.value) == "WEIGHT_TRANSFER_FAILED"
        short.close()
        for stub in stubs:
            info = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
            for _ in range(100):
                if info.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_UNINITIALIZED:
                    break
                await asyncio.sleep(0.1)
                info = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
            assert info.weight_version == v1
            assert info.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_UNINITIALIZED
            await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
        await publisher.verify(update)  # still v1's weights, untouched

        # The group is re-formed and the next update goes through, at the trainer's default bucket size
        # (32 MiB), which still splits this few-MB model into buckets that overlap.
        publisher.close()
        publisher = WeightPublisher(stubs, transfer_timeout_s=20, rpc_timeout_s=30)
        update2 = modified(model_dir, 0.02)
        report = await publisher.publish(v3, update2)
        assert report.version == v3 and report.buckets > 1
        await publisher.verify(update2)
    finally:
        publisher.close()


async def test_a_worker_that_dies_mid_update_is_named_and_a_restarted_one_rejoins(
    model_dir: Path, mesh_key: str, tmp_path: Path
) -> None:
    first = start_worker(model_dir, tmp_path / "a", mesh_key)
    second = start_worker(model_dir, tmp_path / "b", mesh_key)
    channels = [worker_stub(w, mesh_key) for w in (first, second)]
    stubs = [s for _, s in channels]
    publisher = WeightPublisher(stubs, bucket_size_bytes=1 << 20, transfer_timeout_s=5, rpc_timeout_s=30)
    try:
        await publisher.publish(1, modified(model_dir, 0.01))
        second.proc.kill()
        second.proc.wait()
        with pytest.raises(WeightSyncError) as info:
            await publisher.publish(2, modified(model_dir, 0.02))
        assert 1 in info.value.failures  # the dead worker is named
        alive = (await stubs[0].GetWeightInfo(pb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
        assert alive.weight_version == 1  # the survivor kept serving the previous version
        await stubs[0].ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
        # A restarted worker starts from the checkpoint; the next update brings everyone to the current weights.
        restarted = start_worker(model_dir, tmp_path / "b2", mesh_key)
        await channels[1][0].close()
        channels[1] = worker_stub(restarted, mesh_key)
        publisher.workers = [stubs[0], channels[1][1]]
        current = modified(model_dir, 0.03)
        await publisher.publish(3, current)
        await publisher.verify(current)
        stop_worker(restarted)
    finally:
        publisher.close()
        for channel, _ in channels:
            await channel.close()
        stop_worker(first)
        stop_worker(second)


def test_a_missing_model_directory_stops_the_worker_with_a_clear_error(mesh_key: str, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        start_worker(tmp_path / "no-such-model", tmp_path / "w", mesh_key, timeout_s=60)
    assert "no-such-model" in str(info.value)


async def test_the_idle_clock_stops_while_a_generation_runs(model_dir: Path) -> None:
    engine = await TorchEngine.load(str(model_dir))
    worker = InferenceWorker(engine, WorkerSettings(model_path=model_dir, idle_exit_s=30))
    try:
        stream = worker.generate([1, 2, 3], Sampling(max_tokens=4, temperature=0))
        await anext(stream)  # the generation is under way
        assert worker.idle_s() == 0.0
        async for _ in stream:
            pass
        idle = worker.idle_s()
        assert idle > 0.0
        await asyncio.sleep(0.01)
        assert worker.idle_s() > idle  # counting again from the end of the generation
    finally:
        await worker.close()


def test_a_worker_with_an_idle_limit_exits_by_itself(model_dir: Path, mesh_key: str, tmp_path: Path) -> None:
    worker = start_worker(model_dir, tmp_path / "w", mesh_key, {"TANDEM_WORKER_IDLE_EXIT_S": "1"})
    try:
        assert worker.proc.wait(timeout=120) == 0  # no call came: it stopped cleanly, status 0
    finally:
        stop_worker(worker)


async def test_an_in_flight_update_lands_under_a_streaming_generation_without_a_pause(
    model_dir: Path, stubs: list[object]
) -> None:
    stub = stubs[0]
    assert (await stub.GetWorkerInfo(pb.GetWorkerInfoRequest())).worker_info.in_flight_updates  # type: ignore[attr-defined]
    old = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info.weight_version  # type: ignore[attr-defined]
    new = old + 1
    update = modified(model_dir, 0.05)
    publisher = WeightPublisher([stub], bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30)
    cid = "ep-in-flight-" + secrets.token_hex(4)
    call = stub.Generate(  # type: ignore[attr-defined]
        pb.GenerateRequest(
            correlation_id=cid,
            messages=[generation_pb2.ChatMessage(role="user", content="count to three")],
            sampling=generation_pb2.SamplingParams(max_tokens=400, temperature=0.0),
        )
    )
    streamed: list[int] = []  # the version of each token as the stream delivered it
    publishing: asyncio.Future[object] | None = None
    try:
        async for item in call:
            assert item.HasField("delta"), "the generation ended before the update landed"
            streamed += [item.delta.weight_version] * len(item.delta.token_ids)
            if publishing is None:  # the generation is under way: publish into it
                publishing = asyncio.ensure_future(publisher.publish(new, update, in_flight=True))
            elif publishing.done() and streamed[-1] == new:
                break  # tokens of the new version arrived on the same stream: enough
        assert publishing is not None
        report = await publishing
    finally:
        call.cancel()  # the turn is recorded as aborted with every token sampled so far
        publisher.close()
    assert report.in_flight and report.pause_s == 0 and report.resume_s == 0  # type: ignore[attr-defined]
    info = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
    assert info.weight_version == new and not info.paused
    assert info.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY

    turn = None
    for _ in range(100):  # the cancelled turn is recorded as the worker notices the cancellation
        trace = (await stub.GetTrace(pb.GetTraceRequest(correlation_id=cid))).trace  # type: ignore[attr-defined]
        if trace.turns and trace.turns[0].HasField("end_time"):
            turn = trace.turns[0]
            break
        await asyncio.sleep(0.1)
    assert turn is not None
    versions = list(turn.completion_weight_versions)
    assert len(versions) == len(turn.completion_token_ids) >= len(streamed)
    assert versions[: len(streamed)] == streamed  # the trace says what the stream said, token by token
    assert versions[0] == turn.weight_version == old and versions[-1] == turn.last_weight_version == new
    assert set(versions) == {old, new} and versions == sorted(versions)
    await publisher.verify(update)  # the weights in service are the trainer's, bit for bit


async def test_an_in_flight_begin_is_taken_paused_or_not_and_refused_by_an_engine_that_loads_in_place(
    model_dir: Path, stubs: list[object]
) -> None:
    stub = stubs[1]
    publisher = WeightPublisher([stub], bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30)
    try:
        old = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info.weight_version  # type: ignore[attr-defined]
        idle = modified(model_dir, 0.06)
        await publisher.publish(old + 1, idle, in_flight=True)  # running, nothing generating
        await publisher.verify(idle)
        await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_KEEP))  # type: ignore[attr-defined]
        paused = modified(model_dir, 0.07)
        await publisher.publish(old + 2, paused, in_flight=True)  # paused by someone else: it stays paused
        info = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
        assert info.paused and info.weight_version == old + 2
        await publisher.verify(paused)
        await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
        # Without in_flight, a running worker still refuses to be updated.
        begin = pb.BeginWeightUpdateRequest(
            weight_version=old + 3,
            manifest=[
                weights_pb2.TensorSpec(name=n, dtype="float32", shape=list(t.shape)) for n, t in paused
            ],
        )
        with pytest.raises(RpcError) as running:
            await stub.BeginWeightUpdate(begin)  # type: ignore[attr-defined]
        assert reason(running.value) == "WEIGHT_UPDATE_CONFLICT"
    finally:
        publisher.close()

    # An engine that loads in place (vLLM) refuses an in-flight Begin by a reason of its own; the publisher
    # refuses before anything moves when GetWorkerInfo says a worker cannot take one.
    info = EngineInfo("m", "/m", "/m", 512, "vllm", "0.32", 1, "cpu", "float32")
    vllm = VllmEngine(None, None, info, [])
    with pytest.raises(FailedPrecondition) as refused:
        await WeightSync(vllm, 5.0).begin(1, [], 1 << 20, True, in_flight=True)
    assert refused.value.reason == R.ERROR_REASON_IN_FLIGHT_UPDATE_UNSUPPORTED
    assert "loads weights in place" in refused.value.message
    lone = WeightPublisher([stub], bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30)
    try:
        await lone.connect()
        lone._in_flight_updates = [False]  # what a vLLM worker's GetWorkerInfo says
        with pytest.raises(WeightSyncError) as early:
            await lone.publish(old + 3, paused, in_flight=True)
        assert early.value.phase == "GetWorkerInfo" and "loads weights in place" in early.value.failures[0]
    finally:
        lone.close()
