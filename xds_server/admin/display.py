"""What an operator is shown for one node: one state word and one reason that agree with what
Envoy was told. Pure: inputs in, a :class:`NodeDisplay` out; no I/O, no clock reads.

The health state (``NodeState``) says what the model concluded; the shown state also says what
was *published*, which can differ:

====================  ==========================================================================
shown state           when
====================  ==========================================================================
``DRAINING``          the operator drained the node (reason: drain time, requests in flight,
                      and the health state underneath)
``FAIL_STATIC``       fail-static kept an older assignment that still routes this node although
                      its health says it should not be (reason: the verdict not applied)
``UNREACHABLE``       no data yet (COLD) and dials to its agent fail (reason: the dial error)
``HELD_BACK``         a soft ejection (outlier, GPU memory, queue, REFUSING) held back by the
                      max-ejection cap: still routed (reason: what was held back)
any ``NodeState``     otherwise; a node not routed gives why it is not routed; WARMING gives
                      why the engine does not answer yet when the agent says so
====================  ==========================================================================

Shape::

    d = node_display(DisplayInputs(health=nh, published=routing, ...))
    d.state, d.reason, d.routed, d.shown_weight
"""
from __future__ import annotations

from dataclasses import dataclass

from xds_server.health import model as hm

__all__ = ["DISPLAY_STATES", "DisplayInputs", "NodeDisplay", "node_display"]

DISPLAY_STATES: tuple[str, ...] = tuple(s.value for s in hm.NodeState) + ("FAIL_STATIC", "UNREACHABLE", "HELD_BACK")
"""Every shown state (a bounded label set for ``/metrics``)."""


@dataclass(frozen=True, slots=True)
class DisplayInputs:
    """What :func:`node_display` reads.

    ``health``: the node's NodeHealth; ``published``: its Routing as last published (None before
    the first publish); ``why_not_routed``: cluster policy's latest reason ("" when routable);
    ``held_back``: the soft ejection the cap held back ("" when none); ``fail_static_held``:
    the cluster's last publish kept an older assignment; ``agent_connected``: the probe stream is
    up; ``failed_dials``: dials in a row that got nothing from the agent; ``agent_error``: the
    last dial error; ``engine_error``: why the engine does not answer as the agent sees it (its
    metrics error or last failed probe; "" when none); ``drain_s``: seconds since the drain
    began (None when not draining); ``in_flight``: requests running on the engine (None unknown).
    """

    health: hm.NodeHealth
    published: hm.Routing | None
    why_not_routed: str = ""
    held_back: str = ""
    fail_static_held: bool = False
    agent_connected: bool = False
    failed_dials: int = 0
    agent_error: str = ""
    engine_error: str = ""
    drain_s: float | None = None
    in_flight: float | None = None


@dataclass(frozen=True, slots=True)
class NodeDisplay:
    """``state`` (one of :data:`DISPLAY_STATES`), ``reason`` (the evidence), ``routed`` (published
    HEALTHY: Envoy sends it traffic), ``shown_weight`` (the published weight when routed, else
    None: Envoy ignores the weight of a host it does not route to), ``not_routed_because``
    (why the published assignment does not route it; None when routed) and
    ``verdict_not_applied`` (fail-static: the health verdict the held assignment does not carry)."""

    state: str
    reason: str
    routed: bool
    shown_weight: int | None
    not_routed_because: str | None
    verdict_not_applied: str | None = None


def node_display(x: DisplayInputs) -> NodeDisplay:
    """The shown state of one node (see the module docstring for the rules, in order)."""
    nh = x.health
    pub = x.published
    routed = pub is not None and pub.health_status == "HEALTHY"
    weight = pub.weight if routed and pub is not None else None
    health_word = f"{nh.state.value}: {nh.reason}"
    if routed:
        not_routed = None
    elif x.fail_static_held and not x.why_not_routed:
        not_routed = "fail-static keeps the last good assignment, which does not route it"
    else:
        not_routed = x.why_not_routed or (health_word if pub is not None else "not published yet")
    if nh.drain.active:
        flight = "unknown requests" if x.in_flight is None else f"{x.in_flight:g} request(s)"
        since = "" if x.drain_s is None else f" for {x.drain_s:.1f} s"
        return NodeDisplay("DRAINING", f"operator drain{since}, {flight} in flight (health {health_word})",
                           routed, weight, "draining" if not routed else None)
    if x.fail_static_held and routed and x.why_not_routed:
        return NodeDisplay("FAIL_STATIC", f"fail-static keeps it routed; health says {x.why_not_routed}",
                           routed, weight, None, x.why_not_routed)
    if nh.state is hm.NodeState.COLD and not x.agent_connected and x.failed_dials > 0:
        reason = f"agent unreachable ({x.failed_dials} dial(s) failed): {x.agent_error or 'no answer'}"
        return NodeDisplay("UNREACHABLE", reason, routed, weight, reason if not routed else None)
    if x.held_back and routed:
        return NodeDisplay("HELD_BACK", f"held back by max_ejection_percent: {x.held_back}", routed, weight, None)
    reason = nh.reason
    # a reason that gives the last probe already (the health model's COLD/WARMING wording) needs no repeat
    told = nh.reason.startswith(("warming, no good probe yet", "cannot warm: "))
    if nh.state is hm.NodeState.WARMING and x.engine_error and not told:
        reason = f"{nh.reason}; engine not answering: {x.engine_error}"
    elif not routed and not x.agent_connected and x.failed_dials > 0:
        reason = f"{nh.reason}; agent unreachable ({x.failed_dials} dial(s) failed): {x.agent_error or 'no answer'}"
    if not_routed is not None and nh.state is hm.NodeState.WARMING and (x.engine_error or told):
        not_routed = f"WARMING: {reason}"
    return NodeDisplay(nh.state.value, reason, routed, weight, not_routed)
