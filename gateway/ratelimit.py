"""Per-organization token buckets: `rate_per_s` sustained, `rate_burst` at once. A refused call learns how
long until one token is back (RESOURCE_EXHAUSTED / RATE_LIMITED with RetryInfo)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mesh.errors import R, ResourceExhausted

MAX_BUCKETS = 100_000  # full buckets are forgotten past this many callers; they start full anyway


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate_per_s
        self._burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, caller: str) -> None:
        """Spend one token of `caller`'s bucket or raise RATE_LIMITED with the wait until the next."""
        now = self._clock()
        bucket = self._buckets.get(caller)
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._forget_full(now)
            bucket = self._buckets[caller] = _Bucket(self._burst, now)
        bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.updated) * self._rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return
        wait = (1.0 - bucket.tokens) / self._rate
        raise ResourceExhausted(
            f"rate limit of {self._rate:g} calls/s (burst {self._burst:g}) exceeded; retry in {wait:.3f}s",
            reason=R.ERROR_REASON_RATE_LIMITED,
            retry_after_s=wait,
        )

    def _forget_full(self, now: float) -> None:
        for key in [
            k for k, b in self._buckets.items() if b.tokens + (now - b.updated) * self._rate >= self._burst
        ]:
            del self._buckets[key]
