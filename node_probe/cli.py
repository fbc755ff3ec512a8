"""``node-probe`` command line.

Forms::

    node-probe --engine-url URL --listen HOST:PORT [options]     run the agent (default mode)
    node-probe --engine-url URL --control-plane HOST:PORT ...    dial-in: the agent dials each control
                                                                 plane (no gRPC port unless --listen)
    node-probe agent --engine-url URL ...                        same, explicit
    node-probe sim-engine ...                                    simulated engine (node_probe.sim)

The agent runs until SIGTERM or SIGINT, then stops cleanly and exits 0; SIGHUP is logged and
changes nothing (TLS files are re-read when they change; other flags need a restart). Once
serving it prints ``node-probe <node_id> listening on HOST:PORT engine=URL`` (flushed) on
stdout when it has a gRPC port, and ``node-probe <node_id> dialling HOST:PORT[,HOST:PORT...]
engine=URL`` when it dials in (both lines when it does both). ``--version``, ``--log-level`` and
``--log-format`` as the other programs (:mod:`xds_server.process.commandline`).

Exit codes: 0 stopped by a signal; 1 runtime failure (a listen address that cannot be bound,
TLS files that do not load: one line naming the flag); 2 bad arguments (argparse, naming the
flag).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from node_probe.engines import ENGINE_KINDS
from node_probe.telemetry import FATAL_XIDS
from xds_server.process.commandline import add_common_options, bind_failure, run_main
from xds_server.process.logs import configure_logging, quiet_grpc_core

if TYPE_CHECKING:
    from node_probe.config import AgentConfig

__all__ = ["build_parser", "main"]


def _number(kind: type, lo: float | None = None, *, strict: bool = False, hi: float | None = None):
    """An argparse ``type=`` converter: ``kind`` (int or float) with an optional lower bound
    (``strict``: exclusive) and exclusive upper bound ``hi``; errors say what was expected."""
    what = "an integer" if kind is int else "a number"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if lo is not None and (value <= lo if strict else value < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo:g}: {text!r}")
        if hi is not None and not value < hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo:g}, {hi:g}): {text!r}")
        return value

    return convert


_positive_int = _number(int, 1)
_positive_float = _number(float, 0, strict=True)
_float = _number(float)
_jitter = _number(float, 0, hi=1)
_non_negative_int = _number(int, 0)


def _engine_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must start with http:// or https://: {text!r}")
    return text.rstrip("/")


def _listen(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT (port 0 = any free port): {text!r}")
    return text


NO_LISTEN = ""
"""``--listen none`` as parsed (the flag's default, None, is: not given)."""


def _listen_or_none(text: str) -> str:
    return NO_LISTEN if text.lower() == "none" else _listen(text)


def _targets(text: str) -> list[str]:
    from node_probe.targets import split_target

    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT (or a comma-separated list): {text!r}")
    for target in out:
        try:
            split_target(target)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return out


def _xids(text: str) -> frozenset[int]:
    try:
        values = frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"Xid codes must be >= 0: {text!r}")
    return values


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must start with http:// or https://: {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the agent mode (also used by ``node-probe agent``)."""
    p = argparse.ArgumentParser(
        prog="node-probe",
        description=(
            "Health probe agent beside one LLM inference engine: serves the NodeProbe gRPC "
            "stream (heartbeats, pongs, micro-inference results, engine and GPU telemetry). "
            "Other forms: 'node-probe agent ...' (same as this), "
            "'node-probe sim-engine ...' (simulated OpenAI-compatible engine)."
        ),
    )
    p.add_argument("--engine-url", required=True, type=_engine_url,
                   help="engine root URL, e.g. http://127.0.0.1:8000 (required)")
    p.add_argument("--listen", default=None, type=_listen_or_none,
                   help="gRPC listen address HOST:PORT the control planes dial; port 0 picks a free one; "
                   "'none': no gRPC port (dial-in only) (default 127.0.0.1:50051, or none with --control-plane)")
    p.add_argument("--metrics-listen", default=None, type=_listen,
                   help="serve the agent's own Prometheus /metrics on HOST:PORT (probe TTFT, scrape "
                   "errors, stall flag, GPU readings) and /healthz (200 while the agent runs); "
                   "default: off")
    p.add_argument("--node-id", default=None,
                   help="node id reported in heartbeats (default: host name)")
    p.add_argument("--heartbeat-interval-ms", type=_positive_int, default=100,
                   help="heartbeat period per stream, ms (default %(default)s)")
    p.add_argument("--no-transport-liveness", dest="transport_liveness", action="store_false",
                   help="send heartbeats every interval even when the control plane asks for "
                   "liveness by HTTP/2 PINGs (as agents before it did; default: take the request)")
    p.add_argument("--no-replay", dest="replay", action="store_false",
                   help="do not run switch-back replays (advertised in heartbeats: the control plane "
                   "validates this node by probes alone, as an agent before replay; default: replay)")
    p.add_argument("--replay-busy-max-waiting", type=int, default=0,
                   help="refuse a replay while the engine queues more requests than this (running "
                   "ones do not count; default %(default)s: any queue)")
    p.add_argument("--min-ping-interval-ms", type=_positive_int, default=50,
                   help="least gap between the control plane's HTTP/2 PINGs accepted, ms (agents "
                   "before transport liveness: 1000; default %(default)s)")
    p.add_argument("--engine-kind", default="auto", choices=list(ENGINE_KINDS),
                   help="engine family (adapter); auto detects it (default %(default)s)")
    p.add_argument("--metrics-url", type=_url, default=None,
                   help="engine Prometheus page (default: ENGINE_URL/metrics; Triton: port 8002)")
    p.add_argument("--metrics-interval-ms", type=_positive_int, default=None,
                   help="engine /metrics scrape (and stall sampling) period, ms "
                        "(default: the heartbeat interval)")
    p.add_argument("--stall-window-ms", type=_positive_int, default=1000,
                   help="requests running and the progress counter frozen this long -> "
                        "telemetry says stalled, ms (default %(default)s)")
    p.add_argument("--probe-interval-s", type=_positive_float, default=4.0,
                   help="mean micro-probe period while the engine is busy and stall detection "
                        "watches it, s (default %(default)s: 3-5 s with the default jitter)")
    p.add_argument("--probe-idle-interval-s", type=_positive_float, default=0.5,
                   help="mean micro-probe period while the engine is idle or its load unknown, s; "
                        "never longer than --probe-interval-s (default %(default)s)")
    p.add_argument("--probe-jitter", type=_jitter, default=0.25,
                   help="probe interval jitter ratio j: each interval is uniform in "
                        "[i*(1-j), i*(1+j)] (default %(default)s)")
    p.add_argument("--probe-timeout-ms", type=_positive_int, default=800,
                   help="deadline for a probe's first token, ms (default %(default)s)")
    p.add_argument("--min-probe-now-interval-ms", type=_non_negative_int, default=1000,
                   help="minimum spacing of ProbeNow-triggered probes, ms (default %(default)s)")
    p.add_argument("--deep-check-interval-s", type=_float, default=0.0,
                   help="period of the deep check (arithmetic prompt whose answer is checked), s; "
                        "0 disables it (default %(default)s)")
    p.add_argument("--deep-check-prompt", default="1+1=",
                   help="deep-check prompt (default %(default)s)")
    p.add_argument("--deep-check-expect", default="2",
                   help="text the deep-check answer must contain (default %(default)s)")
    p.add_argument("--gpu-interval-s", type=_float, default=1.0,
                   help="NVML collection period, s; 0 disables GPU telemetry (default %(default)s)")
    p.add_argument("--fatal-xids", type=_xids, default=None,
                   help="comma-separated Xid codes that mark the engine FAILED "
                        f"(default {','.join(map(str, sorted(FATAL_XIDS)))})")
    p.add_argument("--model", default=None,
                   help="model id to probe (default: first id from GET /v1/models)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve the gRPC port over TLS with this certificate (re-read when it changes; "
                   "default: plaintext)")
    p.add_argument("--tls-key", default=None, metavar="PEM",
                   help="the certificate's private key (default: none; needed with --tls-cert)")
    p.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="mutual TLS: the control plane must present a certificate this CA signed "
                   "(default: no client certificate asked)")
    p.add_argument("--tls-allow-client", dest="tls_allow_clients", action="append", default=[], metavar="PATTERN",
                   help="mutual TLS: serve only clients whose certificate matches this typed fnmatch "
                        "pattern: spiffe://... or uri:P (URI SANs only), dns:P or P (DNS SANs), cn:P (the "
                        "CN of a certificate without SANs); repeatable, give the control plane's identity "
                        "(default: any certificate the CA signed, with a warning at start)")
    p.add_argument("--tls-expiry-warning-days", type=_positive_float, default=7.0, metavar="DAYS",
                   help="warn when --tls-cert, --tls-client-ca, --client-cert-file or --control-plane-ca-file "
                        "is within this many days of its end (default %(default)s)")
    p.add_argument("--plaintext", action="store_true",
                   help="serve plaintext on a non-loopback --listen, and dial a non-loopback --control-plane "
                   "without TLS (refused unless said; default off)")
    d = p.add_argument_group("dial-in", "the agent dials the control planes (ProbeHub.Connect) and registers "
                             "its node; no inbound port needed. Node fields left unsaid come from the control "
                             "plane's config; said ones must agree with it")
    d.add_argument("--control-plane", dest="control_planes", action="extend", type=_targets, default=[],
                   metavar="HOST:PORT",
                   help="a control-plane replica to dial and hold a stream to; repeatable or a comma list; a DNS "
                   "name gets one stream per address it resolves to (default: none, control planes dial --listen)")
    d.add_argument("--cluster", default="",
                   help="the cluster this node registers into; needed for a node the control plane's config "
                   "does not list (default: unsaid, the listed node's own)")
    d.add_argument("--serving-address", default=None, metavar="IP:PORT",
                   help="the address Envoy routes this node's requests to, an IP literal; a listed node's "
                   "config must agree (default: unsaid, the config's; with --cluster --engine-url's host:port "
                   "when its host is an IP)")
    d.add_argument("--region", default="", help="the node's locality: region (default: unsaid)")
    d.add_argument("--zone", default="", help="the node's locality: zone (default: unsaid)")
    d.add_argument("--sub-zone", default="", help="the node's locality: sub-zone (default: unsaid)")
    d.add_argument("--priority", type=_number(int, 0, hi=129), default=0,
                   help="the node's Envoy priority, 0..128, 0 first (default %(default)s: unsaid)")
    d.add_argument("--capacity", type=_number(int, 1, hi=1_000_001), default=None,
                   help="the node's relative capacity (load-balancing weight), 1..1000000 (default: unsaid, the "
                   "config's; 1 for a registered node)")
    d.add_argument("--control-plane-ca-file", default=None, metavar="PEM",
                   help="dial over TLS: the control plane's certificate must chain to this CA bundle (re-read "
                   "when it changes; default: plaintext, loopback targets only unless --plaintext)")
    d.add_argument("--client-cert-file", default=None, metavar="PEM",
                   help="mutual TLS: the agent's client certificate; the control plane checks its identity "
                   "against the node id (default: none)")
    d.add_argument("--client-key-file", default=None, metavar="PEM",
                   help="the client certificate's private key (default: none; needed with --client-cert-file)")
    d.add_argument("--control-plane-server-name", default=None, metavar="NAME",
                   help="the name the control plane's certificate must carry (default: the --control-plane host)")
    add_common_options(p, "node-probe")
    return p


