"""docs/config.md is generated from the configuration models and kept equal to them: every key of
every section is there with its default and unit, protection limits are marked advanced, and the
essential keys exist. Pure: no process, no socket."""
from __future__ import annotations

from pathlib import Path

from xds_server import cli
from xds_server.config import HealthConfig, SentinelConfig, XdsConfig
from xds_server.config.reference import ESSENTIAL, keys, render_reference

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_the_generated_reference(tmp_path):
    """Regenerate with: xds-server config-reference -o docs/config.md"""
    out = tmp_path / "config.md"
    args = cli.build_parser().parse_args(["config-reference", "-o", str(out)])  # the command, without
    assert args.fn(args) == 0                                                  # main's logging setup
    assert out.read_text() == render_reference()
    assert (ROOT / "docs" / "config.md").read_text() == render_reference(), \
        "docs/config.md is stale: run xds-server config-reference -o docs/config.md"


def test_every_field_of_every_section_is_listed_once():
    paths = [k.path for k in keys()]
    assert len(paths) == len(set(paths))
    for name in HealthConfig.model_fields:
        assert f"health.{name}" in paths
    for name in XdsConfig.model_fields:
        assert f"xds.{name}" in paths
    assert "clusters[].nodes[].address" in paths and "lrs.shed.classes.enabled" in paths
    assert {p.split(".")[0].removesuffix("[]") for p in paths} == set(SentinelConfig.model_fields)


def test_defaults_units_and_advanced_marks_come_from_the_models():
    by = {k.path: k for k in keys()}
    hb = by["health.heartbeat.interval"]
    assert (hb.default, hb.unit, hb.advanced) == ('"100ms"', "duration", False)
    assert by["health.phi.suspicion_window"].advanced and by["health.drain_timeout"].default == '"10m"'
    assert "| `health.heartbeat_interval_ms` | `health.heartbeat.interval` |" in render_reference()
    assert "seed 000" in hb.description
    assert by["clusters[].name"].default == "required"
    assert by["xds.limits.memo_max_bytes"].advanced and by["xds.limits.memo_max_bytes"].unit == "bytes"
    assert "`memo_max_bytes` *(advanced)*" in render_reference()
    assert not by["xds.listen"].advanced


def test_the_essential_keys_exist():
    paths = {k.path for k in keys()}
    assert {p for p, _ in ESSENTIAL} <= paths


def test_every_advanced_mark_names_a_key_of_its_model():
    from xds_server.config.reference import _models

    seen: set[type] = set()
    stack: list[type] = [SentinelConfig]
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        assert getattr(m, "ADVANCED", frozenset()) <= set(m.model_fields), m.__name__
        stack.extend(s for f in m.model_fields.values() for s in _models(f.annotation))
    assert len(seen) > 20


def test_every_earlier_name_is_not_a_key_of_today():
    """A moved name is an old one: never today's key itself (then the old name would be refused)."""
    from xds_server.config.reference import _renaming_models

    for m in _renaming_models(SentinelConfig):
        for old, (path, _) in m.MOVED.items():
            assert old != path and old not in m.model_fields, (m.__name__, old)
            assert path.split(".")[0] in m.model_fields, (m.__name__, path)  # the new place exists
