"""Sparse delta weight updates: the encoding (trainer/inference/delta.py) bit for bit, and delta mode end to
end from this process (rank 0) to two torch-engine worker processes over gloo, with each reason a delta
update goes whole instead."""

from __future__ import annotations

import itertools
import math
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tandem.inference.v1 import inference_service_pb2 as pb
from tandem.inference.v1 import weights_pb2

from mesh.status import RpcError
from tests.support.workers import Worker, open_stubs, running_workers, start_worker, stop_worker, worker_stub
from trainer.inference import delta
from trainer.inference.engine import TensorMeta
from trainer.inference.publisher import WeightPublisher
from trainer.inference.weights import dtype_name, manifest_of
from trainer.models import build_tiny_model


def meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_delta_turns_the_base_into_the_new_tensor_bit_for_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=generator).to(dtype)
    new = base.clone()
    flat = new.view(-1)
    flat[[3, 100, 2000, 3071]] += 1.0
    flat[7] = -0.0 if float(base.view(-1)[7]) == 0.0 else 0.0  # a change only the sign bit shows
    base.view(-1)[11] = new.view(-1)[11] = math.nan  # a NaN equal to itself is no change
    m = meta("w", base)
    part = delta.diff(m, base, new)
    assert part.changed == 5 and delta.is_sparse(m, part.changed)
    gaps, values = part.wire
    assert gaps.dtype == torch.int16 and delta.positions(gaps).tolist() == [3, 7, 100, 2000, 3071]
    assert values.dtype == dtype
    held = base.clone()
    delta.check(held, m, part.changed, part.wire)
    delta.apply(held, m, part.changed, part.wire)
    assert bits(held) == bits(new)
    # what a worker reads back after writing is what was sent; the old tensor's read-back is not
    assert delta.digest([delta.read_back(held, m, part.changed, part.wire)]) == delta.digest([values])
    assert delta.digest([delta.read_back(base, m, part.changed, part.wire)]) != delta.digest([values])


def test_changes_far_apart_are_bridged_so_every_gap_fits_in_16_bits() -> None:
    base = torch.zeros(200_000, dtype=torch.bfloat16)
    for where in ([0, 199_999], [150_000], [40_000, 40_001, 105_535 + 40_001]):
        new = base.clone()
        new[where] = 1.0
        m = meta("w", base)
        part = delta.diff(m, base, new)
        gaps = part.wire[0]
        found = delta.positions(gaps)
        steps = torch.diff(found, prepend=found.new_tensor([-1]))
        assert (
            set(where) <= set(found.tolist()) and int(steps.min()) >= 1 and int(steps.max()) <= delta.MAX_GAP
        )
        assert part.changed == found.numel() < len(where) + 4  # a few unchanged entries bridge the distance
        held = base.clone()
        delta.check(held, m, part.changed, part.wire)
        delta.apply(held, m, part.changed, part.wire)
        assert bits(held) == bits(new)


def test_a_tensor_compared_in_pieces_gives_the_delta_of_the_whole() -> None:
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(300_001, generator=generator).to(torch.bfloat16)
    new = base.clone()
    moved = torch.randperm(300_001, generator=generator)[:4000]
    new[moved] = (new[moved].float() * 1.5 + 0.01).to(torch.bfloat16)
    new[[0, 300_000]] += 1.0  # the first and the last element, at the edges of the first and last piece
    m = meta("w", base)
    whole = delta.diff(m, base, new)
    for size in (7, 65_536, 100_000, 300_001, 10**9):
        ranges = delta.pieces(base.numel(), size)
        assert ranges[0][0] == 0 and ranges[-1][1] == base.numel() and all(b - a <= size for a, b in ranges)
        assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(ranges))
        if size < 1000:  # the first and last few of 42,858 pieces: each finds its own positions only
            ranges = ranges[:3] + ranges[-3:]
            found = torch.cat([delta.changed_positions(base, new, a, b) for a, b in ranges])
            assert found.tolist() == [p for p in (0, 300_000) if any(a <= p < b for a, b in ranges)]
            continue
        found = torch.cat([delta.changed_positions(base, new, a, b) for a, b in ranges])
        part = delta.diff(m, base, new, found)
        assert part.changed == whole.changed and [bits(t) for t in part.wire] == [bits(t) for t in whole.wire]
    assert delta.pieces(0, 8) == [(0, 0)]
    with pytest.raises(ValueError, match="at least one element"):
        delta.pieces(10, 0)


