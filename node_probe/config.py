"""The agent's settings (:class:`AgentConfig`), validated on construction."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from node_probe.engines import ENGINE_KINDS
from node_probe.replay import ReplayLimits
from node_probe.schedule import ScheduleSettings
from node_probe.telemetry import FATAL_XIDS
from xds_server.process.identity import check_pattern
from xds_server.process.tls import is_loopback

__all__ = ["AgentConfig"]

#: Largest value of a ``uint32`` proto field (timeouts and intervals in ms travel as uint32).
UINT32_MAX = 2**32 - 1


@dataclass
class AgentConfig:
    """Agent settings. Durations carry their unit in the name.

    Attributes:
        engine_url: engine root URL, e.g. ``http://127.0.0.1:8000``.
        listen: gRPC listen address ``HOST:PORT``; port 0 picks a free port (returned by
            :meth:`ProbeAgent.start`).
        node_id: reported in every heartbeat; default: this host's name.
        metrics_listen: ``HOST:PORT`` of the agent's own Prometheus ``/metrics`` (probe TTFT,
            scrape errors, stall flag, GPU readings; :mod:`node_probe.metrics`); ``None``: off.
        heartbeat_interval_ms: heartbeat period per stream.
        engine_kind: ``"auto"`` (detect from ``/metrics`` and the endpoints the engine serves)
            or one of ``vllm``, ``sglang``, ``tgi``, ``triton``, ``openai``.
        metrics_url: the engine's Prometheus page; ``None``: the adapter's default (the engine
            URL + ``/metrics``; Triton: port 8002 of the engine host).
        metrics_interval_ms: ``/metrics`` scrape period (also the stall-detection sampling
            period); ``None``: the heartbeat interval.
        metrics_timeout_ms: deadline for one scrape.
        stall_window_ms: how long the engine's progress counter may stay frozen while requests
            run before telemetry says ``stalled``.
        probe_interval_s: mean period between scheduled micro-probes while the engine is busy
            (requests running or waiting, and its progress counter makes stall detection
            possible). Default 4 s, i.e. 3-5 s with the default jitter.
        probe_idle_interval_s: mean period while the engine is idle, its load unknown or its
            progress unobservable; never longer than ``probe_interval_s``. ``None``: same as
            ``probe_interval_s``.
        probe_jitter_ratio: each probe interval is uniform in ``[i*(1-j), i*(1+j)]``; 0..<1.
        probe_timeout_ms: deadline for the first token of one probe (also for model discovery).
        probe_recheck_ms: a probe that timed out, or got its token this late or later, is
            followed by the next one at the idle cadence even while busy, so a node that was
            only busy is seen back within ~0.5 s of its load easing. Default 200 ms:
            seed 001's good/slow TTFT boundary (the control plane's ``health.ttft_healthy_ms``).
        model: model id to probe; ``None`` discovers it (``/v1/models``; Triton: repository
            index), re-discovered after a 404.
        deep_check_interval_s: period of the deep check, a fixed arithmetic prompt whose answer
            is checked (catches silently corrupt weights); ``None`` or 0: off.
        deep_check_prompt, deep_check_expect: its prompt and the text the answer must contain.
        deep_check_max_tokens: tokens the deep check may generate.
        deep_check_timeout_ms: deadline of a deep check (whole answer).
        gpu_interval_s: NVML collection period; 0 or less disables GPU telemetry.
        fatal_xids: Xid codes that mark the engine FAILED (default
            :data:`node_probe.telemetry.FATAL_XIDS`: 48, 63, 64, 74, 79, 94, 95).
        min_probe_now_interval_ms: minimum spacing of probes triggered by ``ProbeNow`` (or by
            stall detection). A request inside the window is not dropped: all such requests
            are coalesced into one probe at the window's end.
        stream_queue_max: outbound messages buffered per stream; beyond it messages for that
            stream are dropped (and counted) rather than growing memory for a stuck client.
        grpc_keepalive_time_ms: server-side HTTP/2 keepalive ping period (detects dead
            control planes on silent networks).
        transport_liveness: take a control plane's request (``Hello.liveness``) for liveness by
            HTTP/2 PINGs, heartbeats then sent on change only (False: heartbeats every interval
            whatever is asked, as agents before it did).
        min_ping_interval_ms: the least gap (ms) between the control plane's keepalive PINGs
            this server accepts without data (gRPC's grpc.http2.min_ping_interval_without_data_ms;
            ours 50: half the control plane's 100 ms transport keepalive; gRPC's default 5 min
            would answer a transport-liveness control plane with GOAWAY too_many_pings).
        tls_cert_file, tls_key_file: the agent's server certificate and key (PEM; both or
            neither): the gRPC port serves TLS, the files re-read when they change.
        tls_client_ca_file: with a certificate: the control plane must present a client
            certificate this CA bundle signed (mutual TLS).
        tls_allow_clients: with ``tls_client_ca_file``: typed fnmatch patterns
            (:mod:`xds_server.process.identity`: ``spiffe://...`` and ``uri:`` match URI SANs
            only, ``dns:`` or no prefix DNS SANs, ``cn:`` the CN of a certificate without SANs);
            a stream is served only when one matches, else it ends with PERMISSION_DENIED.
            Empty: any certificate the CA signed (the agent warns at start).
        tls_expiry_warning_days: days; the certificate files within this many days of their
            notAfter log a warning (at start and at most hourly on a scrape) and are on
            ``node_probe_tls_certificate_expiry_seconds`` (ours: as the control plane's
            ``tls.expiry_warning_days``, a week covers a weekend and a renewal's retries).
        plaintext: serve plaintext on a non-loopback ``listen`` (must be said; without a
            certificate a non-loopback listen is refused).
        replay: bounds of the switch-back replay (:class:`~node_probe.replay.ReplayLimits`;
            ``max_prompts`` 0: no replay, advertised as such).

    Raises:
        ValueError: (on construction) a value is out of range.
    """

    engine_url: str
    listen: str = "127.0.0.1:50051"
    node_id: str = field(default_factory=socket.gethostname)
    heartbeat_interval_ms: int = 100
    engine_kind: str = "auto"
    metrics_url: str | None = None
    metrics_interval_ms: int | None = None
    metrics_timeout_ms: int = 1000
    stall_window_ms: int = 1000
    probe_interval_s: float = 4.0
    probe_idle_interval_s: float | None = 0.5
    probe_jitter_ratio: float = 0.25
    probe_timeout_ms: int = 800
    probe_recheck_ms: int = 200
    model: str | None = None
    deep_check_interval_s: float | None = None
    deep_check_prompt: str = "1+1="
    deep_check_expect: str = "2"
    deep_check_max_tokens: int = 4
    deep_check_timeout_ms: int = 3000
    gpu_interval_s: float = 1.0
    fatal_xids: frozenset[int] = FATAL_XIDS
    min_probe_now_interval_ms: int = 1000
    stream_queue_max: int = 1024
    metrics_listen: str | None = None
    grpc_keepalive_time_ms: int = 10_000
    transport_liveness: bool = True
    min_ping_interval_ms: int = 50
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    tls_allow_clients: tuple[str, ...] = ()
    tls_expiry_warning_days: float = 7.0
    plaintext: bool = False
    replay: ReplayLimits = field(default_factory=ReplayLimits)

    def __post_init__(self) -> None:
        if not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"engine_url must start with http:// or https://: {self.engine_url!r}")
        if self.metrics_url is not None and not self.metrics_url.startswith(("http://", "https://")):
            raise ValueError(f"metrics_url must start with http:// or https://: {self.metrics_url!r}")
        if self.engine_kind not in ENGINE_KINDS:
            raise ValueError(f"engine_kind must be one of {', '.join(ENGINE_KINDS)}: {self.engine_kind!r}")
        if ":" not in self.listen:
            raise ValueError(f"listen must be HOST:PORT: {self.listen!r}")
        if self.metrics_listen is not None and not self.metrics_listen.rpartition(":")[2].isdigit():
            raise ValueError(f"metrics_listen must be HOST:PORT: {self.metrics_listen!r}")
        if not 1 <= self.heartbeat_interval_ms <= UINT32_MAX:
            raise ValueError("heartbeat_interval_ms must be >= 1")
        if (self.metrics_interval_ms is not None and self.metrics_interval_ms < 1) \
                or self.metrics_timeout_ms < 1:
            raise ValueError("metrics_interval_ms and metrics_timeout_ms must be >= 1")
        if self.stall_window_ms < 1:
            raise ValueError("stall_window_ms must be >= 1")
        if not 1 <= self.min_ping_interval_ms <= 3_600_000:
            raise ValueError(f"min_ping_interval_ms must be 1..3600000 ms: {self.min_ping_interval_ms!r}")
        if self.probe_interval_s <= 0:
            raise ValueError("probe_interval_s must be > 0")
        if self.probe_idle_interval_s is not None and self.probe_idle_interval_s <= 0:
            raise ValueError("probe_idle_interval_s must be > 0")
        if not 0 <= self.probe_jitter_ratio < 1:
            raise ValueError("probe_jitter_ratio must be in [0, 1)")
        if not 1 <= self.probe_timeout_ms <= UINT32_MAX:
            raise ValueError("probe_timeout_ms must be >= 1")
        if not 0 <= self.probe_recheck_ms <= UINT32_MAX:
            raise ValueError("probe_recheck_ms must be >= 0")
        if self.deep_check_interval_s is not None and self.deep_check_interval_s < 0:
            raise ValueError("deep_check_interval_s must be >= 0")
        if self.deep_check_interval_s and (not self.deep_check_prompt or not self.deep_check_expect):
            raise ValueError("deep_check_prompt and deep_check_expect must not be empty")
        if self.deep_check_max_tokens < 1 or not 1 <= self.deep_check_timeout_ms <= UINT32_MAX:
            raise ValueError("deep_check_max_tokens and deep_check_timeout_ms must be >= 1")
        if self.min_probe_now_interval_ms < 0:
            raise ValueError("min_probe_now_interval_ms must be >= 0")
        if self.stream_queue_max < 1:
            raise ValueError("stream_queue_max must be >= 1")
        if not self.node_id:
            raise ValueError("node_id must not be empty")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        self.tls_allow_clients = tuple(self.tls_allow_clients)
        if self.tls_allow_clients and self.tls_client_ca_file is None:
            raise ValueError("tls_allow_clients needs tls_client_ca_file (mutual TLS)")
        if not 0 < self.tls_expiry_warning_days <= 3650:
            raise ValueError("tls_expiry_warning_days must be > 0 and <= 3650")
        for pat in self.tls_allow_clients:
            if why := check_pattern(pat):
                raise ValueError(f"--tls-allow-client/tls_allow_clients: {why}")
        if self.plaintext and self.tls_cert_file is not None:
            raise ValueError("plaintext and tls_cert_file exclude each other")
        if self.tls_cert_file is None and not self.plaintext and not is_loopback(self.listen.rpartition(":")[0]):
            raise ValueError(f"listen {self.listen} is not a loopback address: give a certificate "
                             "(--tls-cert/tls_cert_file and --tls-key/tls_key_file; --tls-client-ca/"
                             "tls_client_ca_file for mutual TLS) or say --plaintext/plaintext explicitly")
        self.fatal_xids = frozenset(self.fatal_xids)

    @property
    def effective_metrics_interval_ms(self) -> int:
        """The scrape period in use (``metrics_interval_ms`` or the heartbeat interval)."""
        return self.metrics_interval_ms or self.heartbeat_interval_ms

    @property
    def effective_idle_interval_s(self) -> float:
        """The idle probe period in use (never longer than the busy one)."""
        if self.probe_idle_interval_s is None:
            return self.probe_interval_s
        return min(self.probe_idle_interval_s, self.probe_interval_s)

    def schedule_settings(self) -> ScheduleSettings:
        """The probe schedule's settings (:mod:`node_probe.schedule`) from these."""
        return ScheduleSettings(
            busy_interval_s=self.probe_interval_s,
            idle_interval_s=self.effective_idle_interval_s,
            jitter_ratio=self.probe_jitter_ratio,
            min_request_gap_s=self.min_probe_now_interval_ms / 1000.0,
            deep_interval_s=self.deep_check_interval_s,
        )
