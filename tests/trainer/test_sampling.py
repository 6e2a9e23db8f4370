"""The sampling distribution (trainer/sampling.py) by hand, and the trainer scoring a torch engine's samples
under it: the on-policy ratio is 1 at top_p, top_k and min_p, where against the full distribution it was
the kept mass."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tandem.inference.v1 import trace_pb2

from tests.trainer.test_ranks import make_job, trainer
from trainer.inference.engine import Finished, Sampling, TokenChunk
from trainer.inference.torch_engine import TorchEngine
from trainer.sampling import dropped, truncated, truncates
from trainer.scoring import batch_loss
from trainer.train import Episode

PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.log(torch.tensor(PROBS))


def kept(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, keep: int | None = None) -> list[int]:
    target = None if keep is None else torch.tensor(keep)
    return [i for i, out in enumerate(dropped(LOGITS, top_k, top_p, min_p, target).tolist()) if not out]


def test_each_truncation_by_hand() -> None:
    assert kept() == [0, 1, 2, 3] and not truncates(0, 1.0, 0.0)
    # top-p: a token goes when the mass before it (0.8 before the third) already reaches top_p.
    assert kept(top_p=0.7) == [0, 1]
    assert kept(top_p=0.81) == [0, 1, 2]
    assert kept(top_p=1e-6) == [0]  # the most likely always stays
    assert kept(top_k=3) == [0, 1, 2]
    assert kept(min_p=0.2) == [0, 1, 2]  # below 0.2 * 0.5 = 0.1: the last (0.05)
    assert kept(min_p=0.7) == [0]  # below 0.35
    # top-p is taken over what top-k left, renormalised: [0.625, 0.375] -> the mass before the second
    # (0.625) reaches 0.6, so it goes, where over the full distribution (0.5 before it) it stays.
    assert kept(top_k=2, top_p=0.6) == [0]
    assert kept(top_p=0.6) == [0, 1]
    # The sampled token stays in whatever the truncation says.
    assert kept(top_p=0.7, keep=3) == [0, 1, 3]


def test_truncated_logits_renormalise_over_the_kept_tokens() -> None:
    logp = torch.log_softmax(truncated(LOGITS, top_p=0.7), dim=-1)
    assert logp[:2].tolist() == pytest.approx([math.log(0.5 / 0.8), math.log(0.3 / 0.8)], rel=1e-5)
    assert logp[2:].tolist() == [-math.inf, -math.inf]
    rows = torch.stack([LOGITS, LOGITS.flip(0)])  # batched: each row on its own
    assert dropped(rows, top_p=0.7).tolist() == [[False, False, True, True], [True, True, False, False]]
    assert truncated(LOGITS) is LOGITS  # nothing to drop: the logits themselves


async def sample_episodes(model_dir: Path, sampling: Sampling, count: int) -> list[Episode]:
    """`count` one-turn episodes the torch engine samples with `sampling`, as a worker's traces hold them."""
    engine = await TorchEngine.load(str(model_dir))
    episodes = []
    try:
        for i in range(count):
            prompt = [5 + i, 6, 7, 8]
            trace = trace_pb2.Trace(correlation_id=f"c{i}")
            turn = trace.turns.add(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
            )
            turn.prompt_token_ids.extend(prompt)
            async for item in engine.generate(prompt, sampling):
                if isinstance(item, TokenChunk):
                    turn.completion_token_ids.extend(item.token_ids)
                    turn.sampler_logprobs.extend(item.logprobs)
                    turn.loss_mask.extend([True] * len(item.token_ids))
                else:
                    assert isinstance(item, Finished)
            episodes.append(Episode(seed=i, reward=float(i % 2), trace=trace))
    finally:
        await engine.close()
    return episodes


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1.0, top_p=0.9, max_tokens=12, seed=3),
        Sampling(temperature=0.8, top_k=20, max_tokens=12, seed=4),
        Sampling(temperature=1.2, min_p=0.5, top_p=0.95, max_tokens=12, seed=5),
    ],
    ids=["top_p_0.9", "top_k_20", "min_p_0.5_and_top_p"],
)
async def test_the_on_policy_ratio_is_one_under_the_distribution_sampled_from(
    tiny_model: Path, tmp_path: Path, sampling: Sampling
) -> None:
    episodes = await sample_episodes(tiny_model, sampling, 8)
    t = trainer(make_job(tiny_model), tmp_path)
    sequences, advantages, _ = t._sequences([episodes[:4], episodes[4:]])
    assert {s[4] for s in sequences} == {
        (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    }
    with torch.no_grad():
        _, stats, _, tokens = batch_loss(t.policy, t.reference, sequences, advantages, t.job, t.device)
    assert tokens == sum(len(e.trace.turns[0].completion_token_ids) for e in episodes if e.trace) > 40
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-3)
    assert 0.99 < stats.ratio_min <= stats.ratio_max < 1.01
    assert stats.clip_fraction == 0.0
    # Scored against the temperature-only distribution instead, the ratio is the kept mass, below 1.
    full = [(*s[:4], (s[4][0], 0, 1.0, 0.0), s[5]) for s in sequences]
    with torch.no_grad():
        _, unprocessed, _, _ = batch_loss(t.policy, t.reference, full, advantages, t.job, t.device)
    assert unprocessed.ratio_mean < 0.99
