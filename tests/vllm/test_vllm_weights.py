"""Weights into two vLLM worker processes on a CPU through vLLM's own weight-transfer API: this process is the
trainer (rank 0, `WeightPublisher` with the gloo backend), each worker's vLLM receives the packed buckets with
Tandem's gloo engine (trainer/inference/vllm_transfer.py, registered by the package's vLLM plugin).

vLLM's checksums cannot prove an update on a CPU (they hash the emptied parameters of its repacked linear
layers), so the proof is behaviour: after each version, each worker's greedy output equals that of a fresh
vLLM loaded from the trainer's checkpoint of that version, for tied and untied embeddings. And a trainer
killed mid-broadcast leaves the workers saying so (INCONSISTENT: paused, serving nothing) until the next
update completes."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tandem.inference.v1 import generation_pb2, weights_pb2
from tandem.inference.v1 import inference_service_pb2 as pb

from mesh.status import RpcError
from tests.support.weights_peer import publisher_that_dies
from tests.support.workers import Worker, start_worker, stop_worker, worker_stub
from tests.vllm.conftest import START_S, VLLM_CPU, fresh_outputs, greedy, weight_info
from trainer.inference.publisher import WeightPublisher, WeightSyncError
from trainer.models import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
PROMPTS = ([11, 42, 7, 300, 5], list(range(20, 60, 3)), [400, 2, 2, 2, 99, 100])
BUCKET = 1 << 20  # several buckets for these models (~4.5 MB in float32)
WORKER_ENV = {**VLLM_CPU, "TANDEM_WORKER_PAUSE_QUEUE_S": "2", "TANDEM_WORKER_TRANSFER_TIMEOUT_S": "30"}


class Pair:
    """Two vLLM workers on one base model, and their stubs."""

    def __init__(self, model_dir: Path, workers: list[Worker]) -> None:
        self.model_dir = model_dir
        self.workers = workers
        self.stubs: list[object] = []


def start_pair(model_dir: Path, folder: Path, mesh_key: str) -> Iterator[Pair]:
    started: list[Worker] = []
    try:
        for index in range(2):
            started.append(
                start_worker(model_dir, folder / f"w{index}", mesh_key, WORKER_ENV, timeout_s=START_S)
            )
        yield Pair(model_dir, started)
    finally:
        for worker in started:
            stop_worker(worker)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def pair(
    request: pytest.FixtureRequest, mesh_key: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    tied = bool(request.param)
    folder = tmp_path_factory.mktemp("tied" if tied else "untied")
    model_dir = build_tiny_model(folder / "base", tie_embeddings=tied)
    yield from start_pair(model_dir, folder, mesh_key)


@pytest.fixture
async def stubs(pair: Pair, mesh_key: str) -> AsyncIterator[list[object]]:
    opened = [worker_stub(w, mesh_key) for w in pair.workers]
    try:
        yield [stub for _, stub in opened]
    finally:
        for channel, _ in opened:
            await channel.close()


def trainer_weights(model_dir: Path, version: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's tensors at `version`: the base model's, each moved by seeded noise."""
    generator = torch.Generator().manual_seed(version)
    return [
        (name, tensor + 0.05 * torch.randn(tensor.shape, generator=generator))
        for name, tensor in load_file(str(model_dir / "model.safetensors")).items()
    ]


def save_checkpoint(model_dir: Path, target: Path, named: list[tuple[str, torch.Tensor]]) -> Path:
    """The trainer's checkpoint of `named`: the base model's folder with these weights."""
    target.mkdir()
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    save_file(dict(named), str(target / "model.safetensors"))
    return target


def fresh(checkpoint: Path, mesh_key: str) -> Awaitable[list[list[int]]]:
    """Greedy outputs of a fresh vLLM worker on `checkpoint`."""
    return fresh_outputs(
        checkpoint, checkpoint.parent / f"fresh-{checkpoint.name}", mesh_key, WORKER_ENV, PROMPTS
    )


