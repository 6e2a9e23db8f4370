"""GRPO's pure functions against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.grpo import (
    Aggregation,
    LossStats,
    aggregate,
    combine,
    drop_non_finite,
    entropy,
    group_advantages,
    kl_k3,
    mismatch_kl,
    policy_loss,
    scored_tokens,
    staleness,
    staleness_counts,
    token_logprobs,
    token_weights,
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


def test_the_std_advantages_are_divided_by_has_a_floor() -> None:
    # Rewards 1e-4 apart: std = 5e-5 * sqrt(4 / 3), well below the floor of 1e-3, which divides instead.
    close = torch.tensor([1e-4, 0.0, 0.0, 1e-4, 1.0, 0.0, 0.0, 1.0])
    floored, _ = group_advantages(close, 4, std_floor=1e-3)
    std = math.sqrt(4 / 3) * 0.5  # the second group's, far above the floor
    assert floored.tolist() == fp32([0.05, -0.05, -0.05, 0.05, 0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    unfloored, _ = group_advantages(close, 4, std_floor=0.0)
    assert unfloored[:4].tolist() == fp32(
        [1 / math.sqrt(4 / 3), -1 / math.sqrt(4 / 3), -1 / math.sqrt(4 / 3), 1 / math.sqrt(4 / 3)]
    )
    with pytest.raises(ValueError, match="std_floor"):
        group_advantages(close, 4, std_floor=-1.0)


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


def test_the_constant_normaliser_divides_by_tokens_per_completion_times_completions() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # Dr. GRPO: (1 + 2 + 3 + 10) / (4 tokens per completion x 2 completions), whatever the lengths.
    assert float(aggregate(values, mask, "constant", constant_tokens=4)) == fp32(16 / 8)
    # A completion without a trained token still counts as one of the batch's completions.
    three = torch.cat([values, torch.zeros(1, 3)])
    assert float(
        aggregate(three, torch.cat([mask, torch.zeros(1, 3)]), "constant", constant_tokens=4)
    ) == fp32(16 / 12)
    with pytest.raises(ValueError, match="constant_tokens"):
        aggregate(values, mask, "constant")


@pytest.mark.parametrize("how", ["token_mean", "sequence_mean", "constant"])
def test_micro_batches_weighted_by_the_whole_batch_add_up_to_its_loss_and_gradient(how: Aggregation) -> None:
    generator = torch.Generator().manual_seed(0)
    logp = (-torch.rand(5, 4, generator=generator)).requires_grad_(True)
    sampler = -torch.rand(5, 4, generator=generator)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    whole, whole_stats = policy_loss(logp, sampler, adv, mask, aggregation=how, constant_tokens=4)
    (want,) = torch.autograd.grad(whole, logp)
    weights = token_weights(mask, how, constant_tokens=4)
    parts, total = [], torch.zeros(())
    for rows in ([0, 1], [2], [3, 4]):
        loss, stats = policy_loss(logp[rows], sampler[rows], adv[rows], mask[rows], weights=weights[rows])
        total = total + loss
        parts.append(stats)
    (got,) = torch.autograd.grad(total, logp)
    assert float(total.detach()) == fp32(float(whole.detach()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    combined = combine(parts)
    assert combined.tokens == whole_stats.tokens == 10
    for name in ("loss", "policy_loss", "ratio_mean", "ratio_min", "ratio_max", "clip_fraction"):
        assert getattr(combined, name) == fp32(getattr(whole_stats, name))


def test_combined_statistics_weigh_each_part_by_its_tokens() -> None:
    a = LossStats(
        loss=0.5,
        policy_loss=0.4,
        kl=0.1,
        clip_fraction=0.5,
        ratio_mean=1.2,
        ratio_min=0.9,
        ratio_max=1.5,
        tokens=2,
    )
    b = LossStats(
        loss=-0.25,
        policy_loss=-0.25,
        kl=0.4,
        clip_fraction=0.0,
        ratio_mean=0.9,
        ratio_min=0.7,
        ratio_max=1.0,
        tokens=6,
    )
    empty = LossStats(
        loss=0.0,
        policy_loss=0.0,
        kl=0.0,
        clip_fraction=0.0,
        ratio_mean=1.0,
        ratio_min=1.0,
        ratio_max=1.0,
        tokens=0,
    )
    both = combine([a, empty, b])
    assert (both.loss, both.policy_loss, both.tokens) == fp32((0.25, 0.15, 8))
    assert (both.kl, both.clip_fraction, both.ratio_mean) == fp32(((0.2 + 2.4) / 8, 1 / 8, (2.4 + 5.4) / 8))
    assert (both.ratio_min, both.ratio_max) == (0.7, 1.5)  # the empty part's 1.0 does not count
    assert combine([empty]).ratio_mean == 1.0


def test_a_non_finite_sampler_logprob_changes_nothing_where_masked_and_drops_its_token_where_trained() -> (
    None
):
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5], [0.9, 1.1, 1.0]]))
    sampler = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    clean_logp = logp.clone().requires_grad_(True)
    want, want_stats = policy_loss(
        clean_logp, sampler, adv, mask, kl_coef=0.1, ref_logprobs=torch.zeros(2, 3)
    )
    want.backward()
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = sampler.clone()
        poisoned[0, 2] = bad  # masked: nothing changes, the gradient included
        got_logp = logp.clone().requires_grad_(True)
        got, got_stats = policy_loss(
            got_logp, poisoned, adv, mask, kl_coef=0.1, ref_logprobs=torch.zeros(2, 3)
        )
        got.backward()
        assert float(got.detach()) == float(want.detach()) and got_stats == want_stats
        assert got_logp.grad is not None and clean_logp.grad is not None
        assert torch.equal(got_logp.grad, clean_logp.grad)
    # At a trained position the token leaves the loss: the same as masking it off.
    poisoned = sampler.clone()
    poisoned[1, 0] = math.nan
    dropped, stats = policy_loss(logp, poisoned, adv, mask)
    without = mask.clone()
    without[1, 0] = 0
    assert float(dropped) == float(policy_loss(logp, sampler, adv, without)[0])
    assert stats.tokens == 4
    # A = -1 tokens 1.1 and 1.0 (unclipped); A = +1 tokens min(1.5, 1.2) and 1.0: (-1.2 - 1 + 1.1 + 1) / 4
    assert float(dropped) == fp32((-1.2 - 1.0 + 1.1 + 1.0) / 4)


def test_non_finite_logprobs_leave_a_turn_counted() -> None:
    values, mask, dropped = drop_non_finite(
        [-1.0, math.nan, math.inf, -2.0, -math.inf], [True, True, False, True]
    )
    assert values == [-1.0, 0.0, 0.0, -2.0, 0.0]
    assert mask == [True, False, False, True, False]
    assert dropped == 1  # the inf at position 2 and the -inf past the mask's end were not trained on
    assert drop_non_finite([-1.0], [True, False]) == ([-1.0], [True, False], 0)


def test_the_sequence_level_ratio_by_hand() -> None:
    # GSPO: sequence 1 (A = +1) has token ratios 1.21 and 1.0, so s = sqrt(1.21) = 1.1 (inside the clip range);
    # sequence 2 (A = -1) has 0.125, 1.0 and 1.0, so s = 0.125 ** (1/3) = 0.5, clipped below at 0.8.
    logp = torch.log(torch.tensor([[1.21, 1.0, 1.0], [0.125, 1.0, 1.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(
        logp, torch.zeros(2, 3), adv, mask, ratio_level="sequence", aggregation="sequence_mean"
    )
    assert float(loss.detach()) == fp32((-1.1 + 0.8) / 2)
    assert (stats.ratio_min, stats.ratio_max) == fp32((0.5, 1.1))
    assert stats.clip_fraction == fp32(3 / 5)  # sequence 2's three tokens
    loss.backward()
    assert logp.grad is not None
    # d/dlogp_t of -A * s / 2 sequences = -A * s * (1 / |y|) / 2 on each trained token of sequence 1; 0 for the
    # clipped sequence and the masked token.
    assert logp.grad.flatten().tolist() == fp32([-1.1 / 2 / 2, -1.1 / 2 / 2, 0.0, 0.0, 0.0, 0.0])
    token_mean, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, ratio_level="sequence")
    assert float(token_mean.detach()) == fp32(
        (2 * -1.1 + 3 * 0.8) / 5
    )  # each token carries its sequence's loss
    with pytest.raises(ValueError, match="ratio level"):
        policy_loss(logp, torch.zeros(2, 3), adv, mask, ratio_level="episode")  # type: ignore[arg-type]


def test_the_dual_clip_applies_to_lagging_sequences_only() -> None:
    logp = torch.log(torch.tensor([[5.0], [5.0]]))
    adv = torch.tensor([-1.0, -1.0])
    lagging = torch.tensor([True, False])
    loss, _ = policy_loss(logp, torch.zeros(2, 1), adv, torch.ones(2, 1), max_ratio=2.0, lagging=lagging)
    assert float(loss) == fp32((2.0 + 5.0) / 2)  # the on-policy sequence keeps its unbounded cost


def test_the_decoupled_objective_keeps_the_gradient_of_a_lagging_token_the_clip_would_drop() -> None:
    """A lagging token the current weights find 1.5x as likely as its sampler did (outside the 0.2 clip):
    the clipped objective gives it no gradient; the decoupled one gives -w * A, w = 1.5 the behaviour
    weight, and truncates w at `max_ratio`. On-policy rows are the clipped objective's either way."""
    sampler = torch.log(torch.tensor([[0.2], [0.2]]))
    adv = torch.tensor([1.0, 1.0])
    lagging = torch.tensor([True, False])

    def grads(decoupled: bool, max_ratio: float) -> tuple[float, list[float]]:
        logp = torch.log(torch.tensor([[0.3], [0.3]])).requires_grad_()
        loss, _ = policy_loss(
            logp, sampler, adv, torch.ones(2, 1), max_ratio=max_ratio, lagging=lagging, decoupled=decoupled
        )
        loss.backward()
        assert logp.grad is not None
        return float(loss), logp.grad.flatten().tolist()

    loss, (lagged, on_policy) = grads(False, 2.0)
    assert lagged == on_policy == 0.0  # both clipped at 1.2
    loss, (lagged, on_policy) = grads(True, 2.0)
    assert lagged == pytest.approx(-1.5 / 2)  # token mean over 2 tokens
    assert on_policy == 0.0
    assert loss == pytest.approx((-1.5 - 1.2) / 2)
    _, (lagged, _) = grads(True, 1.25)
    assert lagged == pytest.approx(-1.25 / 2)  # the behaviour weight truncated


