"""Generation throughput of the torch engine (`TorchEngine`) at 1 and 32 concurrent requests, each beside
Hugging Face `generate` measured in the same run on the same model, threads and prompts.

Run from the repository root:

    .venv/bin/python benchmarks/generation.py             # 64 new tokens per request, 3 rounds, ~2 min on 2 cores
    .venv/bin/python benchmarks/generation.py --quick     # 16 new tokens per request, smoke run, < 40 s

The model is built on the spot with `trainer.models.build_tiny_model` in a temporary folder: Llama
architecture, 4 layers, hidden 256, vocabulary 2048, ~4.5M parameters, float32, on the CPU. Prompts are 32
chat messages of different lengths rendered with the chat template (about 15 to 60 tokens). Sampling is
temperature 1.0, top-p 1.0, with a seed per request; every request asks for the same number of new tokens.

What is measured, after a warm-up that is not counted, as generated tokens per second of wall time; each
figure is the median of 3 rounds (1 with --quick) in which the engine and the baselines take turns, so a
neighbour's load on a shared machine falls on both columns rather than on one:

1. one request at a time: 4 requests in turn, each to the end. Engine: `generate` through the scheduler
   (one sequence per step, KV cache). Baseline: `model.generate` on one prompt (KV cache), what a server
   without batching runs per request.
2. 32 concurrent requests. Engine: 32 `generate` calls started together, served by continuous batching.
   Two baselines: `model.generate` on each of the 32 prompts in turn (serving without batching), and one
   `model.generate` call on all 32 prompts left-padded (static batching: the best case for a batch that
   arrives all at once, with nothing joining or leaving; an upper bound more than a rival).

The baselines cannot stop early: HF sampling is told to ignore EOS (`min_new_tokens`), so each yields exactly
the tokens asked for; the engine stops at EOS like a server does, and its figure counts the tokens it
actually returned. The engine's forward passes run on its worker thread, the baseline's on this one; both
use torch's intra-op threads (printed). Under the table: the engine's batch sizes, from `engine.stats`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.inference.engine import Sampling, TokenChunk
from trainer.inference.torch_engine import TorchEngine
from trainer.models import build_tiny_model, parameter_count

CONCURRENT = 32
SEQUENTIAL_REQUESTS = 4
TOPICS = (
    "rivers",
    "the sea at night",
    "a farm in the north",
    "counting to ten",
    "why the sky is blue",
    "a short story about a horse",
    "numbers",
    "music and song",
)


@dataclass(frozen=True)
class Plan:
    new_tokens: int
    rounds: int  # each measurement this many times, engine and baselines alternating; the median is shown


FULL = Plan(new_tokens=64, rounds=3)
QUICK = Plan(new_tokens=16, rounds=1)


@dataclass
class Row:
    label: str
    engine_tps: float
    baseline_tps: float
    baseline: str


def prompts(engine: TorchEngine) -> list[list[int]]:
    """32 chat prompts of different lengths."""
    out = []
    for i in range(CONCURRENT):
        topic = TOPICS[i % len(TOPICS)]
        content = f"Tell me about {topic}." + " Say more, and add numbers." * (i % 5)
        out.append(engine.render([{"role": "user", "content": content}], {}))
    return out


async def engine_run(engine: TorchEngine, batch: Sequence[list[int]], new_tokens: int) -> tuple[int, float]:
    """Generate for every prompt of `batch` concurrently; (tokens returned, seconds)."""

    async def one(prompt: list[int], seed: int) -> int:
        count = 0
        async for item in engine.generate(
            prompt, Sampling(temperature=1.0, max_tokens=new_tokens, seed=seed)
        ):
            if isinstance(item, TokenChunk):
                count += len(item.token_ids)
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p, seed) for seed, p in enumerate(batch)))
    return sum(counts), time.perf_counter() - started


def hf_run(
    generate: Callable[..., Any], pad_id: int, batch: Sequence[list[int]], new_tokens: int
) -> tuple[int, float]:
    """One call of `generate` (a model's `generate` method) over `batch`, left-padded; (tokens generated,
    seconds)."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    started = time.perf_counter()
    with torch.inference_mode():
        out = generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - started
    assert isinstance(out, torch.Tensor)  # token ids, as no dict output was asked for
    return int(out.shape[0] * (out.shape[1] - width)), elapsed


