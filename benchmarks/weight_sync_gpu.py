"""Weight sync on one GPU: a CUDA IPC update of a vLLM worker, beside a same-run baseline.

Run it on a machine with an NVIDIA GPU and the `gpu` extra (scripts/gpu_check.sh does):

    .venv/bin/python benchmarks/weight_sync_gpu.py [--params 500e6]

A worker process serves a Llama-shaped model of about `--params` parameters (bfloat16, random weights, built
locally) with the vLLM engine; this process plays the trainer on the same GPU and publishes new weights to it
with `WeightPublisher(backend="ipc")` (Pause -> Begin with the tensors' IPC handles -> Finish -> Resume), a
few times. The baseline is the memory system's own ceiling for the same bytes: one device-to-device copy of
every tensor in this process (what loading the weights cannot beat). It prints seconds and GB/s per update
for both and their ratio. NCCL needs two GPUs (one per rank), so the packed NCCL path is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.workers import start_worker, stop_worker, worker_stub  # noqa: E402
from trainer.inference.publisher import WeightPublisher  # noqa: E402
from trainer.models import build_tiny_model  # noqa: E402


def shape_for(params: float) -> dict[str, int]:
    """A Llama shape of roughly `params` parameters (hidden, layers) with a 32k vocabulary."""
    for hidden, layers in ((512, 8), (1024, 12), (1536, 16), (2048, 20), (2560, 24)):
        approx = layers * 12 * hidden * hidden + 2 * 32000 * hidden
        if approx >= params:
            return {"hidden_size": hidden, "layers": layers}
    return {"hidden_size": 2560, "layers": 24}


async def run(params: float, rounds: int) -> int:
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return 1
    with tempfile.TemporaryDirectory(prefix="tandem-bench-gpu-") as tmp:
        folder = Path(tmp)
        shape = shape_for(params)
        model = build_tiny_model(
            folder / "model", vocab_size=32000, heads=shape["hidden_size"] // 64, dtype="bfloat16", **shape
        )
        weights = load_file(str(model / "model.safetensors"))
        total = sum(t.numel() * t.element_size() for t in weights.values())
        key = secrets.token_hex(32)
        env = {
            "TANDEM_WORKER_ENGINE": "vllm",
            "TANDEM_WORKER_TRANSFER_BACKEND": "ipc",
            "TANDEM_WORKER_GPU_MEMORY_UTILIZATION": "0.4",
        }
        worker = start_worker(model, folder / "worker", key, env, timeout_s=900)
        channel, stub = worker_stub(worker, key)
        publisher = WeightPublisher([stub], backend="ipc", transfer_timeout_s=600, rpc_timeout_s=600)
        try:
            ipc: list[float] = []
            copy: list[float] = []
            for version in range(1, rounds + 1):
                named = [(n, (t.float() + 0.001 * version).to(t.dtype).cuda()) for n, t in weights.items()]
                torch.cuda.synchronize()
                report = await publisher.publish(version, named)
                ipc.append(report.total_s)
                targets = [torch.empty_like(t) for _, t in named]
                torch.cuda.synchronize()
                start = time.perf_counter()
                for target, (_, tensor) in zip(targets, named, strict=True):
                    target.copy_(tensor)
                torch.cuda.synchronize()
                copy.append(time.perf_counter() - start)
        finally:
            publisher.close()
            await channel.close()
            stop_worker(worker)
    a, b = statistics.median(ipc), statistics.median(copy)
    print(
        f"model: {sum(t.numel() for t in weights.values()) / 1e6:.0f}M params, {total / 1e9:.2f} GB bfloat16"
    )
    print(f"IPC update, whole protocol (median of {rounds}): {a:.3f} s, {total / a / 1e9:.1f} GB/s")
    print(f"baseline, one device copy of every tensor:       {b:.3f} s, {total / b / 1e9:.1f} GB/s")
    print(f"ratio (IPC update / copy time): {a / b:.1f}x")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--params", type=float, default=500e6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    return asyncio.run(run(args.params, args.rounds))


if __name__ == "__main__":
    sys.exit(main())
