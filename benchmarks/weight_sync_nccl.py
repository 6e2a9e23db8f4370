"""An 8B-shaped NCCL weight broadcast between two GPUs, against the link's bandwidth measured in the same run.

Run it on a machine with at least two NVIDIA GPUs and the `gpu` extra (scripts/gpu_check.sh does):

    .venv-gpu/bin/python benchmarks/weight_sync_nccl.py [--shape llama-8b] [--rounds 3]

Two processes, one per GPU, form vLLM's stateless NCCL group the way a trainer and an inference worker do
(`trainer_init` on the trainer's side, the same `StatelessProcessGroup` + `PyNcclCommunicator` on the
worker's). Rank 0 holds the model's tensors in bfloat16 (Llama-3-8B's shapes by default: 32 layers, hidden
4096, MLP 14336, 8 KV heads, a 128,256 vocabulary, untied head; about 8.0B parameters, 16.1 GB) and sends
them with the packed-bucket protocol of Tandem's NCCL path (vLLM's `packed_nccl_broadcast_producer`);
rank 1 receives them with `packed_nccl_broadcast_consumer` and copies each tensor into a parameter of its
own, as vLLM's weight loading does. The baseline is the link itself: one flat NCCL broadcast of the same
number of bytes on the same communicator. It prints seconds and GB/s for both and their ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

SHAPES = {  # name -> (layers, hidden, intermediate, kv_heads, head_dim, vocab)
    "llama-8b": (32, 4096, 14336, 8, 128, 128256),
    "llama-1b": (16, 2048, 8192, 8, 64, 128256),
}


def tensor_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    layers, hidden, inter, kv_heads, head_dim, vocab = SHAPES[shape]
    kv = kv_heads * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def rank_main(rank: int, port: int, shape: str, rounds: int, bucket: int, results: Any) -> None:
    import torch  # noqa: PLC0415
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group  # noqa: PLC0415
    from vllm.distributed.weight_transfer.packed_tensor import (  # noqa: PLC0415
        packed_nccl_broadcast_consumer,
        packed_nccl_broadcast_producer,
    )

    torch.cuda.set_device(rank)
    group = stateless_init_process_group("127.0.0.1", port, rank, 2, torch.cuda.current_device())
    shapes = tensor_shapes(shape)
    dtype = torch.bfloat16
    tensors = {name: torch.empty(dims, dtype=dtype, device="cuda") for name, dims in shapes}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    flat = torch.empty(total // 2, dtype=dtype, device="cuda")

    def metadata() -> Iterator[tuple[str, tuple[list[int], torch.dtype]]]:
        return ((name, (list(dims), dtype)) for name, dims in shapes)

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, received in pairs:
            tensors[name].copy_(received)

    packed: list[float] = []
    link: list[float] = []
    for _ in range(rounds + 1):  # the first round warms NCCL's channels and the allocator up
        torch.cuda.synchronize()
        group.broadcast(torch.zeros(1, device="cuda"), src=0)  # both ranks start together
        torch.cuda.synchronize()
        began = time.perf_counter()
        if rank == 0:
            packed_nccl_broadcast_producer(
                iterator=iter(tensors.items()),
                group=group,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=bucket,
            )
        else:
            packed_nccl_broadcast_consumer(
                iterator=metadata(), group=group, src=0, post_unpack_func=load, buffer_size_bytes=bucket
            )
        torch.cuda.synchronize()
        packed.append(time.perf_counter() - began)
        group.broadcast(torch.zeros(1, device="cuda"), src=0)
        torch.cuda.synchronize()
        began = time.perf_counter()
        group.broadcast(flat, src=0)
        torch.cuda.synchronize()
        link.append(time.perf_counter() - began)
    if rank == 1:
        params = sum(t.numel() for t in tensors.values())
        results.put((params, total, packed[1:], link[1:], torch.cuda.get_device_name(0)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--bucket-mb", type=int, default=1024, help="packed bucket size (vLLM's default: 1 GiB)"
    )
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("weight_sync_nccl: needs two GPUs (NCCL refuses two ranks on one device); nothing measured")
        return 2
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [
        spawn.Process(
            target=rank_main, args=(r, port, args.shape, args.rounds, args.bucket_mb << 20, results)
        )
        for r in (0, 1)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(p.exitcode != 0 for p in ranks):
        print("weight_sync_nccl: a rank failed:", [p.exitcode for p in ranks])
        return 1
    params, total, packed, link = results.get(timeout=5)[:4]
    a, b = statistics.median(packed), statistics.median(link)
    print(f"model: {args.shape}, {params / 1e9:.2f}B params, {total / 1e9:.2f} GB bfloat16, 2 GPUs")
    print(f"packed NCCL broadcast + load (median of {args.rounds}): {a:.3f} s, {total / a / 1e9:.1f} GB/s")
    print(f"baseline, one flat NCCL broadcast of the same bytes:   {b:.3f} s, {total / b / 1e9:.1f} GB/s")
    print(f"ratio (packed update / link time): {a / b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
