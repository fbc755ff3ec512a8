"""Control-plane targets for dial-in (:mod:`node_probe.dialer`): plain values, no gRPC, so the config
(:mod:`node_probe.config`) validates with them.

- :func:`split_target` -> (host, port) of ``HOST:PORT`` (an IPv6 literal in brackets), ValueError
  saying what is wrong; :func:`is_ip_literal`, :func:`join_host_port` (its inverse).
- :func:`backoff_s`: the re-dial delay after consecutive failures (none for the first, then full
  jitter doubling from 50 ms to 5 s); :func:`failures_after`: the count after a stream ended (a
  stream held :data:`STABLE_S` starts it over).
- :class:`FailureLog`: one warning at the first failure of a run, then at most one a minute with
  the count.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import re
import time
from collections.abc import Callable

__all__ = ["STABLE_S", "FailureLog", "backoff_s", "failures_after", "is_ip_literal", "join_host_port",
           "split_target"]

log = logging.getLogger("node_probe.dialer")

_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?")
LOG_EVERY_S = 60.0
"""While failures go on, a line at most this often (s)."""
STABLE_S = 10.0
"""A stream the control plane held this long (s, from its first message) starts the back-off over
(ours, as the control plane's probe workers' restarts: one that lived 10 s is not dying in a loop;
client-go's reflector waits 2 minutes). Seen at 2,000 agents on a starved control plane: ~1,300
dials a second, streams dropped seconds after they opened (there most ended before any message,
which the earlier rule already backed off from; benchmarks/RESULTS.md)."""


def split_target(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 literal in brackets: ``[::1]:18000``) -> (host, port), the host without
    brackets. Raises ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"must be HOST:PORT with a port 1..65535: {text!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1].split("%", 1)[0])
        except ValueError:
            raise ValueError(f"not an IPv6 address in brackets: {text!r}") from None
        return host[1:-1], int(port)
    if ":" in host:
        raise ValueError(f"an IPv6 address goes in brackets, [ADDR]:PORT: {text!r}")
    if not _HOST.fullmatch(host) or len(host) > 253:
        raise ValueError(f"not a host name or IP address: {text!r}")
    return host, int(port)


def is_ip_literal(host: str) -> bool:
    """True for an IPv4 or IPv6 address (without brackets; an IPv6 zone allowed)."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def join_host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def backoff_s(failures: int, base_s: float = 0.05, max_s: float = 5.0,
              rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before a re-dial after ``failures`` consecutive stream ends without a message:
    0 for the first, then full jitter, uniform in [0, min(max_s, base_s * 2**(failures - 2))]."""
    if failures <= 1:
        return 0.0
    return rng() * min(max_s, base_s * 2.0 ** min(failures - 2, 40))


def failures_after(failures: int, held_s: float | None, stable_s: float = STABLE_S) -> int:
    """The consecutive failures (:func:`backoff_s`'s count) after a stream ended that the control
    plane held ``held_s`` seconds from its first message (None: it sent none). Held at least
    ``stable_s``: 1, the next dial at once. Shorter, or never up: one more than ``failures``, so
    an agent whose streams keep being dropped soon after they open (an overloaded control plane,
    a replica dropping every stream) dials again later and later instead of in step with the
    rest of the fleet."""
    return 1 if held_s is not None and held_s >= stable_s else failures + 1


class FailureLog:
    """Warnings about one thing that fails again and again (``what``: a control plane, its address):
    one at the first failure of a run, then at most one per :data:`LOG_EVERY_S` with the count."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._logged_at = 0.0

    def failed(self, error: str) -> None:
        """Count one failure (``error``: why), logging as said above."""
        self.count += 1
        now = time.monotonic()
        if self.count == 1:
            log.warning("%s: %s (retrying with back-off; at most one line a minute while it fails)",
                        self.what, error)
            self._logged_at = now
        elif now - self._logged_at >= LOG_EVERY_S:
            log.warning("%s: %d failures in a row, the last: %s", self.what, self.count, error)
            self._logged_at = now

    def recovered(self) -> int:
        """End the run: the number of its failures (0: there was none)."""
        count, self.count = self.count, 0
        return count
