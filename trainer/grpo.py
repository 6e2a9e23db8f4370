"""GRPO as small pure functions: advantages, the clipped policy objective, the KL penalty, loss aggregation,
staleness decisions and the diagnostics a run logs. No I/O, no model: tensors in, tensors out, so every
formula is tested on CPU against values computed by hand (tests/trainer/test_grpo.py).

Shapes: B sequences (completions), T completion positions (right-padded), G completions per group.

- `group_advantages(rewards)`: reward minus its group's mean, optionally divided by the group's standard
  deviation (sample std, as TRL and the DeepSeekMath paper use). A group whose rewards are all equal carries
  no signal: its advantages are 0 and `GroupStats.zero_variance` counts it.
- `policy_loss(...)`: per token, -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) with the importance
  ratio r = exp(logp - sampler_logp) against the log-probs the inference worker recorded, plus
  `kl_coef` times the k3 estimator of KL(policy || reference), exp(ref - logp) - (ref - logp) - 1, which is
  non-negative and unbiased for the KL under samples from the policy.
- `aggregate(...)`: "token_mean" (every trained token weighs the same across the batch) or "sequence_mean"
  (each sequence's mean over its trained tokens, then the mean over sequences).
- `staleness(...)`: how many weight versions behind a trace is, and whether it is used or dropped under
  `max_staleness`; used stale traces are importance-corrected by the same ratio r.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "sequence_mean"]


@dataclass(frozen=True)
class GroupStats:
    reward_mean: float
    reward_std: float
    zero_variance: int  # groups whose rewards were all equal (no learning signal)
    groups: int


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, GroupStats]:
    """Advantages for `rewards` [B] laid out group after group (B = groups x group_size)."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    spread = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
    flat = spread.squeeze(1) <= eps
    if normalize_std:
        centred = centred / torch.where(spread > eps, spread, torch.ones_like(spread))
    centred[flat] = 0.0
    stats = GroupStats(
        reward_mean=float(rewards.double().mean()),
        reward_std=float(rewards.double().std()) if rewards.numel() > 1 else 0.0,
        zero_variance=int(flat.sum()),
        groups=grouped.shape[0],
    )
    return centred.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32), stats


@dataclass(frozen=True)
class LossStats:
    loss: float
    policy_loss: float
    kl: float  # mean k3 estimate over trained tokens (0 without a reference)
    clip_fraction: float  # trained tokens whose ratio was clipped in the direction that matters
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    tokens: int
    # The sampler/trainer mismatch over trained tokens, before the step: mean |r - 1|, and the k3 estimate of
    # KL(mu || pi), r - 1 - log r, for the sampler's mu (whose samples these are) and the trainer's pi.
    mismatch_abs: float = 0.0
    mismatch_kl: float = 0.0


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = ref - logp."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: Aggregation) -> torch.Tensor:
    """Reduce per-token `values` [B, T] over the trained tokens `mask` [B, T]."""
    weights = mask.to(values.dtype)
    if how == "token_mean":
        return (values * weights).sum() / weights.sum().clamp(min=1.0)
    if how == "sequence_mean":
        per_sequence = (values * weights).sum(dim=1)
        counts = weights.sum(dim=1)
        present = counts > 0
        if not bool(present.any()):
            return values.new_zeros(())
        return (per_sequence[present] / counts[present]).mean()
    raise ValueError(f"unknown aggregation {how!r}: token_mean or sequence_mean")


def policy_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    aggregation: Aggregation = "token_mean",
    max_ratio: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO loss (to minimise) for one batch and its diagnostics.

    `logprobs` [B, T]: the policy's log-probs of the sampled tokens, with gradient; `sampler_logprobs`
    [B, T]: what the inference worker recorded; `advantages` [B]; `mask` [B, T]: tokens trained on;
    `ref_logprobs` [B, T]: the reference model's, required when `kl_coef` > 0; `max_ratio`: the dual clip
    (Ye et al., 2020) for negative advantages, so a token whose ratio grew large (a stale episode, a drifting
    policy) costs at most `max_ratio * |A|` instead of an unbounded amount."""
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs the reference model's log-probs")
    trained = mask.bool()
    ratio = torch.exp(logprobs - sampler_logprobs)
    adv = advantages.unsqueeze(1).to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if max_ratio is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -max_ratio * adv), per_token)
    kl = kl_k3(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(per_token)
    total = per_token + kl_coef * kl if kl_coef > 0 else per_token
    loss = aggregate(total, trained, aggregation)
    with torch.no_grad():
        was_clipped = ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low))
        count = int(trained.sum())
        picked = ratio[trained] if count else ratio.new_ones(1)
        # In float64: for a close sampler the KL is about (r - 1)^2 / 2, below float32's resolution near 1.
        log_ratio = (logprobs - sampler_logprobs)[trained].double() if count else ratio.new_zeros(1).double()
        stats = LossStats(
            loss=float(loss),
            policy_loss=float(aggregate(per_token, trained, aggregation)),
            kl=float(aggregate(kl, trained, "token_mean")),
            clip_fraction=float(was_clipped[trained].float().mean()) if count else 0.0,
            ratio_mean=float(picked.mean()),
            ratio_min=float(picked.min()),
            ratio_max=float(picked.max()),
            tokens=count,
            mismatch_abs=float((picked - 1.0).abs().mean()),
            mismatch_kl=float(mismatch_kl(log_ratio).mean()),
        )
    return loss, stats


def mismatch_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi) from tokens sampled by mu, with `log_ratio` = log pi - log mu:
    r - 1 - log r for r = pi / mu. Non-negative, and unbiased for the KL under mu's samples."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, T] of `tokens` [B, T] under `logits` [B, T, V] scaled by the sampling temperature, the
    way the inference worker scaled them (temperature 0, greedy, is scored at temperature 1)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> float:
    """Mean entropy (nats) of the sampling distributions at the trained positions (tokens a truncation
    dropped, at -inf, count 0)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    per_token = -torch.where(logp.isfinite(), logp.exp() * logp, 0.0).sum(dim=-1)
    trained = mask.bool()
    return float(per_token[trained].mean()) if bool(trained.any()) else 0.0


@dataclass(frozen=True)
class Staleness:
    lag: int  # weight versions between the trace's oldest turn and the policy being trained
    used: bool


def staleness(trace_version: int, policy_version: int, max_staleness: int) -> Staleness:
    """Whether a trace sampled by weights `trace_version` trains the policy at `policy_version`."""
    lag = policy_version - trace_version
    if lag < 0:
        raise ValueError(f"a trace from version {trace_version} is newer than the policy {policy_version}")
    return Staleness(lag, lag <= max_staleness)


def staleness_counts(lags: Sequence[Staleness]) -> dict[str, int]:
    """on_policy (lag 0), corrected (used with lag > 0, importance-corrected), dropped."""
    return {
        "on_policy": sum(1 for s in lags if s.used and s.lag == 0),
        "corrected": sum(1 for s in lags if s.used and s.lag > 0),
        "dropped": sum(1 for s in lags if not s.used),
    }


def finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
