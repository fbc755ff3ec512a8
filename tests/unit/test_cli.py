"""The xds-server command line (global options anywhere, --version, config given
the same way to serve and check-config, status --admin forms, drain/undrain, envoy-bootstrap,
exit codes) and its log formats. Commands run as real subprocesses; drain/undrain talk to a
real admin endpoint (a ControlPlane with in-memory probe sources)."""
from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from xds_server.cli import EXIT_CODES, TOKEN_ENV, admin_base_url, build_parser
from xds_server.config import parse_config
from xds_server.probing.memory import InMemoryProbes
from xds_server.process.logs import JsonFormatter, TextFormatter
from xds_server.server import ControlPlane

CLI = [sys.executable, "-m", "xds_server.cli"]
TOKEN = "cli-token"
CONFIG = {
    "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
    "admin": {"listen": "127.0.0.1:0", "token": TOKEN},
    "health": {"ramp_start_percent": 100},
    "clusters": [{"name": "llm", "nodes": [
        {"id": "n0", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:9001"}]}],
}


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=60, env=env)


async def arun(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(*CLI, *args, stdout=asyncio.subprocess.PIPE,
                                             stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    return p.returncode, out.decode(), err.decode()


def test_global_options_before_and_after_the_command():
    p = build_parser()
    a = p.parse_args(["--log-level", "debug", "status"])
    assert a.log_level == "DEBUG" and a.cmd == "status"
    a = p.parse_args(["status", "--log-level", "warning", "--log-format", "json"])
    assert a.log_level == "WARNING" and a.log_format == "json"
    a = p.parse_args(["--log-format", "json", "check-config", "x.yaml"])
    assert a.log_format == "json" and a.config_pos == "x.yaml"


@pytest.mark.parametrize("argv", [["--log-level", "LOUD", "status"], ["status", "--log-format", "xml"]])
def test_invalid_global_option_is_usage_error(argv):
    r = run(*argv)
    assert r.returncode == 2
    assert ("--log-level" in r.stderr) or ("--log-format" in r.stderr)


def test_version_and_exit_codes_in_help():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("xds-server ") and r.stdout.strip() != "xds-server"
    r = run("--help")
    assert r.returncode == 0
    for code, text in EXIT_CODES.items():
        assert f"{code}  {text}" in r.stdout


def test_admin_base_url_forms():
    assert admin_base_url("127.0.0.1:19000") == "http://127.0.0.1:19000"
    assert admin_base_url(":19000") == "http://127.0.0.1:19000"
    assert admin_base_url("http://h:1/") == "http://h:1"
    assert admin_base_url("https://h.example:443") == "https://h.example:443"
    for bad in ("ftp://h:1", "h:notaport", "http://"):
        with pytest.raises(ValueError, match="--admin"):
            admin_base_url(bad)


def test_check_config_and_serve_take_config_both_ways(tmp_path: Path):
    cfg = tmp_path / "xds.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    for argv in (["check-config", str(cfg)], ["check-config", "--config", str(cfg)]):
        r = run(*argv)
        assert r.returncode == 0 and "OK (1 cluster(s), 1 node(s))" in r.stdout
    r = run("check-config")
    assert r.returncode == 2 and "config file is required" in r.stderr
    r = run("serve", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read config file" in r.stderr
    r = run("serve", str(cfg), "--config", str(tmp_path / "other.yaml"))
    assert r.returncode == 2 and "config given twice" in r.stderr


def test_envoy_bootstrap_renders_given_ports_and_cluster(tmp_path: Path):
    out = tmp_path / "envoy.yaml"
    r = run("envoy-bootstrap", "--xds-port", "18123", "--listener-port", "10123", "--admin-port", "9123",
            "--cluster", "big", "-o", str(out))
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    assert doc["admin"]["address"]["socket_address"]["port_value"] == 9123
    sr = doc["static_resources"]
    assert sr["listeners"][0]["address"]["socket_address"]["port_value"] == 10123
    xds = next(c for c in sr["clusters"] if c["name"] == "xds_cluster")
    ep = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert ep["address"]["socket_address"]["port_value"] == 18123
    hcm = sr["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert {r["route"]["cluster"] for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]} == {"big"}
    r = run("envoy-bootstrap", "--xds-port", "70000")
    assert r.returncode == 2 and "outside 1..65535" in r.stderr


async def test_drain_and_undrain_commands_against_a_real_admin_endpoint():
    probes = InMemoryProbes()
    cp = ControlPlane(parse_config(CONFIG), probe_sources=probes)
    await cp.start()
    try:
        probes["n0"].heartbeat()
        probes["n0"].probe(ttft_ms=20.0)
        hostport = f"127.0.0.1:{cp.admin_port}"
        env_ok = {**_env(), TOKEN_ENV: TOKEN}
        rc, out, err = await arun("drain", "n0", "--admin", hostport, "--reason", "maint", "--json", env=env_ok)
        assert rc == 0, err
        assert json.loads(out)["state"] == "DRAINING"
        assert cp.health["n0"].effective_state.value == "DRAINING"
        rc, out, err = await arun("status", "--admin", hostport, "--json")
        assert rc == 0 and json.loads(out)["nodes"][0]["state"] == "DRAINING"
        rc, out, err = await arun("drain", "n0", "--admin", hostport, env=env_ok)  # one line, as status
        assert rc == 0 and out.count("\n") == 1 and out.startswith("drain n0: now DRAINING, weight -, EDS DRAINING: ")
        rc, out, err = await arun("undrain", "n0", "--admin", f"http://{hostport}", "--token", TOKEN)
        assert rc == 0, err
        assert out.count("\n") == 1 and out.startswith("undrain n0: now "), out
        assert cp.health["n0"].effective_state.value != "DRAINING"
        rc, _, err = await arun("drain", "n0", "--admin", hostport, "--token", "wrong")
        assert rc == 3 and "401" in err and "--token" in err and err.count("\n") == 1
        rc, _, err = await arun("drain", "nope", "--admin", hostport, env=env_ok)
        assert rc == 3 and "unknown node 'nope'" in err and err.count("\n") == 1
        rc, _, err = await arun("drain", "n0", "--admin", hostport, env=_env())
        assert rc == 2 and TOKEN_ENV in err
    finally:
        await cp.stop()


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != TOKEN_ENV}


def _record(**extra) -> logging.LogRecord:
    r = logging.LogRecord("xds_server.x", logging.WARNING, __file__, 1, "ejected %s", ("n0",), None)
    for k, v in extra.items():
        setattr(r, k, v)
    return r


def test_log_formats_carry_structured_fields_escaped():
    rec = _record(node="n0", cluster="llm", reason="probe\ntimeout", version="v1")
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["msg"] == "ejected n0" and doc["level"] == "WARNING" and doc["node"] == "n0"
    assert doc["reason"] == "probe\\ntimeout" and doc["cluster"] == "llm" and doc["version"] == "v1"
    line = TextFormatter().format(rec)
    assert "\n" not in line and line.endswith("node=n0 cluster=llm reason=probe\\ntimeout version=v1")


def test_demo_prints_what_it_shortens_next_to_the_defaults():
    from xds_server.config import HealthConfig
    from xds_server.demo import shortened_settings

    rows = {name: (demo, prod) for name, demo, prod in shortened_settings()}
    h = HealthConfig()
    assert rows["health.probation.clean (half-open clean period)"] == ("3s", "1m") and h.probation.clean.s == 60
    assert rows["health.probation.ramp_step_percent / ramp_step (ramp)"] == ("+10 % per 300ms", "+1 % per 1s")
    assert rows["Envoy retry per_try_idle_timeout"] == ("2 s", "10s")


def _parsers():
    """(name, parser) for every program and xds-server subcommand."""
    import argparse

    from node_probe.cli import build_parser as probe_parser
    from sentinel_relay.cli import _parser as relay_parser

    out = [("node-probe", probe_parser()), ("sentinel-relay", relay_parser())]
    p = build_parser()
    out.append(("xds-server", p))
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += [(f"xds-server {name}", sp) for name, sp in action.choices.items()]
    return out


def test_every_flag_of_every_program_has_help_with_its_default():
    """--help of each program names every flag's default (the relay's showed
    none for --listen, --admin-listen, --workers, --max-rescues)."""
    missing = []
    for name, p in _parsers():
        for a in p._actions:
            if not a.option_strings or a.dest in ("help", "version"):
                continue
            if not a.help or ("default" not in a.help and "required" not in a.help):
                missing.append(f"{name} {a.option_strings[0]}")
    r = subprocess.run([sys.executable, "-m", "node_probe.cli", "sim-engine", "--help"], capture_output=True,
                       text=True, timeout=30)
    for line in r.stdout.split("\n  --")[1:]:
        flag = line.split()[0]
        if flag not in ("help", "version") and "default" not in line:
            missing.append(f"sim-engine --{flag}")
    assert missing == []


def test_tracebacks_only_at_debug_in_both_formats():
    try:
        raise ConnectionResetError("peer went away")
    except ConnectionResetError:
        rec = logging.LogRecord("sentinel_relay", logging.ERROR, __file__, 1, "client gone", (), sys.exc_info())
    line = TextFormatter(tracebacks=False).format(rec)
    assert "\n" not in line and line.endswith("client gone exc=ConnectionResetError: peer went away")
    assert "Traceback" in TextFormatter(tracebacks=True).format(rec)
    assert json.loads(JsonFormatter(tracebacks=False).format(rec))["exc"] == "ConnectionResetError: peer went away"
    from xds_server.process.commandline import run_main

    def boom() -> int:
        raise RuntimeError("a bug")

    assert run_main("prog", boom, lambda: False) == 1
    with pytest.raises(RuntimeError):
        run_main("prog", boom, lambda: True)
