"""Decode an Envoy ``LoadStatsRequest`` (bytes) into the plain :class:`~xds_server.load.aggregate.Report`
the aggregator takes, bounded: a report naming more clusters or endpoints than allowed is refused
whole (:class:`ReportRefused`, naming the field and the limit), so a hostile client cannot make
the server build large structures. Client strings are clipped.
"""
from __future__ import annotations

from envoy.service.load_stats.v3 import lrs_pb2
from google.protobuf.message import DecodeError

from xds_server.load.aggregate import ClusterReport, Counts, EndpointReport, LocalityReport, Report
from xds_server.process.untrusted import clip

__all__ = ["ReportRefused", "decode_report", "decode_request"]

_TEXT_MAX = 256  # cluster names are <= 128 characters (config); localities are short


class ReportRefused(ValueError):
    """``reason``: ``undecodable`` or ``too_large``; the message names the field and the limit."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def decode_request(raw: bytes) -> lrs_pb2.LoadStatsRequest:
    """Parse one request; ReportRefused("undecodable") when it does not decode."""
    try:
        return lrs_pb2.LoadStatsRequest.FromString(raw)
    except DecodeError as e:
        raise ReportRefused("undecodable", f"undecodable LoadStatsRequest: {e}") from None


def decode_report(req: lrs_pb2.LoadStatsRequest, reporter: str, stream: int, *, max_clusters: int,
                  max_endpoints: int) -> Report:
    """The :class:`Report` of ``req`` (counts as sent; their sanity is the aggregator's job).
    Raises ReportRefused("too_large") over ``max_clusters`` cluster entries or ``max_endpoints``
    endpoint entries (all clusters)."""
    if len(req.cluster_stats) > max_clusters:
        raise ReportRefused("too_large", f"cluster_stats: {len(req.cluster_stats)} entries, at most "
                            f"{max_clusters} (lrs.max_clusters_per_report)")
    n_ep = sum(len(loc.upstream_endpoint_stats) for cs in req.cluster_stats for loc in cs.upstream_locality_stats)
    if n_ep > max_endpoints:
        raise ReportRefused("too_large", f"upstream_endpoint_stats: {n_ep} entries, at most "
                            f"{max_endpoints} (lrs.max_endpoints_per_report)")
    clusters = []
    for cs in req.cluster_stats:
        interval = None
        if cs.HasField("load_report_interval"):
            interval = cs.load_report_interval.seconds + cs.load_report_interval.nanos / 1e9
        locs = []
        for loc in cs.upstream_locality_stats:
            eps = tuple(
                EndpointReport(clip(ep.address.socket_address.address, _TEXT_MAX),
                               ep.address.socket_address.port_value,
                               Counts(ep.total_issued_requests, ep.total_successful_requests,
                                      ep.total_error_requests, ep.total_requests_in_progress))
                for ep in loc.upstream_endpoint_stats)
            key = (clip(loc.locality.region, _TEXT_MAX), clip(loc.locality.zone, _TEXT_MAX),
                   clip(loc.locality.sub_zone, _TEXT_MAX))
            locs.append(LocalityReport(key, loc.priority,
                                       Counts(loc.total_issued_requests, loc.total_successful_requests,
                                              loc.total_error_requests, loc.total_requests_in_progress), eps))
        clusters.append(ClusterReport(
            clip(cs.cluster_name, _TEXT_MAX), interval, tuple(locs), cs.total_dropped_requests,
            tuple((clip(d.category, _TEXT_MAX), d.dropped_count) for d in cs.dropped_requests)))
    return Report(reporter, stream, tuple(clusters))