def hf_sequential(
    generate: Callable[..., Any], pad_id: int, batch: Sequence[list[int]], new_tokens: int
) -> tuple[int, float]:
    tokens, seconds = 0, 0.0
    for prompt in batch:
        count, elapsed = hf_run(generate, pad_id, [prompt], new_tokens)
        tokens, seconds = tokens + count, seconds + elapsed
    return tokens, seconds


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def rate(result: tuple[int, float]) -> float:
    tokens, seconds = result
    return tokens / seconds if seconds else math.nan


def report(rows: Sequence[Row], engine: TorchEngine, plan: Plan, params: int, elapsed_s: float) -> str:
    table = [("requests", "torch engine (tok/s)", "baseline (tok/s)", "ratio", "baseline")]
    for row in rows:
        ratio = row.engine_tps / row.baseline_tps if row.baseline_tps else math.nan
        table.append(
            (row.label, f"{row.engine_tps:,.0f}", f"{row.baseline_tps:,.0f}", f"{ratio:.2f}x", row.baseline)
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    sizes = ", ".join(
        f"{size}: {count}" for size, count in sorted(engine.stats.batch_sizes.items(), reverse=True)
    )
    lines += [
        "",
        f"model: {params:,} parameters, {engine.info.dtype} on {engine.info.device}; {plan.new_tokens} new tokens "
        f"per request; median of {plan.rounds} rounds; {os.cpu_count()} cores, "
        f"torch intra-op threads {torch.get_num_threads()}; run took {elapsed_s:.0f} s"
        + ("; --quick: rough figures" if plan is QUICK else ""),
        f"engine steps by batch size (size: steps), warm-up included: {sizes}",
    ]
    return "\n".join(lines)


async def run_benchmark(plan: Plan) -> int:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as folder:
        path = build_tiny_model(Path(folder) / "model", vocab_size=2048, hidden_size=256, layers=4, heads=4)
        params = parameter_count(path)
        engine = await TorchEngine.load(str(path), max_batch=CONCURRENT)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
            model.train(False)
            generate = model.generate  # type: ignore[misc]  # transformers types `self` as a Protocol the model misses
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            pad_id = int(tokenizer.pad_token_id)
            batch = prompts(engine)
            print(f"model built: {params:,} parameters; warming up ...", flush=True)
            await engine_run(engine, batch[:4], 4)
            hf_run(generate, pad_id, batch[:4], 4)

            rows = []
            single: dict[str, list[float]] = {"engine": [], "hf": []}
            concurrent: dict[str, list[float]] = {"engine": [], "in turn": [], "static": []}
            for round_ in range(plan.rounds):
                print(f"round {round_ + 1}/{plan.rounds}: 1 request at a time ...", flush=True)
                requests = batch[:SEQUENTIAL_REQUESTS]
                runs = [await engine_run(engine, [prompt], plan.new_tokens) for prompt in requests]
                single["engine"].append(rate((sum(t for t, _ in runs), sum(s for _, s in runs))))
                single["hf"].append(rate(hf_sequential(generate, pad_id, requests, plan.new_tokens)))
                print(f"round {round_ + 1}/{plan.rounds}: {CONCURRENT} concurrent requests ...", flush=True)
                concurrent["engine"].append(rate(await engine_run(engine, batch, plan.new_tokens)))
                concurrent["in turn"].append(rate(hf_sequential(generate, pad_id, batch, plan.new_tokens)))
                concurrent["static"].append(rate(hf_run(generate, pad_id, batch, plan.new_tokens)))
            rows.append(
                Row("1 at a time", median(single["engine"]), median(single["hf"]), "HF generate, one request")
            )
            together = median(concurrent["engine"])
            rows.append(
                Row(
                    f"{CONCURRENT} concurrent",
                    together,
                    median(concurrent["in turn"]),
                    "HF generate, one at a time",
                )
            )
            rows.append(
                Row(
                    f"{CONCURRENT} concurrent",
                    together,
                    median(concurrent["static"]),
                    f"HF generate, static batch of {CONCURRENT}",
                )
            )
            print()
            print(report(rows, engine, plan, params, time.perf_counter() - started))
        finally:
            await engine.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="16 new tokens per request for a smoke run")
    args = parser.parse_args(argv)
    return asyncio.run(run_benchmark(QUICK if args.quick else FULL))


if __name__ == "__main__":
    sys.exit(main())
