"""The admin endpoint as the ``status``, ``drain``, ``undrain`` and ``reload`` commands see it:
one request, and one line naming what is wrong and the flag to change when the answer is not
what an xds-server admin endpoint answers (nothing listening, a gRPC port such as the ADS port,
another HTTP server such as Envoy's admin, a refused token, an unknown node).

No aiohttp and no control plane here (the commands start in ~0.3 s): urllib only.

``AdminError.code``: 1 for a runtime failure (unreachable, not ours), 3 for a refusal by the
server (token, unknown node, invalid config), as ``xds-server --help`` documents.
"""
from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from xds_server.process.untrusted import for_log

__all__ = ["AdminError", "admin_base_url", "drain_line", "get_json", "post_json"]

TOKEN_HINT = "--token or $XDS_SENTINEL_ADMIN_TOKEN (the server's admin.token)"
ADMIN_HINT = "--admin takes xds-server's admin.listen (default 127.0.0.1:19000)"


class AdminError(Exception):
    """One line for the operator; ``code``: the exit code (1 runtime failure, 3 refused)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def admin_base_url(value: str) -> str:
    """``host:port``, ``:port`` or an ``http(s)://`` URL -> the admin base URL, no trailing slash.

    Raises ValueError naming ``--admin`` when the value is neither.
    """
    v = value.strip()
    if "://" not in v:
        if v.startswith(":"):
            v = "127.0.0.1" + v
        v = "http://" + v
    u = urllib.parse.urlsplit(v)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or not u.hostname or (port is None and ":" in u.netloc.rsplit("]", 1)[-1]):
        raise ValueError(f"--admin: expected HOST:PORT or http(s)://HOST:PORT, got {value!r}")
    return v.rstrip("/")


def _where(base: str) -> str:
    return f"{urllib.parse.urlsplit(base).netloc} (--admin)"


def _unreachable(base: str, exc: BaseException) -> AdminError:
    """The one line for a request that got no HTTP answer."""
    reason = getattr(exc, "reason", exc)
    where = _where(base)
    if isinstance(reason, ConnectionRefusedError):
        return AdminError(f"nothing listens on {where}: is xds-server running? {ADMIN_HINT}")
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return AdminError(f"{where} did not answer in time: {ADMIN_HINT}")
    if isinstance(reason, ssl.SSLError):
        return AdminError(f"{where}: TLS failed ({for_log(str(reason), 200)}): is it https? {ADMIN_HINT}")
    if isinstance(exc, http.client.BadStatusLine) and str(exc).startswith("\x00"):
        return AdminError(f"{where} answers HTTP/2 (gRPC: the ADS port, xds.listen?), not the admin "
                          f"endpoint: {ADMIN_HINT}")
    if isinstance(exc, http.client.HTTPException | ConnectionResetError):
        return AdminError(f"{where} does not answer HTTP/1.1 as xds-server's admin does "
                          f"({type(exc).__name__}): {ADMIN_HINT}")
    return AdminError(f"cannot reach {where}: {for_log(str(reason), 200)}")


def _not_ours(base: str, path: str, status: int, server: str | None) -> AdminError:
    who = f"; its Server header says {for_log(server, 40)!r}" if server else ""
    hint = " (Envoy's admin?)" if server and server.lower().startswith("envoy") else ""
    return AdminError(f"{_where(base)} is not an xds-server admin endpoint{hint}: {path} answered "
                      f"HTTP {status}{who}; {ADMIN_HINT}")


def _error_field(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc.get("error") if isinstance(doc, dict) and isinstance(doc.get("error"), str) else None


def _request(base: str, path: str, req: urllib.request.Request, timeout_s: float) -> tuple[Any, str | None]:
    """(the parsed JSON answer, its Server header); AdminError for anything else."""
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body, server = r.read(), r.headers.get("Server")
    except urllib.error.HTTPError as e:
        detail = e.read(4096)
        error = _error_field(detail)
        if error is None:  # no {"error": ...}: not our admin endpoint
            raise _not_ours(base, path, e.code, e.headers.get("Server")) from None
        if e.code == 401:
            raise AdminError(f"refused: {for_log(error, 200)} (HTTP 401): pass {TOKEN_HINT}", 3) from None
        if e.code == 404 and "unknown node" in error:
            raise AdminError(f"refused: {for_log(error, 200)} (HTTP 404): NODE is an id that "
                             "`xds-server status` lists", 3) from None
        raise AdminError(f"refused: {for_log(error, 300)} (HTTP {e.code})",
                         3 if e.code in (400, 403, 404, 409, 422) else 1) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise _unreachable(base, e) from None
    try:
        return json.loads(body), server
    except ValueError:
        raise _not_ours(base, path, 200, server) from None


def get_json(base: str, path: str, timeout_s: float = 3.0) -> Any:
    """GET ``base + path`` -> its JSON; AdminError (one line) when it is not our answer."""
    doc, server = _request(base, path, urllib.request.Request(base + path), timeout_s)
    if path == "/nodes" and not (isinstance(doc, dict) and isinstance(doc.get("nodes"), list)):
        raise _not_ours(base, path, 200, server)
    return doc


def post_json(base: str, path: str, token: str, timeout_s: float = 10.0) -> Any:
    """POST ``base + path`` with the bearer ``token`` -> its JSON; AdminError (one line)."""
    req = urllib.request.Request(base + path, data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {token}"})
    return _request(base, path, req, timeout_s)[0]


def drain_line(cmd: str, view: dict) -> str:
    """One line for a ``drain``/``undrain`` answer (a node view): what the node is now, its
    published weight as ``status`` shows it, and why."""
    state = view.get("display_state") or view.get("state") or "?"
    reason = view.get("display_reason") or view.get("reason") or ""
    routed = view.get("routed", view.get("eds_health_status") == "HEALTHY")
    weight = view.get("weight") if routed else "-"
    return (f"{cmd} {for_log(str(view.get('id')), 64)}: now {state}, weight {weight}, "
            f"EDS {view.get('eds_health_status')}: {for_log(str(reason), 200)}")
