"""Generation throughput of the torch engine (`TorchEngine`) at 1 and 32 concurrent requests, each beside
Hugging Face `generate` measured in the same run on the same model, threads and prompts; and, where vLLM is
installed, the vLLM engine (`VllmEngine`) on the same model and prompts in the same run, against the torch
engine as its baseline: tokens/s and time to first token.

Run from the repository root:

    .venv/bin/python benchmarks/generation.py             # 64 new tokens per request, 3 rounds, ~2 min on 2 cores
    .venv/bin/python benchmarks/generation.py --quick     # 16 new tokens per request, smoke run, < 40 s
    .venv-vllm/bin/python benchmarks/generation.py        # the same with vLLM's CPU build beside (make setup-vllm)

The model is built on the spot with `trainer.models.build_tiny_model` in a temporary folder: Llama
architecture, 4 layers, hidden 256, vocabulary 2048, ~4.5M parameters, float32, on the CPU. Prompts are 32
chat messages of different lengths rendered with the chat template (about 15 to 60 tokens). Sampling is
temperature 1.0, top-p 1.0, with a seed per request; every request asks for the same number of new tokens.

What is measured, after a warm-up that is not counted, as generated tokens per second of wall time; each
figure is the median of 3 rounds (1 with --quick) in which the engines and the baselines take turns, so a
neighbour's load on a shared machine falls on every column rather than on one:

1. one request at a time: 4 requests in turn, each to the end. Engine: `generate` through the scheduler
   (one sequence per step, KV cache). Baseline: `model.generate` on one prompt (KV cache), what a server
   without batching runs per request.
2. 32 concurrent requests. Engine: 32 `generate` calls started together, served by continuous batching.
   Two baselines: `model.generate` on each of the 32 prompts in turn (serving without batching), and one
   `model.generate` call on all 32 prompts left-padded (static batching: the best case for a batch that
   arrives all at once, with nothing joining or leaving; an upper bound more than a rival).
3. vLLM (when importable; `--no-vllm` leaves it out): the same two measurements through `VllmEngine`
   (`AsyncLLM` in this process, its engine core in another, serving float32 like the torch engine, with
   torch.compile unless `--vllm-eager`), beside the torch engine's. Time to first token is the median, over
   the round's requests, of the time from a request's start to its first tokens arriving.

The baselines cannot stop early: HF sampling is told to ignore EOS (`min_new_tokens`), so each yields exactly
the tokens asked for; the engines stop at EOS like a server does, and their figures count the tokens they
actually returned. The torch engine's forward passes run on its worker thread, the baseline's on this one,
vLLM's in its engine-core process; all use torch's intra-op threads (printed), and on 2 cores they share them.
Under the tables: the torch engine's batch sizes, from `engine.stats`, and vLLM's start-up time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.inference.engine import Engine, Sampling, TokenChunk
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


async def engine_run(
    engine: Engine, batch: Sequence[list[int]], new_tokens: int, ttfts: list[float] | None = None
) -> tuple[int, float]:
    """Generate for every prompt of `batch` concurrently; (tokens returned, seconds). Each request's time to
    its first tokens is appended to `ttfts`, when given."""

    async def one(prompt: list[int], seed: int) -> int:
        count = 0
        began = time.perf_counter()
        async for item in engine.generate(
            prompt, Sampling(temperature=1.0, max_tokens=new_tokens, seed=seed)
        ):
            if isinstance(item, TokenChunk):
                if not count and ttfts is not None:
                    ttfts.append(time.perf_counter() - began)
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


def table_lines(table: Sequence[Sequence[str]]) -> list[str]:
    """Rows as aligned columns, a rule under the header."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return lines


def report(rows: Sequence[Row], engine: TorchEngine, plan: Plan, params: int, elapsed_s: float) -> str:
    table = [("requests", "torch engine (tok/s)", "baseline (tok/s)", "ratio", "baseline")]
    for row in rows:
        ratio = row.engine_tps / row.baseline_tps if row.baseline_tps else math.nan
        table.append(
            (row.label, f"{row.engine_tps:,.0f}", f"{row.baseline_tps:,.0f}", f"{ratio:.2f}x", row.baseline)
        )
    lines = table_lines(table)
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


