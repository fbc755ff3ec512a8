"""Routing state kept across a restart: NodeHealth <-> a JSON document (pure, no I/O).

What is kept per node: the state and reason, the ejection record (cause, the
state before it, the required clean period - the doubled back-off - and the start of the
HEALTHY run), the PROBATION ramp, the operator drain and the RTT baseline. Liveness, probe runs
and engine telemetry are not kept: they are re-observed within one heartbeat.

Times in :class:`~xds_server.health.model.NodeHealth` are on the process's monotonic clock, which
a restart resets; the document stores each as seconds relative to the moment it was written and
the wall-clock time of that moment, and :func:`restore` maps them onto the new monotonic clock.

A kept state waits until its node's first heartbeat (``ControlCore.restored``), also for a node
not configured at the restart (one found again by discovery later, while the document is younger
than ``max_age_s``: :func:`usable_until_s`); until then it is written again as it was
(:func:`with_unclaimed`), so a second restart does not lose it.

Shape::

    doc = snapshot(core.health, now_mono_s, now_wall_s)         # JSON-able dict
    kept = restore(doc, now_mono_s, now_wall_s, max_age_s, ids)  # node id -> NodeHealth (ids None: all)
    until = usable_until_s(doc, now_mono_s, now_wall_s, max_age_s)   # monotonic s
    to_write = with_unclaimed(core.health, core.restored)

Errors: :func:`restore` raises ValueError naming the field for a document it cannot read.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Literal, overload

from xds_server.health import model as hm
from xds_server.health.records import Drain, EjectionCause, Ramp, Rtt

__all__ = ["FORMAT_VERSION", "KEPT_STATES", "restore", "snapshot", "usable_until_s", "with_unclaimed"]

FORMAT_VERSION = 1
KEPT_STATES = frozenset({hm.NodeState.HEALTHY, hm.NodeState.DEGRADED, hm.NodeState.PROBATION,
                         hm.NodeState.REFUSING, hm.NodeState.UNHEALTHY})
"""States worth keeping; COLD and WARMING nodes start afresh anyway. A REFUSING node resumes not
routed (its reason kept) until its first answered probe."""


def _rel(t: float | None, now_s: float) -> float | None:
    return None if t is None else t - now_s


def snapshot(health: Mapping[str, hm.NodeHealth], now_mono_s: float, now_wall_s: float) -> dict[str, Any]:
    """The JSON-able state document of every node in a kept state (or draining)."""
    nodes: dict[str, Any] = {}
    for node_id, nh in health.items():
        if nh.state not in KEPT_STATES and not nh.drain.active:
            continue
        ej = nh.ejection
        nodes[node_id] = {
            "state": nh.state.value,
            "reason": nh.reason,
            "since_s": _rel(nh.since_s, now_mono_s),
            "ejection": {"cause": None if ej.cause is None else ej.cause.value,
                         "from_state": None if ej.from_state is None else ej.from_state.value,
                         "clean_period_s": ej.clean_period_s,
                         "healthy_since_s": _rel(ej.healthy_since_s, now_mono_s)},
            "ramp": {"percent": nh.ramp.percent, "step_at_s": _rel(nh.ramp.step_at_s, now_mono_s)},
            "drain": {"active": nh.drain.active, "since_s": _rel(nh.drain.since_s, now_mono_s)},
            "rtt": {"ewma_ms": nh.rtt.ewma_ms, "baseline_ms": nh.rtt.baseline_ms},
        }
    return {"version": FORMAT_VERSION, "written_at_wall_s": now_wall_s, "nodes": nodes}


@overload
def _num(v: Any, where: str, optional: Literal[True] = ...) -> float | None: ...
@overload
def _num(v: Any, where: str, optional: Literal[False]) -> float: ...


def _num(v: Any, where: str, optional: bool = True) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{where}: expected a finite number, got {v!r}")
    return float(v)


def _or(v: float | None, default: float) -> float:
    return default if v is None else v


def restore(doc: Any, now_mono_s: float, now_wall_s: float, max_age_s: float,
            node_ids: Iterable[str] | None) -> dict[str, hm.NodeHealth]:
    """Node id -> the NodeHealth to resume from, for the ids in ``node_ids`` found in ``doc``
    (None: every node of ``doc``).

    Empty when the document is older than ``max_age_s`` (``state.max_age``) or from the
    future. Liveness, probes and engine records start fresh. Raises ValueError naming the field
    when ``doc`` is not a state document of :data:`FORMAT_VERSION`.
    """
    age_s = now_wall_s - written_at_wall_s(doc)
    if age_s < 0 or age_s > max_age_s:
        return {}
    nodes = doc.get("nodes")
    if not isinstance(nodes, dict):
        raise ValueError("nodes: expected a mapping")
    shift = now_mono_s - age_s   # a relative time r written then is at shift + r now

    def t(v: Any, where: str) -> float | None:
        r = _num(v, where)
        return None if r is None else shift + r

    out: dict[str, hm.NodeHealth] = {}
    for node_id in (nodes if node_ids is None else node_ids):
        d = nodes.get(node_id)
        if d is None:
            continue
        w = f"nodes.{node_id}"
        try:
            state = hm.NodeState(d["state"])
            if state not in KEPT_STATES:
                continue
            ej, ramp, drain, rtt = d["ejection"], d["ramp"], d["drain"], d["rtt"]
            base = hm.initial(node_id, now_mono_s)
            out[node_id] = dataclasses.replace(
                base, state=state, reason=str(d["reason"])[:512],
                since_s=_or(t(d["since_s"], f"{w}.since_s"), now_mono_s),
                ejection=dataclasses.replace(
                    base.ejection,
                    cause=None if ej["cause"] is None else EjectionCause(ej["cause"]),
                    from_state=None if ej["from_state"] is None else hm.NodeState(ej["from_state"]),
                    clean_period_s=_num(ej["clean_period_s"], f"{w}.ejection.clean_period_s", optional=False),
                    healthy_since_s=t(ej["healthy_since_s"], f"{w}.ejection.healthy_since_s")),
                ramp=Ramp(_num(ramp["percent"], f"{w}.ramp.percent", optional=False),
                          t(ramp["step_at_s"], f"{w}.ramp.step_at_s")),
                drain=Drain(bool(drain["active"]), t(drain["since_s"], f"{w}.drain.since_s")),
                rtt=Rtt(ewma_ms=_num(rtt["ewma_ms"], f"{w}.rtt.ewma_ms"),
                        baseline_ms=_num(rtt["baseline_ms"], f"{w}.rtt.baseline_ms")),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"{w}: missing or malformed field {e}") from None
    return out


def usable_until_s(doc: Any, now_mono_s: float, now_wall_s: float, max_age_s: float) -> float:
    """The monotonic time (s) at which ``doc``, read at ``now_mono_s`` / ``now_wall_s``, becomes
    older than ``max_age_s``: a kept state is given to a node that appears only after that (found
    by discovery, added by a reload) no more. Raises ValueError as :func:`restore` does."""
    return now_mono_s + max_age_s - (now_wall_s - written_at_wall_s(doc))


def written_at_wall_s(doc: Any) -> float:
    """The Unix time (s) the state document ``doc`` was written at; ValueError when it is not a
    document of this format (version) or has no such time."""
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"version: expected {FORMAT_VERSION}")
    return _num(doc.get("written_at_wall_s"), "written_at_wall_s", optional=False)


def with_unclaimed(health: Mapping[str, hm.NodeHealth],
                   kept: Mapping[str, hm.NodeHealth]) -> dict[str, hm.NodeHealth]:
    """The health to write to the state file: each node's, except that a kept state not resumed
    yet (``kept``: ``ControlCore.restored``) stands for its node while that node is still COLD
    and not drained by the operator since the restart, or is not configured now (a discovered
    node not found again yet)."""
    out = dict(health)
    for node_id, k in kept.items():
        nh = health.get(node_id)
        if nh is None or (nh.state is hm.NodeState.COLD and not nh.drain.active):
            out[node_id] = k
    return out
