"""The CPU weight transport (trainer/inference/weights.py): bucket plans, and packed broadcasts over gloo
between real processes on loopback (this process as the trainer's rank 0 unless the sender has to die, two
spawned receivers), including a sender and a receiver that die mid-update."""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.context import SpawnProcess
from multiprocessing.queues import Queue
from typing import Any, TypeVar

import pytest
import torch

from tests.support.weights_peer import (
    HOST,
    Outcome,
    Round,
    make_tensors,
    receiver,
    receiver_that_dies,
    sender_that_dies,
)
from trainer.inference.engine import TensorMeta
from trainer.inference.weights import (
    ALIGNMENT,
    MIN_BUCKET_BYTES,
    OVERLAP_BUCKETS,
    Bucket,
    TransferError,
    TransferGroup,
    bucket_size_for,
    expected_bytes,
    meta_nbytes,
    plan_buckets,
    plan_per_tensor,
    receive_packed,
    send_packed,
    staging_targets,
    tensor_checksum,
)

T = TypeVar("T")
SPAWN = multiprocessing.get_context("spawn")
BUCKET = 16 * 1024
REPORT_WAIT_S = 45.0  # how long a spawned rank may take to report: its start (importing torch) and its work
DTYPES = ("float32", "bfloat16", "float16", "int64")

MIXED: tuple[TensorMeta, ...] = (
    TensorMeta("model.embed_tokens.weight", "bfloat16", (1000, 67)),  # 134,000 bytes: larger than a bucket
    TensorMeta("model.layers.0.self_attn.q_proj.weight", "float32", (33, 17)),
    TensorMeta("model.layers.0.input_layernorm.weight", "float16", (33,)),
    TensorMeta("model.step", "int64", ()),
    TensorMeta("model.empty", "float32", (0, 4)),
    TensorMeta("model.layers.0.mlp.down_proj.weight", "bfloat16", (129, 31)),
    *(TensorMeta(f"model.layers.{i}.mlp.up_proj.weight", "bfloat16", (64, 61)) for i in range(1, 6)),
    *(TensorMeta(f"model.small.{i}", DTYPES[i % 4], (i % 7 + 1,)) for i in range(300)),
    TensorMeta("model.positions", "int64", (513,)),
    TensorMeta("lm_head.weight", "float32", (311, 101)),  # 125,644 bytes: larger than a bucket
)
DOWN = next(i for i, m in enumerate(MIXED) if m.name == "model.layers.0.mlp.down_proj.weight")
LM_HEAD = len(MIXED) - 1


def meta(name: str, dtype: str, *shape: int) -> TensorMeta:
    return TensorMeta(name, dtype, tuple(shape))


# ---- plans ------------------------------------------------------------------------------------------


def test_plan_fills_buckets_in_manifest_order() -> None:
    manifest = [meta(f"t{i}", "float32", 10) for i in range(10)]  # 40 bytes each, 48 with alignment
    buckets = plan_buckets(manifest, 100)
    assert [[e.meta.name for e in b.entries] for b in buckets] == [
        ["t0", "t1"],
        ["t2", "t3"],
        ["t4", "t5"],
        ["t6", "t7"],
        ["t8", "t9"],
    ]
    assert [(e.offset, e.nbytes) for e in buckets[0].entries] == [(0, 40), (48, 40)]
    assert [b.nbytes for b in buckets] == [88] * 5
    assert [b.index for b in buckets] == list(range(5))
    assert expected_bytes(buckets) == 400


def test_plan_gives_a_tensor_larger_than_the_bucket_a_bucket_of_its_own() -> None:
    manifest = [meta("a", "float32", 4), meta("big", "bfloat16", 1000), meta("b", "float32", 4)]
    buckets = plan_buckets(manifest, 64)
    assert [[e.meta.name for e in b.entries] for b in buckets] == [["a"], ["big"], ["b"]]
    assert buckets[1].nbytes == 2000


