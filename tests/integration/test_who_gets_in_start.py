"""Who gets in, checked at start, with real `xds-server` and `node-probe` processes and certificates made here:
an admin port off loopback without a token and an expired certificate are refused by both
`check-config` and `serve` (exit 2, naming the field); a certificate near its end warns in the log
and on /readyz; an agent in mutual TLS without an allowed client says so."""
from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import yaml

from xds_server.testing import ManagedProcess, TestCA, free_port, wait_for

PY = sys.executable


def _doc(**extra) -> dict:
    doc = {"xds": {"listen": f"127.0.0.1:{free_port()}", "warmup_timeout_ms": 0},
           "admin": {"listen": f"127.0.0.1:{free_port()}"},
           "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:1",
                                                   "probe_address": f"127.0.0.1:{free_port()}"}]}]}
    doc.update(extra)
    return doc


def _both(tmp_path: Path, doc: dict, cmds: tuple[str, ...] = ("check-config", "serve")
          ) -> list[subprocess.CompletedProcess[str]]:
    """Run each command on ``doc`` (``serve`` only where it is refused: it would stay up)."""
    path = tmp_path / "xds.yaml"
    path.write_text(yaml.safe_dump(doc))
    return [subprocess.run([PY, "-m", "xds_server.cli", cmd, str(path)], capture_output=True, text=True, timeout=60)
            for cmd in cmds]


def test_admin_off_loopback_without_a_token_exits_2_naming_admin_token_in_check_config_and_serve(tmp_path):
    for listen in ("0.0.0.0:0", "[::]:0", "10.1.2.3:19000"):
        for r in _both(tmp_path, _doc(admin={"listen": listen})):
            assert r.returncode == 2, (listen, r.args, r.stdout, r.stderr)
            assert f"admin.token: admin.listen {listen} is not a loopback address" in r.stderr, r.stderr
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    (ok,) = _both(tmp_path, _doc(admin={"listen": "0.0.0.0:0", "token_file": str(token_file)}), ("check-config",))
    assert ok.returncode == 0, ok.stderr  # with a token (here from a file) it may listen there


def test_an_expired_certificate_is_refused_at_load_naming_its_field(tmp_path):
    ca = TestCA(tmp_path / "pki", "ca")
    good = ca.issue("good", dns=["localhost"], ips=["127.0.0.1"])
    old = ca.issue("old", dns=["localhost"], ips=["127.0.0.1"], valid_from_s=-7200, valid_for_s=3600)
    cases = {
        "tls: cert_file": {"tls": {"mode": "tls", "cert_file": old.cert, "key_file": old.key}},
        "tls.agents: cert_file": {"tls": {"mode": "plaintext", "agents": {
            "mode": "mtls", "ca_file": ca.cert, "cert_file": old.cert, "key_file": old.key}}},
        "admin.tls: cert_file": {"admin": {"listen": f"127.0.0.1:{free_port()}", "token": "t",
                                           "tls": {"cert_file": old.cert, "key_file": old.key}}},
    }
    for field, extra in cases.items():
        for r in _both(tmp_path, _doc(**extra)):
            assert r.returncode == 2, (field, r.args, r.stderr)
            assert field in r.stderr and f"certificate {old.cert} expired at " in r.stderr, r.stderr
    (ok,) = _both(tmp_path, _doc(tls={"mode": "tls", "cert_file": good.cert, "key_file": good.key}), ("check-config",))
    assert ok.returncode == 0, ok.stderr


async def test_a_certificate_near_its_end_warns_in_the_log_and_on_readyz(tmp_path):
    ca = TestCA(tmp_path / "pki", "ca")
    srv = ca.issue("xds", dns=["localhost"], ips=["127.0.0.1"])  # ends a day from now: inside the 7-day default
    admin_port = free_port()
    doc = _doc(tls={"mode": "tls", "cert_file": srv.cert, "key_file": srv.key},
               admin={"listen": f"127.0.0.1:{admin_port}"})
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump(doc))
    proc = ManagedProcess("xds-server", [PY, "-m", "xds_server.cli", "serve", str(tmp_path / "xds.yaml")],
                          tmp_path / "xds.log", ready_pattern="admin listening")
    try:
        proc.start()
        log = (tmp_path / "xds.log").read_text()
        assert f"TLS: certificate {srv.cert} (xds_server) expires in 1.0 days" in log
        assert "renew it (warning window 7.0 days)" in log
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async def readyz() -> dict:
                async with s.get(f"http://127.0.0.1:{admin_port}/readyz") as r:
                    return await r.json()
            body = await wait_for(readyz, timeout_s=10.0, step_s=0.2)
        (warning,) = body["certificate_warnings"]
        assert warning.startswith(f"certificate {srv.cert} (xds_server) expires in 1.0 days (")
        assert "certificate" not in (body["why_not_ready"] or "")  # not expired yet: it still works
    finally:
        proc.stop()
    # A window that does not reach it: no warning.
    doc["tls"]["expiry_warning_days"] = 0.5
    doc["admin"]["listen"] = f"127.0.0.1:{free_port()}"
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump(doc))
    quiet = ManagedProcess("xds-server", [PY, "-m", "xds_server.cli", "serve", str(tmp_path / "xds.yaml")],
                           tmp_path / "quiet.log", ready_pattern="admin listening")
    try:
        quiet.start()
        assert "expires in" not in (tmp_path / "quiet.log").read_text()
    finally:
        quiet.stop()


def test_an_agent_in_mutual_tls_without_allowed_clients_warns_at_start(tmp_path):
    ca = TestCA(tmp_path / "pki", "ca")
    srv = ca.issue("agent", dns=["localhost"], ips=["127.0.0.1"])
    base = [PY, "-m", "node_probe.cli", "--engine-url", f"http://127.0.0.1:{free_port()}", "--node-id", "a",
            "--tls-cert", srv.cert, "--tls-key", srv.key, "--tls-client-ca", ca.cert]
    logs, expiry = {}, {}
    for name, extra in (("open", []), ("allowed", ["--tls-allow-client", "spiffe://cluster.local/ns/llm/sa/xds-server",
                                                    "--tls-expiry-warning-days", "0.5"])):
        metrics_port = free_port()
        proc = ManagedProcess(f"agent-{name}", [*base, "--listen", f"127.0.0.1:{free_port()}", *extra,
                                                "--metrics-listen", f"127.0.0.1:{metrics_port}"],
                              tmp_path / f"{name}.log", ready_pattern="listening")
        try:
            proc.start()
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            expiry[name] = [ln for ln in text.splitlines() if ln.startswith("node_probe_tls_certificate_expiry_days{")]
        finally:
            proc.stop()
        logs[name] = (tmp_path / f"{name}.log").read_text()
    warning = "mutual TLS without --tls-allow-client: any certificate the CA in --tls-client-ca signed"
    assert warning in logs["open"] and warning not in logs["allowed"]
    # Its certificates are watched too: a day left is inside the 7-day default, outside 0.5 days.
    assert f"TLS: certificate {srv.cert} (agent_server) expires in 1.0 days" in logs["open"]
    assert "expires in" not in logs["allowed"]
    (line,) = [ln for ln in expiry["open"] if 'role="agent_server"' in ln]
    assert 'node="a"' in line and 0.9 < float(line.rsplit(" ", 1)[1]) < 1.01
