"""Who gets into the admin port, and what it serves with: the bearer token check shared by every
POST (drain, undrain, reload), counted and logged per peer; HTTPS (``admin.tls``); the site start;
the certificates the control plane watches (:class:`~xds_server.process.certs.CertWatch`).
"""
from __future__ import annotations

import hmac
import logging
import ssl
import time
from collections.abc import Callable

from aiohttp import web

from xds_server.config import SentinelConfig
from xds_server.config.admin import AdminConfig
from xds_server.config.base import parse_hostport
from xds_server.process.certwatch import CertWatch
from xds_server.process.commandline import bind_failure
from xds_server.process.refusals import Refusals

__all__ = ["REFUSALS", "admin_ssl_context", "refused_token", "start_admin_site", "watch_certificates"]

log = logging.getLogger("xds_server.admin")

REFUSALS = web.AppKey("refusals", Refusals)
"""The app's :class:`Refusals` (set by :func:`~xds_server.admin.app.build_admin_app` when the
control plane has one)."""


def refused_token(request: web.Request, token: str) -> str | None:
    """Why ``request`` does not carry ``Bearer <token>`` (``token_missing``, ``token_wrong``),
    else None. Compared in constant time; a refusal is counted and logged with the peer's address
    (never the token given), one line per peer per interval."""
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    if hmac.compare_digest(given, f"Bearer {token}".encode()):
        return None
    reason = "token_missing" if not given else "token_wrong"
    record = request.app.get(REFUSALS)
    if record is not None:
        record.refuse("admin", reason, request.remote or "?", "",
                      f"{request.method} {request.path[:100]}: {'no' if not given else 'a wrong'} bearer token")
    return reason


def admin_ssl_context(admin: AdminConfig) -> ssl.SSLContext | None:
    """The admin port's TLS server context (``admin.tls``); None for plain HTTP. Raises OSError
    naming the fields when the files do not load."""
    if admin.tls is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(admin.tls.cert_file, admin.tls.key_file)
    except OSError as e:  # ssl.SSLError included
        raise OSError(f"cannot load the admin certificate (admin.tls.cert_file {admin.tls.cert_file}, "
                      f"admin.tls.key_file {admin.tls.key_file}): {e}") from e
    return ctx


async def start_admin_site(runner: web.AppRunner, admin: AdminConfig) -> tuple[str, int, str]:
    """Bind ``admin.listen`` (HTTPS with ``admin.tls``) on ``runner`` (set up). Returns (host,
    bound port, scheme). Raises OSError naming admin.listen (or the certificate fields)."""
    host, port = parse_hostport(admin.listen)
    site = web.TCPSite(runner, host, port, ssl_context=admin_ssl_context(admin))
    try:
        await site.start()
    except OSError as exc:  # a bind failure is one line naming the field, as for xds.listen
        raise OSError(bind_failure(admin.listen, "admin.listen", exc)) from exc
    return host, runner.addresses[0][1], "https" if admin.tls else "http"


def watch_certificates(cfg: SentinelConfig, clock: Callable[[], float] = time.time) -> CertWatch:
    """Every certificate file the config uses, by role, within ``tls.expiry_warning_days``; the
    warning lines for those already near their end are written now (start)."""
    w = CertWatch(cfg.tls.expiry_warning_days * 86400.0, clock=clock)
    w.add("xds_server", cfg.tls.cert_file)
    w.add("xds_client_ca", cfg.tls.client_ca_file)
    w.add("agents_ca", cfg.tls.agents.ca_file)
    w.add("agents_client", cfg.tls.agents.cert_file)
    if cfg.admin.tls is not None:
        w.add("admin_server", cfg.admin.tls.cert_file)
    w.reasons()
    return w