NO_ALLOWED_CLIENTS = ("mutual TLS without --tls-allow-client: any certificate the CA in --tls-client-ca "
                      "signed (an Envoy's, a relay's) may read this agent's heartbeats and telemetry and "
                      "trigger probes; give the control plane's identity, e.g. --tls-allow-client "
                      "spiffe://cluster.local/ns/llm/sa/xds-server")

SIGHUP_IGNORED = ("SIGHUP: nothing to reload, still running (TLS files are re-read when they change; "
                  "other flags need a restart)")


def _start_failure(cfg: AgentConfig, agent: object, exc: OSError) -> str:
    """One line naming the flag of what could not start."""
    if cfg.metrics_listen is not None and getattr(agent, "metrics_port", None) is None:
        return bind_failure(cfg.metrics_listen, "--metrics-listen", exc)
    if cfg.listen is not None and str(exc).startswith(f"cannot listen on {cfg.listen}"):
        return bind_failure(cfg.listen, "--listen", exc.__cause__)
    text = str(exc)  # TLS files: the config's field names, said as this command's flags
    for field, flag in (("tls_cert_file", "--tls-cert"), ("tls_key_file", "--tls-key"),
                        ("tls_client_ca_file", "--tls-client-ca"),
                        ("control_plane_ca_file", "--control-plane-ca-file"),
                        ("client_cert_file", "--client-cert-file"), ("client_key_file", "--client-key-file")):
        text = text.replace(field, flag)
    return text