def test_each_tensor_goes_the_cheapest_way_and_the_wire_manifest_says_how() -> None:
    same = torch.zeros(100, dtype=torch.bfloat16)
    few = torch.zeros(100, dtype=torch.bfloat16)
    many = torch.zeros(100, dtype=torch.bfloat16)
    few_new, many_new = few.clone(), many.clone()
    few_new[:10] = 1  # 10 * (2 + 2) bytes < 200: sparse
    many_new[:50] = 1  # 50 * 4 = 200 bytes, not below 200: whole
    parts = [
        delta.diff(meta("same", same), same, same.clone()),
        delta.diff(meta("few", few), few, few_new),
        delta.diff(meta("many", many), many, many_new),
    ]
    assert [p.changed for p in parts] == [0, 10, 100]
    manifest = [meta("same", same), meta("few", few), meta("many", many)]
    wire = delta.wire_manifest(manifest, [p.changed for p in parts])
    assert [(w.name, w.dtype, w.shape) for w in wire] == [
        ("few#gaps", "int16", (10,)),
        ("few#values", "bfloat16", (10,)),
        ("many", "bfloat16", (100,)),
    ]
    assert delta.wire_bytes(manifest, [p.changed for p in parts]) == 20 + 20 + 200
    with pytest.raises(ValueError, match="2 entries for 3"):
        delta.wire_manifest(manifest, [0, 1])
    with pytest.raises(ValueError, match="101 for many"):
        delta.wire_manifest(manifest, [0, 0, 101])


def test_a_received_delta_that_does_not_fit_is_refused_before_anything_is_written() -> None:
    target = torch.zeros(10)
    m = meta("w", target)
    for gaps, why in [
        (torch.tensor([2, 9], dtype=torch.int16), "past"),  # positions 1 and 10
        (torch.tensor([-1, 3], dtype=torch.int16), "past"),  # -1 reads as 65535
        (torch.tensor([4, 0], dtype=torch.int16), "gap is 0"),
    ]:
        with pytest.raises(ValueError, match=why):
            delta.check(target, m, 2, [gaps, torch.ones(2)])
    with pytest.raises(ValueError, match="1 gaps"):
        delta.check(target, m, 2, [torch.tensor([1], dtype=torch.int16), torch.ones(1)])
    assert not target.any()


# ---- delta mode over real workers ------------------------------------------------------------------


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
    """Two workers shared by the tests below, which run in any order: each counts its versions from the
    highest in service (`top`); a test that replaces a worker leaves the replacement in this list."""
    with running_workers(
        model_dir, [tmp_path_factory.mktemp(f"worker{i}") for i in range(2)], mesh_key
    ) as started:
        yield started


@pytest.fixture
async def stubs(workers: list[Worker], mesh_key: str) -> AsyncIterator[list[object]]:
    async with open_stubs(workers, mesh_key) as opened:
        yield list(opened)


async def top(stubs: list[object]) -> int:
    return max(
        [
            (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info.weight_version  # type: ignore[attr-defined]
            for stub in stubs
        ]
    )


def weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(model_dir / "model.safetensors")).items())


def nudged(named: list[tuple[str, torch.Tensor]], every: int, by: float) -> list[tuple[str, torch.Tensor]]:
    """A copy with one element in `every` of each tensor moved by `by` (what a small optimizer step does to
    low-precision weights: most elements stay bit for bit the same)."""
    out = []
    for name, tensor in named:
        changed = tensor.clone()
        changed.view(-1)[::every] += by
        out.append((name, changed))
    return out


@pytest.mark.slow
async def test_delta_mode_sends_only_what_changed_and_the_workers_end_bit_exact(
    model_dir: Path, stubs: list[object]
) -> None:
    publisher = WeightPublisher(
        stubs, bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30, mode="delta", full_every=4
    )
    try:
        info = (await stubs[0].GetWorkerInfo(pb.GetWorkerInfoRequest())).worker_info  # type: ignore[attr-defined]
        assert weights_pb2.WEIGHT_UPDATE_MODE_DELTA in info.weight_update_modes
        v = await top(stubs)
        current = weights(model_dir)
        first = await publisher.publish(v + 1, current)
        assert first.mode == "full" and first.why_full == "no earlier update to start from"
        assert first.bytes == first.full_bytes
        for stub in stubs:
            held = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
            assert held.delta_base_weight_version == v + 1

        for step in (2, 3, 4):
            current = nudged(current, 97, 0.5 * step)
            report = await publisher.publish(v + step, current)
            assert report.mode == "delta", report.why_full
            # one element in 97, each with a 4-byte index: about 8% of a float32 update's bytes
            assert 0 < report.bytes < 0.1 * report.full_bytes
            assert report.changed_tensors == len(current)
            await publisher.verify(current)  # every tensor, on both workers, equals the trainer's

        unchanged = await publisher.publish(v + 5, current)  # full_every=4: the fourth after a whole one
        assert unchanged.mode == "full" and unchanged.why_full == "every 4 updates one goes whole"
        same = await publisher.publish(v + 6, current)
        assert same.mode == "delta" and same.bytes == 0 and same.changed_tensors == 0

        everything = [(name, tensor + 1.0) for name, tensor in current]  # every element moves
        dense = await publisher.publish(v + 7, everything)
        assert dense.mode == "full" and dense.why_full == "the delta would not be smaller"
        await publisher.verify(everything)
    finally:
        publisher.close()


