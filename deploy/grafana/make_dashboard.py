"""Writes deploy/grafana/xds-sentinel.json (run: ``python deploy/grafana/make_dashboard.py``).

Rules the expressions follow, so the dashboard is right with N control-plane replicas:

- Every control-plane selector carries ``instance=~"$replica"`` (the ``replica`` variable lists
  the instances exporting ``sentinel_replica_info``; All by default).
- Per-node series are exported by every replica (each watches every node): they are folded with
  ``max by (node, ...)`` before any ``sum``, so two replicas never count a node twice.
- What each replica does alone (the Envoys it serves, xDS traffic, its process) is summed or
  shown per ``instance``.
- Node states come from ``sentinel_node_display_state`` (what ``status`` and the page show,
  UNREACHABLE, HELD_BACK and FAIL_STATIC included) as one coded series per node; with several
  replicas shown the timeline takes the worst (highest-coded) state a replica reports.
- Agent series carry ``node`` (``--node-id``) and are filtered by the same ``node`` variable.

tests/unit/test_grafana_dashboard.py checks every expression against the exported metric names
and evaluates them in a real Prometheus against two replicas' ``/metrics``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("xds-sentinel.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
CP = 'instance=~"$replica"'
SEL = 'instance=~"$replica", cluster=~"$cluster", node=~"$node"'
AG = 'node=~"$node"'
RI = "[$__rate_interval]"
# shown states, by severity: the worst wins when replicas disagree
STATE_CODES = ("HEALTHY", "PROBATION", "WARMING", "COLD", "HELD_BACK", "DEGRADED", "DRAINING", "FAIL_STATIC",
               "UNREACHABLE", "UNHEALTHY")
STATE_COLORS = {"HEALTHY": "green", "PROBATION": "blue", "WARMING": "#7a8699", "COLD": "#a0a8b5",
                "HELD_BACK": "orange", "DEGRADED": "yellow", "DRAINING": "purple", "FAIL_STATIC": "#b7410e",
                "UNREACHABLE": "#4b5563", "UNHEALTHY": "red"}
ENGINE_CODES = ("READY", "WARMING", "COLD", "FAILED")
ENGINE_COLORS = {"READY": "green", "WARMING": "#7a8699", "COLD": "#a0a8b5", "FAILED": "red"}


def coded(metric: str, sel: str, codes: tuple[str, ...]) -> str:
    """One series per node whose value is the code (1..) of its state: ``or`` of one term per state."""
    terms = " or ".join(f'({metric}{{{sel}, state="{s}"}} == 1) * {i}' for i, s in enumerate(codes, 1))
    return f"max by (node) ({terms})"


def mappings(codes: tuple[str, ...], colors: dict[str, str]) -> list[dict]:
    return [{"type": "value", "options": {str(i): {"text": s, "color": colors[s], "index": i - 1}
                                          for i, s in enumerate(codes, 1)}}]


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"id": len(self.panels) + 1, "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}, "panels": []})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = self.row_h = 0

    def add(self, kind: str, title: str, targets: list[tuple[str, str]], w: int = 12, h: int = 8,
            description: str = "", unit: str = "short", **extra: Any) -> None:
        if self.x + w > 24:
            self._newline()
        panel = {"id": len(self.panels) + 1, "type": kind, "title": title, "description": description,
                 "datasource": DS, "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
                 "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": legend, "datasource": DS}
                             for i, (e, legend) in enumerate(targets)],
                 "fieldConfig": {"defaults": {"unit": unit, **extra.pop("defaults", {})}, "overrides": []},
                 "options": extra.pop("options", {})}
        panel.update(extra)
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def variables() -> list[dict]:
    def query(name: str, q: str, label: str) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DS, "query": {"query": q, "refId": name},
                "definition": q, "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"},
                "refresh": 2}

    return [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
        query("replica", "label_values(sentinel_replica_info, instance)", "control-plane replica"),
        query("cluster", f"label_values(sentinel_node_display_state{{{CP}}}, cluster)", "cluster"),
        query("node", f'label_values(sentinel_node_display_state{{{CP}, cluster=~"$cluster"}}, node)', "node"),
    ]


def build() -> dict:
    L = Layout()
    L.row("Fleet (per-node series folded over replicas: no double counting)")
    L.add("stat", "Fail-static", [(f"max(sentinel_fail_static{{{CP}}})", "fail-static")], w=4, h=4,
          description="1 while more than half the fleet is silent and the last good assignment is held")
    L.add("stat", "Routable nodes", [(f'sum by (cluster) (max by (cluster, node) '
                                      f'(sentinel_node_routable{{{CP}, cluster=~"$cluster"}}))', "{{cluster}}")],
          w=4, h=4, description="nodes published HEALTHY, each counted once whatever the number of replicas")
    L.add("stat", "Nodes out", [(f'count by (cluster) (max by (cluster, node) (sentinel_node_display_state{{{CP}, '
                                 f'cluster=~"$cluster", state=~"UNHEALTHY|UNREACHABLE|HELD_BACK|FAIL_STATIC"}}) == 1)',
                                 "{{cluster}}")], w=4, h=4,
          description="nodes shown UNHEALTHY, UNREACHABLE, HELD_BACK or FAIL_STATIC")
    L.add("stat", "Connected Envoy streams", [(f"sum by (variant) (sentinel_xds_connected_streams{{{CP}}})",
                                               "{{variant}}")], w=4, h=4,
          description="summed over replicas: each Envoy holds its stream to one")
    L.add("stat", "Replicas by version", [(f"count by (version) (sentinel_build_info{{{CP}}})", "{{version}}")],
          w=4, h=4, description="more than one version: replicas of different builds")
    L.add("stat", "Last reload ok", [(f"min by (instance) (sentinel_config_last_reload_ok{{{CP}}})", "{{instance}}")],
          w=4, h=4, description="0: the file on disk is invalid; the old config runs")
    L.row("Nodes")
    L.add("state-timeline", "Node state (shown)",
          [(coded("sentinel_node_display_state", SEL, STATE_CODES), "{{node}}")],
          w=24, h=9, description="the state status and the dashboard show (DRAINING, FAIL_STATIC, UNREACHABLE, "
          "HELD_BACK included); with several replicas, the worst one reports",
          defaults={"mappings": mappings(STATE_CODES, STATE_COLORS), "color": {"mode": "thresholds"}})
    L.add("timeseries", "Published EDS weight (gap: not routed)",
          [(f"max by (node) (sentinel_node_weight{{{SEL}}} and on (instance, node) "
            f"(sentinel_node_routable{{{SEL}}} == 1))", "{{node}}")],
          description="as status shows it: no weight while Envoy does not route to the node")
    L.add("timeseries", "PROBATION ramp", [(f"max by (node) (sentinel_node_ramp_ratio{{{SEL}}})", "{{node}}")],
          unit="percentunit")
    L.add("timeseries", "Ping RTT (EWMA)", [(f"max by (node) (sentinel_node_ewma_rtt_seconds{{{SEL}}})", "{{node}}")],
          unit="s", description="the slowest replica's view")
    L.add("timeseries", "Probe TTFT", [(f"max by (node) (sentinel_node_last_ttft_seconds{{{SEL}}})", "last {{node}}"),
                                       (f"max by (node) (sentinel_node_ewma_ttft_seconds{{{SEL}}})", "EWMA {{node}}")],
          unit="s")
    L.add("timeseries", "Probe results by kind",
          [(f"max by (node, kind) (rate(sentinel_node_probe_results_total{{{SEL}}}{RI}))", "{{node}} {{kind}}")],
          unit="ops", description="each replica receives every result: folded, not summed")
    L.add("bargauge", "Ejections by cause",
          [(f"max by (node, cause) (increase(sentinel_node_ejections_total{{{SEL}}}[$__range]))",
            "{{node}} {{cause}}")])
    L.add("timeseries", "Health events", [(f"max by (kind) (sum by (instance, kind) "
                                           f"(rate(sentinel_health_events_total{{{CP}}}{RI})))", "{{kind}}")],
          unit="ops")
    L.add("timeseries", "Heartbeats received per replica",
          [(f"max by (node) (rate(sentinel_heartbeats_total{{{SEL}}}{RI}))", "{{node}}")], unit="ops",
          description="10/s per node at 100 ms heartbeats; the least is what each replica receives")
    L.row("xDS (summed over replicas: each Envoy talks to one)")
    L.add("timeseries", "xDS requests and responses",
          [(f"sum by (type, kind) (rate(sentinel_xds_requests_total{{{CP}}}{RI}))", "req {{type}} {{kind}}"),
           (f"sum by (type) (rate(sentinel_xds_responses_total{{{CP}}}{RI}))", "resp {{type}}")], unit="ops", w=8)
    L.add("timeseries", "xDS NACKs / refused streams",
          [(f"sum by (type) (increase(sentinel_xds_nacks_total{{{CP}}}{RI}))", "NACK {{type}}"),
           (f"sum by (reason) (increase(sentinel_xds_streams_rejected_total{{{CP}}}{RI}))", "refused {{reason}}")],
          w=8)
    L.add("timeseries", "xDS encode time per replica",
          [(f"sum by (instance) (rate(sentinel_xds_encode_seconds_total{{{CP}}}{RI}))", "encode {{instance}}"),
           (f"sum by (instance) (rate(sentinel_xds_request_throttle_seconds_total{{{CP}}}{RI}))",
            "throttle {{instance}}")], unit="percentunit", w=8)
    L.row("Control-plane process (per replica)")
    L.add("timeseries", "Resident memory and tasks",
          [(f"process_resident_memory_bytes{{{CP}}} and on (instance) sentinel_replica_info", "RSS {{instance}}"),
           (f"sentinel_event_loop_tasks{{{CP}}}", "tasks {{instance}}")], w=8,
          description="above its baseline after clients leave: a leak")
    L.add("timeseries", "Agent edge errors and timer lag",
          [(f"sum by (instance) (rate(sentinel_probe_malformed_messages_total{{{CP}}}{RI}))", "malformed {{instance}}"),
           (f"sum by (field, reason) (rate(sentinel_probe_bad_fields_total{{{CP}}}{RI}))", "{{field}} {{reason}}"),
           (f"sum by (where) (rate(sentinel_probe_handler_errors_total{{{CP}}}{RI}))", "handler {{where}}"),
           (f"sum by (instance) (rate(sentinel_detection_timer_lag_deferrals_total{{{CP}}}{RI}))",
            "lag {{instance}}")], w=8)
    L.add("timeseries", "Config reloads", [(f"sum by (instance, result) (increase(sentinel_config_reloads_total"
                                            f"{{{CP}}}{RI}))", "{{instance}} {{result}}")], w=8)
    L.row("Probe workers (per replica)")
    L.add("timeseries", "Probe workers live / configured",
          [(f"sentinel_probe_workers_live{{{CP}}}", "live {{instance}}"),
           (f"sentinel_probe_workers_configured{{{CP}}}", "configured {{instance}}")],
          description="live below configured for a minute: a worker keeps dying")
    L.add("timeseries", "Probe worker restarts",
          [(f"sum by (instance, worker) (increase(sentinel_probe_worker_restarts_total{{{CP}}}{RI}))",
            "{{instance}} worker {{worker}}")])
    L.add("timeseries", "RTT ping interval per process",
          [(f"sentinel_rtt_ping_interval_seconds{{{CP}}}", "{{instance}} {{process}}")], unit="s",
          description="past health.rtt.ping_budget x ping_interval pinging streams in a process, each "
          "node's RTT is sampled less often (liveness is not): add probe workers")
    L.row("Relay (sentinel-relay --admin-listen)")
    L.add("timeseries", "Relay requests by mode", [(f"sum by (mode) (rate(sentinel_relay_requests_total{RI}))",
                                                    "{{mode}}")], unit="ops", w=8)
    L.add("timeseries", "Rescues by trigger and outcome",
          [(f"sum by (trigger, outcome) (increase(sentinel_relay_rescues_total{RI}))", "{{trigger}} {{outcome}}")], w=8)
    L.add("timeseries", "Client pause across a rescue p50 / p99",
          [(f"histogram_quantile(0.5, sum by (le) (rate(sentinel_relay_client_pause_seconds_bucket{RI})))", "p50"),
           (f"histogram_quantile(0.99, sum by (le) (rate(sentinel_relay_client_pause_seconds_bucket{RI})))", "p99")],
          unit="s", w=8)
    L.add("timeseries", "Relay streams in flight per node", [("sum by (node) (sentinel_relay_in_flight)", "{{node}}")],
          w=8)
    L.add("timeseries", "Relay routing feed connected", [("min by (instance) (sentinel_relay_feed_connected)",
                                                          "{{instance}}")], w=8)
    L.add("timeseries", "GPU tokens redone", [(f"sum by (kind) (rate(sentinel_relay_wasted_tokens_total{RI}))",
                                               "{{kind}}")], w=8)
    L.row("Agents (node-probe --metrics-listen; label node)")
    L.add("timeseries", "Agent: probe TTFT p50 / p99",
          [(f"histogram_quantile(0.5, sum by (node, le) (rate(node_probe_probe_ttft_seconds_bucket{{{AG}}}{RI})))",
            "p50 {{node}}"),
           (f"histogram_quantile(0.99, sum by (node, le) (rate(node_probe_probe_ttft_seconds_bucket{{{AG}}}{RI})))",
            "p99 {{node}}")], unit="s")
    L.add("timeseries", "Agent: probes by result",
          [(f"sum by (node, result) (rate(node_probe_probes_total{{{AG}}}{RI}))", "{{node}} {{result}}")], unit="ops")
    L.add("timeseries", "Agent: engine stalled / scrape errors",
          [(f"max by (node) (node_probe_engine_stalled{{{AG}}})", "stalled {{node}}"),
           (f"sum by (node) (rate(node_probe_metrics_scrape_errors_total{{{AG}}}{RI}))", "scrape errors {{node}}")])
    L.add("state-timeline", "Agent: engine state", [(coded("node_probe_engine_state", AG, ENGINE_CODES), "{{node}}")],
          defaults={"mappings": mappings(ENGINE_CODES, ENGINE_COLORS), "color": {"mode": "thresholds"}})
    L.add("timeseries", "GPU memory used", [(f"max by (node, gpu) (node_probe_gpu_memory_used_bytes{{{AG}}} / "
                                             f"node_probe_gpu_memory_total_bytes{{{AG}}})", "{{node}} GPU {{gpu}}")],
          unit="percentunit")
    L.add("timeseries", "GPU utilization / temperature / power",
          [(f"node_probe_gpu_utilization_ratio{{{AG}}}", "util {{node}} GPU {{gpu}}"),
           (f"node_probe_gpu_temperature_celsius{{{AG}}}", "°C {{node}} GPU {{gpu}}"),
           (f"node_probe_gpu_power_watts{{{AG}}}", "W {{node}} GPU {{gpu}}")])
    return {
        "title": "xds-sentinel", "uid": "xds-sentinel", "schemaVersion": 39, "version": 2, "editable": True,
        "tags": ["xds-sentinel", "envoy", "llm"], "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "description": "Control-plane replicas (xds-server admin /metrics, the replica variable), the relay and "
        "the agents (node-probe --metrics-listen). Generated by deploy/grafana/make_dashboard.py; every "
        "expression names a metric the servers export and evaluates in Prometheus over two replicas "
        "(tests/unit/test_grafana_dashboard.py).",
        "templating": {"list": variables()},
        "panels": L.panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