async def _serve(cfg: AgentConfig) -> int:
    from node_probe.agent import ProbeAgent

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    log = logging.getLogger("node_probe")
    handlers = ((signal.SIGTERM, stop.set), (signal.SIGINT, stop.set),
                (signal.SIGHUP, lambda: log.warning(SIGHUP_IGNORED)))
    for sig, fn in handlers:
        try:
            loop.add_signal_handler(sig, fn)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    agent = ProbeAgent(cfg)
    try:
        try:
            port = await agent.start()
        except OSError as exc:
            print(f"node-probe: {_start_failure(cfg, agent, exc)}", file=sys.stderr, flush=True)
            logging.getLogger("node_probe.agent").setLevel(logging.WARNING)  # the one line stays the last
            return 1
        if cfg.tls_client_ca_file is not None and not cfg.tls_allow_clients:
            log.warning(NO_ALLOWED_CLIENTS)
        watch = agent.metrics.cert_watch()
        if watch is not None:
            watch.reasons()  # a certificate near its end: the warning line now
        if cfg.listen is not None:
            host = cfg.listen.rpartition(":")[0]
            print(f"node-probe {cfg.node_id} listening on {host}:{port} engine={cfg.engine_url}", flush=True)
        if cfg.control_planes:
            print(f"node-probe {cfg.node_id} dialling {','.join(cfg.control_planes)} engine={cfg.engine_url}",
                  flush=True)
        await stop.wait()
        return 0
    finally:
        await agent.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``node-probe`` console script. Returns the process exit code.

    Raises:
        SystemExit: (code 2) bad arguments, (code 0) ``--help``.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "sim-engine":
        from node_probe import sim  # only this subcommand needs it

        return int(sim.main(args_list[1:]) or 0)
    if args_list and args_list[0] == "agent":
        args_list = args_list[1:]

    quiet_grpc_core()  # before grpc is imported: no raw C-core lines on a failed bind
    args = build_parser().parse_args(args_list)
    configure_logging(args.log_level, args.log_format)
    return run_main("node-probe", lambda: _run(args), lambda: args.log_level == "DEBUG")


