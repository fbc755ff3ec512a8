"""The layers are data (pyproject.toml ``[tool.importlinter]``, docs/DESIGN.md section 2), and
``lint-imports`` holds the tree to them: entry points down to process plumbing, health free of
transport and Envoy types, the cluster decisions (``policy``) as pure and below
control, the agent and the relay beside the control plane, no cycle inside any
package, private modules private.

Import-linter counts every import statement: at module level, inside a function (lazy) and under
``TYPE_CHECKING``. The second test shows each kind of slip failing on a copy of the tree.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("xds_server", "node_probe", "sentinel_relay")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_keeps_every_import_contract():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 kept, 0 broken" in r.stdout


# (file, line added at its end, the contract that must break)
SLIPS = {
    "probing_imports_the_decision_layer": (
        "xds_server/probing/edge.py", "from xds_server.control.core import ControlCore\n",
        "The control plane's layers"),
    "lazy_import_of_xds_from_health": (
        "xds_server/health/phi.py", "def _late():\n    from xds_server.xds import resources\n    return resources\n",
        "The control plane's layers"),
    "type_checking_import_of_probing_from_control": (
        "xds_server/control/publish.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from xds_server.probing.session import ProbeSession\n",
        "The control plane's layers"),
    "health_importing_grpc": (
        "xds_server/health/clocks.py", "import grpc\n", "Health is pure"),
    "cluster_decisions_reading_the_clock": (
        "xds_server/policy/overload_drop.py", "from xds_server.process.clock import LoopClock\n",
        "The cluster decisions are pure"),
    "health_reading_a_cluster_decision": (
        "xds_server/health/rules.py", "from xds_server.policy import cluster_routing\n",
        "The control plane's layers"),
    "the_relay_reading_the_control_planes_health": (
        "sentinel_relay/plan.py", "from xds_server.health import model\n", "The agent and the relay use only"),
    "a_cycle_inside_a_package": (
        "xds_server/xds/resources.py", "def _late():\n    from xds_server.xds import ads\n    return ads\n",
        "No cycles"),
}


@pytest.mark.parametrize("slip", sorted(SLIPS))
def test_a_forbidden_import_breaks_its_contract(tmp_path: Path, slip: str):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path, line, contract = SLIPS[slip]
    with open(tmp_path / path, "a") as f:
        f.write("\n\n" + line)
    r = _lint(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    broken = r.stdout.split("Broken contracts")[1]
    assert contract in broken, r.stdout
