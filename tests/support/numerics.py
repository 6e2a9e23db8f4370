"""Comparisons of floating-point results that were computed in a different order or with other kernels.

Two fp32 computations of the same gradient by different routes (two ranks' all-reduced gradients against
one process's backward; a batch of one sequence against a padded batch of two, for which the CPU's matrix
kernels pick other blockings and vector widths) agree only to fp32's precision *relative to the terms that
were summed*, not to an absolute 1e-8. An element whose terms nearly cancel keeps an error of the order of
its terms, which can be far above its own value. So the tolerance here is relative to the scale of the
whole result (its largest magnitude). A real error, such as a rank's loss weighted 1.0 instead of 0.6 or
off by a tenth, moves the result by percents of that scale; the comparison's own test shows it fails then.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Seen on one machine's CPU kernels: two ranks' gradient differed from one process's by 5e-5 of the
# gradient's scale (9.7e-8 of 1.8e-3, at an element whose terms cancel). 1e-3 of the scale leaves a margin
# of 20 over that and is still 30 times below a shard whose weight is off by a tenth.
FP32_REORDER_RTOL = 1e-3


def scale_of(tensors: Iterable[torch.Tensor]) -> float:
    """The largest magnitude over every element of `tensors` (0.0 when they are all zero or empty)."""
    return max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)


def assert_close_at_scale(
    got: list[torch.Tensor], want: list[torch.Tensor], rtol: float = FP32_REORDER_RTOL, what: str = "tensor"
) -> None:
    """Each of `got` equals the same-place tensor of `want` elementwise within `rtol` of its own value
    plus `rtol` of the largest magnitude in all of `want`: what a different summation order allows."""
    assert len(got) == len(want), f"{len(got)} tensors against {len(want)}"
    atol = rtol * scale_of(want)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, i=index: f"{what} {i}: {m}")
