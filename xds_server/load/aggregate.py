"""Pure aggregation of Envoy load reports (LRS) per node, locality and cluster, across every
reporting Envoy, over sliding windows. No I/O: inputs are decoded reports
(:mod:`xds_server.load.report`) and a monotonic time argument (s).

Envoy's reporting quirks (docs/xds_protocol.md section 6, measured on 1.40) and how they are met:

- each report carries the counts of the interval since the previous one (deltas, not totals):
  issued, succeeded and errored are summed; ``in_progress`` is a gauge (the requests open at the
  end of the interval), so only each Envoy's latest value counts, and not once it is stale;
- a locality (and its endpoints) is reported only when it issued requests in the interval: a node
  missing from a report had no traffic from that Envoy (zero), not an unknown;
- drops have no host: they are cluster-level only (``total_dropped_requests`` and per category);
- a cluster added mid-interval is reported from the next interval on (its first partial interval
  is lost by Envoy): nothing to correct here, the window starts at its first report;
- the reported ``load_report_interval`` is what Envoy measured, not what was asked: rates divide
  by the measured interval and never by ``interval_s``.

Reports are bucketed by arrival slot (``interval_s`` wide), so memory is bounded by nodes x
``retain_s / interval_s`` slots whatever the number of Envoys, plus one in-progress gauge per node
and reporting Envoy (reporters are at most the streams admitted, ``lrs.max_streams``).
"""
from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from xds_server.load.records import (  # the records this module sums, re-exported
    ClusterReport,
    Counts,
    EndpointReport,
    LocalityKey,
    LocalityReport,
    Report,
    Traffic,
)

__all__ = ["ClusterReport", "Counts", "EndpointReport", "LoadAggregator", "LocalityReport", "Report",
           "Traffic"]


@dataclass
class _Slot:
    slot: int
    issued: int = 0
    succeeded: int = 0
    errored: int = 0
    dropped: int = 0
    reporters: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)  # reporters whose counts here include errors


_NodeKey = tuple[str, str]          # (cluster, node id)
_LocKey = tuple[str, LocalityKey]   # (cluster, locality)
_K = TypeVar("_K")


