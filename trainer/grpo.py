"""GRPO as small pure functions: advantages, the clipped policy objective, the KL penalty, loss aggregation,
staleness decisions and the diagnostics a run logs. No I/O, no model: tensors in, tensors out, so every
formula is tested on CPU against values computed by hand (tests/trainer/test_grpo.py).

Shapes: B sequences (completions), T completion positions (right-padded), G completions per group.

- `group_advantages(rewards)`: reward minus its group's mean, optionally divided by the group's standard
  deviation (sample std, as TRL and the DeepSeekMath paper use), never by less than `std_floor`. A group
  whose rewards are all equal carries no signal: its advantages are 0 and `GroupStats.zero_variance`
  counts it.
- `policy_loss(...)`: per token, -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) with the importance
  ratio r = exp(logp - sampler_logp) against the log-probs the inference worker recorded (or, at the
  sequence level as in GSPO, the geometric mean of a sequence's token ratios), plus `kl_coef` times the k3
  estimator of KL(policy || reference), exp(ref - logp) - (ref - logp) - 1, which is non-negative and
  unbiased for the KL under samples from the policy. A position whose sampler log-prob is NaN or infinite
  is not trained on and cannot reach the loss.
- `token_weights(...)` / `aggregate(...)`: "token_mean" (every trained token weighs the same across the
  batch), "sequence_mean" (each sequence's mean over its trained tokens, then the mean over sequences) or
  "constant" (the sum over trained tokens divided by a constant, tokens per completion times the batch's
  completions: Dr. GRPO). The loss is the sum of per-token values times these weights, so a batch split
  into micro-batches adds up to the whole batch's loss and gradient.
- `staleness(...)`: how many weight versions behind a trace is, and whether it is used or dropped under
  `max_staleness`; used stale traces are importance-corrected by the same ratio r, and their tokens with a
  negative advantage are dual-clipped at `max_ratio`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tandem_jobs.config import STD_FLOOR

Aggregation = Literal["token_mean", "sequence_mean", "constant"]
RatioLevel = Literal["token", "sequence"]


@dataclass(frozen=True)
class GroupStats:
    reward_mean: float
    reward_std: float
    zero_variance: int  # groups whose rewards were all equal (no learning signal)
    groups: int


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    std_floor: float = STD_FLOOR,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, GroupStats]:
    """Advantages for `rewards` [B] laid out group after group (B = groups x group_size). With
    `normalize_std` each group is divided by max(its std, `std_floor`), so rewards that differ by less than
    the floor make advantages below 1 instead of +-1; a group whose std is at most `eps` counts as flat."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if std_floor < 0:
        raise ValueError(f"std_floor must be at least 0, not {std_floor}")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    spread = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
    flat = spread.squeeze(1) <= eps
    if normalize_std:
        divisor = torch.where(spread > eps, spread.clamp(min=std_floor), torch.ones_like(spread))
        centred = centred / divisor
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


