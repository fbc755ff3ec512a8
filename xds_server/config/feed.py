"""``feed:`` section: the routing feed (``sentinel.routing.v1.RoutingFeed/Watch``, served on the
ADS port, :mod:`xds_server.feed.service`) and who may read it.

The feed tells a subscriber every node's address, state and weight. Like the agents' plaintext
(:mod:`xds_server.config.tls`), serving that to unauthenticated clients off loopback must be
said: with ``tls.mode: plaintext`` and a non-loopback ``xds.listen`` the feed refuses every
Watch (PERMISSION_DENIED naming ``feed.plaintext``) unless ``feed.plaintext: true``. With
``tls.mode: mtls``, ``feed.allow_identities`` limits it to the listed client identities.
"""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, field_validator

from xds_server.config.base import parse_hostport
from xds_server.config.duration import Duration, PositiveDuration, at_most
from xds_server.config.renames import Moves, _Renaming
from xds_server.config.tls import check_patterns
from xds_server.process.dialing import is_loopback

__all__ = ["FeedConfig", "check_feed", "feed_plaintext_refusal"]



class FeedConfig(_Renaming):
    """The routing feed's bounds and access."""

    WHERE: ClassVar[str] = "feed"
    MOVED: ClassVar[Moves] = {
        "send_timeout_s": ("send_timeout", "s"),
    }

    #: Protection limits that rarely need changing (marked advanced in docs/config.md).
    ADVANCED: ClassVar[frozenset[str]] = frozenset({
        "max_subscribers", "queue_limit", "send_timeout"})

    max_subscribers: int = Field(
        512, ge=1, le=100_000,
        description="Watch streams open at once; one more is RESOURCE_EXHAUSTED (ours: one stream "
        "per relay worker process, 512 = 64 relays of 8 workers; each costs at most queue_limit "
        "queued changes and one update being written)",
    )
    send_timeout: Annotated[PositiveDuration, at_most("10m")] = Field(
        Duration.parse("10s"),
        description="an update may wait this long (s) for the subscriber to take it; a subscriber "
        "that does not (it stopped reading) is dropped: its queue freed, RESOURCE_EXHAUSTED queued "
        "for it, counted in sentinel_routing_feed_dropped_total{reason=\"deadline\"}. Its place "
        "under max_subscribers is freed when its connection ends (gRPC's keepalive closes one whose "
        "client reads nothing: xds.keepalive.time + xds.keepalive.timeout). Ours: a snapshot "
        "of 10,000 nodes is ~1 MB, a second on a slow link; a relay reads in milliseconds",
    )
    queue_limit: int = Field(
        1024, ge=1, le=1_000_000,
        description="node changes queued per subscriber; one further behind is dropped with "
        "RESOURCE_EXHAUSTED and gets a fresh snapshot on reconnect (ours: a full flap of a "
        "1,000-node fleet fits)",
    )
    plaintext: bool = Field(
        False,
        description="serve the feed to unauthenticated subscribers when tls.mode is plaintext and "
        "xds.listen is not loopback (said explicitly, as tls.agents.mode: plaintext is for the "
        "agents); false: every Watch is refused there (PERMISSION_DENIED). Plaintext only",
    )
    allow_identities: list[str] = Field(
        default_factory=list,
        description="tls.mode mtls only: when not empty, a subscriber whose client certificate "
        "matches none of these typed fnmatch patterns (as tls.node_allow's identity: spiffe:// "
        "and uri: match URI SANs only, dns: or no prefix DNS SANs, cn: the CN of a certificate "
        "without SANs) is refused (PERMISSION_DENIED); applied on reload",
    )

    @field_validator("allow_identities")
    @classmethod
    def _typed(cls, v: list[str]) -> list[str]:
        return check_patterns(v, "allow_identities")  # the one typed matcher's syntax


def check_feed(feed: FeedConfig, tls_mode: str | None) -> None:
    """Refuse ``feed`` settings that do not apply to ``tls_mode`` (ValueError naming the field)."""
    if feed.allow_identities and tls_mode != "mtls":
        raise ValueError(f"feed.allow_identities is used with tls.mode mtls only (mode is {tls_mode})")
    if feed.plaintext and tls_mode != "plaintext":
        raise ValueError(f"feed.plaintext is used with tls.mode plaintext only (mode is {tls_mode})")


def feed_plaintext_refusal(feed: FeedConfig, tls_mode: str | None, xds_listen: str) -> str | None:
    """Why the feed serves no one: plaintext off loopback not said in ``feed.plaintext`` (the
    PERMISSION_DENIED details); None when it may serve."""
    if tls_mode in (None, "plaintext") and not feed.plaintext and not is_loopback(parse_hostport(xds_listen)[0]):
        return (f"routing feed refused: xds.listen {xds_listen} is not loopback and tls.mode is plaintext; "
                "set feed.plaintext: true to serve node routing to unauthenticated subscribers "
                "explicitly, or use tls.mode mtls")
    return None
