"""How the agent meets its control planes, both ways; the streams of both are served by the agent's
one :class:`~node_probe.streams.StreamHub`.

- dial-out: :func:`open_listener` -> the started ``grpc.aio.Server`` serving ``NodeProbe`` on
  ``cfg.listen`` (control planes dial it and open ``Watch`` streams), its bound port and its
  certificate files (TLS) or None.
- dial-in: :func:`open_dialer` -> a started :class:`~node_probe.dialer.ControlPlaneDialer` holding
  one ``ProbeHub.Connect`` stream to each of ``cfg.control_planes`` (each address of a DNS name),
  each opened with :func:`register_message`.
"""

from __future__ import annotations

import grpc

from node_probe.config import AgentConfig
from node_probe.dialer import ControlPlaneDialer
from node_probe.proto import probe_pb2, probe_pb2_grpc
from node_probe.streams import StreamHub
from xds_server.process.commandline import version
from xds_server.process.tls import ClientTls, ServerCertFiles, add_port, channel_credentials, listener_credentials

__all__ = ["client_tls", "open_dialer", "open_listener", "register_message"]


def register_message(cfg: AgentConfig) -> probe_pb2.Register:
    """The ``Register`` a dial-in stream opens with: the node as ``cfg`` describes it; what the config
    leaves unsaid stays empty (address "", priority 0, capacity 0), so the control plane's config
    fills it in and never sees a conflict the operator did not write."""
    return probe_pb2.Register(
        node_id=cfg.node_id, cluster=cfg.cluster, address=cfg.serving_address or "",
        locality=probe_pb2.Locality(region=cfg.region, zone=cfg.zone, sub_zone=cfg.sub_zone),
        priority=cfg.priority, capacity=cfg.capacity or 0, agent_version=version())


def client_tls(cfg: AgentConfig) -> ClientTls | None:
    """How dial-in dials: TLS from ``control_plane_ca_file`` (with the client certificate: mutual
    TLS), None for plaintext. The files are loaded once here, so a bad one fails the start.

    Raises:
        OSError: a file does not load (ssl.SSLError included; an expired client certificate too);
            the message names the fields.
    """
    if cfg.control_plane_ca_file is None:
        return None
    tls = ClientTls(cfg.control_plane_ca_file, cfg.client_cert_file, cfg.client_key_file,
                    cfg.control_plane_server_name)
    try:
        channel_credentials(tls)
    except OSError as exc:
        raise OSError(f"cannot load the dial-in TLS files (control_plane_ca_file {tls.ca_file}, client_cert_file "
                      f"{tls.cert_file}, client_key_file {tls.key_file}): {exc}") from exc
    return tls


def open_dialer(cfg: AgentConfig, hub: StreamHub) -> ControlPlaneDialer:
    """Start dialling ``cfg.control_planes`` (call from the running event loop).

    Raises:
        OSError: the TLS files do not load (:func:`client_tls`).
    """
    dialer = ControlPlaneDialer(cfg.control_planes, hub, lambda: register_message(cfg), tls=client_tls(cfg))
    dialer.start()
    return dialer


async def open_listener(cfg: AgentConfig, servicer: probe_pb2_grpc.NodeProbeServicer
                        ) -> tuple[grpc.aio.Server, int, ServerCertFiles | None]:
    """Bind and start the gRPC server serving ``servicer`` on ``cfg.listen`` (TLS when the config has a
    certificate): (server, bound port, certificate files or None).

    Raises:
        OSError: the address cannot be bound ("cannot listen on ADDRESS: ..."), or the TLS files do
            not load (naming the ``tls_`` fields).
    """
    assert cfg.listen is not None
    server = grpc.aio.server(
        options=[
            ("grpc.keepalive_time_ms", cfg.grpc_keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", cfg.min_ping_interval_ms),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 0),
        ]
    )
    probe_pb2_grpc.add_NodeProbeServicer_to_server(servicer, server)
    try:
        mode = None if not cfg.tls_cert_file else "mtls" if cfg.tls_client_ca_file else "tls"
        creds, tls_files = listener_credentials(mode, cfg.tls_cert_file, cfg.tls_key_file,
                                                cfg.tls_client_ca_file, fields="tls_")
        port = add_port(server, cfg.listen, creds)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {cfg.listen}: {exc}") from exc
    if not port:
        raise OSError(f"cannot listen on {cfg.listen}")
    await server.start()
    return server, port, tls_files