def token_weights(
    mask: torch.Tensor, how: Aggregation, *, constant_tokens: int | None = None
) -> torch.Tensor:
    """Per-token weights [B, T] (zero off `mask`) such that the sum of per-token values times them is the
    batch's loss under `how`. Computed once for a whole batch, they let each micro-batch's share of the loss
    be its own tokens' weighted sum. "constant" divides by `constant_tokens` x B (every completion of the
    batch counts, trained or not), whatever the completions' lengths."""
    weights = mask.to(torch.float32)
    if how == "token_mean":
        return weights / weights.sum().clamp(min=1.0)
    if how == "sequence_mean":
        counts = weights.sum(dim=1, keepdim=True)
        sequences = (counts > 0).sum().clamp(min=1)
        return weights / (counts.clamp(min=1.0) * sequences)
    if how == "constant":
        if constant_tokens is None or constant_tokens < 1:
            raise ValueError(f"the constant aggregation needs constant_tokens >= 1, not {constant_tokens}")
        return weights / float(constant_tokens * max(mask.shape[0], 1))
    raise ValueError(f"unknown aggregation {how!r}: token_mean, sequence_mean or constant")


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, how: Aggregation, *, constant_tokens: int | None = None
) -> torch.Tensor:
    """Reduce per-token `values` [B, T] over the trained tokens `mask` [B, T]."""
    trained = mask.bool()
    weights = token_weights(trained, how, constant_tokens=constant_tokens).to(values.dtype)
    return (torch.where(trained, values, torch.zeros_like(values)) * weights).sum()


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
    constant_tokens: int | None = None,
    max_ratio: float | None = None,
    lagging: torch.Tensor | None = None,
    ratio_level: RatioLevel = "token",
    weights: torch.Tensor | None = None,
    decoupled: bool = False,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO loss (to minimise) for one batch and its diagnostics.

    `logprobs` [B, T]: the policy's log-probs of the sampled tokens, with gradient; `sampler_logprobs`
    [B, T]: what the inference worker recorded; `advantages` [B]; `mask` [B, T]: tokens trained on (a
    position whose sampler log-prob is not finite is dropped from it); `ref_logprobs` [B, T]: the reference
    model's, required when `kl_coef` > 0.

    `ratio_level` "sequence" (GSPO, Zheng et al., 2025) replaces each token's ratio by its sequence's,
    exp(mean over the sequence's trained tokens of logp - sampler_logp), clipped at the sequence level.
    `max_ratio`: the dual clip (Ye et al., 2020) for negative advantages, so a token whose ratio grew large
    costs at most `max_ratio * |A|` instead of an unbounded amount; it applies to the sequences `lagging`
    [B] marks (those sampled by older weights than the policy's), to every sequence when `lagging` is None.
    `weights` [B, T]: the batch's `token_weights` when this is a micro-batch of it; None computes them from
    the mask with `aggregation` (and `constant_tokens` for "constant").

    `decoupled` (the decoupled objective: Hilton et al., 2022; AReaL, Fu et al., 2025) changes the loss of
    the `lagging` sequences: their ratio is taken to the weights being trained (the proximal policy, which
    with one optimizer step a batch is the policy itself, so the ratio is 1 with the policy's gradient) and
    clipped around them, and the gap to the sampler is an importance weight exp(logp - sampler_logp), without
    gradient, truncated at `max_ratio` (2 when None); the dual clip does not apply to them."""
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs the reference model's log-probs")
    trained = mask.bool() & torch.isfinite(sampler_logprobs)
    zeros = torch.zeros_like(logprobs)
    # Untrained positions get a log-ratio of exactly 0 and no path from a NaN to the gradient.
    log_ratio = torch.where(trained, logprobs - torch.where(trained, sampler_logprobs, zeros), zeros)
    if ratio_level == "sequence":
        counts = trained.sum(dim=1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / counts).expand_as(log_ratio)
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r}: token or sequence")
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1).to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    lag = lagging.bool().unsqueeze(1) if lagging is not None else torch.ones_like(trained)
    if max_ratio is not None:
        capped = torch.where(adv < 0, torch.minimum(per_token, -max_ratio * adv), per_token)
        per_token = torch.where(lag if not decoupled else torch.zeros_like(lag), capped, per_token)
    if decoupled:
        proximal = torch.exp(logprobs - logprobs.detach())  # 1, with the policy's gradient
        behaviour = torch.exp(log_ratio.detach()).clamp(max=max_ratio if max_ratio is not None else 2.0)
        surrogate = torch.minimum(
            proximal * adv, torch.clamp(proximal, 1.0 - clip_low, 1.0 + clip_high) * adv
        )
        per_token = torch.where(lag, -behaviour * surrogate, per_token)
    kl = zeros  # and 0 off the trained positions, whatever the reference holds there
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, torch.where(trained, ref_logprobs, logprobs.detach()))
    total = per_token + kl_coef * kl if kl_coef > 0 else per_token
    if weights is None:
        weights = token_weights(trained, aggregation, constant_tokens=constant_tokens)
    weights = weights.to(logprobs.dtype)
    loss = (torch.where(trained, total, zeros) * weights).sum()
    with torch.no_grad():
        was_clipped = ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low))
        count = int(trained.sum())
        picked = ratio[trained] if count else ratio.new_ones(1)
        # In float64: for a close sampler the KL is about (r - 1)^2 / 2, below float32's resolution near 1.
        log_ratio = (logprobs - sampler_logprobs)[trained].double() if count else ratio.new_zeros(1).double()
        stats = LossStats(
            loss=float(loss),
            policy_loss=float((torch.where(trained, per_token, zeros) * weights).sum()),
            kl=float(kl[trained].mean()) if count else 0.0,
            clip_fraction=float(was_clipped[trained].float().mean()) if count else 0.0,
            ratio_mean=float(picked.mean()),
            ratio_min=float(picked.min()),
            ratio_max=float(picked.max()),
            tokens=count,
            # Token by token, whatever `ratio_level`: the sampler's and the trainer's numbers for each token.
            mismatch_abs=float((torch.exp(log_ratio) - 1.0).abs().mean()),
            mismatch_kl=float(mismatch_kl(log_ratio).mean()),
        )
    return loss, stats


def mismatch_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi) from tokens sampled by mu, with `log_ratio` = log pi - log mu:
    r - 1 - log r for r = pi / mu. Non-negative, and unbiased for the KL under mu's samples."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


def combine(parts: Sequence[LossStats]) -> LossStats:
    """A batch's statistics from its micro-batches': their losses already carry the batch's weights, so
    they add; the means over tokens weigh each part by its trained tokens."""
    tokens = sum(p.tokens for p in parts)
    present = [p for p in parts if p.tokens]

    def mean(name: str) -> float:
        return sum(getattr(p, name) * p.tokens for p in present) / tokens if tokens else 0.0

    return LossStats(
        loss=sum(p.loss for p in parts),
        policy_loss=sum(p.policy_loss for p in parts),
        kl=mean("kl"),
        clip_fraction=mean("clip_fraction"),
        ratio_mean=mean("ratio_mean") if tokens else 1.0,
        ratio_min=min((p.ratio_min for p in present), default=1.0),
        ratio_max=max((p.ratio_max for p in present), default=1.0),
        tokens=tokens,
        mismatch_abs=mean("mismatch_abs"),
        mismatch_kl=mean("mismatch_kl"),
    )


def drop_non_finite(
    sampler_logprobs: Sequence[float], mask: Sequence[bool]
) -> tuple[list[float], list[bool], int]:
    """A turn's sampler log-probs and loss mask with every NaN or infinite log-prob replaced by 0.0 and its
    position taken out of the mask, and how many trained positions that dropped (masked ones change
    nothing: they were not trained on)."""
    values: list[float] = []
    kept: list[bool] = []
    dropped = 0
    for index, value in enumerate(sampler_logprobs):
        trained = bool(mask[index]) if index < len(mask) else False
        if finite(value):
            values.append(value)
            kept.append(trained)
        else:
            values.append(0.0)
            kept.append(False)
            dropped += trained
    kept.extend(bool(m) for m in mask[len(kept) :])
    return values, kept, dropped


def _log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log_softmax of `logits` [..., V] in float32, divided by the temperature (a number, or one per row);
    temperature 0 (greedy) is scored at 1."""
    if isinstance(temperature, torch.Tensor):
        divisor = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
        return torch.log_softmax(logits.float() / divisor.unsqueeze(-1), dim=-1)
    return torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


def scored_tokens(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `tokens` [...] under `logits` [..., V] at the sampling temperature (a number, or one per
    token), the way the inference worker scaled them, and the entropy (nats, without gradient) of each of
    those distributions."""
    logp = _log_softmax(logits, temperature)
    with torch.no_grad():
        entropies = _entropies(logp)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropies


def _entropies(logp: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each distribution of `logp` [..., V]; tokens a truncation dropped (at -inf) count 0."""
    return -torch.where(logp.isfinite(), logp.exp() * logp, 0.0).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, T] of `tokens` [B, T] under `logits` [B, T, V] scaled by the sampling temperature."""
    return _log_softmax(logits, temperature).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> float:
    """Mean entropy (nats) of the sampling distributions at the trained positions (tokens a truncation
    dropped, at -inf, count 0)."""
    with torch.no_grad():
        per_token = _entropies(_log_softmax(logits, temperature))
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
