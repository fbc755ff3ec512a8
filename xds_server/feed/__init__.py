"""The relay's routing feed (docs/DESIGN.md section 9): a reader of the published result, at the
same point in the flow as Envoy.

:mod:`~xds_server.feed.events` turns each publish into the nodes whose routing changed
(:class:`RoutingChange`, fanned out by a :class:`RoutingNotifier`); :mod:`~xds_server.feed.service`
serves them as the ``sentinel.routing.v1.RoutingFeed/Watch`` gRPC stream (:class:`RoutingFeed`),
a full snapshot first and changes after.
"""
from xds_server.feed.events import RoutingChange, RoutingListener, RoutingNotifier
from xds_server.feed.service import DEFAULT_QUEUE_LIMIT, RoutingFeed

__all__ = ["DEFAULT_QUEUE_LIMIT", "RoutingChange", "RoutingFeed", "RoutingListener", "RoutingNotifier"]
