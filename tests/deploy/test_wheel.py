"""The wheel the Dockerfile builds carries everything the programs read at run time: built here
from the same build context (the ``wheel`` stage's COPY sources) with the same ``pip wheel``
(offline: ``--no-build-isolation``, this venv's setuptools), every file of our packages is in it,
and ``xds-server envoy-bootstrap`` and the demo's settings table work from the extracted wheel
alone (the bootstrap template is package data, not a file of the checkout)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from deploy_checks import ROOT, read_dockerfile

from xds_server.demo import shortened_settings
from xds_server.envoy.bootstrap import render_bootstrap

PACKAGES = ("xds_server", "node_probe", "sentinel_relay")
# What runs inside the extracted wheel: fails unless xds_server is imported from there.
INSTALLED_RUN = """
import json, sys
from pathlib import Path
import xds_server
site = Path(sys.argv[1]).resolve()
assert Path(xds_server.__file__).resolve().is_relative_to(site), xds_server.__file__
from xds_server.cli import main
from xds_server.demo import shortened_settings
rc = main(["envoy-bootstrap", "--xds-port", "18123", "--listener-port", "10123", "--admin-port", "9123",
           "--cluster", "big", "-o", sys.argv[2]])
print(json.dumps({"rc": rc, "settings": shortened_settings()}))
"""


def _source_files(root: Path) -> set[str]:
    """Files of our packages under ``root`` as wheel paths (bytecode caches left out, as the
    .dockerignore does)."""
    return {p.relative_to(root).as_posix() for pkg in PACKAGES for p in (root / pkg).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the Dockerfile's build context, as its ``wheel`` stage does."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    copied = [p for _, paths in read_dockerfile(ROOT / "Dockerfile")["wheel"].copies for p in paths]
    assert set(PACKAGES) | {"pyproject.toml"} <= set(copied), copied
    for p in copied:
        if (ROOT / p).is_dir():
            shutil.copytree(ROOT / p, src / p, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / p, src / p)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-cache-dir", "--no-deps",
                        "--no-build-isolation", "--wheel-dir", str(tmp / "wheels"), str(src)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "wheels").glob("xds_sentinel-*.whl")
    return whl


def test_the_wheel_holds_every_package_file_and_the_bootstrap_template(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "xds_server/envoy/envoy.yaml" in names
    missing = _source_files(ROOT) - names
    assert not missing, f"not in the wheel (add them to [tool.setuptools.package-data]): {sorted(missing)}"
    template = zipfile.ZipFile(wheel).read("xds_server/envoy/envoy.yaml")
    assert template == (ROOT / "xds_server/envoy/envoy.yaml").read_bytes()


def test_envoy_bootstrap_and_demo_settings_work_from_the_installed_wheel(wheel: Path, tmp_path: Path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = tmp_path / "envoy.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-c", INSTALLED_RUN, str(site), str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0
    assert yaml.safe_load(out.read_text()) == render_bootstrap(
        xds_port=18123, listener_port=10123, admin_port=9123, cluster="big")
    assert [tuple(s) for s in got["settings"]] == shortened_settings()
