"""Weight-sync benchmark: one weight update from the trainer to two inference workers on CPU (gloo over
loopback), by the packed transport, against per-tensor broadcasts with a gRPC call each and against one
flat broadcast of the same bytes, all measured in the same run over the same transfer group.

Run from the repository root:

    .venv/bin/python benchmarks/weight_sync.py             # 10M, 100M and 500M parameters, ~2.5 minutes
    .venv/bin/python benchmarks/weight_sync.py --quick     # the 10M model only, ~20 s
    .venv/bin/python benchmarks/weight_sync.py --bucket-mib 8 --repeats 9
    .venv/bin/python benchmarks/weight_sync.py --models 10M,100M --split 1   # plain 32 MiB buckets
    .venv/bin/python benchmarks/weight_sync.py --modes-only          # (e) alone: full, delta, LoRA; ~10 min

(or `make bench-weights`). Memory: about 10 GB at the 500M model (each worker holds the model three times:
staging, weights, flat buffer).

Processes: this one is the trainer, rank 0 of a `TransferGroup` (trainer/inference/weights.py); two workers
are spawned (`multiprocessing`, spawn), join the group as ranks 1 and 2 and each serve a plain gRPC
`InferenceService` on loopback with `BeginWeightUpdate` and `FinishWeightUpdate` only. A pipe to each
worker carries what a benchmark needs beyond the protocol (load a model's buffers, arm the flat receive,
compute checksums).

Models: the tensor names and shapes of Llama models built by transformers on the meta device, nine tensors
per layer (q/k/v/o, gate/up/down, two RMSNorm weights) plus the embedding, the final norm and, when not tied
to the embedding, lm_head; bfloat16 with random values:

    10M    hidden 256, 8 layers, vocab 8192, lm_head untied                     (75 tensors)
    100M   SmolLM2-135M's shapes (hidden 576, GQA 9/3), 20 layers, tied         (182 tensors)
    500M   Qwen2.5-0.5B's shapes (hidden 896, GQA 14/2, vocab 151936), tied     (218 tensors)

Per model, the same tensors move in these ways, each timed on the trainer until both workers hold every
byte (the figures of (a) and (c) are the transport's, the others include their control plane):

(a) packed: `send_packed` (double-buffered buckets, sized as below) into `receive_packed` on each worker,
    armed beforehand over the pipe, exactly like (c). The workers receive into staging targets laid out as
    the plan (`staging_targets`), so a bucket of several tensors lands in place without being unpacked.
(a) + Begin/Finish: the contract's whole update. `BeginWeightUpdate` (whole manifest, packed) to both
    workers, which arm `receive_packed` on a thread and answer; `send_packed`; `FinishWeightUpdate`, which
    answers once the worker's receive ended. This is what (b) is compared with.
(b) per-tensor + gRPC: how older RL trainers did it. For each tensor, a unary `BeginWeightUpdate` carrying
    that one tensor's name, dtype and shape to every worker (issued as futures, so the worker can post its
    receive), one broadcast of the tensor, and the wait for both answers; each worker allocates a tensor,
    receives into it and copies it into its weights before answering.
(c) ceiling: one broadcast of one preallocated flat buffer of the same total bytes into one preallocated
    buffer on each worker, with no control plane at all: one collective, no copies, no per-tensor work.

(d) a full update into real inference workers, the torch engine's and vLLM's (where vLLM is installed:
    `.venv-vllm/bin/python benchmarks/weight_sync.py`; `--engines no` leaves it out): two worker processes of
    each engine serve the same 10M model in float32, and `WeightPublisher.publish` (Pause -> Begin -> packed
    gloo broadcast -> Finish -> Resume) puts new weights into each pair, the engines taking turns each round;
    printed with its phases and the ratio of vLLM's time to the torch engine's. The torch workers stage and
    swap; vLLM's engine core receives with Tandem's gloo engine and loads through its layerwise reload.

(e) the update modes, `[weights] mode` (`--modes-only` for this part alone; `--modes no` leaves it out): at the
    100M and 500M shapes and Qwen2-0.5B's (the 500M shape with Qwen2's q/k/v biases), a float32 model
    initialised as transformers does (std 0.02) takes --mode-steps real AdamW steps (next-token loss on random
    tokens) at --mode-lr (1e-6), and each step's bf16 cast is published into two real torch worker processes
    serving the model in bf16: once whole (`mode="full"`) and once as a delta from the step before
    (`mode="delta"`); then a LoRA adapter of rank 16 and of rank 64 on every linear layer, trained at --lora-lr,
    is published as adapter-only updates (`mode="lora"`) into fresh workers. Printed per shape and mode: MB on
    the wire and their share of a full update, the median seconds per update on the trainer's clock and the
    ratio to full, each phase in ms, and the share of bf16 elements each step changed. Every mode ends with
    `verify`: the workers hold the trainer's tensors bit for bit. Memory: about 12 GB at the 500M shapes.

Two variants are printed below the table: (a) into separately allocated targets (what an engine does when
its staging is not laid out as the plan: each bucket of several tensors is unpacked with a copy), and one
broadcast per tensor without gRPC (the contract's unpacked mode, `plan_per_tensor`); beside them, (b)'s
time over (c)'s: the most (a) + Begin/Finish could gain on (b) (a bound on the second goal, same run).

GB/s is tensor bytes per second of update, the rate at which each worker receives. Every figure is the
median of --repeats runs after one warm-up run of each (first touches of fresh buffers are not measured);
the methods take turns within each round, so slow phases of a shared machine hit them all alike. Then, for
(a), (a) + Begin/Finish and (b) in turn, the workers zero what they hold, the update runs once more, and
each worker's checksum digest of what it received is compared with the trainer's.

Goals: (a) reaches >= 0.85x the ceiling's GB/s; (a) + Begin/Finish is >= 5x faster than (b) on the 100M
model.

Bucket size: as the trainer's publisher chooses it (`bucket_size_for`): up to --bucket-mib (32 MiB by
default), and a model smaller than --split (2) such buckets goes in about --split buckets of at least 1 MiB,
so that the 10M model's 22 MB moves in 3 buckets, not one that is packed whole before its first byte moves;
`--split 1` gives the plain --bucket-mib plan (one bucket for 10M, six for 100M), for a before/after in the
same conditions. A tensor larger than the bucket goes on its own, from and into its memory without a copy,
and the sender packs bucket k+1 while bucket k is on the wire. Earlier, on the 2-core machine this was
written on, 8, 32 and 256 MiB gave ratios to the ceiling within the run-to-run noise of one another (about
+-0.1); 32 MiB keeps the two staging buffers at 64 MiB per rank and still gives the 500M model 25 buckets.

Shortcuts: one machine, so "network" is loopback TCP and the three processes share its cores (each runs
torch with one intra-op thread so they do not fight over them; on 2 cores, every copy the transport makes
takes CPU from the kernel's socket copies, which is what keeps (a) below (c)); the gRPC servers have no
auth, no interceptors and no TLS, which only flatters (b) and (a) + Begin/Finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import torch
from tandem.inference.v1 import inference_service_pb2 as pb
from tandem.inference.v1 import inference_service_pb2_grpc, weights_pb2

from trainer.inference.engine import TensorMeta
from trainer.inference.weights import (
    OVERLAP_BUCKETS,
    Bucket,
    TransferGroup,
    TransferStats,
    bucket_size_for,
    checksum_digest,
    dtype_of,
    expected_bytes,
    plan_buckets,
    plan_per_tensor,
    receive_packed,
    send_packed,
    staging_targets,
    tensor_checksum,
)

HOST = "127.0.0.1"
WORKERS = 2
TIMEOUT_S = 120.0  # forming the group, and each broadcast
RPC_TIMEOUT_S = 60.0
DIGEST = "digest"


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool


MODELS = (
    ModelShape("10M", 256, 768, 8, 4, 4, 8192, tied=False),
    ModelShape("100M", 576, 1536, 20, 9, 3, 49152, tied=True),
    ModelShape("500M", 896, 4864, 24, 14, 2, 151936, tied=True),
)


def config_for(shape: ModelShape, kind: str = "llama", **extra: Any) -> Any:
    """The transformers config of the shape: a Llama model, or a Qwen2 one (`kind` "qwen2")."""
    from transformers import LlamaConfig, Qwen2Config  # noqa: PLC0415

    return (LlamaConfig if kind == "llama" else Qwen2Config)(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=shape.tied,
        **extra,
    )


def manifest_for(shape: ModelShape) -> list[TensorMeta]:
    """The model's parameters as transformers names them, in its order, without materializing any."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - only the trainer needs it

    config = config_for(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    return [TensorMeta(name, "bfloat16", tuple(p.shape)) for name, p in model.named_parameters()]


def zeros_for(manifest: Sequence[TensorMeta]) -> dict[str, torch.Tensor]:
    return {m.name: torch.zeros(m.shape, dtype=dtype_of(m.dtype)) for m in manifest}


def digest_of(manifest: Sequence[TensorMeta], tensors: dict[str, torch.Tensor]) -> str:
    return checksum_digest([(m.name, tensor_checksum(tensors[m.name])) for m in manifest])


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


# ---- the worker ----------------------------------------------------------------------------------------


@dataclass
class WorkerModel:
    """One model's buffers on a worker: (a)'s staging targets laid out as the plan, its weights one tensor
    each (what (b) loads into, and the variant's separate targets), (c)'s flat buffer."""

    manifest: list[TensorMeta]
    buckets: list[Bucket]
    laid_out: dict[str, torch.Tensor]
    separate: dict[str, torch.Tensor]
    flat: torch.Tensor


@dataclass
class WorkerState:
    group: TransferGroup
    model: WorkerModel | None = None
    receiving: futures.Future[TransferStats] | None = None
    pool: futures.ThreadPoolExecutor = field(default_factory=lambda: futures.ThreadPoolExecutor(1))


class WorkerWeights:
    """The worker's two weight-update RPCs. BeginWeightUpdate with `packed` arms a background receive of the
    whole plan and answers at once (the contract); without `packed`, with a one-tensor manifest, it receives
    that tensor before answering (the per-parameter baseline). FinishWeightUpdate answers once the armed
    receive ended."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def begin(
        self, request: pb.BeginWeightUpdateRequest, _: grpc.ServicerContext
    ) -> pb.BeginWeightUpdateResponse:
        state, model = self.state, self.state.model
        assert model is not None
        if request.packed:
            manifest = [TensorMeta(s.name, s.dtype, tuple(s.shape)) for s in request.manifest]
            buckets = plan_buckets(manifest, request.bucket_size_bytes)
            state.receiving = state.pool.submit(
                receive_packed, state.group, buckets, model.laid_out, TIMEOUT_S
            )
            return pb.BeginWeightUpdateResponse(
                expected_bytes=expected_bytes(buckets), expected_broadcasts=len(buckets)
            )
        spec = request.manifest[0]
        received = torch.empty(tuple(spec.shape), dtype=dtype_of(spec.dtype))
        state.group.broadcast(as_bytes(received), TIMEOUT_S)
        model.separate[spec.name].copy_(received)
        return pb.BeginWeightUpdateResponse(expected_bytes=received.nbytes, expected_broadcasts=1)

    def finish(
        self, request: pb.FinishWeightUpdateRequest, _: grpc.ServicerContext
    ) -> pb.FinishWeightUpdateResponse:
        assert self.state.receiving is not None
        stats = self.state.receiving.result(timeout=TIMEOUT_S)
        response = pb.FinishWeightUpdateResponse(weight_version=request.weight_version)
        response.timings.receive.FromNanoseconds(int(stats.seconds * 1e9))
        response.timings.bytes_received = stats.bytes
        response.timings.buckets_received = stats.buckets
        return response

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "tandem.inference.v1.InferenceService",
            {
                "BeginWeightUpdate": grpc.unary_unary_rpc_method_handler(
                    self.begin,
                    request_deserializer=pb.BeginWeightUpdateRequest.FromString,
                    response_serializer=pb.BeginWeightUpdateResponse.SerializeToString,
                ),
                "FinishWeightUpdate": grpc.unary_unary_rpc_method_handler(
                    self.finish,
                    request_deserializer=pb.FinishWeightUpdateRequest.FromString,
                    response_serializer=pb.FinishWeightUpdateResponse.SerializeToString,
                ),
            },
        )


def worker_main(rank: int, port: int, conn: Connection) -> None:
    """A worker process: join the group, serve gRPC, then follow the trainer's commands on `conn`."""
    torch.set_num_threads(1)
    state = WorkerState(TransferGroup.join(HOST, port, WORKERS + 1, rank, TIMEOUT_S))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((WorkerWeights(state).handler(),))
    conn.send(server.add_insecure_port(f"{HOST}:0"))
    server.start()
    try:
        while (command := conn.recv()) is not None:
            kind, *args = command
            if kind == "load":
                state.model = None  # the previous model's buffers go first
                manifest, bucket_size = args
                buckets = plan_buckets(manifest, bucket_size)
                laid_out = staging_targets(buckets)
                for tensor in laid_out.values():
                    tensor.zero_()
                total = expected_bytes(buckets)
                state.model = WorkerModel(
                    manifest, buckets, laid_out, zeros_for(manifest), torch.zeros(total, dtype=torch.uint8)
                )
                conn.send("loaded")
            elif kind == "flat":
                assert state.model is not None
                conn.send("armed")
                began = time.perf_counter()
                state.group.broadcast(state.model.flat, TIMEOUT_S)
                conn.send(time.perf_counter() - began)
            elif kind == "packed":
                assert state.model is not None
                targets = state.model.laid_out if args[0] == "laid_out" else state.model.separate
                conn.send("armed")
                conn.send(receive_packed(state.group, state.model.buckets, targets, TIMEOUT_S))
            elif kind == "unpacked":
                assert state.model is not None
                per_tensor = plan_per_tensor(state.model.manifest)
                conn.send("armed")
                conn.send(receive_packed(state.group, per_tensor, state.model.separate, TIMEOUT_S))
            elif kind == "zero":
                assert state.model is not None
                for tensor in [*state.model.laid_out.values(), *state.model.separate.values()]:
                    tensor.zero_()
                conn.send("ok")
            elif kind == DIGEST:
                assert state.model is not None
                which = state.model.laid_out if args[0] == "staging" else state.model.separate
                conn.send(digest_of(state.model.manifest, which))
    finally:
        server.stop(0)
        state.group.close()


# ---- the trainer --------------------------------------------------------------------------------------


@dataclass
class Worker:
    conn: Connection
    stub: inference_service_pb2_grpc.InferenceServiceStub
    channel: grpc.Channel

    def ask(self, *command: Any) -> Any:
        self.conn.send(command)
        return self.conn.recv()


@dataclass
class Trainer:
    group: TransferGroup
    workers: list[Worker]
    max_bucket_size: int
    split: int  # bucket_size_for's `buckets`
    bucket_size: int = 0  # the loaded model's, as the publisher chooses it
    version: int = 0
    buckets: list[Bucket] = field(default_factory=list)  # the loaded model's plans
    per_tensor: list[Bucket] = field(default_factory=list)

    def all(self, *command: Any) -> list[Any]:
        for worker in self.workers:
            worker.conn.send(command)
        return [worker.conn.recv() for worker in self.workers]

    def packed(self, tensors: Sequence[torch.Tensor], layout: str = "laid_out") -> float:
        """(a): the packed transport alone, the workers armed beforehand over the pipe (as for (c)), receiving
        into staging targets laid out as the plan, or allocated one by one."""
        return self.piped(
            ("packed", layout), lambda: send_packed(self.group, tensors, self.buckets, TIMEOUT_S)
        )

    def protocol(self, manifest: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> float:
        """(a) with its control plane: Begin (packed) on every worker, the packed broadcast, Finish."""
        self.version += 1
        begin = pb.BeginWeightUpdateRequest(
            weight_version=self.version,
            manifest=[
                weights_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape)) for m in manifest
            ],
            bucket_size_bytes=self.bucket_size,
            packed=True,
        )
        finish = pb.FinishWeightUpdateRequest(weight_version=self.version)
        began = time.perf_counter()
        for reply in [w.stub.BeginWeightUpdate.future(begin, timeout=RPC_TIMEOUT_S) for w in self.workers]:
            reply.result()
        send_packed(self.group, tensors, plan_buckets(manifest, self.bucket_size), TIMEOUT_S)
        for finished in [
            w.stub.FinishWeightUpdate.future(finish, timeout=RPC_TIMEOUT_S) for w in self.workers
        ]:
            finished.result()
        return time.perf_counter() - began

    def per_tensor_grpc(self, manifest: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> float:
        """(b): per tensor, a one-tensor BeginWeightUpdate to every worker, the broadcast, both answers."""
        self.version += 1
        began = time.perf_counter()
        for meta, tensor in zip(manifest, tensors, strict=True):
            request = pb.BeginWeightUpdateRequest(
                weight_version=self.version,
                manifest=[weights_pb2.TensorSpec(name=meta.name, dtype=meta.dtype, shape=list(meta.shape))],
                packed=False,
            )
            replies = [w.stub.BeginWeightUpdate.future(request, timeout=RPC_TIMEOUT_S) for w in self.workers]
            self.group.broadcast(as_bytes(tensor), TIMEOUT_S)
            for reply in replies:
                reply.result()
        return time.perf_counter() - began

    def flat(self, buffer: torch.Tensor) -> float:
        """(c): one broadcast of one preallocated buffer into one on each worker."""
        return self.piped(("flat",), lambda: self.group.broadcast(buffer, TIMEOUT_S))

    def unpacked(self, tensors: Sequence[torch.Tensor]) -> float:
        """Variant: the transport's unpacked mode, one broadcast per tensor (no gRPC)."""
        return self.piped(("unpacked",), lambda: send_packed(self.group, tensors, self.per_tensor, TIMEOUT_S))

    def piped(self, command: tuple[str, ...], send: Callable[[], object]) -> float:
        """Arm both workers' receive over the pipe, then time `send` until both workers report the end."""
        for worker in self.workers:
            worker.conn.send(command)
        for worker in self.workers:
            assert worker.conn.recv() == "armed"
        began = time.perf_counter()
        send()
        for worker in self.workers:
            worker.conn.recv()
        return time.perf_counter() - began


@dataclass
class Row:
    shape: ModelShape
    params: int
    tensors: int
    nbytes: int
    buckets: int
    seconds: dict[str, float]
    exact: dict[str, bool]

    def gbps(self, method: str) -> float:
        return self.nbytes / self.seconds[method] / 1e9


def median_of(repeats: int, runs: dict[str, Callable[[], float]]) -> dict[str, float]:
    """One warm-up run of each, then `repeats` rounds in which each method runs once; medians."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run())
    return {name: statistics.median(values) for name, values in times.items()}


def measure(trainer: Trainer, shape: ModelShape, repeats: int) -> Row:
    manifest = manifest_for(shape)
    generator = torch.Generator().manual_seed(len(manifest))
    tensors = [
        torch.empty(m.shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator) for m in manifest
    ]
    total = sum(t.nbytes for t in tensors)
    flat = torch.ones(total, dtype=torch.uint8)
    trainer.bucket_size = bucket_size_for(manifest, trainer.max_bucket_size, trainer.split)
    trainer.buckets = plan_buckets(manifest, trainer.bucket_size)
    trainer.per_tensor = plan_per_tensor(manifest)
    assert trainer.all("load", manifest, trainer.bucket_size) == ["loaded"] * WORKERS
    print(
        f"{shape.name}: {len(manifest)} tensors, {total / 1e6:.1f} MB, buckets of (a): {len(trainer.buckets)} "
        f"of up to {trainer.bucket_size / (1 << 20):.2f} MiB; measuring",
        flush=True,
    )
    seconds = median_of(
        repeats,
        {
            "a": lambda: trainer.packed(tensors),
            "a_rpc": lambda: trainer.protocol(manifest, tensors),
            "b": lambda: trainer.per_tensor_grpc(manifest, tensors),
            "c": lambda: trainer.flat(flat),
            "a_separate": lambda: trainer.packed(tensors, layout="separate"),
            "unpacked": lambda: trainer.unpacked(tensors),
        },
    )

    # The proof: zero what the workers hold, move the weights once more, compare digests with the trainer's.
    want = [digest_of(manifest, dict(zip((m.name for m in manifest), tensors, strict=True)))] * WORKERS
    exact: dict[str, bool] = {}
    checks: list[tuple[str, Callable[[], float], str]] = [
        ("a", lambda: trainer.packed(tensors), "staging"),
        ("a_rpc", lambda: trainer.protocol(manifest, tensors), "staging"),
        ("b", lambda: trainer.per_tensor_grpc(manifest, tensors), "weights"),
    ]
    for method, run, held in checks:
        trainer.all("zero")
        run()
        exact[method] = trainer.all(DIGEST, held) == want
    return Row(
        shape, sum(t.numel() for t in tensors), len(manifest), total, len(trainer.buckets), seconds, exact
    )


def cell(row: Row, method: str) -> str:
    return f"{row.seconds[method]:6.3f}s {row.gbps(method):5.2f}GB/s"


def table(rows: Sequence[Row], trainer: Trainer, repeats: int) -> str:
    lines = [
        f"weight sync: 1 trainer + {WORKERS} workers, gloo on loopback, bfloat16 random weights, buckets of "
        f"up to {trainer.max_bucket_size / (1 << 20):g} MiB, a model under {trainer.split} of them in "
        f"{trainer.split}, median of {repeats}; {os.cpu_count()} CPU cores for the 3 processes",
        "",
        f"{'model':<6} {'params':>7} {'tensors':>7} {'bytes':>8} {'buckets':>7} | {'(a) packed':>16} | "
        f"{'(a) + Begin/Finish':>18} | "
        f"{'(b) per-tensor+gRPC':>19} | {'(c) flat ceiling':>16} | {'(a)/(c)':>7} {'goal':>6} | "
        f"{'(a)+ vs (b)':>11} {'goal':>6}",
    ]
    for row in rows:
        ratio = row.gbps("a") / row.gbps("c")
        speedup = row.seconds["b"] / row.seconds["a_rpc"]
        speed_goal = ("met" if speedup >= 5 else "missed") if row.shape.name == "100M" else "-"
        lines.append(
            f"{row.shape.name:<6} {row.params / 1e6:6.1f}M {row.tensors:>7} {row.nbytes / 1e6:6.1f}MB "
            f"{row.buckets:>7} | "
            f"{cell(row, 'a'):>16} | {cell(row, 'a_rpc'):>18} | {cell(row, 'b'):>19} | {cell(row, 'c'):>16} | "
            f"{ratio:6.2f}x {'met' if ratio >= 0.85 else 'missed':>6} | {speedup:10.1f}x {speed_goal:>6}"
        )
    lines += [
        "",
        "seconds per update on the trainer's clock, until both workers hold every byte; GB/s = tensor bytes / s",
        "(a) and (c): transport alone, receivers armed beforehand; (a) + Begin/Finish and (b): with their gRPC",
        "goals: (a) >= 0.85x the ceiling's GB/s; (a) + Begin/Finish >= 5x faster than (b) on the 100M model",
        "",
        "variants, same run:",
        f"{'model':<6} | {'(a) into separate targets':>26} | {'per-tensor broadcasts, no gRPC':>30} | "
        f"{'(a) + Begin/Finish':>18} | {'(b) / (c)':>9}",
    ]
    for row in rows:
        versus = {
            m: f"{cell(row, m)} {row.gbps(m) / row.gbps('c'):4.2f}x" for m in ("a_separate", "unpacked")
        }
        lines.append(
            f"{row.shape.name:<6} | {versus['a_separate']:>26} | {versus['unpacked']:>30} | "
            f"{row.gbps('a_rpc') / row.gbps('c'):17.2f}x | {row.seconds['b'] / row.seconds['c']:8.1f}x"
        )
    lines.append(
        "(each against (c); separate targets: each bucket unpacked with a copy instead of landing in place;"
    )
    lines.append(
        "(b) / (c): the most (a) + Begin/Finish could gain on (b), were its update as fast as the ceiling)"
    )
    lines.append("")
    for row in rows:
        verdict = {m: "bit-exact" if ok else "MISMATCH" for m, ok in row.exact.items()}
        lines.append(
            f"{row.shape.name}: workers' checksum digests against the trainer's after (a): {verdict['a']}, "
            f"after (a) + Begin/Finish: {verdict['a_rpc']}, after (b): {verdict['b']}"
        )
    return "\n".join(lines)


# ---- (d) a full update into inference workers: the torch engine's and vLLM's ---------------------------------

ENGINE_ENV = {
    "torch": {},
    "vllm": {
        "TANDEM_WORKER_ENGINE": "vllm",
        "TANDEM_WORKER_ENFORCE_EAGER": "true",
        "TANDEM_WORKER_DTYPE": "float32",  # the same bytes as the torch engine's
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    },
}


def full_updates(repeats: int, bucket_size: int) -> str:
    """(d): `WeightPublisher.publish` (Pause, Begin, packed broadcast, Finish, Resume) of a real model into two
    real worker processes of each engine, the engines taking turns each round."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, beside trainer
    return asyncio.run(_full_updates(repeats, bucket_size))


async def _full_updates(repeats: int, bucket_size: int) -> str:
    import secrets  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from safetensors.torch import load_file  # noqa: PLC0415

    from tests.support.workers import start_worker, stop_worker, worker_stub  # noqa: PLC0415
    from trainer.inference.publisher import UpdateReport, WeightPublisher  # noqa: PLC0415
    from trainer.models import build_tiny_model  # noqa: PLC0415

    key = secrets.token_hex(32)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-engines-") as tmp:
        folder = Path(tmp)
        shape = MODELS[0]  # 10M: hidden 256, 8 layers, vocabulary 8192, untied; float32 here
        model = build_tiny_model(
            folder / "model",
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            layers=shape.layers,
            heads=shape.heads,
            tie_embeddings=shape.tied,
        )
        base = load_file(str(model / "model.safetensors"))
        nbytes = sum(t.numel() * t.element_size() for t in base.values())
        started: dict[str, list[Any]] = {}
        opened: list[Any] = []
        publishers: dict[str, Any] = {}
        reports: dict[str, list[UpdateReport]] = {name: [] for name in ENGINE_ENV}
        try:
            for name, env in ENGINE_ENV.items():
                print(f"(d) starting 2 {name} workers ...", flush=True)
                started[name] = [
                    await asyncio.to_thread(start_worker, model, folder / f"{name}-{i}", key, env, 600.0)
                    for i in range(WORKERS)
                ]
                pairs = [worker_stub(w, key) for w in started[name]]
                opened += [channel for channel, _ in pairs]
                publishers[name] = WeightPublisher(
                    [stub for _, stub in pairs], backend="gloo", bucket_size_bytes=bucket_size
                )
            for version in range(1, repeats + 2):  # the first round is the warm-up (and forms the groups)
                named = [(n, t + 0.001 * version) for n, t in base.items()]
                for name, publisher in publishers.items():
                    report = await publisher.publish(version, named)
                    if version > 1:
                        reports[name].append(report)
            await publishers["torch"].verify(named)  # the torch engine's workers hold it bit for bit
        finally:
            for publisher in publishers.values():
                publisher.close()
            for channel in opened:
                await channel.close()
            for workers in started.values():
                for worker in workers:
                    await asyncio.to_thread(stop_worker, worker)

    def med(name: str, phase: str) -> float:
        return float(statistics.median(getattr(r, phase) for r in reports[name]))

    lines = [
        f"(d) a full update into {WORKERS} worker processes per engine ({shape.name} model, float32, "
        f"{nbytes / 1e6:.1f} MB, bucket {bucket_size / (1 << 20):g} MiB, median of {repeats}):",
        f"{'engine':<6} | {'total':>8} {'GB/s':>6} | {'pause':>7} {'begin':>7} {'transfer':>8} {'finish':>7} "
        f"{'resume':>7} | ratio to torch",
    ]
    for name in ENGINE_ENV:
        total = med(name, "total_s")
        phases = " ".join(
            f"{med(name, phase) * 1000:{width}.0f}ms"
            for phase, width in (
                ("pause_s", 5),
                ("begin_s", 5),
                ("transfer_s", 6),
                ("finish_s", 5),
                ("resume_s", 5),
            )
        )
        ratio = total / med("torch", "total_s")
        lines.append(
            f"{name:<6} | {total:7.3f}s {nbytes / total / 1e9:6.2f} | {phases} | "
            + ("1.00x (baseline)" if name == "torch" else f"{ratio:.2f}x the time")
        )
    lines += [
        "seconds per update on the trainer's clock (Pause -> Begin -> broadcast -> Finish -> Resume); the torch",
        "engine stages the tensors and swaps them in, vLLM loads each bucket through its layerwise reload inside",
        "its engine core (Tandem's gloo engine). The torch workers' checksums equal the trainer's after the last",
        "round; vLLM's cannot on a CPU, its correctness is tests/vllm/test_vllm_weights.py's.",
    ]
    return "\n".join(lines)


# (e): the update modes. Qwen2-0.5B's shape is the 500M one with the q/k/v biases Qwen2 has.
PHASES = ("diff_s", "pause_s", "begin_s", "transfer_s", "finish_s", "resume_s", "verify_s")
MODE_SHAPES = {"100M": "llama", "500M": "llama", "Qwen2-0.5B": "qwen2"}


@dataclass
class ModeRow:
    shape: str
    params: int
    full_bytes: int
    changed: list[float] = field(default_factory=list)  # per step: the share of bf16 elements that changed
    bytes: dict[str, list[int]] = field(default_factory=dict)  # per mode, per update
    seconds: dict[str, list[float]] = field(default_factory=dict)
    why_full: list[str] = field(default_factory=list)
    phases: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # per mode, per update


def _mode_model(name: str, seed: int) -> Any:
    """A float32 model of the shape, initialised as transformers does (normal, std 0.02)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    shape = {m.name: m for m in MODELS}["500M" if name == "Qwen2-0.5B" else name]
    config = config_for(shape, MODE_SHAPES[name], max_position_embeddings=512)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]


def _optimizer_step(model: Any, optimizer: Any, generator: torch.Generator, tokens: int) -> None:
    """One real AdamW step: next-token cross-entropy on random tokens."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator)
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def sync_modes(shapes: Sequence[str], steps: int, lr: float, lora_lr: float, tokens: int) -> str:
    """(e): bytes on the wire and seconds per update, full against delta against LoRA, into two real torch
    worker processes, after real optimizer steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, beside trainer
    rows = [asyncio.run(_sync_modes(name, steps, lr, lora_lr, tokens)) for name in shapes]
    return _modes_table(rows, steps, lr, lora_lr)


async def _sync_modes(name: str, steps: int, lr: float, lora_lr: float, tokens: int) -> ModeRow:
    import secrets  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from tests.support.workers import start_worker, stop_worker, worker_stub  # noqa: PLC0415
    from trainer import lora  # noqa: PLC0415
    from trainer.inference.publisher import WeightPublisher  # noqa: PLC0415
    from trainer.models import build_tokenizer  # noqa: PLC0415

    torch.set_num_threads(os.cpu_count() or 1)  # the optimizer steps; the workers run apart
    key = secrets.token_hex(32)
    generator = torch.Generator().manual_seed(1)
    model = _mode_model(name, seed=0)
    params = sum(p.numel() for p in model.parameters())
    print(f"(e) {name}: {params / 1e6:.0f}M parameters; {steps} AdamW steps at lr {lr:g} ...", flush=True)

    def served() -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]

    snapshots = [served()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        _optimizer_step(model, optimizer, generator, tokens)
        snapshots.append(served())
    del optimizer
    full_bytes = sum(t.numel() * t.element_size() for _, t in snapshots[0])
    row = ModeRow(name, params, full_bytes)
    for before, after in itertools.pairwise(snapshots):
        moved = sum(
            int(torch.ne(a.view(torch.int16), b.view(torch.int16)).sum())
            for (_, a), (_, b) in zip(before, after, strict=True)
        )
        row.changed.append(moved / sum(t.numel() for _, t in after))

    async def workers_of(folder: Path) -> tuple[list[Any], list[Any]]:
        started = [
            await asyncio.to_thread(
                start_worker, folder, folder.parent / f"w{i}-{secrets.token_hex(2)}", key, None, 600.0
            )
            for i in range(WORKERS)
        ]
        return started, [worker_stub(w, key) for w in started]

    async def stop(started: list[Any], pairs: list[Any]) -> None:
        for channel, _ in pairs:
            await channel.close()
        for worker in started:
            await asyncio.to_thread(stop_worker, worker)

    with tempfile.TemporaryDirectory(prefix="tandem-bench-modes-") as tmp:
        folder = Path(tmp) / "model"
        base = _mode_model(name, seed=0).to(
            torch.bfloat16
        )  # the workers' checkpoint: the snapshot before step 1
        base.save_pretrained(folder)
        del base
        build_tokenizer(512).save_pretrained(folder)
        print(f"(e) {name}: full and delta updates into {WORKERS} torch workers ...", flush=True)
        started, pairs = await workers_of(folder)
        try:
            stubs = [stub for _, stub in pairs]
            for mode in ("full", "delta"):
                publisher = WeightPublisher(stubs, mode=mode, full_every=1 << 20)
                try:
                    version = await _top_version(stubs)
                    await publisher.publish(version + 1, snapshots[0])  # warm-up; delta's base (whole)
                    for index, snapshot in enumerate(snapshots[1:], start=2):
                        report = await publisher.publish(version + index, snapshot)
                        row.bytes.setdefault(mode, []).append(report.bytes)
                        row.seconds.setdefault(mode, []).append(report.total_s)
                        row.phases.setdefault(mode, []).append(
                            {phase: getattr(report, phase) for phase in PHASES}
                        )
                        if mode == "delta" and report.mode != "delta":
                            row.why_full.append(report.why_full)
                    await publisher.verify(snapshots[-1])
                finally:
                    publisher.close()
        finally:
            await stop(started, pairs)
        for rank in (16, 64):
            label = f"lora r{rank}"
            print(f"(e) {name}: {label} updates into {WORKERS} fresh torch workers ...", flush=True)
            adapted = lora.wrap(
                model, weights_pb2.LoraAdapterSpec(rank=rank, alpha=2.0 * rank, target_modules=["all-linear"])
            )
            optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=lora_lr)
            spec = lora.resolved(adapted)
            adapters = []
            for _ in range(steps):
                _optimizer_step(adapted, optimizer, generator, tokens)
                adapters.append(lora.adapter_weights(adapted, torch.bfloat16))
            del optimizer
            model = adapted.unload()  # the base again, for the next rank
            started, pairs = await workers_of(folder)
            publisher = WeightPublisher([stub for _, stub in pairs], mode="lora", lora=spec)
            try:
                await publisher.publish(1, adapters[0])  # warm-up: the workers add the adapter
                for version, adapter in enumerate(adapters, start=2):
                    report = await publisher.publish(version, adapter)
                    row.bytes.setdefault(label, []).append(report.bytes)
                    row.seconds.setdefault(label, []).append(report.total_s)
                await publisher.verify(adapters[-1])
            finally:
                publisher.close()
                await stop(started, pairs)
    return row


async def _top_version(stubs: Sequence[Any]) -> int:
    infos = [await s.GetWeightInfo(pb.GetWeightInfoRequest()) for s in stubs]
    return int(max(i.weight_info.weight_version for i in infos))


def _modes_table(rows: Sequence[ModeRow], steps: int, lr: float, lora_lr: float) -> str:
    lines = [
        f"(e) update modes into {WORKERS} torch worker processes (bf16 serving, float32 AdamW weights; {steps} updates "
        f"each, after real optimizer steps at lr {lr:g}, LoRA at lr {lora_lr:g}; median seconds per update):",
        f"{'shape':<11} {'mode':<9} | {'MB on wire':>10} {'of full':>8} | {'s/update':>9} {'vs full':>8}",
    ]
    for row in rows:
        full_s = statistics.median(row.seconds["full"])
        for mode, sent in row.bytes.items():
            seconds = statistics.median(row.seconds[mode])
            share = statistics.median(sent) / row.full_bytes
            speed = "1.00x (baseline)" if mode == "full" else f"{full_s / seconds:.2f}x faster"
            megabytes = statistics.median(sent) / 1e6
            lines.append(
                f"{row.shape:<11} {mode:<9} | {megabytes:10.2f} {share:8.2%} | {seconds:9.3f} {speed:>8}"
            )
        for mode, updates in row.phases.items():
            medians = "  ".join(
                f"{phase.removesuffix('_s')} {statistics.median(u[phase] for u in updates) * 1000:.0f}"
                for phase in PHASES
            )
            lines.append(f"{'':<11} {mode:<9} | ms: {medians}")
        changed = ", ".join(f"{c:.3%}" for c in row.changed)
        lines.append(
            f"{'':<11} bf16 elements changed per step: {changed}"
            + (f"; delta went whole: {row.why_full}" if row.why_full else "")
        )
    lines += [
        "Goals: delta <= 10% of full bytes and faster than full end to end; LoRA rank 16 <= 2% of full bytes.",
        "s/update is the trainer's clock over the whole publish (pause, begin, broadcast, finish, resume; delta adds",
        "its compare with the last update's copy and the check of what each worker wrote).",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the 10M model only, 3 repeats (< 60 s)")
    parser.add_argument(
        "--bucket-mib", type=int, default=32, help="largest bucket of (a) in MiB (default 32, the trainer's)"
    )
    parser.add_argument(
        "--split",
        type=int,
        default=OVERLAP_BUCKETS,
        help=f"a model under this many buckets goes in this many smaller ones (default {OVERLAP_BUCKETS}, the "
        "publisher's; 1: one bucket per --bucket-mib, as before)",
    )
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated model names to measure, of "
        + ", ".join(m.name for m in MODELS)
        + " (default all)",
    )
    parser.add_argument(
        "--repeats", type=int, default=0, help="measured runs per method (default 7, quick 3)"
    )
    parser.add_argument(
        "--modes",
        default="100M,500M,Qwen2-0.5B",
        help="(e), the update modes (full, delta, LoRA r16 and r64) after real optimizer steps, at these shapes "
        "of " + ", ".join(MODE_SHAPES) + "; 'no' leaves it out (default all three)",
    )
    parser.add_argument("--modes-only", action="store_true", help="(e) alone")
    parser.add_argument("--mode-steps", type=int, default=3, help="(e): updates per mode (default 3)")
    parser.add_argument(
        "--mode-lr", type=float, default=1e-6, help="(e): AdamW's learning rate (default 1e-6)"
    )
    parser.add_argument(
        "--lora-lr", type=float, default=1e-4, help="(e): LoRA's learning rate (default 1e-4)"
    )
    parser.add_argument(
        "--engines",
        choices=("auto", "yes", "no"),
        default="auto",
        help="(d), a full update into torch and vLLM workers: auto runs it where vLLM is installed",
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    engines = args.engines == "yes" or (
        args.engines == "auto" and importlib.util.find_spec("vllm") is not None
    )
    chosen = {name for name in args.models.split(",") if name} or {m.name for m in MODELS}
    if unknown := chosen - {m.name for m in MODELS}:
        parser.error(f"unknown models: {', '.join(sorted(unknown))}")
    models = MODELS[:1] if args.quick else [m for m in MODELS if m.name in chosen]
    modes = [] if args.modes == "no" or args.quick else [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODE_SHAPES):
        parser.error(f"unknown --modes shapes: {', '.join(sorted(unknown))}")
    if args.modes_only:
        print(sync_modes(modes, args.mode_steps, args.mode_lr, args.lora_lr, tokens=64))
        return 0
    torch.set_num_threads(1)

    started = time.perf_counter()
    spawn = get_context("spawn")
    listener = TransferGroup.listen(HOST, WORKERS + 1, TIMEOUT_S)
    pipes = [spawn.Pipe() for _ in range(WORKERS)]
    processes = [
        spawn.Process(target=worker_main, args=(rank, listener.port, pipes[rank - 1][1]), daemon=True)
        for rank in range(1, WORKERS + 1)
    ]
    for process in processes:
        process.start()
    print(f"starting {WORKERS} workers; the group listens on {HOST}:{listener.port}", flush=True)
    group = listener.connect()
    workers: list[Worker] = []
    try:
        for conn, _ in pipes:
            channel = grpc.insecure_channel(f"{HOST}:{conn.recv()}")
            workers.append(Worker(conn, inference_service_pb2_grpc.InferenceServiceStub(channel), channel))
        trainer = Trainer(group, workers, args.bucket_mib << 20, args.split)
        rows = [measure(trainer, shape, repeats) for shape in models]
        print()
        print(table(rows, trainer, repeats))
        ok = all(all(row.exact.values()) for row in rows)
    finally:
        for worker in workers:
            worker.channel.close()  # before the servers stop, which would otherwise send GOAWAY to log
            with contextlib.suppress(OSError):  # a worker that died has closed its end
                worker.conn.send(None)
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        group.close()
    if engines:  # once the workers above have freed their memory
        print()
        print(full_updates(repeats, args.bucket_mib << 20))
    else:
        print("\n(d) not measured: vLLM is not installed here (run with .venv-vllm/bin/python)")
    if modes:
        print()
        print(sync_modes(modes, args.mode_steps, args.mode_lr, args.lora_lr, tokens=64))
    print(f"\n(took {time.perf_counter() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
