"""The slips of an operator's first hour, with real
processes of all three programs (xds-server, node-probe with sim-engine, sentinel-relay) and a
real Envoy. Each slip gets one line on stderr naming what is wrong and the flag or field to
change, its documented exit code, and no traceback; the three share --version (no other flag
needed), --log-format json and one timestamp format; SIGHUP leaves node-probe and sim-engine
running."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from xds_server.envoy.bootstrap import find_envoy, render_bootstrap
from xds_server.testing import ManagedProcess, free_port, wait_for

pytestmark = pytest.mark.envoy

PY = sys.executable
XDS = [PY, "-m", "xds_server.cli"]
PROBE = [PY, "-m", "node_probe.cli"]
SIM = [PY, "-m", "node_probe.cli", "sim-engine"]
RELAY = [PY, "-m", "sentinel_relay.cli"]
TOKEN = "slips-token"
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def one_shot(argv: list[str], timeout_s: float = 60) -> tuple[int, str, str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    return r.returncode, r.stdout, r.stderr


def one_line(err: str, prog: str, *must: str) -> str:
    """The single stderr line of a refused command: starts with ``prog:``, names ``must``."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{err}"
    assert "Traceback" not in err and lines[0].startswith(f"{prog}: "), err
    for word in must:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    print(f"\n{' '.join(must)} -> {lines[0]}")
    return lines[0]


@pytest.fixture
def fleet(tmp_path: Path):
    """A sim engine, its agent, a control plane and an Envoy: the ports a slip points at."""
    ports = {k: free_port() for k in ("engine", "agent", "xds", "admin", "listener", "envoy_admin")}
    procs: list[ManagedProcess] = []
    cfg = {"xds": {"listen": f"127.0.0.1:{ports['xds']}"},
           "admin": {"listen": f"127.0.0.1:{ports['admin']}", "token": TOKEN},
           "clusters": [{"name": "llm", "nodes": [
               {"id": "gpu-a", "address": f"127.0.0.1:{ports['engine']}"}]}]}  # its agent dials in
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump(cfg))
    boot = render_bootstrap(xds_port=ports["xds"], listener_port=ports["listener"],
                            admin_port=ports["envoy_admin"], cluster="llm", node_id="slips")
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(boot))
    specs = [
        ("sim", [*SIM, "--port", str(ports["engine"])], "listening on"),
        ("agent", [*PROBE, "--engine-url", f"http://127.0.0.1:{ports['engine']}",
                   "--listen", f"127.0.0.1:{ports['agent']}", "--control-plane", f"127.0.0.1:{ports['xds']}",
                   "--node-id", "gpu-a", "--gpu-interval-s", "0"],
         "listening on"),
        ("xds", [*XDS, "serve", str(tmp_path / "xds.yaml")], "admin listening"),
        ("envoy", [find_envoy(None), "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart",
                   "--concurrency", "1", "-l", "warning"], None),
    ]
    try:
        for name, argv, ready in specs:
            procs.append(ManagedProcess(name, argv, tmp_path / f"{name}.log", ready_pattern=ready).start())
        wait_for_envoy_admin(ports["envoy_admin"])
        yield ports, tmp_path, procs
    finally:
        for p in reversed(procs):
            p.stop()