class LoadAggregator:
    """Sums reports per node, locality and cluster (see module docstring).

    ``nodes``: cluster -> {(host, port): node id} (:meth:`set_nodes` on every config change);
    ``interval_s``: the slot width (the asked reporting interval, s); ``retain``: slots older are
    dropped (s); ``stale_after_s``: a reporter silent this long no longer counts (s);
    ``max_count``: a count above it in one report is absurd (the cluster entry is refused);
    ``min_gap_s``: a stream's report sooner than this after its previous one is a flood;
    ``max_categories``: drop categories kept per cluster (more are counted in the total only);
    ``max_localities``: localities kept per cluster (more: not shown as localities, counted
    ``too_many_localities``; their endpoints still count for their nodes).
    ``problems`` counts what was refused, by reason; ``totals`` the cumulative counts per node.
    """

    def __init__(self, nodes: Mapping[str, Mapping[tuple[str, int], str]], *, interval_s: float = 1.0,
                 retain_s: float = 60.0, stale_after_s: float = 3.0, max_count: int = 10_000_000,
                 min_gap_s: float = 0.5, max_categories: int = 16, max_localities: int = 256) -> None:
        self.interval_s = interval_s
        self.retain_s = retain_s
        self.stale_after_s = stale_after_s
        self.max_count = max_count
        self.min_gap_s = min_gap_s
        self.max_categories = max_categories
        self.max_localities = max_localities
        self.problems: Counter[str] = Counter()
        self.reports = 0
        self.ignored_clusters = 0  # entries of the bootstrap's own control-plane clusters
        self.totals: dict[_NodeKey, Counts] = {}
        self._nodes: dict[str, dict[tuple[str, int], str]] = {}
        self._by_node: dict[_NodeKey, deque[_Slot]] = {}
        self._by_locality: dict[_LocKey, deque[_Slot]] = {}
        self._drops: dict[tuple[str, str], deque[_Slot]] = {}  # (cluster, category); "" = total
        self._in_progress: dict[_NodeKey, dict[str, tuple[float, int]]] = {}
        self._last_report: dict[tuple[str, int], float] = {}
        self._measured: dict[str, float] = {}  # cluster -> last measured load_report_interval, s
        self._listing: dict[str, dict[str, float]] = {}  # cluster -> reporter -> last report naming it
        self._parent: dict[str, str] = {}  # request-class cluster -> the cluster it serves (lrs.shed.classes)
        self._by_reported: dict[str, deque[_Slot]] = {}  # each class cluster's own demand (issued, dropped)
        self.set_nodes(nodes)

    # -- input -------------------------------------------------------------------------------

    def set_nodes(self, nodes: Mapping[str, Mapping[tuple[str, int], str]],
                  aliases: Mapping[str, str] | None = None) -> None:
        """The clusters and nodes reports may name; figures of nodes no longer listed are dropped.
        ``aliases``: request-class cluster -> the cluster it serves: its reports count as that
        cluster's (nodes, localities, drops), and its own demand is kept apart (:meth:`demand`)."""
        self._nodes = {c: dict(m) for c, m in nodes.items()}
        self._parent = {a: p for a, p in (aliases or {}).items() if p in self._nodes}
        for rk in [k for k in self._by_reported if self._parent.get(k, k) not in self._nodes]:
            del self._by_reported[rk]
        known = {(c, n) for c, m in self._nodes.items() for n in m.values()}
        for d in (self._by_node, self._in_progress, self.totals):
            for k in [k for k in d if k not in known]:
                del d[k]
        for lk in [k for k in self._by_locality if k[0] not in self._nodes]:
            del self._by_locality[lk]
        for dk in [k for k in self._drops if k[0] not in self._nodes]:
            del self._drops[dk]
        for c in [c for c in self._listing if c not in self._nodes]:
            del self._listing[c]

    def forget_stream(self, reporter: str, stream: int) -> None:
        """A stream ended: its flood bookkeeping goes (its counts stay until they age out)."""
        self._last_report.pop((reporter, stream), None)

    def ingest(self, report: Report, now_s: float) -> list[str]:
        """Apply one report received at ``now_s`` (monotonic s). Returns the problems found (also
        counted in ``problems``): ``flood`` (nothing applied: the same reporter's previous report
        on the same stream came less than ``min_gap_s`` before; a peer replica's forwarded
        reports are keyed by the Envoy they name and the peer's stream, so a peer cannot flood
        for an Envoy either), and per cluster entry ``unknown_cluster``, ``absurd_count``,
        ``bad_interval`` (refused), ``unknown_endpoint`` (that endpoint skipped)."""
        found: list[str] = []
        key = (report.reporter, report.stream)
        last = self._last_report.get(key)
        if report.clusters and last is not None and now_s - last < self.min_gap_s:
            found.append("flood")
        else:
            if report.clusters:
                self._last_report[key] = now_s
                self.reports += 1
            for cr in report.clusters:
                found.extend(self._cluster(report.reporter, cr, now_s))
        self.problems.update(found)
        self.prune(now_s)
        return found

    def _cluster(self, reporter: str, cr: ClusterReport, now_s: float) -> list[str]:
        parent = self._parent.get(cr.cluster, cr.cluster)
        nodes = self._nodes.get(parent)
        if nodes is None:
            # send_all_clusters also reports the bootstrap's own static clusters (xds_cluster,
            # xds_<group>): expected, counted apart from bad input
            if cr.cluster == "xds_cluster" or cr.cluster.startswith("xds_"):
                self.ignored_clusters += 1
                return []
            return ["unknown_cluster"]
        if cr.interval_s is not None and (not math.isfinite(cr.interval_s) or cr.interval_s < 0
                                          or cr.interval_s > self.retain_s * 10):
            return ["bad_interval"]
        counts = [cr.dropped_total, *(n for _, n in cr.dropped)]
        for loc in cr.localities:
            counts.extend(_values(loc.counts))
            for ep in loc.endpoints:
                counts.extend(_values(ep.counts))
        if any(c < 0 or c > self.max_count for c in counts):
            return ["absurd_count"]
        if cr.interval_s is not None:
            self._measured[parent] = cr.interval_s
        self._listing.setdefault(parent, {})[reporter] = now_s
        slot = int(now_s // self.interval_s)
        found: list[str] = []
        if parent in self._parent.values():
            _add(self._by_reported, cr.cluster, slot, reporter,
                 Counts(sum(loc.counts.issued for loc in cr.localities)), cr.dropped_total)
        if cr.dropped_total:
            _add(self._drops, (parent, ""), slot, reporter, Counts(), cr.dropped_total)
        for category, n in cr.dropped:
            if (parent, category) not in self._drops and self._categories(parent) >= self.max_categories:
                found.append("too_many_categories")  # counted in the total only
                continue
            _add(self._drops, (parent, category), slot, reporter, Counts(), n)
        n_locs = sum(1 for k in self._by_locality if k[0] == parent)
        for loc in cr.localities:
            if (parent, loc.locality) in self._by_locality or n_locs < self.max_localities:
                n_locs += (parent, loc.locality) not in self._by_locality
                _add(self._by_locality, (parent, loc.locality), slot, reporter, loc.counts)
            elif "too_many_localities" not in found:
                found.append("too_many_localities")  # its endpoints still count below
            for ep in loc.endpoints:
                node = nodes.get((ep.host, ep.port))
                if node is None:
                    found.append("unknown_endpoint")
                    continue
                nk = (parent, node)
                _add(self._by_node, nk, slot, reporter, ep.counts)
                self._in_progress.setdefault(nk, {})[reporter] = (now_s, ep.counts.in_progress)
                t = self.totals.get(nk, Counts())
                self.totals[nk] = Counts(t.issued + ep.counts.issued, t.succeeded + ep.counts.succeeded,
                                         t.errored + ep.counts.errored)
        # a node this Envoy did not report had no request open from it at the end of the interval
        for node in nodes.values():
            gauges = self._in_progress.get((parent, node))
            if gauges is not None and reporter in gauges and gauges[reporter][0] != now_s:
                gauges[reporter] = (now_s, 0)
        return found

    def _categories(self, cluster: str) -> int:
        return sum(1 for c, cat in self._drops if c == cluster and cat)

    def prune(self, now_s: float) -> None:
        """Drop slots older than ``retain`` and gauges of reporters silent past ``retain``."""
        oldest = self._oldest(now_s)
        _prune(self._by_node, oldest)
        _prune(self._by_locality, oldest)
        _prune(self._drops, oldest)
        _prune(self._by_reported, oldest)
        for gk, gauges in list(self._in_progress.items()):
            for r in [r for r, (at, _) in gauges.items() if now_s - at > self.retain_s]:
                del gauges[r]
            if not gauges:
                del self._in_progress[gk]
        for sk in [k for k, at in self._last_report.items() if now_s - at > self.retain_s]:
            del self._last_report[sk]
        for listing in self._listing.values():
            for r in [r for r, at in listing.items() if now_s - at > self.retain_s]:
                del listing[r]

    # -- output ------------------------------------------------------------------------------

    def node(self, cluster: str, node_id: str, now_s: float, window_s: float) -> Traffic:
        """A node's figures over the last ``window_s`` (s) before ``now_s``."""
        return self._window(self._by_node.get((cluster, node_id)), now_s, window_s,
                            self._gauge((cluster, node_id), now_s))

    def locality(self, cluster: str, locality: LocalityKey, now_s: float, window_s: float) -> Traffic:
        return self._window(self._by_locality.get((cluster, locality)), now_s, window_s, 0)

    def localities(self, cluster: str) -> list[LocalityKey]:
        return sorted(k[1] for k in self._by_locality if k[0] == cluster)

    def cluster(self, cluster: str, now_s: float, window_s: float) -> Traffic:
        """A cluster's figures: the sum of its nodes, with its cluster-level drops."""
        nodes = self._nodes.get(cluster, {}).values()
        parts = [self.node(cluster, n, now_s, window_s) for n in nodes]
        drops = self._window(self._drops.get((cluster, "")), now_s, window_s, 0)
        reporters: set[str] = set()
        for n in nodes:
            reporters |= _reporters(self._by_node.get((cluster, n)), self._first(now_s, window_s))
        return Traffic(sum(p.issued for p in parts), sum(p.succeeded for p in parts),
                       sum(p.errored for p in parts), sum(p.in_progress for p in parts), len(reporters),
                       window_s, drops.dropped)

    def parent_of(self, name: str) -> str:
        """The cluster whose figures a report of Envoy cluster ``name`` counts in (itself, or the
        cluster a request-class cluster serves)."""
        return self._parent.get(name, name)

    def demand(self, name: str, now_s: float, window_s: float) -> Traffic:
        """One Envoy cluster's own issued and dropped requests over the window: a request-class
        cluster or a cluster that has classes (zeros for any other)."""
        return self._window(self._by_reported.get(name), now_s, window_s, 0)

    def drops(self, cluster: str, now_s: float, window_s: float) -> dict[str, int]:
        """Dropped requests per category over the window ("" = Envoy's total)."""
        return {cat: self._window(q, now_s, window_s, 0).dropped
                for (c, cat), q in sorted(self._drops.items()) if c == cluster}

    def measured_interval_s(self, cluster: str) -> float | None:
        """The last ``load_report_interval`` an Envoy reported for ``cluster`` (s)."""
        return self._measured.get(cluster)

    def listing(self, cluster: str, now_s: float) -> int:
        """Envoys whose reports within ``stale_after_s`` name ``cluster`` (Envoy counts a cluster's
        traffic only from the first report that names it: earlier traffic is not reported)."""
        return sum(1 for at in self._listing.get(cluster, {}).values() if now_s - at <= self.stale_after_s)

    def reporters(self, now_s: float) -> int:
        """Envoys that reported within ``stale_after_s``."""
        return len({r for (r, _), at in self._last_report.items() if now_s - at <= self.stale_after_s})

    def slot_count(self) -> int:
        """Slots held (all stores): what memory is bounded by."""
        return sum(len(q) for s in (self._by_node, self._by_locality, self._drops, self._by_reported)
                   for q in s.values())

    def _gauge(self, key: _NodeKey, now_s: float) -> int:
        return sum(n for at, n in self._in_progress.get(key, {}).values() if now_s - at <= self.stale_after_s)

    def _first(self, now_s: float, window_s: float) -> int:
        """The oldest slot a read of the last ``window_s`` (s) before ``now_s`` sums: none older
        than :meth:`prune` keeps, whether or not a report has pruned since (a read never sees
        figures past ``retain``)."""
        return max(int((now_s - window_s) // self.interval_s) + 1, self._oldest(now_s))

    def _oldest(self, now_s: float) -> int:
        """The oldest slot kept at ``now_s``: the one ``retain`` ago."""
        return int((now_s - self.retain_s) // self.interval_s)

    def _window(self, q: Iterable[_Slot] | None, now_s: float, window_s: float, in_progress: int) -> Traffic:
        first = self._first(now_s, window_s)
        issued = succeeded = errored = dropped = 0
        reporters: set[str] = set()
        failing: set[str] = set()
        for s in q or ():
            if s.slot >= first:
                issued += s.issued
                succeeded += s.succeeded
                errored += s.errored
                dropped += s.dropped
                reporters |= s.reporters
                failing |= s.failing
        return Traffic(issued, succeeded, errored, in_progress, len(reporters), window_s, dropped,
                       tuple(sorted(failing)))


def _values(c: Counts) -> tuple[int, int, int, int]:
    return c.issued, c.succeeded, c.errored, c.in_progress


def _reporters(q: Iterable[_Slot] | None, first: int) -> set[str]:
    out: set[str] = set()
    for s in q or ():
        if s.slot >= first:
            out |= s.reporters
    return out


def _prune(store: dict[_K, deque[_Slot]], oldest: int) -> None:
    for k in list(store):
        q = store[k]
        while q and q[0].slot < oldest:
            q.popleft()
        if not q:
            del store[k]


def _add(store: dict[_K, deque[_Slot]], key: _K, slot: int, reporter: str, c: Counts, dropped: int = 0) -> None:
    q = store.get(key)
    if q is None:
        q = store[key] = deque()
    if not q or q[-1].slot != slot:
        q.append(_Slot(slot))
    s = q[-1]
    s.issued += c.issued
    s.succeeded += c.succeeded
    s.errored += c.errored
    s.dropped += dropped
    s.reporters.add(reporter)
    if c.errored:
        s.failing.add(reporter)
