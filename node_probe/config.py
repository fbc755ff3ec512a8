"""The agent's settings (:class:`AgentConfig`), validated on construction."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from node_probe.engines import ENGINE_KINDS
from node_probe.replay import ReplayLimits
from node_probe.schedule import ScheduleSettings
from node_probe.targets import is_ip_literal, join_host_port, split_target
from node_probe.telemetry import FATAL_XIDS
from xds_server.process.identity import check_pattern
from xds_server.process.tls import is_loopback

__all__ = ["AgentConfig"]

#: Largest value of a ``uint32`` proto field (timeouts and intervals in ms travel as uint32).
UINT32_MAX = 2**32 - 1


def _ip_host_port(text: str) -> str:
    """Why ``text`` is not ``IP:PORT`` (an IPv6 address in brackets), naming it; "" when it is."""
    try:
        host, _ = split_target(text)
    except ValueError as exc:
        return str(exc)
    return "" if is_ip_literal(host) else f"must be IP:PORT (an IP literal, not a name): {text!r}"


def _engine_address(engine_url: str) -> str | None:
    """``engine_url``'s ``HOST:PORT`` (the scheme's port when it names none) when the host is an IP
    literal, else None."""
    try:
        parts = urlsplit(engine_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    host = parts.hostname or ""
    return join_host_port(host, port) if is_ip_literal(host) else None


@dataclass
class AgentConfig:
    """Agent settings. Durations carry their unit in the name.

    Attributes:
        engine_url: engine root URL, e.g. ``http://127.0.0.1:8000``.
        listen: gRPC listen address ``HOST:PORT`` control planes dial (``Watch``); port 0 picks a
            free port (returned by :meth:`ProbeAgent.start`). ``None`` (dial-in only): no gRPC
            port at all.
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
        plaintext: serve plaintext on a non-loopback ``listen``, and dial non-loopback
            ``control_planes`` without TLS (must be said; else either is refused).
        replay: bounds of the switch-back replay (:class:`~node_probe.replay.ReplayLimits`;
            ``max_prompts`` 0: no replay, advertised as such).
        control_planes: dial-in: the control-plane replicas this agent dials, each ``HOST:PORT``
            (an IP literal, ``[v6]:PORT``, or a DNS name: one stream per address it resolves to),
            holding one ``ProbeHub.Connect`` stream to each (:mod:`node_probe.dialer`). Empty: no
            dial-in, control planes dial ``listen``.
        cluster: the cluster this node registers into (``Register.cluster``): needed for a node
            the control plane's config does not list; "": unsaid (a listed node's own cluster).
        serving_address: ``HOST:PORT`` (an IP literal) Envoy routes this node's requests to
            (``Register.address``). ``None``: unsaid, the control plane's config has it; but with
            ``cluster`` (registering) ``engine_url``'s host:port when its host is an IP literal,
            else required. Only what is said is checked: a listed node whose config says other
            than its agent's Register is refused (the config wins), so an address derived from a
            loopback ``engine_url`` is never claimed for it.
        region, zone, sub_zone: the node's locality in its Register ("": unsaid).
        priority: the node's Envoy priority in its Register, 0..128 (0: unsaid, the first).
        capacity: the node's relative capacity in its Register, 1..1000000; ``None``: unsaid
            (the config's; 1 for a registered node).
        control_plane_ca_file: dial-in over TLS: the CA bundle (PEM) the control plane's
            certificate must chain to. ``None``: plaintext, allowed to loopback targets only
            unless ``plaintext`` is said.
        client_cert_file, client_key_file: dial-in mutual TLS: the agent's client certificate and
            key (PEM; both or neither; need ``control_plane_ca_file``). Its identity is what the
            control plane checks against the node id. Re-read at a dial when they change.
        control_plane_server_name: the name the control plane's certificate must carry; ``None``:
            the target's host (a DNS name is checked as given, not as the address dialled).

    Raises:
        ValueError: (on construction) a value is out of range.
    """

    engine_url: str
    listen: str | None = "127.0.0.1:50051"
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
    control_planes: tuple[str, ...] = ()
    cluster: str = ""
    serving_address: str | None = None
    region: str = ""
    zone: str = ""
    sub_zone: str = ""
    priority: int = 0
    capacity: int | None = None
    control_plane_ca_file: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None
    control_plane_server_name: str | None = None

    def __post_init__(self) -> None:
        if not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"engine_url must start with http:// or https://: {self.engine_url!r}")
        if self.metrics_url is not None and not self.metrics_url.startswith(("http://", "https://")):
            raise ValueError(f"metrics_url must start with http:// or https://: {self.metrics_url!r}")
        if self.engine_kind not in ENGINE_KINDS:
            raise ValueError(f"engine_kind must be one of {', '.join(ENGINE_KINDS)}: {self.engine_kind!r}")
        if self.listen is not None and ":" not in self.listen:
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
        if (self.listen is not None and self.tls_cert_file is None and not self.plaintext
                and not is_loopback(self.listen.rpartition(":")[0])):
            raise ValueError(f"listen {self.listen} is not a loopback address: give a certificate "
                             "(--tls-cert/tls_cert_file and --tls-key/tls_key_file; --tls-client-ca/"
                             "tls_client_ca_file for mutual TLS) or say --plaintext/plaintext explicitly")
        self.fatal_xids = frozenset(self.fatal_xids)
        self._check_dial_in()

    def _check_dial_in(self) -> None:
        """Validate the dial-in fields (and ``listen`` None); derive ``serving_address`` when
        registering."""
        self.control_planes = tuple(self.control_planes)
        if self.listen is None and not self.control_planes:
            raise ValueError("listen may be None only with control_planes (--control-plane): the agent "
                             "would have no way to reach a control plane, nor one to reach it")
        if self.listen is None and self.tls_cert_file is not None:
            raise ValueError("tls_cert_file/tls_key_file (--tls-cert/--tls-key) are the listen port's certificate "
                             "and listen is None; dial-in's certificate is client_cert_file/client_key_file "
                             "(--client-cert-file/--client-key-file)")
        for target in self.control_planes:
            try:
                host, _ = split_target(target)
            except ValueError as exc:
                raise ValueError(f"control_planes (--control-plane): {exc}") from None
            if self.control_plane_ca_file is None and not self.plaintext and not is_loopback(host):
                raise ValueError(f"control_planes (--control-plane): {target} is not a loopback address: give "
                                 "control_plane_ca_file (--control-plane-ca-file; client_cert_file and "
                                 "client_key_file for mutual TLS) or say plaintext (--plaintext) explicitly")
        if len(set(self.control_planes)) != len(self.control_planes):
            raise ValueError(f"control_planes (--control-plane): a target given twice: {self.control_planes!r}")
        if self.serving_address is None and self.cluster and self.control_planes:  # registering: said
            self.serving_address = _engine_address(self.engine_url)
            if self.serving_address is None:
                raise ValueError("serving_address (--serving-address): needed to register into cluster "
                                 f"{self.cluster!r} when engine_url's host is not an IP literal ({self.engine_url}): "
                                 "the IP:PORT Envoy routes to")
        elif self.serving_address is not None:
            why = _ip_host_port(self.serving_address)
            if why:
                raise ValueError(f"serving_address (--serving-address): {why}")
        if not 0 <= self.priority <= 128:
            raise ValueError(f"priority (--priority) must be 0..128: {self.priority!r}")
        if self.capacity is not None and not 1 <= self.capacity <= 1_000_000:
            raise ValueError(f"capacity (--capacity) must be 1..1000000: {self.capacity!r}")
        for name in ("cluster", "region", "zone", "sub_zone"):
            if len(getattr(self, name)) > 256:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) is longer than 256 characters")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("client_cert_file and client_key_file (--client-cert-file, --client-key-file) go together")
        if self.control_plane_ca_file is None and (self.client_cert_file or self.control_plane_server_name):
            raise ValueError("client_cert_file and control_plane_server_name need control_plane_ca_file "
                             "(--control-plane-ca-file): the CA the control plane's certificate must chain to")
        if self.plaintext and self.control_plane_ca_file is not None:
            raise ValueError("plaintext and control_plane_ca_file exclude each other")

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
