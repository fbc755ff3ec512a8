"""The admin edge: regression tests and a hypothesis run of hostile HTTP requests against
a real admin endpoint (a ControlPlane with in-memory probe sources, real aiohttp server)."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from admin_stack import healthy_admin_stack, three_node_admin_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xds_server.admin import access as admin_access

TOKEN = "s3cret-token"


def config() -> dict:
    return three_node_admin_config(TOKEN, events_buffer=50)


@pytest.fixture
async def admin():
    """(control plane, in-memory probes, base URL); every node HEALTHY."""
    async with healthy_admin_stack(config()) as stack:
        yield stack


async def raw(port: int, data: bytes, timeout_s: float = 5.0, cap: int = 4 << 20) -> bytes:
    """Send ``data`` on a fresh connection; everything the server answers (up to ``cap`` bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        async with asyncio.timeout(timeout_s):
            while len(out) < cap:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                out += chunk
        return out
    except (ConnectionError, TimeoutError):
        return b""
    finally:
        writer.close()


def status_of(answer: bytes) -> int | None:
    if not answer.startswith(b"HTTP/1."):
        return None
    return int(answer.split(b" ", 2)[1])


def tracebacks(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info or r.exc_text or "Traceback" in r.getMessage()]


async def test_events_negative_limit_is_400_with_a_clear_message(admin):
    _, _, url = admin
    async with aiohttp.ClientSession(url) as http:
        for q, code in (("-5", 400), ("abc", 400), ("1.5", 400), ("", 400), ("0", 200), ("3", 200),
                        ("9" * 30, 200)):
            async with http.get(f"/events?limit={q}") as r:
                body = await r.json()
            assert r.status == code, q
            if code == 400:
                assert "limit must be an integer >= 0" in body["error"]
            else:
                assert len(body["events"]) <= (int(q) if len(q) < 5 else 50)


async def test_admin_token_is_compared_in_constant_time(admin, monkeypatch):
    _, _, url = admin
    calls = []
    real = admin_access.hmac.compare_digest  # the one token check (xds_server.admin.access)

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(admin_access.hmac, "compare_digest", spy)
    async with aiohttp.ClientSession(url) as http:
        async with http.post("/nodes/n0/drain", headers={"Authorization": "Bearer s3cret-tokex"}) as r:
            assert r.status == 401
        async with http.post("/nodes/n0/drain", headers={"Authorization": "Bearer ünï"}) as r:
            assert r.status == 401
        async with http.post("/nodes/n0/undrain", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200
    assert [b for _, b in calls] == [f"Bearer {TOKEN}".encode()] * 3


async def test_malformed_http_never_logs_a_traceback(admin, caplog):
    cp, _, _ = admin
    caplog.set_level(logging.DEBUG)
    cases = [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),          # TLS hello
        b"GET /nodes HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"GET /nodes HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20_000 + b"\r\n\r\n",         # header too long
        b"GET /" + b"n" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",                     # line too long
        b"GET /nodes HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\n",
        b"POST /nodes/n0/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n",       # body never comes
        b"GET /nodes HTTP/9.9\r\n\r\n",
        b"\r\n\r\n\r\n",
        b"GET /nodes\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    for data in cases:
        answer = await raw(cp.admin_port, data, timeout_s=1.0)
        code = status_of(answer)
        assert code is None or code < 500, (data[:40], answer[:200])
    assert tracebacks(caplog) == []
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= len(cases)


async def test_drain_reason_and_node_id_are_escaped_in_logs_and_bounded_in_events(admin, caplog):
    cp, _, url = admin
    caplog.set_level(logging.INFO)
    forged = "maint\nINFO xds_server.server: node n1: HEALTHY -> UNHEALTHY (forged)" + "x" * 5_000
    async with aiohttp.ClientSession(url) as http:
        async with http.post("/nodes/n0/drain", params={"reason": forged},
                             headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200 and (await r.json())["state"] == "DRAINING"
        async with http.get("/nodes/" + "%0AFORGED" * 500) as r:
            body = await r.json()
            assert r.status == 404 and "\n" not in body["error"] and len(body["error"]) < 120
        async with http.get("/events?limit=1") as r:
            ev = (await r.json())["events"][0]
    assert ev["to"] == "DRAINING" and len(ev["reason"]) <= cp.config.admin.drain_reason_max_chars + 40
    assert all("\n" not in r.getMessage() for r in caplog.records)
    assert any("drain requested: maint\\n" in r.getMessage() for r in caplog.records)


async def test_config_dump_never_shows_the_admin_token(admin):
    _, _, url = admin
    async with aiohttp.ClientSession(url) as http:
        async with http.get("/config_dump") as r:
            text = await r.text()
    assert r.status == 200 and TOKEN not in text and "<redacted>" in text


# -- hypothesis: hostile requests ---------------------------------------------------------------

_PATHS = ["/", "/healthz", "/readyz", "/nodes", "/nodes/n0", "/nodes/n0/drain", "/nodes/n1/undrain",
          "/clusters", "/xds/clients", "/config_dump", "/events", "/metrics", "/nodes/%00", "/../etc/passwd"]
_token = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789-_.~!$&'*+^`|"), min_size=1, max_size=12)
_qtext = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e, exclude_characters="#"), max_size=40)
_hval = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=60)


@st.composite
def requests(draw) -> bytes:
    method = draw(st.one_of(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]), _token))
    path = draw(st.one_of(st.sampled_from(_PATHS), st.builds(lambda a, b: f"/{a}/{b}", _token, _token)))
    query = draw(st.one_of(st.just(""), st.builds(lambda q: "?" + q, _qtext),
                           st.sampled_from(["?limit=-5", "?limit=1e9", "?limit=99999999999999999999999",
                                            "?reason=%0Aforged&limit=%ff", "?limit=nan"])))
    headers = draw(st.lists(st.tuples(_token, _hval), max_size=5))
    if draw(st.booleans()):
        headers.append(("Authorization", draw(st.sampled_from([f"Bearer {TOKEN}", "Bearer x", "Basic ==", ""]))))
    body = draw(st.binary(max_size=200))
    lines = [f"{method} {path}{query} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in ("content-length", "transfer-encoding", "host")]
    lines += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=requests())
async def test_hostile_admin_requests_get_no_5xx_no_traceback_and_bounded_answers(admin, caplog, data):
    cp, _, _ = admin
    caplog.set_level(logging.DEBUG)
    answer = await raw(cp.admin_port, data)
    code = status_of(answer)
    assert code is None or code < 500, (data[:200], answer[:300])
    assert len(answer) < 1 << 20
    assert tracebacks(caplog) == []
    assert cp.sessions["n0"] is not None and (await raw(cp.admin_port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                                                         b"Connection: close\r\n\r\n")).startswith(b"HTTP/1.1 200")
