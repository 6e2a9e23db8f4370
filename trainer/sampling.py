"""The sampling distribution, defined once: what the torch engine samples from and what the trainer scores.

A token's log-prob in a trace is the one of the distribution it was drawn from: the logits divided by the
temperature, then three truncations, each setting the logits of the tokens it drops to -inf before the
renormalising softmax:

1. `min_p`: drop every token whose probability is below `min_p` times the most likely token's;
2. `top_k`: keep the `top_k` largest logits (ties with the k-th kept);
3. `top_p`: of what remains, keep the smallest prefix by descending probability whose mass reaches `top_p`
   (a token is dropped when the mass before it already reaches `top_p`; the most likely always stays).

This is vLLM's order (min-p among its logits processors, then top-k and top-p together) and its rules,
except that vLLM's top-p boundary is computed in ascending order, so a token at the exact boundary can
fall on the other side. The trainer therefore always keeps the token that was sampled (`keep`): the ratio
of a token near the boundary stays finite and close to 1 instead of becoming 0 with a NaN gradient.

Scoring under the truncated distribution is what makes the on-policy ratio 1 at top_p < 1: against the
full distribution it would be the kept mass (0.7 at top_p 0.7), and the clip would cut half the tokens.
Truncation costs a sort over the vocabulary per scored position, so it runs only where a turn asked for it.
"""

from __future__ import annotations

import math

import torch


def truncates(top_k: int, top_p: float, min_p: float) -> bool:
    """Whether these settings drop any token at all."""
    return top_k > 0 or top_p < 1 or min_p > 0


@torch.no_grad()
def dropped(
    scaled: torch.Tensor,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """A bool mask like `scaled` [..., V] (logits already divided by the temperature): True where the token
    is outside the sampling set. `keep` [...] names one token per position that stays whatever."""
    scaled = scaled.detach().float()
    drop = torch.zeros_like(scaled, dtype=torch.bool)
    if min_p > 0:
        probs = torch.softmax(scaled, dim=-1)
        drop |= probs < min_p * probs.amax(dim=-1, keepdim=True)
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        drop |= scaled < kth
    if top_p < 1:
        remaining = scaled.masked_fill(drop, -math.inf)
        ordered, order = remaining.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        beyond = (probs.cumsum(dim=-1) - probs) >= top_p
        beyond[..., 0] = False
        drop |= torch.zeros_like(beyond).scatter(-1, order, beyond)
    if keep is not None:
        drop.scatter_(-1, keep.unsqueeze(-1), False)
    return drop


def truncated(
    scaled: torch.Tensor,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """`scaled` with the tokens outside the sampling set at -inf (differentiable in the kept logits)."""
    if not truncates(top_k, top_p, min_p):
        return scaled
    return scaled.masked_fill(dropped(scaled, top_k, top_p, min_p, keep), -math.inf)


def truncated_rows(scaled: torch.Tensor, targets: torch.Tensor, truncation: torch.Tensor) -> torch.Tensor:
    """`scaled` [N, V] with each row truncated by its own settings, `truncation` [N, 3] (top_k, top_p,
    min_p), keeping each row's target [N]; rows that share settings are truncated together."""
    drop = torch.zeros_like(scaled, dtype=torch.bool)
    for setting in torch.unique(truncation.detach().cpu(), dim=0):
        top_k, top_p, min_p = int(setting[0]), float(setting[1]), float(setting[2])
        if not truncates(top_k, top_p, min_p):
            continue
        rows = (truncation == setting.to(truncation.device)).all(dim=-1)
        drop[rows] = dropped(scaled[rows], top_k, top_p, min_p, keep=targets[rows])
    return scaled.masked_fill(drop, -math.inf)