def test_plan_is_deterministic_and_covers_every_tensor_once() -> None:
    rng = random.Random(7)  # noqa: S311 - reproducible test data, not a secret
    for _ in range(50):
        manifest = [
            meta(f"t{i}", rng.choice(DTYPES), *[rng.randint(0, 40) for _ in range(rng.randint(0, 3))])
            for i in range(rng.randint(0, 60))
        ]
        size = rng.choice([1, 16, 100, 1000, 1 << 20])
        buckets = plan_buckets(manifest, size)
        assert buckets == plan_buckets(list(manifest), size)
        assert [e.meta for b in buckets for e in b.entries] == manifest
        for bucket in buckets:
            assert bucket.entries
            assert bucket.nbytes <= size or len(bucket.entries) == 1
            end = 0
            for entry in bucket.entries:
                assert entry.nbytes == meta_nbytes(entry.meta)
                assert entry.offset >= end
                assert entry.offset % ALIGNMENT == 0 or entry.nbytes == 0
                end = entry.offset + entry.nbytes
            assert bucket.nbytes == end


def test_plan_edge_cases() -> None:
    assert plan_buckets([], 1024) == []
    scalar = plan_buckets([meta("s", "int64")], 1024)
    assert scalar[0].entries[0].nbytes == 8
    empty_only = plan_buckets([meta("e", "float32", 0, 3)], 1024)
    assert empty_only == [Bucket(0, empty_only[0].entries, 0)]
    per_tensor = plan_per_tensor(MIXED)
    assert [len(b.entries) for b in per_tensor] == [1] * len(MIXED)
    assert expected_bytes(per_tensor) == expected_bytes(plan_buckets(MIXED, BUCKET))
    with pytest.raises(ValueError, match="at least 1"):
        plan_buckets(MIXED, 0)
    with pytest.raises(ValueError, match="t is listed twice"):
        plan_buckets([meta("t", "float32", 1), meta("t", "float32", 1)], 1024)
    with pytest.raises(ValueError, match="not a torch dtype"):
        plan_buckets([meta("t", "float33", 1)], 1024)
    with pytest.raises(ValueError, match="negative dimension"):
        plan_buckets([meta("t", "float32", -1)], 1024)


