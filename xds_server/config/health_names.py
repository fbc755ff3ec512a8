"""The flat ``health:`` names of earlier releases and where each lives now.

Before the sections (:mod:`xds_server.config.health`), ``health`` was one flat mapping whose
durations carried their unit in the name (``heartbeat_interval_ms: 100``). Each old name is
still read for one release (:mod:`xds_server.config.renames`): it is moved to its section, a
number of ms or s becoming a duration string (``heartbeat.interval: 100ms``), and said in one line.
"""
from __future__ import annotations

from xds_server.config.renames import Moves

__all__ = ["RENAMED"]


#: Flat names of earlier releases -> (path in ``health``, unit of the old value or "" when not a duration).
RENAMED: Moves = {
    "heartbeat_interval_ms": ("heartbeat.interval", "ms"),
    "heartbeat_grace_ms": ("heartbeat.grace", "ms"),
    "consecutive_misses": ("heartbeat.consecutive_misses", ""),
    "failure_detector": ("heartbeat.failure_detector", ""),
    "self_lag_tolerance_ms": ("heartbeat.self_lag_tolerance", "ms"),
    "silent_tick_max_ms": ("heartbeat.silent_tick_max", "ms"),
    "reconnect_backoff_initial_ms": ("heartbeat.reconnect_backoff_initial", "ms"),
    "reconnect_backoff_max_ms": ("heartbeat.reconnect_backoff_max", "ms"),
    "phi_threshold": ("phi.threshold", ""),
    "phi_min_std_ms": ("phi.min_std", "ms"),
    "phi_acceptable_pause_ms": ("phi.acceptable_pause", "ms"),
    "phi_alpha": ("phi.alpha", ""),
    "phi_min_samples": ("phi.min_samples", ""),
    "phi_max_suspicions_per_min": ("phi.max_suspicions", ""),
    "phi_suspicion_window_s": ("phi.suspicion_window", "s"),
    "ping_interval_ms": ("rtt.ping_interval", "ms"),
    "rtt_ewma_alpha": ("rtt.ewma_alpha", ""),
    "rtt_baseline_alpha": ("rtt.baseline_alpha", ""),
    "rtt_baseline_tolerance": ("rtt.baseline_tolerance", ""),
    "rtt_baseline_slack_ms": ("rtt.baseline_slack", "ms"),
    "ttft_healthy_ms": ("probes.ttft_healthy", "ms"),
    "ttft_timeout_ms": ("probes.ttft_timeout", "ms"),
    "ttft_ewma_alpha": ("probes.ttft_ewma_alpha", ""),
    "probe_failures_to_eject": ("probes.failures_to_eject", ""),
    "good_probes_to_recover": ("probes.good_to_recover", ""),
    "degraded_weight_factor": ("probes.degraded_weight_factor", ""),
    "stall_confirm_ms": ("probes.stall_confirm", "ms"),
    "warm_limit_s": ("probes.warm_limit", "s"),
    "saturated_http_statuses": ("busy.saturated_http_statuses", ""),
    "busy_http_statuses": ("busy.http_statuses", ""),
    "busy_progress_window_ms": ("busy.progress_window", "ms"),
    "busy_confirm_min_ms": ("busy.confirm_min", "ms"),
    "busy_confirm_gaps": ("busy.confirm_gaps", ""),
    "busy_refusal_block_s": ("busy.refusal_block", "s"),
    "busy_good_probes_to_recover": ("busy.good_probes_to_recover", ""),
    "gpu_min_free_ratio": ("load.gpu_min_free_ratio", ""),
    "queue_warning": ("load.queue_warning", ""),
    "queue_warning_weight_factor": ("load.queue_warning_weight_factor", ""),
    "queue_critical": ("load.queue_critical", ""),
    "fatal_xids": ("load.fatal_xids", ""),
    "probation_clean_s": ("probation.clean", "s"),
    "probation_clean_max_s": ("probation.clean_max", "s"),
    "probation_min_probes": ("probation.min_probes", ""),
    "ramp_start_percent": ("probation.ramp_start_percent", ""),
    "ramp_step_percent": ("probation.ramp_step_percent", ""),
    "ramp_step_s": ("probation.ramp_step", "s"),
    "score_rtt_weight": ("score.rtt_weight", ""),
    "score_gpu_weight": ("score.gpu_weight", ""),
    "score_slack": ("score.slack", ""),
    "score_min_factor": ("score.min_factor", ""),
    "score_step": ("score.step", ""),
    "outlier_factor": ("outlier.factor", ""),
    "outlier_min_gap_rtt_ms": ("outlier.min_gap_rtt", "ms"),
    "outlier_min_gap_ttft_ms": ("outlier.min_gap_ttft", "ms"),
    "outlier_min_nodes": ("outlier.min_nodes", ""),
    "outlier_ejection_s": ("outlier.ejection", "s"),
    "outlier_ejection_max_s": ("outlier.ejection_max", "s"),
    "max_ejection_percent": ("outlier.max_ejection_percent", ""),
    "fail_static_fraction": ("fail_static.fraction", ""),
    "fail_static_window_ms": ("fail_static.window", "ms"),
    "fail_static_min_nodes": ("fail_static.min_nodes", ""),
    "fail_static_forgive_intervals": ("fail_static.forgive_intervals", ""),
    "drain_timeout_s": ("drain_timeout", "s"),
}
