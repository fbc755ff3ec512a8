"""Per-stream request budget: a token bucket over request bytes that may be overdrawn once.

Pure: the caller passes the time. The ADS shell asks :meth:`RequestBudget.wait_s` before it
decodes a request and sleeps that long first (the stream is not read meanwhile, so HTTP/2 flow
control holds the client back), then :meth:`RequestBudget.charge` s the request. One request is
always admitted while the bucket is not overdrawn, whatever its size (a reconnect that names
every resource is served at once); the next waits until the debt is paid back.

Shape::

    b = RequestBudget(rate_bytes_per_s=1 << 20, burst_bytes=16 << 20, min_cost_bytes=1024, now_s=0.0)
    b.wait_s(now_s)           # -> 0.0 when a request may be processed now, else seconds to wait
    b.charge(nbytes, now_s)   # take max(nbytes, min_cost_bytes) from the bucket
"""
from __future__ import annotations

__all__ = ["RequestBudget"]


class RequestBudget:
    """Token bucket of ``burst_bytes`` (> 0) refilled at ``rate_bytes_per_s`` (> 0); each request
    costs ``max(size, min_cost_bytes)`` (>= 0). Starts full at ``now_s``. Raises ValueError for
    out-of-range parameters. Times are seconds on any monotonic clock."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float, min_cost_bytes: float, now_s: float) -> None:
        if rate_bytes_per_s <= 0 or burst_bytes <= 0 or min_cost_bytes < 0:
            raise ValueError(f"bad budget: rate {rate_bytes_per_s}, burst {burst_bytes}, min cost {min_cost_bytes}")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self.min_cost = float(min_cost_bytes)
        self.tokens = self.burst
        self._at = now_s

    def _refill(self, now_s: float) -> None:
        if now_s > self._at:
            self.tokens = min(self.burst, self.tokens + (now_s - self._at) * self.rate)
            self._at = now_s

    def wait_s(self, now_s: float) -> float:
        """Seconds until the bucket is no longer overdrawn (0.0: a request may be processed now)."""
        self._refill(now_s)
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def charge(self, nbytes: int, now_s: float) -> None:
        """Take one request of ``nbytes`` from the bucket (may overdraw it)."""
        self._refill(now_s)
        self.tokens -= max(float(nbytes), self.min_cost)