async def test_each_version_serves_what_a_fresh_vllm_serves_from_its_checkpoint(
    pair: Pair, stubs: list[object], mesh_key: str, tmp_path: Path
) -> None:
    before = [await greedy(stubs[0], list(p)) for p in PROMPTS]
    current = (await weight_info(stubs[0])).weight_version
    publisher = WeightPublisher(stubs, backend="gloo", bucket_size_bytes=BUCKET, transfer_timeout_s=60)
    try:
        for version in (current + 1, current + 2):
            named = trainer_weights(pair.model_dir, version)
            report = await publisher.publish(version, named)
            assert report.workers == 2 and report.buckets > 1
            expected = await fresh(save_checkpoint(pair.model_dir, tmp_path / f"v{version}", named), mesh_key)
            assert expected != before  # the version changes what greedy decoding says
            for stub in stubs:
                info = await weight_info(stub)
                assert info.weight_version == version
                assert info.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY
                assert [await greedy(stub, list(p)) for p in PROMPTS] == expected
            before = expected
    finally:
        publisher.close()


@pytest.mark.parametrize("pair", [True], ids=["tied"], indirect=True)  # the abort path does not depend on it
async def test_a_trainer_killed_mid_broadcast_leaves_the_workers_inconsistent_until_the_next_update(
    pair: Pair, stubs: list[object], mesh_key: str, tmp_path: Path
) -> None:
    current = (await weight_info(stubs[0])).weight_version
    spawn = multiprocessing.get_context("spawn")
    sent = spawn.Queue()
    trainer = spawn.Process(
        target=publisher_that_dies,
        args=(
            [w.grpc_address for w in pair.workers],
            mesh_key,
            str(pair.model_dir),
            current + 1,
            BUCKET,
            sent,
        ),
    )
    trainer.start()
    try:
        assert await asyncio.to_thread(sent.get, True, 240) == current + 1  # one bucket of several is out
    finally:
        trainer.kill()
        trainer.join()
    for stub in stubs:
        info = await weight_info(stub)
        for _ in range(600):  # the receive fails as the connection drops, at the latest at the 30 s timeout
            if info.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_INCONSISTENT:
                break
            await asyncio.sleep(0.1)
            info = await weight_info(stub)
        assert info.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_INCONSISTENT
        assert info.paused and info.weight_version == current
        with pytest.raises(RpcError) as refused:
            await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
        assert refused.value.reason == "WEIGHT_UPDATE_CONFLICT"
        traced = pb.GenerateRequest(
            correlation_id="after-the-kill",
            prompt_token_ids=list(PROMPTS[0]),
            sampling=generation_pb2.SamplingParams(max_tokens=4),
        )
        with pytest.raises(RpcError) as paused:
            _ = [item async for item in stub.Generate(traced)]  # type: ignore[attr-defined]
        assert paused.value.reason == "GENERATION_PAUSED"

    # The next update re-forms the group and completes: both serve exactly its weights again.
    publisher = WeightPublisher(stubs, backend="gloo", bucket_size_bytes=BUCKET, transfer_timeout_s=60)
    try:
        named = trainer_weights(pair.model_dir, current + 2)
        await publisher.publish(current + 2, named)
    finally:
        publisher.close()
    expected = await fresh(save_checkpoint(pair.model_dir, tmp_path / "recovered", named), mesh_key)
    for stub in stubs:
        info = await weight_info(stub)
        assert info.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY and not info.paused
        assert info.weight_version == current + 2
        assert [await greedy(stub, list(p)) for p in PROMPTS] == expected


@pytest.mark.parametrize("pair", [True], ids=["tied"], indirect=True)  # the refusal does not depend on it
async def test_an_in_flight_update_is_refused_before_anything_moves(pair: Pair, stubs: list[object]) -> None:
    info = (await stubs[0].GetWorkerInfo(pb.GetWorkerInfoRequest())).worker_info  # type: ignore[attr-defined]
    assert not info.in_flight_updates  # vLLM loads weights in place: its workers pause for an update
    current = (await weight_info(stubs[0])).weight_version
    named = trainer_weights(pair.model_dir, current + 1)
    publisher = WeightPublisher(stubs, backend="gloo", bucket_size_bytes=BUCKET, transfer_timeout_s=60)
    try:
        with pytest.raises(WeightSyncError) as refused:
            await publisher.publish(current + 1, named, in_flight=True)
        assert refused.value.phase == "GetWorkerInfo" and set(refused.value.failures) == {0, 1}
        begin = pb.BeginWeightUpdateRequest(
            weight_version=current + 1,
            manifest=[weights_pb2.TensorSpec(name=n, dtype="float32", shape=list(t.shape)) for n, t in named],
            in_flight=True,
        )
        with pytest.raises(RpcError) as direct:
            await stubs[0].BeginWeightUpdate(begin)  # type: ignore[attr-defined]
        assert direct.value.reason == "IN_FLIGHT_UPDATE_UNSUPPORTED"
        for stub in stubs:
            assert (await weight_info(stub)).weight_version == current  # nothing moved
    finally:
        publisher.close()