async def load_vllm(path: Path, eager: bool) -> tuple[Engine | None, float]:
    """vLLM on the same model in float32 (the torch engine's dtype), and its start-up seconds; None where
    vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None, 0.0
    # On a CPU vLLM otherwise claims most of the machine's memory for its KV cache; 1 GiB holds these requests.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from trainer.inference.vllm_engine import VllmEngine  # noqa: PLC0415 - the optional vLLM extras

    began = time.perf_counter()
    engine = await VllmEngine.load(str(path), dtype="float32", enforce_eager=eager)
    return engine, time.perf_counter() - began


@dataclass
class EngineFigures:
    """One engine's measurements over the rounds: tokens/s per round and every request's time to first token."""

    single: list[float] = field(default_factory=list)
    concurrent: list[float] = field(default_factory=list)
    single_ttft: list[float] = field(default_factory=list)
    concurrent_ttft: list[float] = field(default_factory=list)

    async def measure(self, engine: Engine, batch: Sequence[list[int]], new_tokens: int) -> None:
        requests = batch[:SEQUENTIAL_REQUESTS]
        runs = [await engine_run(engine, [prompt], new_tokens, self.single_ttft) for prompt in requests]
        self.single.append(rate((sum(t for t, _ in runs), sum(s for _, s in runs))))
        self.concurrent.append(rate(await engine_run(engine, batch, new_tokens, self.concurrent_ttft)))


def engine_table(torch_figures: EngineFigures, vllm_figures: EngineFigures, vllm_info: str) -> str:
    table = [("engine", "requests", "tok/s", "time to first token (median)", "tok/s ratio to torch engine")]
    for label, kind in (("1 at a time", "single"), (f"{CONCURRENT} concurrent", "concurrent")):
        base = median(getattr(torch_figures, kind))
        for name, figures in (("torch", torch_figures), ("vllm", vllm_figures)):
            tps = median(getattr(figures, kind))
            table.append(
                (
                    name,
                    label,
                    f"{tps:,.0f}",
                    f"{median(getattr(figures, kind + '_ttft')) * 1000:,.1f} ms",
                    "1.00x (baseline)" if figures is torch_figures else f"{tps / base:.2f}x",
                )
            )
    lines = table_lines(table)
    return "\n".join([*lines, "", vllm_info])


async def run_benchmark(plan: Plan, with_vllm: bool = True, vllm_eager: bool = False) -> int:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as folder:
        path = build_tiny_model(Path(folder) / "model", vocab_size=2048, hidden_size=256, layers=4, heads=4)
        params = parameter_count(path)
        engine = await TorchEngine.load(str(path), max_batch=CONCURRENT)
        vllm_engine, vllm_start_s = await load_vllm(path, vllm_eager) if with_vllm else (None, 0.0)
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
            if vllm_engine is not None:
                await engine_run(vllm_engine, batch, 4)

            rows = []
            torch_figures, vllm_figures = EngineFigures(), EngineFigures()
            single: dict[str, list[float]] = {"hf": []}
            concurrent: dict[str, list[float]] = {"in turn": [], "static": []}
            for round_ in range(plan.rounds):
                print(
                    f"round {round_ + 1}/{plan.rounds}: 1 request at a time, then {CONCURRENT} ...",
                    flush=True,
                )
                await torch_figures.measure(engine, batch, plan.new_tokens)
                requests = batch[:SEQUENTIAL_REQUESTS]
                single["hf"].append(rate(hf_sequential(generate, pad_id, requests, plan.new_tokens)))
                concurrent["in turn"].append(rate(hf_sequential(generate, pad_id, batch, plan.new_tokens)))
                concurrent["static"].append(rate(hf_run(generate, pad_id, batch, plan.new_tokens)))
                if vllm_engine is not None:
                    await vllm_figures.measure(vllm_engine, batch, plan.new_tokens)
            rows.append(
                Row(
                    "1 at a time",
                    median(torch_figures.single),
                    median(single["hf"]),
                    "HF generate, one request",
                )
            )
            together = median(torch_figures.concurrent)
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
            print()
            if vllm_engine is None:
                print(
                    "vLLM: not measured (not installed here, or --no-vllm); run it with .venv-vllm/bin/python"
                )
            else:
                info = vllm_engine.info
                print(
                    engine_table(
                        torch_figures,
                        vllm_figures,
                        f"vLLM {info.engine_version}: {info.dtype} on {info.device}, "
                        f"{'eager' if vllm_eager else 'torch.compile'}; started in {vllm_start_s:.1f} s",
                    )
                )
        finally:
            await engine.close()
            if vllm_engine is not None:
                await vllm_engine.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="16 new tokens per request for a smoke run")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out even where it is installed")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    args = parser.parse_args(argv)
    return asyncio.run(run_benchmark(QUICK if args.quick else FULL, not args.no_vllm, args.vllm_eager))


if __name__ == "__main__":
    sys.exit(main())
