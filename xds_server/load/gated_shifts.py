"""Gated shifts applied: requests checked, gates read from the load reports, decisions applied,
layouts handed to the publisher (:class:`~xds_server.xds.publisher.EnvoyPublisher`, which reads
:meth:`ShiftService.layout` and :meth:`ShiftService.closing`), state kept in a file (the admin HTTP
routes that reach it are :mod:`xds_server.admin.shift_routes`). The decisions themselves are
pure (:mod:`xds_server.policy.shift_machine`), the node placement too
(:mod:`xds_server.policy.shift_layout`).

Shape::

    svc = ShiftService(config_getter, core, load)          # reads the shift state file if any
    svc.layout(c) / svc.closing(c)                         # what the publisher places nodes by
    svc.begin("llm", {"to": "1", "step_percent": 10, "every_s": 300})   # ShiftRequestError (status, field)
    svc.command("llm", "pause" | "resume" | "cancel")
    svc.tick()                                             # every ``TICK_S`` (``svc.run``, the admin app's task)

Gate readings per window: the target nodes' completed and errored real requests are the growth
of LRS's per-node totals since the window began (a restart begins a fresh window: totals restart
at zero); latency is the mean probe TTFT (EWMA, ms) of the target's nodes against the source's
(the agents do not carry the engines' request histograms to the control plane).

Two replicas: a shift sent to both with the same ``start_at`` (the CLI sends one to every
``--admin`` it is given) decides at the same wall-clock instants, ``start_at + k x every_s``; the
weights of a step are a function of (layout, step), so both publish the same bytes when their gates
agree. They disagree for the clock skew between them plus one publish (coalescing window), and
for a whole window when their gate verdicts differ (each sees the Envoys that report to it).
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from xds_server.config import ClusterConfig, SentinelConfig
from xds_server.control.core import ControlCore
from xds_server.control.state_file import read_json, write_json_atomic
from xds_server.health.records import awaits_verdict
from xds_server.load.service import LoadReportingService
from xds_server.policy import shift_machine as hs
from xds_server.policy.shift_document import from_doc, to_doc
from xds_server.policy.shift_layout import Layout, NodeSpot, check_shiftable, layout, target_nodes

__all__ = ["ShiftRequestError", "ShiftService", "parse_duration_s"]

log = logging.getLogger(__name__)
TICK_S = 0.2
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


class ShiftRequestError(Exception):
    """A refused shift request: HTTP ``status``, the ``field`` at fault, and a sentence."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


