"""A fake monotonic clock for pure logic that takes the time as an argument or a clock callable."""
from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """A monotonic clock that moves only when told to.

    Call it (``clock()``) or read :attr:`now` for the current time in seconds; pass
    ``clock`` wherever a ``Callable[[], float]`` such as ``time.monotonic`` is expected.

    Args:
        start_s: the initial time, in seconds.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self.now = float(start_s)

    def __call__(self) -> float:
        return self.now

    def advance(self, dt_s: float) -> float:
        """Move forward by ``dt_s`` seconds and return the new time. Raises ValueError if
        ``dt_s`` is negative (a monotonic clock never goes back)."""
        if dt_s < 0:
            raise ValueError(f"dt_s must be >= 0 (a monotonic clock never goes back): {dt_s}")
        self.now += dt_s
        return self.now

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now!r})"
