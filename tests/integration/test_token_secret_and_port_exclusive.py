"""Secrets and ports, with real `xds-server serve` processes: the admin bearer token
appears in no admin answer and no log line, and a second server on the same ADS port fails to
start with a clear error instead of sharing the port (grpc's SO_REUSEPORT turned off)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml

from xds_server.testing import ManagedProcess, free_port, wait_for

TOKEN = "s3cr3t-T0ken-4f9a1c77e2"


def write_config(path: Path, xds_port: int, admin_port: int) -> Path:
    cfg = {
        "xds": {"listen": f"127.0.0.1:{xds_port}", "warmup_timeout_ms": 0},
        "admin": {"listen": f"127.0.0.1:{admin_port}", "token": TOKEN},
        "health": {"reconnect_backoff_initial_ms": 200, "reconnect_backoff_max_ms": 1000},
        "clusters": [{"name": "llm", "nodes": [
            {"id": "a", "address": "127.0.0.1:8001", "probe_address": f"127.0.0.1:{free_port()}"},
            {"id": "b", "address": "127.0.0.1:8002", "probe_address": f"127.0.0.1:{free_port()}"}]}],
    }
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def serve(config: Path, log: Path) -> ManagedProcess:
    return ManagedProcess("xds-server", [sys.executable, "-m", "xds_server.cli", "serve", "--config", str(config)],
                          log, ready_pattern="admin listening")


async def test_security_01_token_in_0_of_11_admin_answers_and_0_log_lines(tmp_path):
    xds_port, admin_port = free_port(), free_port()
    proc = serve(write_config(tmp_path / "xds.yaml", xds_port, admin_port), tmp_path / "server.log")
    base = f"http://127.0.0.1:{admin_port}"
    try:
        proc.start()
        answers: dict[str, str] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async def ready() -> bool:
                async with s.get(f"{base}/nodes") as r:
                    return r.status == 200
            await wait_for(ready, timeout_s=10.0, step_s=0.1)
            for path in ("/healthz", "/readyz", "/nodes", "/nodes/a", "/clusters", "/xds/clients",
                         "/config_dump", "/events", "/metrics"):
                async with s.get(base + path) as r:
                    answers[path] = f"{r.status} {dict(r.headers)} {await r.text()}"
            async with s.post(f"{base}/nodes/a/drain", headers={"Authorization": "Bearer wrong"}) as r:
                answers["drain wrong token"] = f"{r.status} {dict(r.headers)} {await r.text()}"
                assert r.status == 401
            async with s.post(f"{base}/nodes/a/drain?reason=maint",
                              headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                answers["drain"] = f"{r.status} {dict(r.headers)} {await r.text()}"
                assert r.status == 200
        assert len(answers) == 11
        assert '"<redacted>"' in answers["/config_dump"]  # the field is there, its value is not
        leaked = [p for p, text in answers.items() if TOKEN in text]
        assert leaked == []
    finally:
        code = proc.stop()
    log = (tmp_path / "server.log").read_text(encoding="utf-8", errors="replace")
    assert "admin listening" in log and log.count("\n") >= 2
    # a clean SIGTERM says so in the log, and exits 0
    assert code == 0 and "SIGTERM: stopping" in log and "INFO xds_server.server: stopped" in log.splitlines()[-1], \
        (code, log[-500:])
    assert TOKEN not in log


async def test_security_02_second_server_on_the_same_ads_port_exits_1_naming_xds_listen(tmp_path):
    xds_port = free_port()
    first = serve(write_config(tmp_path / "a.yaml", xds_port, free_port()), tmp_path / "a.log")
    try:
        first.start()
        second = subprocess.run(
            [sys.executable, "-m", "xds_server.cli", "serve", "--config",
             str(write_config(tmp_path / "b.yaml", xds_port, free_port()))],
            capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"cannot bind xDS port 127.0.0.1:{xds_port} (xds.listen)" in second.stderr
        assert "ADS listening" not in second.stdout
        assert first.alive()
    finally:
        first.stop()