@pytest.mark.slow
async def test_a_restarted_worker_gets_a_whole_update_and_then_deltas_again(
    model_dir: Path, mesh_key: str, workers: list[Worker], stubs: list[object], tmp_path: Path
) -> None:
    publisher = WeightPublisher(
        stubs, bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30, mode="delta"
    )
    channel = None
    try:
        v = await top(stubs)
        current = weights(model_dir)
        await publisher.publish(v + 1, current)
        current = nudged(current, 50, 0.25)
        assert (await publisher.publish(v + 2, current)).mode == "delta"

        stop_worker(workers[1])
        workers[1] = start_worker(model_dir, tmp_path / "again", mesh_key)  # the module's teardown stops it
        channel, stub = worker_stub(workers[1], mesh_key)
        publisher.workers = [stubs[0], stub]
        await publisher.connect()
        current = nudged(current, 50, 0.25)
        report = await publisher.publish(v + 3, current)
        assert report.mode == "full" and report.why_full == f"worker 1 holds v0, not v{v + 2}"
        await publisher.verify(current)
        current = nudged(current, 50, 0.25)
        assert (await publisher.publish(v + 4, current)).mode == "delta"
        await publisher.verify(current)
    finally:
        publisher.close()
        if channel is not None:
            await channel.close()


@pytest.mark.slow
async def test_a_worker_refuses_a_delta_it_cannot_apply(model_dir: Path, stubs: list[object]) -> None:
    stub = stubs[0]
    publisher = WeightPublisher([stub], bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30)
    try:
        v = await top(stubs)
        named = weights(model_dir)
        await publisher.publish(v + 1, named)  # a full-mode publisher: the worker's base is v+1 all the same
        specs = [
            weights_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape))
            for m in manifest_of(named)
        ]
        await stub.PauseGeneration(pb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_KEEP))  # type: ignore[attr-defined]

        def begin(**fields: object) -> object:
            request = pb.BeginWeightUpdateRequest(weight_version=v + 2, manifest=specs, **fields)  # type: ignore[arg-type]
            return stub.BeginWeightUpdate(request)  # type: ignore[attr-defined]

        delta_mode = weights_pb2.WEIGHT_UPDATE_MODE_DELTA
        cases = [
            (
                {"mode": delta_mode, "base_weight_version": 0, "changed_elements": [0] * len(specs)},
                "WEIGHT_DELTA_BASE_MISMATCH",
            ),
            (
                {"mode": delta_mode, "base_weight_version": v, "changed_elements": [0] * len(specs)},
                "WEIGHT_DELTA_BASE_MISMATCH",
            ),
            (
                {"mode": delta_mode, "base_weight_version": v + 1, "changed_elements": [0]},
                "WEIGHT_MANIFEST_MISMATCH",
            ),
            (
                {"mode": weights_pb2.WEIGHT_UPDATE_MODE_FULL, "changed_elements": [0] * len(specs)},
                "INVALID_ARGUMENT",
            ),
        ]
        for fields, reason in cases:
            with pytest.raises(RpcError) as refused:
                await begin(**fields)
            assert reason in (refused.value.reason, refused.value.code.name), fields
        held = (await stub.GetWeightInfo(pb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
        assert (
            held.weight_version == v + 1
            and held.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY
        )
        await stub.ResumeGeneration(pb.ResumeGenerationRequest())  # type: ignore[attr-defined]
    finally:
        publisher.close()


@pytest.mark.slow
async def test_an_in_flight_delta_lands_without_a_pause(model_dir: Path, stubs: list[object]) -> None:
    publisher = WeightPublisher(
        stubs, bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30, mode="delta"
    )
    try:
        v = await top(stubs)
        current = weights(model_dir)
        await publisher.publish(v + 1, current, in_flight=True)
        current = nudged(current, 31, 0.125)
        report = await publisher.publish(v + 2, current, in_flight=True)
        assert report.mode == "delta" and report.in_flight and report.pause_s == 0
        await publisher.verify(current)
    finally:
        publisher.close()


@pytest.mark.slow
async def test_workers_that_take_no_delta_get_every_update_whole_without_a_base(
    model_dir: Path, stubs: list[object]
) -> None:
    """What a vLLM worker on GPUs (NCCL: no DELTA in its WorkerInfo) meets in delta mode: whole updates, and
    no copy kept nor checksums checked against one (its checksums are in vLLM's own naming)."""
    publisher = WeightPublisher(
        stubs, bucket_size_bytes=1 << 20, transfer_timeout_s=20, rpc_timeout_s=30, mode="delta"
    )
    try:
        await publisher.connect()
        publisher._delta_updates = [True, False]  # what GetWorkerInfo says for a worker without DELTA
        v = await top(stubs)
        current = weights(model_dir)
        for step in (1, 2):
            current = nudged(current, 41, 0.25)
            report = await publisher.publish(v + step, current)
            assert report.mode == "full" and report.why_full == "the engine of worker 1 takes no delta"
            assert report.bytes == report.full_bytes and report.verify_s == 0.0
            assert publisher._base is None
        await publisher.verify(current)
    finally:
        publisher.close()