def test_the_decoupled_objective_changes_nothing_without_lagging_turns() -> None:
    logp = torch.log(torch.tensor([[0.3, 0.5], [0.1, 0.4]]))
    sampler = torch.log(torch.tensor([[0.2, 0.5], [0.2, 0.3]]))
    adv = torch.tensor([1.0, -1.0])
    fresh = torch.tensor([False, False])
    plain, _ = policy_loss(logp, sampler, adv, torch.ones(2, 2), max_ratio=2.0, lagging=fresh)
    both, _ = policy_loss(logp, sampler, adv, torch.ones(2, 2), max_ratio=2.0, lagging=fresh, decoupled=True)
    assert torch.equal(plain, both)


def test_token_logprobs_and_entropy_follow_the_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0]]])
    tokens = torch.tensor([[0]])
    assert float(token_logprobs(logits, tokens)) == fp32(math.log(math.exp(2) / (math.exp(2) + 1)))
    assert float(token_logprobs(logits, tokens, temperature=2.0)) == fp32(
        math.log(math.exp(1) / (math.exp(1) + 1))
    )
    p = math.exp(2) / (math.exp(2) + 1)
    assert entropy(logits, torch.ones(1, 1)) == fp32(-(p * math.log(p) + (1 - p) * math.log(1 - p)))
    # One temperature per token; 0 (greedy) is scored at 1.
    both = torch.tensor([[2.0, 0.0], [2.0, 0.0]])
    logp, entropies = scored_tokens(both, torch.tensor([0, 0]), torch.tensor([2.0, 0.0]))
    assert logp.tolist() == fp32([math.log(math.exp(1) / (math.exp(1) + 1)), math.log(p)])
    assert float(entropies[1]) == fp32(-(p * math.log(p) + (1 - p) * math.log(1 - p)))


def test_staleness_decides_use_and_counts() -> None:
    decisions = [staleness(v, 5, max_staleness=2) for v in (5, 4, 3, 2)]
    assert [(d.lag, d.used) for d in decisions] == [(0, True), (1, True), (2, True), (3, False)]
    assert staleness_counts(decisions) == {"on_policy": 1, "corrected": 2, "dropped": 1}
    assert not staleness(4, 5, max_staleness=0).used
    with pytest.raises(ValueError, match="newer"):
        staleness(6, 5, 1)