def moved(named: list[tuple[str, torch.Tensor]], every: int, by: float) -> list[tuple[str, torch.Tensor]]:
    """`named` with one element in `every` of each tensor moved by `by`, the rest bit for bit the same."""
    out = []
    for name, tensor in named:
        flat = tensor.clone().reshape(-1)
        flat[::every] += by
        out.append((name, flat.view(tensor.shape)))
    return out


@pytest.mark.parametrize("pair", [True], ids=["tied"], indirect=True)  # tied: the LM head's repack too
async def test_delta_updates_land_bit_exact_and_serve_what_a_fresh_vllm_serves(
    pair: Pair, stubs: list[object], mesh_key: str, tmp_path: Path
) -> None:
    """Deltas into vLLM's gloo engine: applied to its host mirror of the last update and reloaded into the
    model; the checksums (of the mirror, in checkpoint naming) equal the trainer's after every update, and
    the model serves what a fresh vLLM serves from a checkpoint of the same weights. A restarted worker holds
    no mirror: it gets the next update whole, then deltas again."""
    info = (await stubs[0].GetWorkerInfo(pb.GetWorkerInfoRequest())).worker_info  # type: ignore[attr-defined]
    assert weights_pb2.WEIGHT_UPDATE_MODE_DELTA in info.weight_update_modes
    v = (await weight_info(stubs[0])).weight_version
    publisher = WeightPublisher(
        stubs, backend="gloo", bucket_size_bytes=BUCKET, transfer_timeout_s=60, mode="delta"
    )
    channel = None
    try:
        named = trainer_weights(pair.model_dir, v + 1)
        first = await publisher.publish(v + 1, named)
        assert first.mode == "full" and first.why_full == "no earlier update to start from"
        await publisher.verify(named)
        before = [await greedy(stubs[0], list(p)) for p in PROMPTS]
        for step in (2, 3):
            named = moved(named, 97, 0.5)
            report = await publisher.publish(v + step, named)
            assert report.mode == "delta", report.why_full
            # one element in 97, each with a 4-byte index: about 2% of a float32 update's bytes
            assert 0 < report.bytes < 0.1 * report.full_bytes and report.buckets >= 1
            await publisher.verify(named)  # every tensor, on both workers, equals the trainer's
            for stub in stubs:
                held = await weight_info(stub)
                assert held.weight_version == held.delta_base_weight_version == v + step
                assert held.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY
        expected = await fresh(save_checkpoint(pair.model_dir, tmp_path / "v3", named), mesh_key)
        assert expected != before  # the deltas changed what greedy decoding says
        for stub in stubs:
            assert [await greedy(stub, list(p)) for p in PROMPTS] == expected

        stop_worker(pair.workers[1])
        pair.workers[1] = start_worker(pair.model_dir, tmp_path / "again", mesh_key, WORKER_ENV, START_S)
        channel, stub = worker_stub(pair.workers[1], mesh_key)  # the module's teardown stops the worker
        assert (await weight_info(stub)).delta_base_weight_version == 0  # no mirror: no delta base
        publisher.workers = [stubs[0], stub]
        await publisher.connect()
        named = moved(named, 89, 0.25)
        whole = await publisher.publish(v + 4, named)
        assert whole.mode == "full" and whole.why_full == f"worker 1 holds v0, not v{v + 3}"
        named = moved(named, 89, 0.25)
        again = await publisher.publish(v + 5, named)
        assert again.mode == "delta", again.why_full
        await publisher.verify(named)
    finally:
        publisher.close()
        if channel is not None:
            await channel.close()
