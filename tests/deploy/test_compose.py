"""compose.yaml without a container runtime: Debian's ``docker-compose config`` accepts it, every
file it names exists, the xds-server config it mounts passes our loader (``xds-server
check-config``), the Envoy bootstrap it mounts passes ``envoy --mode validate`` and keeps
xds_server/envoy/envoy.yaml's listener and ADS settings, and the three files agree with each other
(addresses, ports, node ids, replica names, the Envoy version)."""
from __future__ import annotations

import ipaddress
import shutil
import subprocess

import pytest
import yaml
from deploy_checks import (
    ROOT,
    bootstrap_parts,
    envoy_validate,
    envoy_wheel_version,
    read_dockerfile,
    script,
    template_parts,
    xds_hosts,
)

from xds_server.config import parse_config

COMPOSE = ROOT / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _mounted(service: dict, target: str) -> str:
    """Host path (relative to compose.yaml) of the bind mount at ``target``."""
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if dst == target:
            return src
    raise AssertionError(f"nothing mounted at {target}")


def _target_source(mount: str | dict) -> tuple[str, str]:
    """(target, source) of a resolved volume: ``"SRC:DST[:ro]"`` or ``{"source", "target"}``."""
    if isinstance(mount, dict):
        return mount["target"], mount["source"]
    src, dst = mount.split(":")[:2]
    return dst, src


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_docker_compose_config_accepts_it():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose not installed (Debian package docker-compose; .ci/run installs it)")
    out = subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert set(resolved["services"]) == {"envoy", "xds-server-1", "xds-server-2", "engine-a", "engine-b",
                                         "engine-c", "probe-a", "probe-b", "probe-c"}
    # The YAML anchors were merged: each replica got the image build and the config mount,
    # resolved to an existing file (docker-compose 1.x writes "SRC:DST:ro", 2.x a mapping).
    for name in ("xds-server-1", "xds-server-2"):
        svc = resolved["services"][name]
        assert svc["build"]["target"] == "xds-server"
        mounts = dict(_target_source(m) for m in svc["volumes"])
        assert mounts["/etc/xds-sentinel/xds.yaml"] == str(ROOT / "deploy/compose/xds.yaml")
    assert resolved["services"]["probe-a"]["network_mode"] == "service:engine-a"


def test_referenced_files_and_build_targets_exist(compose):
    stages = read_dockerfile(ROOT / "Dockerfile")
    for name, svc in compose["services"].items():
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            assert (ROOT / src).is_file(), f"{name}: {src} does not exist"
        if "build" in svc:
            build = svc["build"]
            assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).is_file()
            assert build["target"] in stages, f"{name}: no stage {build['target']} in the Dockerfile"
            assert svc["image"].split("/")[-1].split(":")[0] == build["target"]


def test_mounted_xds_config_passes_check_config(compose):
    configs = {_mounted(compose["services"][name], "/etc/xds-sentinel/xds.yaml")
               for name in ("xds-server-1", "xds-server-2")}
    assert configs == {"./deploy/compose/xds.yaml"}  # both replicas read one file
    for cfg in configs:
        out = subprocess.run([script("xds-server"), "check-config", str(ROOT / cfg)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().endswith("OK (1 cluster(s), 3 node(s))"), out.stdout


def test_config_names_the_engines_agents_and_ports_compose_gives_them(compose):
    services = compose["services"]
    cfg = yaml.safe_load((ROOT / "deploy/compose/xds.yaml").read_text())
    (cluster,) = cfg["clusters"]
    subnet = ipaddress.ip_network(compose["networks"]["fleet"]["ipam"]["config"][0]["subnet"])
    assert len(cluster["nodes"]) == 3
    replicas = sorted(n for n in services if n.startswith("xds-server-"))
    assert len(replicas) == 2
    for node in cluster["nodes"]:
        assert "probe_address" not in node  # the agents dial in
        ip, _, port = node["address"].rpartition(":")
        (engine_name,) = [n for n, s in services.items() if isinstance(s.get("networks"), dict)
                          and (s["networks"].get("fleet") or {}).get("ipv4_address") == ip]
        engine = services[engine_name]
        # Envoy sends to the engine's pinned address and port.
        assert engine["networks"]["fleet"]["ipv4_address"] == ip
        assert ipaddress.ip_address(ip) in subnet
        assert _flag(engine["command"], "--port") == port
        assert _flag(engine["command"], "--replica-id") == node["id"]
        # Exactly one agent lives in that engine's network namespace, named like the node.
        (agent,) = [s for s in services.values() if s.get("network_mode") == f"service:{engine_name}"]
        assert "--listen" not in agent["command"]  # no inbound port: it dials every replica
        assert _flag(agent["command"], "--control-plane").split(",") == [f"{r}:18000" for r in replicas]
        assert _flag(agent["command"], "--node-id") == node["id"]
        assert _flag(agent["command"], "--engine-url") == f"http://127.0.0.1:{port}"


def test_envoy_bootstrap_lists_both_replicas_and_keeps_the_template(compose, tmp_path):
    envoy = compose["services"]["envoy"]
    assert envoy["image"] == f"envoyproxy/envoy:v{envoy_wheel_version()}"
    text = (ROOT / _mounted(envoy, "/etc/envoy/envoy.yaml")).read_text()
    doc = yaml.safe_load(text)
    cfg = yaml.safe_load((ROOT / "deploy/compose/xds.yaml").read_text())
    ads_port = int(cfg["xds"]["listen"].rpartition(":")[2])
    replicas = sorted(n for n, s in compose["services"].items() if s.get("build", {}).get("target") == "xds-server")
    assert replicas == ["xds-server-1", "xds-server-2"]
    assert sorted(xds_hosts(doc)) == [(r, ads_port) for r in replicas]
    classes = parse_config(cfg).lrs.shed.classes
    assert classes.enabled  # the example sheds, batch first: its routes are the template's with classes
    assert bootstrap_parts(doc) == template_parts(cluster=cfg["clusters"][0]["name"], classes=classes)
    published = {p.rsplit(":", 1)[1] for p in envoy["ports"]}
    assert str(bootstrap_parts(doc)["llm_port"]) in published
    out = envoy_validate(text, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
