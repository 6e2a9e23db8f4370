"""The update's passes over a real (tiny, local) model: log-probs from the hidden states in chunks equal those of
the full logits; micro-batches give the whole batch's gradient for every aggregation and with the reference
model; activation checkpointing gives the same gradient while saving less for backward; dropout is off in
the scoring forward; a bf16 checkpoint trains with float32 master weights and is saved as bf16 again."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tandem.inference.v1 import generation_pb2, trace_pb2
from transformers import AutoModelForCausalLM

from tandem_jobs.config import Job, parse_job
from tests.support.numerics import assert_close_at_scale
from trainer import grpo, scoring
from trainer.checkpoints import Trigger
from trainer.models import build_tiny_model
from trainer.scoring import (
    TrainSequence,
    accumulate,
    batch_loss,
    collate,
    load_policy,
    load_reference,
    micro_batches,
    sequence_logprobs,
)
from trainer.train import Environment, Episode, Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=2)


def make_job(model_dir: Path, algorithm: dict[str, Any] | None = None, **training: Any) -> Job:
    return Job(
        parse_job(
            {
                "model": {"dir": str(model_dir)},
                "task_app": {"name": "orgs/demo/taskApps/single-turn"},
                "data": {"train": {"seeds": [{"start": 0, "end": 10}]}},
                "algorithm": {"group_size": 2, "prompts_per_step": 1, "steps": 10, **(algorithm or {})},
                "optimizer": {"learning_rate": 1e-6, "max_grad_norm": 0},
                "sampling": {"max_tokens": 8},
                "training": training,
            }
        )
    )


def sequences() -> tuple[list[TrainSequence], list[float]]:
    """Six turns of different lengths, masks and temperatures; one lags the policy, one trains nothing."""
    generator = torch.Generator().manual_seed(1)
    made: list[TrainSequence] = []
    for index, (prompt, completion) in enumerate([(3, 5), (6, 2), (2, 7), (4, 4), (5, 1), (2, 3)]):
        ids = torch.randint(3, 500, (prompt + completion,), generator=generator).tolist()
        logprobs = (-1.0 - torch.rand(completion, generator=generator)).tolist()
        mask = [index != 4 and (index + j) % 4 != 3 for j in range(completion)]
        made.append((ids, prompt, logprobs, mask, ([1.0, 0.7, 0.0][index % 3], 0, 1.0, 0.0), index == 2))
    return made, [1.0, -0.5, 0.25, -1.0, 0.5, 2.0]


def trainer(job: Job, folder: Path) -> Trainer:
    return Trainer(job, Environment(None, [], "orgs/demo/taskApps/single-turn", "orgs/demo/jobs/j", folder))


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return [g.detach().clone() for g in grads if g is not None]


def test_log_probs_from_the_hidden_states_in_chunks_equal_the_full_logits(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scoring, "LOGIT_CHUNK_BYTES", 3 * 4 * 512)  # 3 positions a chunk: several chunks
    model = load_policy(model_dir, torch.device("cpu"), make_job(model_dir))
    made, advantages = sequences()
    batch = collate(made, advantages)
    scores = sequence_logprobs(model, batch)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits
    picked = logits.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    want = grpo.token_logprobs(picked, batch.targets, 1.0)
    for row, temperature in enumerate(batch.temperatures.tolist()):
        want[row] = grpo.token_logprobs(picked[row : row + 1], batch.targets[row : row + 1], temperature)[0]
    trained = batch.mask
    assert int(trained.sum()) == 16
    # Chunks take other matrix blockings: measured 2.5e-7 apart relative (2 float32 ulps) on one machine's CPU.
    torch.testing.assert_close(scores.logprobs[trained], want[trained], rtol=1e-6, atol=1e-6)
    assert bool((scores.logprobs[~trained] == 0).all())
    entropies = [
        grpo.entropy(picked[row : row + 1], trained[row : row + 1], t) * int(trained[row].sum())
        for row, t in enumerate(batch.temperatures.tolist())
    ]
    assert scores.entropy_sum == pytest.approx(sum(entropies), rel=1e-5)
    # The gradient through the chunks (each recomputed in backward) is the full logits' gradient.
    model.zero_grad()
    scores.logprobs[trained].sum().backward()
    chunked = gradients(model)
    model.zero_grad()
    want[trained].sum().backward()
    assert_close_at_scale(chunked, gradients(model), what="gradient")


@pytest.mark.parametrize(
    "algorithm",
    [
        {"loss_aggregation": "LOSS_AGGREGATION_TOKEN_MEAN", "kl_coef": 0.1},
        {"loss_aggregation": "LOSS_AGGREGATION_SEQUENCE_MEAN", "kl_coef": 0.1},
        {"loss_aggregation": "LOSS_AGGREGATION_CONSTANT"},
        {"ratio_level": "RATIO_LEVEL_SEQUENCE", "loss_aggregation": "LOSS_AGGREGATION_SEQUENCE_MEAN"},
    ],
    ids=["token_mean_kl", "sequence_mean_kl", "constant", "gspo"],
)
def test_micro_batches_accumulate_the_gradient_of_the_whole_batch(
    model_dir: Path, algorithm: dict[str, Any]
) -> None:
    made, advantages = sequences()
    whole_job, micro_job = (
        make_job(model_dir, algorithm),
        make_job(model_dir, algorithm, micro_batch_tokens=16),
    )
    assert micro_batches([len(ids) for ids, *_ in made], 16) == [[2], [0, 1], [3, 4], [5]]
    device = torch.device("cpu")
    policy = load_policy(model_dir, device, whole_job)
    reference = load_reference(model_dir, device, whole_job) if "kl_coef" in algorithm else None
    with torch.no_grad():  # the reference differs from the policy, so the KL term is not 0
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loss, stats, entropy, tokens = batch_loss(policy, reference, made, advantages, whole_job, device)
    loss.backward()  # type: ignore[no-untyped-call]
    want = gradients(policy)
    policy.zero_grad(set_to_none=True)
    got = accumulate(policy, reference, made, advantages, micro_job, device, scale=0.5)
    assert_close_at_scale(gradients(policy), [0.5 * g for g in want], what="gradient")
    assert float(got.loss) == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
    assert got.tokens == tokens == 16
    assert got.entropy == pytest.approx(entropy, rel=1e-5)
    for name in ("policy_loss", "kl", "clip_fraction", "ratio_mean", "ratio_min", "ratio_max"):
        assert getattr(got.stats, name) == pytest.approx(getattr(stats, name), rel=1e-5, abs=1e-7)
    if reference is not None:
        assert stats.kl > 1e-6


def test_micro_batches_group_rows_of_like_length_within_the_budget() -> None:
    assert micro_batches([5, 9, 3, 9, 2], 18) == [[1, 3], [0, 2, 4]]  # 2 x 9, then 3 x 5
    assert micro_batches([5, 9, 3, 9, 2], 4) == [[1], [3], [0], [2], [4]]  # too long to share: alone
    assert micro_batches([4, 4, 4], 100) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="budget"):
        micro_batches([1], 0)


def saved_bytes(model: torch.nn.Module, batch: scoring.Batch) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for backward in the forward (parameters excluded), and the scores."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in parameters:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scores = sequence_logprobs(model, batch)
    return sum(kept.values()), scores.logprobs


def test_activation_checkpointing_gives_the_same_gradient_and_keeps_less(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "deeper", layers=4)
    made, advantages = sequences()
    batch = collate(made, advantages)
    results = []
    for checkpointing in (False, True):
        model = load_policy(
            model_dir, torch.device("cpu"), make_job(model_dir, activation_checkpointing=checkpointing)
        )
        model.train(False)
        kept, logprobs = saved_bytes(model, batch)
        (logprobs * batch.advantages.unsqueeze(1)).sum().backward()
        results.append((kept, gradients(model), [name for name, _ in model.named_parameters()]))
    (plain, plain_grads, plain_names), (checkpointed, grads, names) = results
    assert names == plain_names  # the composable checkpoint renames nothing: checkpoints and sync unchanged
    assert_close_at_scale(grads, plain_grads, what="gradient")
    assert checkpointed < plain / 2, (checkpointed, plain)


def test_dropout_is_off_in_the_scoring_forward(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "dropout", layers=2)
    config = json.loads((model_dir / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (model_dir / "config.json").write_text(json.dumps(config))
    job = make_job(model_dir)
    policy = load_policy(model_dir, torch.device("cpu"), job)
    made, advantages = sequences()
    policy.train()  # as a caller may leave it
    first = batch_loss(policy, None, made, advantages, job, torch.device("cpu"))
    second = batch_loss(policy, None, made, advantages, job, torch.device("cpu"))
    assert not policy.training
    assert float(first.loss.detach()) == float(second.loss.detach())
    assert first.stats.ratio_max == second.stats.ratio_max
    policy.train()  # the check can fail: with dropout on, two forwards differ
    batch = collate(made, advantages)
    one, two = (sequence_logprobs(policy, batch).logprobs for _ in range(2))
    assert not torch.equal(one, two)


def test_a_bf16_checkpoint_trains_with_every_weight_moving_and_is_saved_as_bf16(tmp_path: Path) -> None:
    model_dir = build_tiny_model(
        tmp_path / "bf16", vocab_size=512, hidden_size=64, layers=2, dtype="bfloat16"
    )
    job = make_job(model_dir)
    t = trainer(job, tmp_path / "run")
    assert {p.dtype for p in t.policy.parameters()} == {torch.float32}
    assert t.serve_dtype == torch.bfloat16
    before = [p.detach().clone() for p in t.policy.parameters()]
    made, advantages = sequences()
    update = t._update(made, advantages, 1e-6)
    assert update.finite
    # AdamW's first step moves a weight by lr * |g| / (|g| + eps): about lr, except where the gradient is
    # near eps (1e-8). Every weight whose step exceeds its float32 spacing moved; in bf16 (the checkpoint's
    # own dtype, which AdamW used to update) only the few whose step reaches half a bf16 spacing would have.
    moved = total = float32_movable = bf16_movable = 0
    for old, p in zip(before, t.policy.parameters(), strict=True):
        gradient = t.optimizer.state[p]["exp_avg"] / 0.1  # (1 - beta1) * g after one step
        step = 1e-6 * gradient.abs() / (gradient.abs() + 1e-8)
        spacing32 = torch.nextafter(old, torch.full_like(old, math.inf)) - old
        spacing16 = (old.to(torch.bfloat16).float().abs() * 2**-7).clamp(min=2**-133)  # bf16 keeps 8 bits
        assert bool((old != p.detach())[step > spacing32].all())
        moved += int((old != p.detach()).sum())
        total += old.numel()
        float32_movable += int((step > spacing32).sum())
        bf16_movable += int((step >= spacing16 / 2).sum())
    assert moved >= float32_movable > 0.9999 * total, (moved, float32_movable, total)
    assert bf16_movable < 0.1 * total, bf16_movable
    assert {s.dtype for state in t.optimizer.state.values() for s in state.values() if s.dim()} == {
        torch.float32
    }
    assert {w.dtype for _, w in t._named_weights()} == {torch.bfloat16}  # what the workers serve

    saved = t._write_checkpoint(Trigger.FINAL)
    assert json.loads((saved.path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(saved.path / "model.safetensors"), "pt") as stored:
        assert {stored.get_tensor(k).dtype for k in stored.keys()} == {torch.bfloat16}  # noqa: SIM118
    loaded = AutoModelForCausalLM.from_pretrained(saved.path)
    assert loaded.dtype == torch.bfloat16
    for (name, mine), theirs in zip(t.policy.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(mine.detach().to(torch.bfloat16), theirs), name
    # Resuming restores the float32 master weights, not their bf16 rounding.
    again = trainer(job, tmp_path / "run")
    assert again.resume()
    for mine, theirs in zip(t.policy.parameters(), again.policy.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert math.isfinite(update.stats.loss)


def turn_episode(reward: float, finish: int, version: int) -> Episode:
    trace = trace_pb2.Trace(correlation_id="c", min_weight_version=version)
    turn = trace.turns.add(temperature=1.0, weight_version=version, finish_reason=finish)  # type: ignore[arg-type]
    turn.prompt_token_ids.extend([5, 6, 7])
    turn.completion_token_ids.extend([8, 9])
    turn.sampler_logprobs.extend([-1.0, -2.0])
    turn.loss_mask.extend([True, True])
    return Episode(seed=1, reward=reward, trace=trace)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_truncated_completions_are_counted_and_masked_when_asked_and_lagging_turns_marked(
    model_dir: Path, tmp_path: Path, mask_truncated: bool
) -> None:
    t = trainer(make_job(model_dir, {"mask_truncated": mask_truncated, "max_staleness": 2}), tmp_path)
    t.version = 3
    group = [
        turn_episode(1.0, generation_pb2.FINISH_REASON_STOP, 3),
        turn_episode(0.0, generation_pb2.FINISH_REASON_LENGTH, 2),
    ]
    made, advantages, counts = t._sequences([group])
    assert counts["completions/truncated"] == 1.0
    assert [s[3] for s in made] == [[True, True], [not mask_truncated] * 2]
    assert [s[5] for s in made] == [False, True]  # sampled by version 2 while the policy is at 3
    assert advantages == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)])  # the truncated reward counts


def test_bf16_autocast_computes_in_bf16_and_keeps_float32_weights_and_gradients(model_dir: Path) -> None:
    made, advantages = sequences()
    device = torch.device("cpu")
    results = []
    for dtype in ("float32", "bfloat16"):
        job = make_job(model_dir, {"kl_coef": 0.1}, compute_dtype=dtype)
        policy = load_policy(model_dir, device, job)
        reference = load_reference(model_dir, device, job)
        loss, stats, *_ = batch_loss(policy, reference, made, advantages, job, device)
        loss.backward()  # type: ignore[no-untyped-call]
        assert (
            {p.dtype for p in policy.parameters()}
            == {p.grad.dtype for p in policy.parameters() if p.grad is not None}
            == {torch.float32}
        )
        results.append((float(loss.detach()), stats, {p.dtype for p in reference.parameters()}))
    (exact, exact_stats, exact_ref), (low, low_stats, low_ref) = results
    assert (exact_ref, low_ref) == ({torch.float32}, {torch.bfloat16})
    assert low == pytest.approx(exact, rel=0.05, abs=0.01)
    assert low_stats.ratio_mean != exact_stats.ratio_mean  # it did compute in bf16