def test_bucket_size_splits_a_small_model_into_buckets_that_overlap() -> None:
    mib = 1 << 20
    # A 10M-parameter bfloat16 model (hidden 256, 8 layers, vocabulary 8192): 22 MB, one 32 MiB bucket as is.
    layers = [
        meta(f"l{i}.{name}", "bfloat16", *shape)
        for i in range(8)
        for name, shape in [
            *((p, (256, 256)) for p in "qkvo"),
            *((p, (768, 256)) for p in ("gate", "up", "down")),
            ("norm", (256,)),
        ]
    ]
    small = [meta("embed", "bfloat16", 8192, 256), *layers, meta("lm_head", "bfloat16", 8192, 256)]
    total = sum(meta_nbytes(m) for m in small)
    assert len(plan_buckets(small, 32 * mib)) == 1
    size = bucket_size_for(small, 32 * mib)
    assert size == -(-total // OVERLAP_BUCKETS // ALIGNMENT) * ALIGNMENT
    assert len(plan_buckets(small, size)) >= OVERLAP_BUCKETS
    # Every rank plans from the announced size: the plan moves every tensor once, in order.
    assert [e.meta for b in plan_buckets(small, size) for e in b.entries] == small
    # A model of at least that many full buckets keeps the configured size.
    large = [meta(f"t{i}", "float32", mib) for i in range(OVERLAP_BUCKETS)]  # 4 MiB each
    assert bucket_size_for(large, 4 * mib) == 4 * mib
    # Never below the contract's smallest bucket, nor above the configured one; a tiny model is one bucket.
    assert bucket_size_for([meta("t", "float32", 1000)], 32 * mib) == MIN_BUCKET_BYTES
    assert bucket_size_for([meta("t", "float32", 1000)], 100) == 100
    assert bucket_size_for([], 32 * mib) == MIN_BUCKET_BYTES
    assert bucket_size_for(small, 32 * mib, buckets=1) == -(-total // ALIGNMENT) * ALIGNMENT
    with pytest.raises(ValueError, match="at least 1"):
        bucket_size_for(small, 32 * mib, buckets=0)


def test_staging_targets_are_views_of_one_buffer_per_bucket() -> None:
    buckets = plan_buckets(MIXED, BUCKET)
    targets = staging_targets(buckets)
    for bucket in buckets:
        first = targets[bucket.entries[0].meta.name]
        for entry in bucket.entries:
            target = targets[entry.meta.name]
            assert target.dtype == getattr(torch, entry.meta.dtype)
            assert tuple(target.shape) == entry.meta.shape
            assert target.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


# ---- one process, two ranks (validation, timeouts, cancellation) ------------------------------------


@contextlib.contextmanager
def two_ranks(timeout_s: float = 20) -> Iterator[tuple[TransferGroup, TransferGroup]]:
    """A real group of two ranks in this process: rank 1 joins from a thread while rank 0 connects."""
    listener = TransferGroup.listen(HOST, 2, timeout_s)
    joined: list[TransferGroup] = []
    joining = threading.Thread(
        target=lambda: joined.append(TransferGroup.join(HOST, listener.port, 2, 1, timeout_s))
    )
    joining.start()
    sender = listener.connect()
    joining.join()
    try:
        yield sender, joined[0]
    finally:
        joined[0].close()
        sender.close()


def in_thread(fn: Callable[[], T]) -> Callable[[], T]:
    """Run `fn` on a thread now; the returned function joins it and returns its result or raises."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()

    def join() -> T:
        thread.join()
        if failure:
            raise failure[0]
        return result[0]

    return join


def test_listen_lets_the_os_choose_the_port() -> None:
    first = TransferGroup.listen(HOST, 3, 5)
    second = TransferGroup.listen(HOST, 3, 5)
    try:
        assert first.port > 0
        assert second.port > 0
        assert first.port != second.port
    finally:
        first.close()
        second.close()
    with pytest.raises(ValueError, match="rank 3 is not a worker rank"):
        TransferGroup.join(HOST, 1, 3, 3, 5)
    with pytest.raises(ValueError, match="rank 0 is not a worker rank"):
        TransferGroup.join(HOST, 1, 3, 0, 5)


def test_create_tells_the_port_before_it_blocks() -> None:
    joining: list[Callable[[], TransferGroup]] = []

    def start_joining(port: int) -> None:
        joining.append(in_thread(lambda: TransferGroup.join(HOST, port, 2, 1, 20)))

    with TransferGroup.create(HOST, 2, 20, on_listening=start_joining) as sender, joining[0]() as worker:
        values = torch.arange(-5, 6, dtype=torch.int64)
        landed = torch.zeros(11, dtype=torch.int64)
        receiving = in_thread(lambda: worker.broadcast(landed, timeout_s=10))
        sender.broadcast(values, timeout_s=10)
        receiving()
        assert torch.equal(landed, values)


def test_a_group_whose_ranks_do_not_all_arrive_does_not_form() -> None:
    listener = TransferGroup.listen(HOST, 2, timeout_s=1)
    with pytest.raises(TransferError, match=f"the transfer group on port {listener.port} did not form"):
        listener.connect()
    with pytest.raises(TransferError, match="already connected or closed"):
        listener.connect()


def test_bad_geometry_is_a_value_error_before_any_collective() -> None:
    buckets = plan_buckets(MIXED, BUCKET)
    tensors = make_tensors(MIXED, seed=11)
    with two_ranks() as (sender, worker):
        good = {m.name: torch.zeros(m.shape, dtype=getattr(torch, m.dtype)) for m in MIXED}
        missing = {k: v for k, v in good.items() if k != "model.positions"}
        with pytest.raises(ValueError, match=r"no target for model\.positions"):
            receive_packed(worker, buckets, missing, timeout_s=5)
        wrong_dtype = {**good, "lm_head.weight": torch.zeros(311, 101, dtype=torch.bfloat16)}
        with pytest.raises(ValueError, match=r"lm_head\.weight is bfloat16, the plan says float32"):
            receive_packed(worker, buckets, wrong_dtype, timeout_s=5)
        wrong_shape = {**good, "model.step": torch.zeros(1, dtype=torch.int64)}
        with pytest.raises(ValueError, match=r"model\.step has shape \[1\], the plan says \[\]"):
            receive_packed(worker, buckets, wrong_shape, timeout_s=5)
        strided = {**good, "lm_head.weight": torch.zeros(101, 311).t()}
        with pytest.raises(ValueError, match=r"lm_head\.weight is not contiguous"):
            receive_packed(worker, buckets, strided, timeout_s=5)
        with pytest.raises(
            ValueError, match=f"the plan has {len(MIXED)} tensors, {len(MIXED) - 1} were given"
        ):
            send_packed(sender, tensors[:-1], buckets, timeout_s=5)
        with pytest.raises(ValueError, match=r"model\.step is float32, the plan says int64"):
            send_packed(sender, [*tensors[:3], torch.zeros(()), *tensors[4:]], buckets, timeout_s=5)
        with pytest.raises(ValueError, match="runs on rank 0"):
            send_packed(worker, tensors, buckets, timeout_s=5)
        assert sender.failure is None
        assert worker.failure is None

        # Nothing was posted by the calls above: a real update now lines up bucket for bucket.
        sending = in_thread(lambda: send_packed(sender, tensors, buckets, timeout_s=10))
        received = receive_packed(worker, buckets, good, timeout_s=10)
        sent = sending()
        assert received.bytes == sent.bytes == expected_bytes(buckets)
        assert [tensor_checksum(good[m.name]) for m in MIXED] == [tensor_checksum(t) for t in tensors]


def test_only_buckets_of_several_tensors_are_copied() -> None:
    buckets = plan_buckets(MIXED, BUCKET)
    shared = sum(b.payload_bytes for b in buckets if len(b.entries) > 1)
    assert 0 < shared < expected_bytes(buckets)
    tensors = make_tensors(MIXED, seed=12)
    laid_out = staging_targets(buckets)
    separate = {m.name: torch.zeros(m.shape, dtype=getattr(torch, m.dtype)) for m in MIXED}
    with two_ranks() as (sender, worker):
        for targets, unpacked in ((laid_out, 0), (separate, shared)):
            sending = in_thread(lambda: send_packed(sender, tensors, buckets, timeout_s=10))
            received = receive_packed(worker, buckets, targets, timeout_s=10)
            assert sending().copied_bytes == shared  # single contiguous tensors go from their own memory
            assert received.copied_bytes == unpacked  # laid-out targets take each bucket in place
            assert [tensor_checksum(targets[m.name]) for m in MIXED] == [tensor_checksum(t) for t in tensors]


def test_a_receive_that_gets_nothing_times_out() -> None:
    buckets = plan_buckets(MIXED, BUCKET)
    targets = staging_targets(buckets)
    with two_ranks() as (_, worker):
        with pytest.raises(
            TransferError, match=r"receiving bucket 0 \(134000 bytes: model\.embed_tokens\.weight\)"
        ) as failed:
            receive_packed(worker, buckets, targets, timeout_s=1)
        assert failed.value.bucket == 0
        assert worker.failure is not None
        with pytest.raises(TransferError, match="unusable"):
            receive_packed(worker, buckets, targets, timeout_s=1)


def test_a_cancelled_receive_stops_waiting() -> None:
    buckets = plan_buckets(MIXED, BUCKET)
    cancelled = threading.Event()
    cancelled.set()
    with two_ranks() as (_, worker):
        with pytest.raises(TransferError, match="cancelled") as failed:
            receive_packed(worker, buckets, staging_targets(buckets), timeout_s=2, cancelled=cancelled)
        assert failed.value.bucket == 0


# ---- three processes ----------------------------------------------------------------------------


@contextlib.contextmanager
def spawned(target: Callable[..., None], *args: object) -> Iterator[SpawnProcess]:
    process = SPAWN.Process(target=target, args=args, daemon=True)
    process.start()
    try:
        yield process
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


def outcomes(out: Queue[Outcome], count: int) -> list[Outcome]:
    """`count` reports from the spawned ranks, ordered by rank then round."""
    got = [out.get(timeout=REPORT_WAIT_S) for _ in range(count)]
    return sorted(got, key=lambda o: (o.rank, o.round))


def expected_checksums(manifest: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple((m.name, tensor_checksum(t)) for m, t in zip(manifest, tensors, strict=True))


def test_every_tensor_arrives_bit_exact_on_every_receiver() -> None:
    rounds = [
        Round(MIXED, BUCKET, seed=1),
        Round(MIXED, 0, seed=2),  # one broadcast per tensor
        Round(MIXED, 1 << 20, seed=3),  # everything in one bucket
        Round(MIXED, BUCKET, seed=4),  # the group's staging buffers again, with new values
    ]
    out: Queue[Outcome] = SPAWN.Queue()
    listener = TransferGroup.listen(HOST, 3, 60)
    with (
        spawned(receiver, listener.port, 3, 1, rounds, "separate", out),
        spawned(receiver, listener.port, 3, 2, rounds, "laid_out", out),
        listener.connect() as group,
    ):
        sent: list[tuple[Any, ...]] = []
        for rnd in rounds:
            tensors = make_tensors(rnd.manifest, rnd.seed)
            for index in (DOWN, LM_HEAD):  # the sender's tensors need not be contiguous, packed or alone
                tensors[index] = tensors[index].t().contiguous().t()
                assert not tensors[index].is_contiguous()
            stats = send_packed(group, tensors, rnd.plan(), timeout_s=10)
            assert stats.bytes == expected_bytes(rnd.plan())
            assert stats.buckets == len(rnd.plan())
            sent.append(expected_checksums(rnd.manifest, tensors))
        reports = outcomes(out, 2 * len(rounds))
    assert [(o.rank, o.round, o.error) for o in reports] == [(r, i, "") for r in (1, 2) for i in range(4)]
    for report in reports:
        assert report.checksums == sent[report.round], f"rank {report.rank}, round {report.round}"
    assert len(set(sent)) == len(rounds)


def test_a_sender_that_dies_mid_update_fails_the_receivers() -> None:
    rnd = Round(MIXED, BUCKET, seed=5)
    assert len(rnd.plan()) >= 4
    ports: Queue[int] = SPAWN.Queue()
    out: Queue[Outcome] = SPAWN.Queue()
    with spawned(sender_that_dies, 3, rnd, ports) as sender:
        port = ports.get(timeout=REPORT_WAIT_S)
        with (
            spawned(receiver, port, 3, 1, [rnd], "separate", out),
            spawned(receiver, port, 3, 2, [rnd], "laid_out", out),
        ):
            reports = outcomes(out, 2)
        sender.join(timeout=10)
    assert sender.exitcode == -signal.SIGKILL
    for report in reports:
        assert report.error == "TransferError", report.message
        assert report.bucket is not None
        assert f"receiving bucket {report.bucket} " in report.message


def test_a_receiver_that_dies_mid_update_fails_the_sender() -> None:
    rnd = Round(MIXED, BUCKET, seed=6)
    tensors = make_tensors(rnd.manifest, rnd.seed)
    out: Queue[Outcome] = SPAWN.Queue()
    listener = TransferGroup.listen(HOST, 3, 60)
    with (
        spawned(receiver, listener.port, 3, 1, [rnd], "separate", out),
        spawned(receiver_that_dies, listener.port, 3, 2, rnd, out) as dying,
    ):
        group = listener.connect()
        try:
            with pytest.raises(TransferError, match="sending bucket") as failed:
                send_packed(group, tensors, rnd.plan(), timeout_s=5)
            assert failed.value.bucket is not None
            assert group.failure is not None
            with pytest.raises(TransferError, match="unusable"):
                send_packed(group, tensors, rnd.plan(), timeout_s=5)
        finally:
            group.close()
        del failed  # its traceback holds the collectives, and with them the connections to the survivor
        reports = outcomes(out, 2)
        dying.join(timeout=10)
    assert dying.exitcode == -signal.SIGKILL
    survivor, died = reports
    assert (died.rank, died.error) == (2, "")  # it had its first bucket, then was killed
    assert (survivor.rank, survivor.error) == (1, "TransferError"), survivor.message
