"""The plain records of Envoy load reports (:mod:`xds_server.load.report` decodes into them,
:class:`~xds_server.load.aggregate.LoadAggregator` sums them) and the figures it answers with.
Counts are requests; intervals and windows seconds."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClusterReport", "Counts", "EndpointReport", "LocalityKey", "LocalityReport", "Report", "Traffic"]

LocalityKey = tuple[str, str, str]
"""(region, zone, sub_zone) as Envoy reports it."""


@dataclass(frozen=True)
class Counts:
    """One interval's counts (requests): issued, succeeded, errored; in_progress (a gauge)."""

    issued: int = 0
    succeeded: int = 0
    errored: int = 0
    in_progress: int = 0


@dataclass(frozen=True)
class EndpointReport:
    """One endpoint (``host``, ``port``) of a locality in one report."""

    host: str
    port: int
    counts: Counts


@dataclass(frozen=True)
class LocalityReport:
    locality: LocalityKey
    priority: int
    counts: Counts
    endpoints: tuple[EndpointReport, ...] = ()


@dataclass(frozen=True)
class ClusterReport:
    """One ``ClusterStats``: ``interval_s`` the measured ``load_report_interval`` (None: absent)."""

    cluster: str
    interval_s: float | None
    localities: tuple[LocalityReport, ...] = ()
    dropped_total: int = 0
    dropped: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Report:
    """One ``LoadStatsRequest`` from the Envoy ``reporter`` (its node id) on stream ``stream``."""

    reporter: str
    stream: int
    clusters: tuple[ClusterReport, ...] = ()


@dataclass(frozen=True)
class Traffic:
    """Real-traffic figures over a window (requests; ``rps`` per s over the measured span;
    ``success_ratio`` 0..1 of completed, None when none completed; ``reporters``: how many
    Envoys reported it; ``failing``: the node ids of those that reported errors, sorted)."""

    issued: int
    succeeded: int
    errored: int
    in_progress: int
    reporters: int
    window_s: float
    dropped: int = 0
    failing: tuple[str, ...] = ()

    @property
    def completed(self) -> int:
        return self.succeeded + self.errored

    @property
    def success_ratio(self) -> float | None:
        return self.succeeded / self.completed if self.completed else None

    @property
    def rps(self) -> float:
        return self.issued / self.window_s if self.window_s > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        ratio = self.success_ratio
        return {"issued": self.issued, "succeeded": self.succeeded, "errored": self.errored,
                "in_progress": self.in_progress, "dropped": self.dropped, "reporting_envoys": self.reporters,
                "window_s": round(self.window_s, 3), "rps": round(self.rps, 3),
                "success_ratio": None if ratio is None else round(ratio, 6)}