def wait_for_envoy_admin(port: int, timeout_s: float = 20.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("Envoy's admin did not come up")


def test_each_slip_of_the_three_programs_is_one_line_with_its_exit_code(fleet):
    ports, tmp, _ = fleet
    ads, admin, envoy_admin, engine, agent = (f"127.0.0.1:{ports[k]}" for k in
                                              ("xds", "admin", "envoy_admin", "engine", "agent"))
    nothing = f"127.0.0.1:{free_port()}"
    # xds-server status/drain pointed at the wrong port
    rc, _, err = one_shot([*XDS, "status", "--admin", ads])
    assert rc == 1
    one_line(err, "xds-server", "HTTP/2", "xds.listen", "--admin", "admin.listen")
    rc, _, err = one_shot([*XDS, "status", "--admin", envoy_admin])
    assert rc == 1
    one_line(err, "xds-server", "not an xds-server admin endpoint", "Envoy's admin", "--admin")
    rc, _, err = one_shot([*XDS, "status", "--admin", nothing])
    assert rc == 1
    one_line(err, "xds-server", "nothing listens", "--admin")
    rc, _, err = one_shot([*XDS, "drain", "gpu-a", "--admin", ads, "--token", TOKEN])
    assert rc == 1
    one_line(err, "xds-server", "HTTP/2", "--admin")
    rc, _, err = one_shot([*XDS, "drain", "gpu-a", "--admin", envoy_admin, "--token", TOKEN])
    assert rc == 1
    one_line(err, "xds-server", "Envoy's admin", "--admin")
    rc, _, err = one_shot([*XDS, "drain", "gpu-a", "--admin", admin, "--token", "wrong"])
    assert rc == 3
    one_line(err, "xds-server", "refused", "HTTP 401", "--token")
    rc, _, err = one_shot([*XDS, "drain", "gpu-x", "--admin", admin, "--token", TOKEN])
    assert rc == 3
    one_line(err, "xds-server", "unknown node 'gpu-x'")
    rc, out, err = one_shot([*XDS, "drain", "gpu-a", "--admin", admin, "--token", TOKEN])
    assert rc == 0 and out.count("\n") == 1 and out.startswith("drain gpu-a: now DRAINING, weight -"), out + err
    # xds-server serve: the admin port in use, a missing file
    cfg = yaml.safe_load((tmp / "xds.yaml").read_text())
    cfg["xds"]["listen"] = f"127.0.0.1:{free_port()}"
    cfg["admin"]["listen"] = engine  # taken by the sim engine
    (tmp / "busy.yaml").write_text(yaml.safe_dump(cfg))
    rc, _, err = one_shot([*XDS, "serve", str(tmp / "busy.yaml")])
    assert rc == 1
    one_line(err, "xds-server", f"cannot listen on {engine} (admin.listen)", "already in use")
    rc, _, err = one_shot([*XDS, "serve", str(tmp / "missing.yaml")])
    assert rc == 2
    one_line(err, "xds-server", "missing.yaml")
    # node-probe and sim-engine: ports in use
    rc, _, err = one_shot([*PROBE, "--engine-url", f"http://{engine}", "--listen", agent, "--gpu-interval-s", "0"])
    assert rc == 1
    one_line(err, "node-probe", f"cannot listen on {agent} (--listen)", "already in use")
    rc, _, err = one_shot([*PROBE, "--engine-url", f"http://{engine}", "--listen", "127.0.0.1:0",
                           "--metrics-listen", engine, "--gpu-interval-s", "0"])
    assert rc == 1
    one_line(err, "node-probe", f"cannot listen on {engine} (--metrics-listen)")
    rc, _, err = one_shot([*SIM, "--port", str(ports["engine"])])
    assert rc == 1
    one_line(err, "sim-engine", "(--port)", "already in use")
    rc, _, err = one_shot([*PROBE, "--engine-url", "localhost:8000"])
    assert rc == 2 and "--engine-url" in err and "Traceback" not in err
    # sentinel-relay: its port and its admin port in use, a missing config file
    rc, _, err = one_shot([*RELAY, "--listen", engine, "--admin-listen", "127.0.0.1:0"])
    assert rc == 1
    one_line(err, "sentinel-relay", f"cannot listen on {engine} (--listen)", "already in use")
    assert "Unclosed" not in err
    rc, _, err = one_shot([*RELAY, "--listen", "127.0.0.1:0", "--admin-listen", engine, "--log-level", "WARNING"])
    assert rc == 1
    one_line(err, "sentinel-relay", f"cannot listen on {engine} (--admin-listen)")
    rc, _, err = one_shot([*RELAY, "--workers", "2", "--listen", engine])
    assert rc == 1
    one_line(err, "sentinel-relay", "(--listen)")
    rc, _, err = one_shot([*RELAY, "--config", str(tmp / "relay-missing.yaml")])
    assert rc == 2
    one_line(err, "sentinel-relay", "--config", "no such file")
    rc, _, err = one_shot([*RELAY, "--routing-feed", ads, "--feed-tls-ca", str(tmp / "ca-missing.pem")])
    assert rc == 2  # refused at start, not retried at every reconnect
    one_line(err, "sentinel-relay", "--feed-tls-ca", "no such file")
    rc, _, err = one_shot([*PROBE, "--engine-url", f"http://{engine}", "--listen", "127.0.0.1:0", "--gpu-interval-s",
                           "0", "--tls-cert", str(tmp / "missing.pem"), "--tls-key", str(tmp / "missing.key")])
    assert rc == 1
    one_line(err, "node-probe", "--tls-cert", "No such file")


def test_the_three_programs_share_version_log_format_and_timestamps(tmp_path):
    for argv, prog in ((XDS, "xds-server"), (PROBE, "node-probe"), (SIM, "sim-engine"), (RELAY, "sentinel-relay")):
        rc, out, err = one_shot([*argv, "--version"])
        assert rc == 0 and re.fullmatch(rf"{prog} \S+\n", out), (prog, out, err)
        rc, out, _ = one_shot([*argv, "--help"])
        assert rc == 0 and "--log-format {text,json}" in out and "--log-level" in out, prog
        assert "``" not in out, prog
    rc, out, _ = one_shot([*RELAY, "--help"])
    for flag in ("--listen", "--admin-listen", "--workers", "--max-rescues"):
        line = out[out.index(f"  {flag} "):].split("\n  -")[0]
        assert "default" in line, (flag, line)
    # one JSON object per line with the same ts format from each program
    port = free_port()
    procs = [ManagedProcess("sim", [*SIM, "--port", str(port), "--log-format", "json"], tmp_path / "sim.log",
                            ready_pattern="listening on"),
             ManagedProcess("agent", [*PROBE, "--engine-url", f"http://127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                                      "--gpu-interval-s", "0", "--log-format", "json"], tmp_path / "agent.log",
                            ready_pattern="listening on"),
             ManagedProcess("relay", [*RELAY, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                                      "--log-format", "json"], tmp_path / "relay.log", ready_pattern="ready on")]
    try:
        for p in procs:
            p.start()
        for p in procs:
            os_signal(p, signal.SIGHUP)

        def logged_hup() -> bool:
            return all("SIGHUP" in p.log_path.read_text() for p in procs)

        wait_for_sync(logged_hup, 30, "a SIGHUP line from each")
        for p in procs:
            docs = [json.loads(ln) for ln in p.log_path.read_text().splitlines() if ln.startswith("{")]
            assert docs, p.name
            for d in docs:
                assert TS.match(d["ts"]) and {"level", "logger", "msg"} <= set(d), d
    finally:
        for p in procs:
            p.stop()
    rc, _, err = one_shot([*XDS, "check-config", str(tmp_path / "nope.yaml"), "--log-format", "json"])
    assert rc == 2 and "Traceback" not in err


def test_every_program_takes_a_sighup_sent_on_its_ready_line(tmp_path):
    """Each program installs its signal handlers before it prints its ready line: a SIGHUP sent
    the moment the line appears is handled (xds-server reloads, the others log it), never the
    default action (exit 129). xds-server used to print "admin listening" first and died in 17
    of 20 such tries."""
    port = free_port()
    cfg = tmp_path / "xds.yaml"
    cfg.write_text(yaml.safe_dump({
        "xds": {"listen": f"127.0.0.1:{free_port()}"}, "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "clusters": [{"name": "llm", "nodes": [{"id": "gpu-a", "address": f"127.0.0.1:{port}"}]}]}))
    procs = [ManagedProcess("xds", [*XDS, "serve", str(cfg)], tmp_path / "xds.log", ready_pattern="admin listening"),
             ManagedProcess("sim", [*SIM, "--port", str(port)], tmp_path / "sim.log", ready_pattern="listening on"),
             ManagedProcess("agent", [*PROBE, "--engine-url", f"http://127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                                      "--gpu-interval-s", "0"], tmp_path / "agent.log", ready_pattern="listening on"),
             ManagedProcess("relay", [*RELAY, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
                            tmp_path / "relay.log", ready_pattern="ready on")]
    try:
        for p in procs:
            p.start()
            os_signal(p, signal.SIGHUP)  # at once: start() returns when the ready line is read
        wait_for_sync(lambda: "config reloaded (SIGHUP)" in procs[0].log_path.read_text(), 30,
                      "xds-server's reload line")
        wait_for_sync(lambda: all("SIGHUP" in p.log_path.read_text() for p in procs[1:]), 30,
                      "a SIGHUP line from each")
        for p in procs:
            assert p.alive(), (p.name, p.log_path.read_text()[-2000:])
    finally:
        for p in procs:
            p.stop()


def os_signal(p: ManagedProcess, sig: int) -> None:
    import os

    os.kill(p.pid, sig)


def wait_for_sync(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_sighup_leaves_node_probe_and_sim_engine_running(tmp_path, http):
    """``kill -HUP`` (the reflex that reloads xds-server) used to end both
    (exit by signal 1) and eject the node; now each logs it, keeps serving, and stops on SIGTERM."""
    port = free_port()
    sim = ManagedProcess("sim", [*SIM, "--port", str(port)], tmp_path / "sim.log", ready_pattern="listening on")
    agent = ManagedProcess("agent", [*PROBE, "--engine-url", f"http://127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                                     "--metrics-listen", "127.0.0.1:0", "--gpu-interval-s", "0"],
                           tmp_path / "agent.log", ready_pattern="listening on")
    try:
        sim.start()
        agent.start()
        for _ in range(3):
            os_signal(sim, signal.SIGHUP)
            os_signal(agent, signal.SIGHUP)
            time.sleep(0.3)
        await wait_for(lambda: "SIGHUP" in sim.log_path.read_text() and "SIGHUP" in agent.log_path.read_text(),
                       timeout_s=10, what="SIGHUP logged")
        time.sleep(1.0)
        assert sim.alive() and agent.alive()
        async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "sim-model"
        assert "nothing to reload, still running" in agent.log_path.read_text()
        assert sim.stop() == 0 and agent.stop() == 0
    finally:
        sim.stop()
        agent.stop()
