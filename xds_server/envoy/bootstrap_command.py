"""``xds-server envoy-bootstrap``: render an Envoy bootstrap (envoy.yaml) for this control plane,
optionally for several control planes (``--group``), request classes (``--classes``) and TLS to
the ADS port (``--xds-tls-*``). Exit codes as the rest of ``xds-server`` (:data:`xds_server.cli.EXIT_CODES`).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["add_bootstrap_parser"]


def add_bootstrap_parser(cmd: Callable[[str, str, Callable[[argparse.Namespace], int]], Any]) -> None:
    """Register the ``envoy-bootstrap`` command through the CLI's ``cmd(name, help, fn)``."""
    eb = cmd("envoy-bootstrap", "render an Envoy bootstrap (envoy.yaml) for this control plane", _envoy_bootstrap)
    eb.add_argument("--xds-port", type=_port, default=18000, help="xds-server's ADS port (default 18000)")
    eb.add_argument("--listener-port", type=_port, default=10000, help="Envoy's HTTP listener (default 10000)")
    eb.add_argument("--admin-port", type=_port, default=9901, help="Envoy's admin port (default 9901)")
    eb.add_argument("--cluster", default=None, help="cluster routed for /v1/ (default llm; not with --group)")
    eb.add_argument("--node-id", default="envoy-llm-gw-1", help="Envoy's node id (default envoy-llm-gw-1)")
    eb.add_argument("--api", choices=("GRPC", "DELTA_GRPC"), default="GRPC", help="ADS variant (default GRPC)")
    eb.add_argument("--per-try-timeout-s", type=float, default=None, help="retry per-try timeout (default 10)")
    eb.add_argument("--xds-tls-ca", default=None, metavar="PEM",
                    help="connect to the ADS port over TLS, verifying xds-server with this CA "
                         "(default: plaintext)")
    eb.add_argument("--xds-tls-cert", default=None, metavar="PEM",
                    help="Envoy's client certificate (mutual TLS; default: none)")
    eb.add_argument("--xds-tls-key", default=None, metavar="PEM", help="its private key (default: none)")
    eb.add_argument("--xds-tls-server-name", default=None,
                    help="DNS SAN xds-server's certificate must carry (also sent as SNI; default: none, "
                         "the CA alone decides)")
    eb.add_argument("--xds-tls-sds", default=None, metavar="DIR",
                    help="write the certificate and CA as filesystem SDS files into DIR and point Envoy "
                         "at them (Envoy watches DIR: rotation without restart; default: inline files)")
    eb.add_argument("--xds", action="append", metavar="HOST:PORT",
                    help="a replica of the control plane (repeat for each; default 127.0.0.1:--xds-port)")
    eb.add_argument("--group", action="append", metavar="CONFIG[=HOST:PORT,...]",
                    help="several control planes: one per group of clusters, given by its xds-server config "
                    "file and its replicas' ADS addresses (default its xds.listen); repeat per group")
    eb.add_argument("--route-header", default="x-sentinel-cluster",
                    help="with --group: the request header naming the cluster (default x-sentinel-cluster)")
    eb.add_argument("--classes", nargs="?", const="", default=None, metavar="CONFIG",
                    help="route request classes (lrs.shed.classes: header and names from the xds-server CONFIG "
                    "given, else the defaults x-sentinel-priority: sheddable | standard | critical); with "
                    "--group each group's config says it (default: none)")
    eb.add_argument("-o", "--output", default=None, help="file to write (default stdout)")


def _envoy_bootstrap(args: argparse.Namespace) -> int:
    import yaml

    from xds_server.config import ConfigError, ShedClassesConfig, load_config
    from xds_server.envoy.bootstrap import ControlPlaneGroup, render_bootstrap

    if args.group and args.classes is not None:
        print("xds-server: --classes is for one control plane: with --group, each group's config says whether "
              "its clusters route request classes (lrs.shed.classes.enabled)", file=sys.stderr)
        return 2
    try:
        groups = []
        for spec in args.group or ():
            path, _, addrs = spec.partition("=")
            groups.append(ControlPlaneGroup.from_config(path, [a for a in addrs.split(",") if a]))
        classes = None if args.classes is None else (
            load_config(args.classes).lrs.shed.classes if args.classes else ShedClassesConfig())
        doc = render_bootstrap(xds_port=args.xds_port, listener_port=args.listener_port,
                               admin_port=args.admin_port, cluster=args.cluster, node_id=args.node_id,
                               api_type=args.api, per_try_timeout_s=args.per_try_timeout_s,
                               xds_replicas=args.xds or (), groups=groups, route_header=args.route_header,
                               classes=None if classes is None else classes.model_copy(update={"enabled": True}))
    except ConfigError as e:
        print(f"xds-server: --group/--classes: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"xds-server: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"xds-server: cannot read the bootstrap template: {e}", file=sys.stderr)
        return 1
    if args.xds_tls_ca:
        try:
            _bootstrap_tls(args, doc)
        except (OSError, ValueError) as e:
            print(f"xds-server: {e}", file=sys.stderr)
            return 2 if isinstance(e, ValueError) else 1
    elif args.xds_tls_cert or args.xds_tls_key or args.xds_tls_sds or args.xds_tls_server_name:
        print("xds-server: --xds-tls-cert/--xds-tls-key/--xds-tls-server-name/--xds-tls-sds need --xds-tls-ca",
              file=sys.stderr)
        return 2
    text = yaml.safe_dump(doc, sort_keys=False)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            print(f"xds-server: cannot write {args.output}: {e}", file=sys.stderr)
            return 1
        if groups:
            where = "; ".join(f"group {g.name}: {', '.join(c.name for c in g.clusters)} from "
                              f"{', '.join(g.replicas)}" for g in groups)
        else:
            where = f"ADS {', '.join(args.xds or [f'127.0.0.1:{args.xds_port}'])}, cluster {args.cluster}"
        print(f"wrote {args.output} ({where}; listener :{args.listener_port}, admin :{args.admin_port})")
    return 0


def _bootstrap_tls(args: argparse.Namespace, doc: dict) -> None:
    """Add TLS to the bootstrap's xds_cluster (absolute paths; with --xds-tls-sds also write the
    SDS file). Raises ValueError for a lone cert or key, OSError when the SDS file cannot be written."""
    import yaml

    from xds_server.envoy.tls import add_xds_tls, xds_tls_sds_secrets, xds_tls_transport_socket

    def absolute(v: str | None) -> str | None:
        return os.path.abspath(v) if v else None

    ca: str = os.path.abspath(args.xds_tls_ca)  # set: the caller checked
    cert, key, sds = absolute(args.xds_tls_cert), absolute(args.xds_tls_key), absolute(args.xds_tls_sds)
    if sds:
        os.makedirs(sds, exist_ok=True)
        for name, secret in xds_tls_sds_secrets(ca, cert, key, args.xds_tls_server_name).items():
            with open(os.path.join(sds, name), "w", encoding="utf-8") as f:
                f.write(yaml.safe_dump(secret, sort_keys=False))
    add_xds_tls(doc, xds_tls_transport_socket(ca, cert, key, args.xds_tls_server_name, sds))


def _port(v: str) -> int:
    try:
        p = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port {v!r} is not an integer") from None
    if not 1 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port {p} outside 1..65535")
    return p