def _listen_of(args: argparse.Namespace) -> str | None:
    """The config's ``listen``: as given, None for ``none``; not given: 127.0.0.1:50051, or None
    (no gRPC port) with ``--control-plane``."""
    if args.listen is None:
        return None if args.control_planes else "127.0.0.1:50051"
    return None if args.listen == NO_LISTEN else str(args.listen)


def _run(args: argparse.Namespace) -> int:
    from node_probe.agent import AgentConfig
    from node_probe.replay import ReplayLimits

    extra = {} if args.fatal_xids is None else {"fatal_xids": args.fatal_xids}
    try:
        cfg = AgentConfig(
            engine_kind=args.engine_kind,
            metrics_url=args.metrics_url,
            stall_window_ms=args.stall_window_ms,
            deep_check_interval_s=args.deep_check_interval_s or None,
            deep_check_prompt=args.deep_check_prompt,
            deep_check_expect=args.deep_check_expect,
            **extra,
            engine_url=args.engine_url,
            listen=_listen_of(args),
            metrics_listen=args.metrics_listen,
            node_id=args.node_id or socket.gethostname(),
            heartbeat_interval_ms=args.heartbeat_interval_ms, transport_liveness=args.transport_liveness,
            min_ping_interval_ms=args.min_ping_interval_ms,
            metrics_interval_ms=args.metrics_interval_ms,
            probe_interval_s=args.probe_interval_s,
            probe_idle_interval_s=args.probe_idle_interval_s,
            probe_jitter_ratio=args.probe_jitter,
            probe_timeout_ms=args.probe_timeout_ms,
            min_probe_now_interval_ms=args.min_probe_now_interval_ms,
            gpu_interval_s=args.gpu_interval_s,
            model=args.model,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            tls_client_ca_file=args.tls_client_ca,
            tls_allow_clients=tuple(args.tls_allow_clients),
            tls_expiry_warning_days=args.tls_expiry_warning_days,
            plaintext=args.plaintext,
            replay=ReplayLimits(max_prompts=16 if args.replay else 0,
                                busy_max_waiting=args.replay_busy_max_waiting),
            control_planes=tuple(args.control_planes), cluster=args.cluster, serving_address=args.serving_address,
            region=args.region, zone=args.zone, sub_zone=args.sub_zone, priority=args.priority,
            capacity=args.capacity, control_plane_ca_file=args.control_plane_ca_file,
            client_cert_file=args.client_cert_file, client_key_file=args.client_key_file,
            control_plane_server_name=args.control_plane_server_name,
        )
    except ValueError as exc:
        build_parser().error(str(exc))  # exits 2
    try:
        return asyncio.run(_serve(cfg))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
