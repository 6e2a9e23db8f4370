"""GRPO's pure functions against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.grpo import (
    aggregate,
    entropy,
    group_advantages,
    kl_k3,
    mismatch_kl,
    policy_loss,
    staleness,
    staleness_counts,
    token_logprobs,
)


def fp32(expected: object) -> object:
    """A hand-computed (float64) value, compared with a float32 result: each float32 operation rounds to
    about 6e-8, and a few of them in a row (log, exp, a sum, a cancellation as in k3) to some 1e-6, which
    the default tolerance of `pytest.approx` (1e-6) does not always cover on every CPU's kernels. 1e-5
    still tells any wrong formula apart."""
    return pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_advantages_are_centred_per_group_and_scaled_by_the_sample_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    plain, stats = group_advantages(rewards, 4, normalize_std=False)
    assert plain.tolist() == fp32([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    scaled, _ = group_advantages(rewards, 4, normalize_std=True)
    std = math.sqrt((4 * 0.25) / 3)  # sample std of [1, 0, 0, 1]
    assert scaled.tolist() == fp32([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0, 0, 0, 0])
    assert (stats.zero_variance, stats.groups) == (1, 2)
    assert stats.reward_mean == fp32(0.5)


def test_a_group_of_one_has_no_advantage_and_bad_shapes_are_refused() -> None:
    single, stats = group_advantages(torch.tensor([3.0, 1.0]), 1)
    assert single.tolist() == [0.0, 0.0] and stats.zero_variance == 2
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 4)


def test_the_clipped_objective_by_hand() -> None:
    # Two sequences of two tokens; ratios exp(logp - old): [1.5, 1.0] and [0.5, 0.9]; advantages +1, -1.
    logp = torch.log(torch.tensor([[1.5, 1.0], [0.5, 0.9]]))
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2)
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # A=+1: min(1.5, 1.2) = 1.2 and min(1.0, 1.0) = 1.0 -> -1.2, -1.0
    # A=-1: min(-0.5, -0.8) = -0.8 and min(-0.9, -0.9) = -0.9 -> 0.8, 0.9
    assert float(loss) == fp32((-1.2 - 1.0 + 0.8 + 0.9) / 4)
    assert stats.clip_fraction == fp32(2 / 4)  # 1.5 clipped above (A>0), 0.5 clipped below (A<0)
    assert (stats.ratio_min, stats.ratio_max) == fp32((0.5, 1.5))
    assert stats.kl == 0.0 and stats.tokens == 4


def test_the_sampler_trainer_mismatch_by_hand() -> None:
    # Ratios pi/mu of the trained tokens: 1.5, 0.5 and 1.0; the last token is masked out (ratio 4).
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.0, 4.0]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    _, stats = policy_loss(logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), mask)
    assert stats.mismatch_abs == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    # r - 1 - log r per token: 0.5 - log 1.5, -0.5 - log 0.5, 0
    assert stats.mismatch_kl == pytest.approx((0.5 - math.log(1.5) + (-0.5 - math.log(0.5))) / 3)
    assert mismatch_kl(torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]  # the same distribution: no mismatch
    assert bool((mismatch_kl(torch.linspace(-3, 3, 13)) >= 0).all())


def test_the_gradient_vanishes_where_the_ratio_is_clipped() -> None:
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_(True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0, 0] == 0.0  # clipped: no push beyond 1 + eps
    assert float(logp.grad[0, 1]) == fp32(-1.0 / 2)  # d(-r)/dlogp = -r = -1, token mean over 2


def test_the_dual_clip_bounds_a_negative_advantage_at_a_large_ratio() -> None:
    logp = torch.log(torch.tensor([[5.0, 1.5]])).requires_grad_(True)
    adv = torch.tensor([-1.0])
    plain, _ = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2))
    capped, _ = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), max_ratio=2.0)
    # A=-1: -min(-5, -1.2) = 5 and -min(-1.5, -1.2) = 1.5; capped at 2 * |A| = 2 -> 2 and 1.5.
    assert float(plain.detach()) == fp32((5.0 + 1.5) / 2)
    assert float(capped.detach()) == fp32((2.0 + 1.5) / 2)
    capped.backward()
    assert logp.grad is not None and logp.grad[0, 0] == 0.0  # no gradient through the capped token


def test_k3_by_hand_and_added_with_its_coefficient() -> None:
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    d = math.log(0.25) - math.log(0.5)
    assert float(kl_k3(logp, ref)) == fp32(math.exp(d) - d - 1)
    assert float(kl_k3(logp, logp)) == 0.0
    loss, stats = policy_loss(
        logp, logp, torch.tensor([0.0]), torch.ones(1, 1), kl_coef=0.1, ref_logprobs=ref
    )
    assert float(loss) == fp32(0.1 * (math.exp(d) - d - 1))
    assert stats.kl == fp32(math.exp(d) - d - 1)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), kl_coef=0.1)


def test_masked_tokens_do_not_count_and_the_two_aggregations_differ() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(values, mask, "token_mean")) == fp32((1 + 2 + 3 + 10) / 4)
    assert float(aggregate(values, mask, "sequence_mean")) == fp32((2.0 + 10.0) / 2)
    assert float(aggregate(values, torch.zeros(2, 3), "sequence_mean")) == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(values, mask, "sum")  # type: ignore[arg-type]


def test_token_logprobs_and_entropy_follow_the_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0]]])
    tokens = torch.tensor([[0]])
    assert float(token_logprobs(logits, tokens)) == fp32(math.log(math.exp(2) / (math.exp(2) + 1)))
    assert float(token_logprobs(logits, tokens, temperature=2.0)) == fp32(
        math.log(math.exp(1) / (math.exp(1) + 1))
    )
    p = math.exp(2) / (math.exp(2) + 1)
    assert entropy(logits, torch.ones(1, 1)) == fp32(-(p * math.log(p) + (1 - p) * math.log(1 - p)))


def test_staleness_decides_use_and_counts() -> None:
    decisions = [staleness(v, 5, max_staleness=2) for v in (5, 4, 3, 2)]
    assert [(d.lag, d.used) for d in decisions] == [(0, True), (1, True), (2, True), (3, False)]
    assert staleness_counts(decisions) == {"on_policy": 1, "corrected": 2, "dropped": 1}
    assert not staleness(4, 5, max_staleness=0).used
    with pytest.raises(ValueError, match="newer"):
        staleness(6, 5, 1)
