"""The Dockerfile without a container runtime (this machine cannot run containers): each target's
entrypoint is one of our console scripts, it runs as a non-root user, everything its COPY lines
need is in the build context and not excluded by .dockerignore, and its HEALTHCHECK command,
run here against the real program started with compose.yaml's arguments, passes while the
program runs and fails when nothing answers."""
from __future__ import annotations

import re
import tomllib

import pytest
import yaml
from deploy_checks import ROOT, console_scripts, healthcheck_exit, read_dockerfile, script, with_port

from node_probe.cli import build_parser as agent_parser
from xds_server.testing import ManagedProcess, free_port

STAGES = read_dockerfile(ROOT / "Dockerfile")
TARGETS = ("xds-server", "node-probe")


def test_each_target_runs_one_of_our_console_scripts_as_a_non_root_user():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    installed = console_scripts()
    for target in TARGETS:
        st = STAGES[target]
        assert st.entrypoint == [target], (target, st.entrypoint)
        assert scripts[target] == installed[target], target  # declared and installed alike
        uid, _, gid = (st.user or "").partition(":")
        assert uid.isdigit() and int(uid) >= 1000 and gid.isdigit(), (target, st.user)
        assert st.healthcheck is not None and st.cmd, target
        url = st.env["SENTINEL_HEALTHCHECK_URL"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/healthz", url), url
    assert STAGES["runtime"].base == STAGES["wheel"].base == "${PYTHON_IMAGE}"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim", (ROOT / "Dockerfile").read_text(), re.M)


def test_default_commands_parse_with_the_programs_own_parsers():
    """The node-probe image's CMD is valid agent arguments whose metrics port is the one the
    healthcheck asks; the xds-server image serves the config path compose and Kubernetes mount."""
    st = STAGES["node-probe"]
    args = agent_parser().parse_args(st.cmd)
    assert args.engine_url == "http://127.0.0.1:8000"
    assert args.metrics_listen.rpartition(":")[2] == st.env["SENTINEL_HEALTHCHECK_URL"].split(":")[2].split("/")[0]
    cmd = STAGES["xds-server"].cmd
    assert cmd[-2:] == ["serve", "/etc/xds-sentinel/xds.yaml"], cmd


def test_copied_paths_exist_and_pass_the_dockerignore():
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", "the .dockerignore is an allow-list"
    allowed = {ln[1:] for ln in ignore if ln.startswith("!")}
    from_context = [p for st in STAGES.values() for src, paths in st.copies if src is None
                    for p in paths]
    assert from_context, "nothing copied from the build context"
    for p in from_context:
        assert (ROOT / p).exists(), p
        assert p.rstrip("/") in allowed, f"{p} is excluded by .dockerignore"
    # What setuptools reads to build the wheel is in the context too.
    assert {"pyproject.toml", "README.md"} <= allowed


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_healthchecks_pass_against_the_real_programs_and_fail_without_them(tmp_path, compose):
    """Start xds-server, one simulated engine and its agent with compose.yaml's arguments (ports
    moved to free 127.0.0.1 ones), then run each container's HEALTHCHECK command here."""
    services = compose["services"]
    cfg = yaml.safe_load((ROOT / "deploy/compose/xds.yaml").read_text())
    xds_url = STAGES["xds-server"].env["SENTINEL_HEALTHCHECK_URL"]
    assert cfg["admin"]["listen"].rpartition(":")[2] == xds_url.split(":")[2].split("/")[0]
    admin, ads = free_port(), free_port()
    cfg["admin"]["listen"], cfg["xds"]["listen"] = f"127.0.0.1:{admin}", f"127.0.0.1:{ads}"
    cfg["state"]["path"] = str(tmp_path / "state.json")
    (tmp_path / "xds.yaml").write_text(yaml.safe_dump(cfg))

    engine_svc, probe_svc = services["engine-a"], services["probe-a"]
    engine_url = engine_svc["environment"]["SENTINEL_HEALTHCHECK_URL"]
    engine_port, metrics_port = free_port(), free_port()
    engine_args = list(engine_svc["command"])
    assert engine_args[engine_args.index("--port") + 1] == engine_url.split(":")[2].split("/")[0]
    engine_args[engine_args.index("--port") + 1] = str(engine_port)
    engine_args[engine_args.index("--host") + 1] = "127.0.0.1"
    probe_args = list(probe_svc["command"])
    probe_url = STAGES["node-probe"].env["SENTINEL_HEALTHCHECK_URL"]
    i = probe_args.index("--metrics-listen")
    assert probe_args[i + 1].rpartition(":")[2] == probe_url.split(":")[2].split("/")[0]
    probe_args[i + 1] = f"127.0.0.1:{metrics_port}"
    j = probe_args.index("--control-plane")   # the agent dials the control plane (both replicas in compose)
    probe_args[j + 1] = f"127.0.0.1:{ads}"
    k = probe_args.index("--engine-url")
    probe_args[k + 1] = f"http://127.0.0.1:{engine_port}"

    assert engine_svc["entrypoint"] == ["node-probe", "sim-engine"]
    procs = [
        ManagedProcess("xds-server", [script("xds-server"), "serve", str(tmp_path / "xds.yaml")],
                       tmp_path / "xds.log", ready_pattern="admin listening"),
        ManagedProcess("engine", [script("node-probe"), "sim-engine", *engine_args], tmp_path / "engine.log",
                       ready_pattern="listening"),
        ManagedProcess("agent", [script("node-probe"), *probe_args], tmp_path / "agent.log",
                       ready_pattern="dialling"),
    ]
    checks = [(STAGES["xds-server"], with_port(xds_url, admin)),
              (STAGES["node-probe"], with_port(engine_url, engine_port)),
              (STAGES["node-probe"], with_port(probe_url, metrics_port))]
    try:
        for p in procs:
            p.start(timeout_s=30)
        for stage, url in checks:
            assert healthcheck_exit(stage, url) == 0, url
    finally:
        for p in procs:
            p.stop()
    for stage, url in checks:
        assert healthcheck_exit(stage, url) == 1, f"{url} still answers after its program stopped"
