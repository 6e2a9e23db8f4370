"""Peak memory and throughput of one GRPO step at a real model's width and vocabulary: the trainer's update
(`train_shard`: micro-batches, log-probs from the hidden states in chunks) at 8 and at 64 sequences, beside
today's path before it (one forward over the whole batch with its full-vocabulary float32 logits, the
`batch_loss` of commit a6dd1d7) at 8 sequences, in the same run.

Run from the repository root (about 12 minutes on 2 cores; a measurement peaks near 6 GiB):

    .venv/bin/python benchmarks/trainer_memory.py
    .venv/bin/python benchmarks/trainer_memory.py --micro-batch-tokens 2048 --layers 2

The model is built here, nothing is downloaded: Qwen2's architecture at Qwen2-0.5B's width and vocabulary
(hidden 896, MLP 4864, 14 heads, 2 KV heads, vocabulary 151,936, tied embeddings), 4 layers instead of 24 so
that a step takes minutes on a CPU, random initialisation, saved in bfloat16 as Qwen2-0.5B is. Each
sequence is 256 tokens, a 192-token prompt and a 64-token completion, every completion token trained on (the
LM head over 151,936 entries is most of a step's work, so more completion tokens would take hours here);
no reference model (kl_coef 0, the default).

Each measurement runs in a fresh child process, which loads the model (float32 weights, as the trainer
does), resets its peak resident set size (`/proc/self/clear_refs`), runs one step (forward, backward, the
AdamW step, whose state is allocated then) and reports the peak (`VmHWM`) and the step's wall time. Tokens
per second count every token of the batch, prompts included. Under the table: the bytes the step holds for
the full 24-layer Qwen2-0.5B, from the same formulas, with the activations per token and layer measured in
this run (bytes autograd saved for backward, parameters excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandem_jobs.config import MICRO_BATCH_TOKENS, Job, parse_job
from trainer import grpo
from trainer.ranks import Ranks, StepShard
from trainer.scoring import LOGIT_CHUNK_BYTES, TrainSequence, collate, load_policy, sequence_logprobs
from trainer.train import train_shard

ROOT = Path(__file__).resolve().parents[1]

WIDTH = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2}
VOCAB = 151_936
FULL_LAYERS = 24
PROMPT, COMPLETION = 192, 64
GIB = 1 << 30


def qwen_config(layers: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB,
        num_hidden_layers=layers,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        **WIDTH,
    )


def build(path: Path, layers: int) -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen_config(layers)).to(torch.bfloat16)  # type: ignore[no-untyped-call, arg-type]
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path)


def job_for(model: Path, micro_batch_tokens: int) -> Job:
    return Job(
        parse_job(
            {
                "model": {"dir": str(model)},
                "task_app": {"name": "orgs/demo/taskApps/single-turn"},
                "data": {"train": {"seeds": [{"start": 0, "end": 10}]}},
                "algorithm": {"group_size": 8, "prompts_per_step": 1, "steps": 1},
                "optimizer": {"learning_rate": 1e-6},
                "training": {"micro_batch_tokens": micro_batch_tokens},
            }
        )
    )


def batch(count: int) -> tuple[list[TrainSequence], list[float]]:
    generator = torch.Generator().manual_seed(count)
    sequences: list[TrainSequence] = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (PROMPT + COMPLETION,), generator=generator).tolist()
        sampler = (
            -12.0 + torch.rand(COMPLETION, generator=generator)
        ).tolist()  # near uniform: ln(1/V) = -11.9
        sequences.append((ids, PROMPT, sampler, [True] * COMPLETION, (1.0, 0, 1.0, 0.0), False))
    advantages = (torch.rand(count, generator=generator) * 2 - 1).tolist()
    return sequences, advantages


def todays_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: list[TrainSequence],
    advantages: list[float],
) -> None:
    """The update before micro-batches (commit a6dd1d7's `batch_loss` and `train_shard`, one rank): the
    whole batch in one forward, its float32 logits, the completion positions gathered, log_softmax over the
    vocabulary, backward, clip, step."""
    count, width = len(sequences), PROMPT + COMPLETION
    input_ids = torch.tensor([ids for ids, *_ in sequences])
    targets = input_ids[:, PROMPT:]
    positions = torch.arange(PROMPT - 1, width - 1).expand(count, -1)
    sampler = torch.tensor([s[2] for s in sequences])
    mask = torch.ones(count, COMPLETION, dtype=torch.bool)
    policy.train()
    logits = policy(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.float() / 1.0
    picked = torch.gather(logits, 1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    logprobs = torch.log_softmax(picked, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss, _ = grpo.policy_loss(logprobs, sampler, torch.tensor(advantages), mask)
    grpo.entropy(picked.detach(), mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def saved_activation_bytes(policy: torch.nn.Module, job: Job, sequences: list[TrainSequence]) -> int:
    """Bytes autograd saves for backward over one micro-batch's forward, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    policy.train(False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scores = sequence_logprobs(policy, collate(sequences, [0.0] * len(sequences)))
    del scores
    return sum(seen.values())


def child(args: argparse.Namespace) -> int:
    job = job_for(args.model, args.micro_batch_tokens)
    policy = load_policy(args.model, torch.device("cpu"), job)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    sequences, advantages = batch(args.sequences)
    result: dict[str, Any] = {"rss_before_gib": status_kib("VmRSS") / (1 << 20)}
    if args.activations:
        result["saved_bytes"] = saved_activation_bytes(policy, job, sequences)
        print(json.dumps(result))
        return 0
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    started = time.perf_counter()
    if args.mode == "today":
        todays_step(policy, optimizer, sequences, advantages)
    else:
        shard = StepShard(1e-6, 1.0, False, sequences, advantages)
        update = train_shard(Ranks.alone(), policy, None, optimizer, shard, job, torch.device("cpu"))
        assert update.finite
    result["seconds"] = time.perf_counter() - started
    result["peak_gib"] = status_kib("VmHWM") / (1 << 20)
    result["tokens"] = args.sequences * (PROMPT + COMPLETION)
    print(json.dumps(result))
    return 0


def measure(
    model: Path, mode: str, sequences: int, micro: int, *, activations: bool = False
) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", mode, "--model", str(model), "--sequences", str(sequences)]
    argv += ["--micro-batch-tokens", str(micro)] + (["--activations"] if activations else [])
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=dict(os.environ), cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(
            f"{mode} at {sequences} sequences failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def full_model_arithmetic(saved_per_token_layer: float, micro: int, sequences: int) -> None:
    with torch.device("meta"):
        full = Qwen2ForCausalLM(qwen_config(FULL_LAYERS))  # type: ignore[no-untyped-call]
    params = sum(p.numel() for p in full.parameters())
    tokens = sequences * (PROMPT + COMPLETION)
    completion_tokens = sequences * COMPLETION
    rows = [
        ("parameters", f"{params:,}"),
        ("weights, float32", f"{params * 4 / GIB:.2f} GiB"),
        ("gradients, float32", f"{params * 4 / GIB:.2f} GiB"),
        ("AdamW state (2 moments, float32)", f"{params * 8 / GIB:.2f} GiB"),
        (
            f"full-vocabulary float32 logits of {sequences} x {PROMPT + COMPLETION} tokens, one copy (today's path)",
            f"{tokens * VOCAB * 4 / GIB:.2f} GiB ({completion_tokens * VOCAB * 4 / GIB:.2f} GiB at the "
            "completion positions alone; the path kept several such copies for backward)",
        ),
        ("logits at once on the new path (one chunk)", f"{LOGIT_CHUNK_BYTES / GIB:.3f} GiB"),
        (
            f"activations saved for backward, {FULL_LAYERS} layers x {micro} tokens (one micro-batch)",
            f"{saved_per_token_layer * FULL_LAYERS * micro / GIB:.2f} GiB "
            f"({saved_per_token_layer / 1024:.0f} KiB per token and layer, measured)",
        ),
        (
            "the same with activation_checkpointing (each layer's input kept, one layer's activations at once)",
            f"{(FULL_LAYERS * micro * WIDTH['hidden_size'] * 4 + saved_per_token_layer * micro) / GIB:.2f} GiB",
        ),
        (
            f"activations of the whole batch in one forward ({tokens} tokens, today's path)",
            f"{saved_per_token_layer * FULL_LAYERS * tokens / GIB:.2f} GiB",
        ),
    ]
    print(f"\nQwen2-0.5B in full ({FULL_LAYERS} layers), one step of {sequences} sequences:")
    for name, value in rows:
        print(f"  {name:<100} {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch-tokens", type=int, default=MICRO_BATCH_TOKENS)
    parser.add_argument("--child", dest="mode", choices=["today", "trainer"])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--activations", action="store_true")
    args = parser.parse_args()
    if args.mode:
        return child(args)
    micro = args.micro_batch_tokens
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "qwen2-width"
        build(model, args.layers)
        print(
            f"model: Qwen2 width, {args.layers} layers, vocabulary {VOCAB:,}; micro_batch_tokens {micro}; "
            f"{torch.get_num_threads()} threads"
        )
        runs = [("today", 8), ("trainer", 8), ("trainer", 64)]
        results = {}
        for run in runs:
            results[run] = measure(model, *run, micro)
            print(f"{run}: {results[run]}", flush=True)
        probe = measure(model, "trainer", 8, micro, activations=True)
    print(f"\n{'path':<46} {'sequences':>9} {'peak RSS GiB':>13} {'step s':>8} {'tokens/s':>9}")
    for (mode, count), r in results.items():
        name = (
            "today's (whole batch, full logits)"
            if mode == "today"
            else "trainer (micro-batches, chunked log-probs)"
        )
        print(
            f"{name:<46} {count:>9} {r['peak_gib']:>13.2f} {r['seconds']:>8.1f} {r['tokens'] / r['seconds']:>9.0f}"
        )
    today, eight, sixty_four = results[("today", 8)], results[("trainer", 8)], results[("trainer", 64)]
    print(f"\nloaded model before the step: {eight['rss_before_gib']:.2f} GiB resident")
    print(
        f"peak, trainer at 64 / trainer at 8:  {sixty_four['peak_gib'] / eight['peak_gib']:.2f}x  (goal <= 1.3x)"
    )
    print(f"peak, trainer at 8 / today's at 8:   {eight['peak_gib'] / today['peak_gib']:.2f}x")
    print(f"peak, trainer at 64 / today's at 8:  {sixty_four['peak_gib'] / today['peak_gib']:.2f}x")
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    print(
        f"tokens/s, trainer at 8 / today's at 8: {rate(eight) / rate(today):.2f}x; at 64 / today's at 8: "
        f"{rate(sixty_four) / rate(today):.2f}x"
    )
    per_token_layer = probe["saved_bytes"] / (8 * (PROMPT + COMPLETION) * args.layers)
    full_model_arithmetic(per_token_layer, micro, 64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
