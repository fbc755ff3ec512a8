"""Certificates watched: :class:`CertWatch` names each certificate file in use by role and gives
``<prefix>_tls_certificate_expiry_seconds{role,file}`` and ``..._expiry_days`` (negative: expired),
a warning line per file at most hourly within ``window_s`` of its end, and :meth:`CertWatch.reasons`
for ``/readyz``. Files are re-read when they change (rotation). Expiry is read by
:func:`xds_server.process.certs.pem_not_after`.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily

from xds_server.process.certs import iso_utc, pem_not_after

__all__ = ["CertWatch"]

log = logging.getLogger(__name__)

#: A warning line per certificate file at most this often (s) while it is within the window.
WARN_INTERVAL_S = 3600.0


class CertWatch:
    """Certificate files in use by role (``add(role, path)``), re-read when they change.
    ``window_s``: within this much of expiry a file warns and :meth:`reasons` names it (s);
    ``labels``: constant labels of every sample (the agent's ``node``)."""

    def __init__(self, window_s: float, *, prefix: str = "sentinel", labels: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.prefix, self.labels = window_s, prefix, dict(labels or {})
        self._clock, self._mono = clock, monotonic
        self._files: dict[tuple[str, str], tuple[tuple[int, int], float | None, str]] = {}
        self._warned: dict[str, float] = {}

    def add(self, role: str, path: str | None) -> None:
        """Watch ``path`` (nothing for None) under ``role`` (``xds_server``, ``xds_client_ca``,
        ``agents_client``, ``admin_server``, ...)."""
        if path:
            self._files[(role, path)] = ((-1, -1), None, "")

    def _read(self) -> list[tuple[str, str, float | None, str]]:
        out = []
        for (role, path), (sig, not_after, err) in list(self._files.items()):
            try:
                st = os.stat(path)
                now_sig = (st.st_ino, st.st_mtime_ns)
            except OSError as e:
                now_sig, not_after, err = (-2, -2), None, f"cannot read: {e.strerror}"
            if now_sig != sig and now_sig != (-2, -2):
                try:
                    with open(path, "rb") as f:
                        not_after, err = pem_not_after(f.read()), ""
                except (OSError, ValueError) as e:
                    not_after, err = None, str(e)
            self._files[(role, path)] = (now_sig, not_after, err)
            out.append((role, path, not_after, err))
        return out

    def reasons(self) -> list[str]:
        """One reason per certificate expired or within the window (for ``/readyz``), and a
        warning line per such file at most once per :data:`WARN_INTERVAL_S`."""
        now, out = self._clock(), []
        for role, path, not_after, _err in self._read():
            if not_after is None or not_after - now > self.window_s:
                continue
            left = not_after - now
            why = (f"certificate {path} ({role}) expired at {iso_utc(not_after)}" if left <= 0 else
                   f"certificate {path} ({role}) expires in {left / 86400:.1f} days ({iso_utc(not_after)})")
            out.append(why)
            last = self._warned.get(path)
            if last is None or self._mono() - last >= WARN_INTERVAL_S:
                self._warned[path] = self._mono()
                log.warning("TLS: %s: renew it (warning window %.1f days)", why, self.window_s / 86400)
        return out

    def metric_families(self) -> Iterator[GaugeMetricFamily]:
        """Seconds and days to expiry of each watched certificate (negative: expired)."""
        now, names = self._clock(), list(self.labels)
        const = [self.labels[n] for n in names]
        secs = GaugeMetricFamily(f"{self.prefix}_tls_certificate_expiry_seconds", "seconds until the "
                                 "certificate file's earliest notAfter (negative: expired)",
                                 labels=[*names, "role", "file"])
        days = GaugeMetricFamily(f"{self.prefix}_tls_certificate_expiry_days", "days until the "
                                 "certificate file's earliest notAfter (negative: expired)",
                                 labels=[*names, "role", "file"])
        for role, path, not_after, _err in self._read():
            if not_after is not None:
                secs.add_metric([*const, role, path], not_after - now)
                days.add_metric([*const, role, path], (not_after - now) / 86400)
        yield secs
        yield days