def parse_duration_s(v: Any, field: str = "every") -> float:
    """Seconds from a number (s) or a string "300", "5m", "2s", "500ms", "1h". ShiftRequestError (400)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        s = float(v)
    elif isinstance(v, str) and (m := _DURATION.match(v)):
        s = float(m[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[m[2] or "s"]
    else:
        raise ShiftRequestError(400, field, f"{field}: {str(v)[:40]!r} is not a duration (e.g. 300, 5m, 2s)")
    if not (math.isfinite(s) and 0 < s <= 86_400):
        raise ShiftRequestError(400, field, f"{field}: {s:g} s is not within (0, 86400]")
    return s


class ShiftService:
    """The running shifts of a control plane (see module docstring)."""

    def __init__(self, config: Callable[[], SentinelConfig], core: ControlCore, load: LoadReportingService) -> None:
        self._config, self.core, self.load = config, core, load
        self.shifts: dict[str, hs.ShiftState] = {}
        self.base: dict[str, dict[str, int]] = {}  # cluster -> node id -> priority a finished shift left
        self._window: dict[str, tuple[int, int]] = {}  # cluster -> target (completed, errored) at window start
        self._load_file()

    def admin_token(self) -> str | None:
        """The bearer token shift requests need (None: shifts are refused)."""
        return self._config().admin.token

    # -- the state file -------------------------------------------------------------------------

    def path(self) -> str | None:
        cfg = self._config()
        return cfg.shift.state_path or (f"{cfg.state.path}.shifts.json" if cfg.state.path else None)

    def _load_file(self) -> None:
        p = self.path()
        if not p:
            return
        try:
            self.shifts, self.base = from_doc(read_json(p))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("shift state file %s not used: %s", p, e)
            return
        log.info("shift state file %s: %d shift(s) resumed", p, len(self.shifts))

    def _save(self) -> None:
        p = self.path()
        if p:
            try:
                write_json_atomic(p, to_doc(self.shifts, self.base, self.core.clock.wall()))
            except (OSError, ValueError) as e:
                log.warning("cannot write shift state file %s: %s", p, e)

    # -- layouts --------------------------------------------------------------------------------

    def _cfg(self, name: str) -> ClusterConfig:
        for c in self._config().clusters:
            if c.name == name:
                return c
        raise ShiftRequestError(404, "cluster", f"cluster: unknown cluster {name[:128]!r}")

    def _spots(self, c: ClusterConfig) -> list[NodeSpot]:
        base = self.base.get(c.name, {})
        return [NodeSpot(n.id, base.get(n.id, n.priority), (n.locality.region, n.locality.zone, n.locality.sub_zone),
                         n.capacity) for n in c.nodes]

    def _target(self, c: ClusterConfig, spec: hs.ShiftSpec) -> set[str]:
        return target_nodes(self._spots(c), spec.to_kind, spec.to, {n.id: n.priority for n in c.nodes})

    def layout(self, c: ClusterConfig) -> Layout | None:
        """The cluster's placement now; None when it is the config's own (no shift, no base)."""
        st = self.shifts.get(c.name)
        if st is not None and st.phase not in hs.TERMINAL and c.nodes:
            try:
                return layout(self._spots(c), self._target(c, st.spec), st.share_percent)
            except ValueError:  # the target left the config (a reload): the base layout
                pass
        return layout(self._spots(c), set(), 0.0) if c.name in self.base and c.nodes else None

    def closing(self, c: ClusterConfig) -> set[str]:
        """Node ids whose responses close the client's connection: the source of a finished hard switch."""
        st = self.shifts.get(c.name)
        if st is None or not st.spec.hard or st.phase is not hs.Phase.DONE:
            return set()
        try:
            target = self._target(c, st.spec)
        except ValueError:
            return set()
        return {n.id for n in c.nodes if n.id not in target}

    # -- requests -------------------------------------------------------------------------------

    def begin(self, name: str, body: Any) -> dict[str, Any]:
        """Start a shift of cluster ``name`` from a request body (see :mod:`xds_server.admin.shift_routes`).
        ShiftRequestError naming the field; nothing running changes then."""
        c = self._cfg(name)
        if not isinstance(body, dict):
            raise ShiftRequestError(400, "body", "body: expected a JSON object")
        cur = self.shifts.get(name)
        if cur is not None and cur.phase not in hs.TERMINAL:
            raise ShiftRequestError(409, "cluster", f"cluster: {name} already has a shift ({cur.phase.value} at "
                                                    f"{cur.share_percent:g} %); cancel it first")
        cfg = self._config().shift
        raw_to = body.get("to")
        if isinstance(raw_to, bool) or not isinstance(raw_to, (str, int)) or str(raw_to) == "":
            raise ShiftRequestError(400, "to", "to: expected a region name or a priority number")
        to = str(raw_to)
        kind = body.get("to_kind") or ("region" if to.startswith("region:") or not to.lstrip("-").isdigit()
                                       else "priority")
        to = to.removeprefix("region:")
        if kind not in ("region", "priority"):
            raise ShiftRequestError(400, "to_kind", f"to_kind: {str(kind)[:20]!r} is not region or priority")
        step = body.get("step_percent", cfg.default_step_percent)
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not (math.isfinite(step)
                                                                                 and 0 < step <= 100):
            raise ShiftRequestError(400, "step_percent", f"step_percent: {str(step)[:20]} is not within (0, 100]")
        every = parse_duration_s(body.get("every_s", body.get("every", cfg.default_every.s)), "every_s")
        hard = body.get("hard", False)
        if not isinstance(hard, bool):
            raise ShiftRequestError(400, "hard", "hard: expected true or false")
        interval = self._config().lrs.interval.s
        if not hard and every < 2 * interval:
            raise ShiftRequestError(400, "every_s", f"every_s: {every:g} s is shorter than two load-report intervals "
                                    f"(2 x lrs.interval {interval:g} s): its windows would judge one report or "
                                    "none, and the shift would hold for ever")
        now = self.core.clock.wall()
        anchor = body.get("start_at", now)
        if isinstance(anchor, bool) or not isinstance(anchor, (int, float)) or not abs(anchor - now) <= 3600:
            raise ShiftRequestError(400, "start_at", "start_at: expected wall-clock seconds within an hour of now")
        spec = hs.ShiftSpec(name, kind, to, float(step), every, hard)
        try:
            target = self._target(c, spec)
            check_shiftable(self._spots(c), target)
        except ValueError as e:
            raise ShiftRequestError(400, "to", str(e)) from None
        st, events = hs.start(spec, now, float(anchor))
        self._set(c, st, events)
        return self.view(name) or {}

    def command(self, name: str, what: str) -> dict[str, Any]:
        """pause / resume / cancel. ShiftRequestError: 404 (no cluster or shift), 409 (not in this phase)."""
        c = self._cfg(name)
        st = self.shifts.get(name)
        if st is None:
            raise ShiftRequestError(404, "cluster", f"cluster: {name} has no shift")
        try:
            new, events = hs.command(st, what, self.core.clock.wall())
        except ValueError as e:
            raise ShiftRequestError(409, "phase", str(e)) from None
        self._set(c, new, events)
        return self.view(name) or {}

    def _set(self, c: ClusterConfig, st: hs.ShiftState, events: list[hs.ShiftEvent]) -> None:
        before = self.shifts.get(c.name)
        if st.phase is hs.Phase.DONE:  # the finished layout is the cluster's base from now on
            lay = layout(self._spots(c), self._target(c, st.spec), 100.0)
            self.base[c.name] = dict(lay.priority)
        self.shifts[c.name] = st
        if before is None or before.window_start_s != st.window_start_s or before.steps != st.steps:
            self._window[c.name] = self._totals(c, st)
        wall = self.core.clock.wall()
        for ev in events:
            self.core.events.record(wall, c.name, "", f"shift_{ev.kind}", ev.detail)
        self._save()
        self.core.mark_dirty(c.name)

    # -- gates ----------------------------------------------------------------------------------

    def _totals(self, c: ClusterConfig, st: hs.ShiftState) -> tuple[int, int]:
        try:
            target = self._target(c, st.spec)
        except ValueError:
            return 0, 0
        done = err = 0
        for nid in target:
            t = self.load.aggregator.totals.get((c.name, nid))
            if t is not None:
                done, err = done + t.succeeded + t.errored, err + t.errored
        return done, err

    def reading(self, c: ClusterConfig, st: hs.ShiftState) -> hs.GateReading:
        """The current window's evidence so far (see module docstring)."""
        done, err = self._totals(c, st)
        d0, e0 = self._window.get(c.name, (0, 0))
        try:
            target = self._target(c, st.spec)
        except ValueError:
            target = set()

        def ttfts(ids: list[str]) -> list[float]:
            return [v for i in ids if (h := self.core.health.get(i)) is not None
                    and (v := h.probe.ewma_ttft_ms) is not None]

        tgt, src = ttfts(sorted(target)), ttfts([n.id for n in c.nodes if n.id not in target])
        pos = [v for v in src if v > 0]
        noise = max(pos) / min(pos) - 1.0 if len(pos) >= 2 else 0.0
        waiting = tuple(sorted(i for i in target if (h := self.core.health.get(i)) is not None and awaits_verdict(h)))
        return hs.GateReading(max(0, done - d0), max(0, err - e0), sum(tgt) / len(tgt) if tgt else None,
                              sum(src) / len(src) if src else None, noise, waiting)

    def tick(self) -> None:
        """Decide every shift whose decision is due."""
        now = self.core.clock.wall()
        cfg = self._config()
        for name, st in list(self.shifts.items()):
            nxt = st.next_decision_s
            if nxt is None or now < nxt:
                continue
            try:
                c = self._cfg(name)
            except ShiftRequestError:
                continue  # the cluster left the config: kept, shown, not decided
            new, events = hs.decide(st, hs.judge(self.reading(c, st), cfg.shift), now, cfg.shift)
            self._set(c, new, events)

    async def run(self) -> None:
        """Tick at each shift's decision instant (at most ``TICK_S`` apart) until cancelled
        (failures logged): replicas given the same start decide within their clock skew."""
        while True:
            due = [t for st in self.shifts.values() if (t := st.next_decision_s) is not None]
            wait = min([TICK_S, *(t - self.core.clock.wall() for t in due)])
            await asyncio.sleep(max(0.001, wait))
            try:
                self.tick()
            except Exception:  # keep going
                log.exception("shift tick failed")

    # -- views ----------------------------------------------------------------------------------

    def cluster_config(self, name: str) -> ClusterConfig:
        """The configured cluster ``name``; ShiftRequestError 404 when there is none."""
        return self._cfg(name)

    def view(self, name: str) -> dict[str, Any] | None:
        """JSON of a cluster's shift (None: none): phase, share, schedule, gates (the last
        decision's and the current window's so far), layout."""
        st = self.shifts.get(name)
        if st is None:
            return None
        now = self.core.clock.wall()
        cfg = self._config().shift
        c = next((c for c in self._config().clusters if c.name == name), None)
        live = hs.judge(self.reading(c, st), cfg).to_json() if c is not None and st.phase in hs.ACTIVE else None
        nxt = st.next_decision_s
        lay = self.layout(c) if c is not None else None
        s = st.spec
        return {"cluster": name, "to": {"kind": s.to_kind, "value": s.to}, "phase": st.phase.value,
                "share_percent": st.share_percent, "step_percent": s.step_percent, "every_s": s.every_s,
                "hard": s.hard, "steps": st.steps, "anchor_wall_s": st.anchor_s,
                "window_start_wall_s": st.window_start_s, "next_decision_wall_s": nxt,
                "next_decision_in_s": None if nxt is None else round(max(0.0, nxt - now), 3),
                "consecutive_failures": st.failures, "fail_windows": cfg.fail_windows, "rollbacks": st.rollbacks,
                "reason": st.reason or None, "last_gate": st.last_gate.to_json() if st.last_gate else None,
                "window_so_far": live, "window_needs": self._needs(c, st, live) if c is not None else None,
                "layout": None if lay is None else {
                    "priority": dict(sorted(lay.priority.items())),
                    "locality_weights": None if lay.locality_weights is None else [
                        {"priority": p, "locality": {"region": r, "zone": z, "sub_zone": sz}, "weight": w}
                        for (p, (r, z, sz)), w in sorted(lay.locality_weights.items())]}}

    def _needs(self, c: ClusterConfig, st: hs.ShiftState, live: dict[str, Any] | None) -> dict[str, Any] | None:
        """The window arithmetic: requests a window needs at the error ratio seen so far
        (:func:`~xds_server.policy.shift_machine.requests_needed`), and what the target gets in one
        window at the cluster's current rate and the next step's share."""
        if st.phase in hs.TERMINAL or st.spec.hard:
            return None
        cfg = self._config()
        ratio = (live or {}).get("error_ratio") or 0.0
        need = hs.requests_needed(ratio, cfg.shift)
        rps = self.load.aggregator.cluster(c.name, self.load.monotonic(), cfg.lrs.traffic_ejection.window.s).rps
        share = min(100.0, max(st.share_percent, st.spec.step_percent)) / 100.0
        supply = rps * share * st.spec.every_s
        return {"requests": need, "at_error_ratio": round(ratio, 6), "cluster_rps": round(rps, 3),
                "share": share, "expected_per_window": round(supply, 1),
                "enough": need is not None and supply >= need}

    def metric_families(self) -> Iterator[Metric]:
        """``sentinel_shift_*`` gauges per cluster with a shift."""
        share = GaugeMetricFamily("sentinel_shift_share_ratio", "share of the cluster's traffic commanded "
                                  "to the shift's target, 0..1", labels=["cluster"])
        phase = GaugeMetricFamily("sentinel_shift_phase", "1 for the shift's phase", labels=["cluster", "phase"])
        nxt = GaugeMetricFamily("sentinel_shift_next_decision_seconds", "seconds until the next gate decision "
                                "(absent: none due)", labels=["cluster"])
        err = GaugeMetricFamily("sentinel_shift_gate_error_ratio", "target error ratio of the last decided "
                                "window, 0..1", labels=["cluster"])
        lat = GaugeMetricFamily("sentinel_shift_gate_latency_increase", "target probe TTFT over the source's "
                                "minus 1, last decided window", labels=["cluster"])
        rb = GaugeMetricFamily("sentinel_shift_rollbacks", "steps rolled back by this shift", labels=["cluster"])
        now = self.core.clock.wall()
        for name, st in sorted(self.shifts.items()):
            share.add_metric([name], st.share_percent / 100.0)
            phase.add_metric([name, st.phase.value], 1.0)
            rb.add_metric([name], st.rollbacks)
            if (t := st.next_decision_s) is not None:
                nxt.add_metric([name], max(0.0, t - now))
            g = st.last_gate
            if g is not None and g.error_ratio is not None:
                err.add_metric([name], g.error_ratio)
            if g is not None and g.latency_increase is not None:
                lat.add_metric([name], g.latency_increase)
        yield from (share, phase, nxt, err, lat, rb)
