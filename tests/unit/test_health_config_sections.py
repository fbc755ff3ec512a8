"""``health:`` in sections with durations written with their unit, and the flat names of earlier
releases still read: each lands where today's name does, is said once, and ``check-config
--rewrite`` prints the file in today's names. Pure: no process, no socket."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from xds_server.cli import main
from xds_server.config import HealthConfig, SentinelConfig, load_config, parse_config
from xds_server.config.duration import Duration
from xds_server.config.health_names import RENAMED
from xds_server.config.renames import move_old_names, moved_notes, rewrite_old_names

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:8000"}]}]}


def _get(h: object, path: str) -> object:
    for part in path.split("."):
        h = getattr(h, part)
    return h


def _old_form(value: object, unit: str) -> object:
    """Today's value written as the earlier release wrote it (a number of ``unit``)."""
    if isinstance(value, Duration):
        return value.ms if unit == "ms" else value.s
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_every_earlier_name_lands_on_todays_key_and_is_said_once(old: str) -> None:
    path, unit = RENAMED[old]
    default = _get(HealthConfig(), path)
    h = HealthConfig(**{old: _old_form(default, unit)})
    assert h == HealthConfig()  # the same value, in its new place
    [note] = moved_notes(h)
    assert note.startswith(f"health.{old} is deprecated: write health.{path}: ")


@given(st.sampled_from(sorted(n for n, (_, u) in RENAMED.items() if u)),
       st.floats(min_value=0.001, max_value=1e6, allow_nan=False))
def test_an_earlier_duration_keeps_its_unit(old: str, number: float) -> None:
    path, unit = RENAMED[old]
    data, lines = move_old_names({old: number}, RENAMED, "health")
    value: object = data
    for part in path.split("."):
        value = value[part]
    got = Duration.parse(value)
    assert math.isclose(got.s, number / (1000.0 if unit == "ms" else 1.0), rel_tol=1e-12)
    assert len(lines) == 1 and old in lines[0]


def test_an_earlier_name_and_its_new_place_together_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"heartbeat_interval_ms is the old name of health\.heartbeat\.interval"):
        HealthConfig(heartbeat_interval_ms=100, heartbeat={"interval": "100ms"})
    with pytest.raises(ValidationError, match=r"drain_timeout_s is the old name of health\.drain_timeout"):
        HealthConfig(drain_timeout_s=10, drain_timeout="10s")


def test_an_earlier_name_mixed_with_sections_fills_the_same_section() -> None:
    h = HealthConfig(heartbeat={"grace": "50ms"}, heartbeat_interval_ms=200, ramp_step_s=2)
    assert (h.heartbeat.grace.ms, h.heartbeat.interval.ms, h.probation.ramp_step.s) == (50.0, 200.0, 2.0)
    assert len(moved_notes(h)) == 2


@given(st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False))
def test_a_duration_prints_in_a_form_that_reads_back(s: float) -> None:
    d = Duration(s)
    back = Duration.parse(str(d))
    assert math.isclose(back.s, s, rel_tol=1e-9, abs_tol=1e-12) and math.isclose(back.ms, s * 1000, rel_tol=1e-9,
                                                                                   abs_tol=1e-9)


@pytest.mark.parametrize("text,seconds", [("100ms", 0.1), ("1.5s", 1.5), ("5m", 300.0), ("1h", 3600.0),
                                          (" 80 ms ", 0.08), (".5s", 0.5), (0, 0.0)])
def test_durations_read_their_unit(text: object, seconds: float) -> None:
    assert math.isclose(Duration.parse(text).s, seconds)


@pytest.mark.parametrize("bad,reason", [(100, "has no unit"), ("100", "not a duration"), ("fast", "not a duration"),
                                        ("1d", "not a duration"), (True, "not a duration"),
                                        ("nanms", "not a duration")])
def test_a_duration_without_a_unit_or_form_is_refused_with_the_reason(bad: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        Duration.parse(bad)


def test_check_config_says_each_earlier_name_and_rewrite_prints_todays_file(tmp_path, capsys) -> None:
    old = {**MINIMAL, "health": {"heartbeat_interval_ms": 50, "probation_clean_s": 3.0, "score_rtt_weight": 0,
                                 "phi": {"threshold": 9}}}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old), encoding="utf-8")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "OK (1 cluster(s), 1 node(s))" in out
    assert "note: health.heartbeat_interval_ms is deprecated: write health.heartbeat.interval: 50ms" in out
    assert "note: health.probation_clean_s is deprecated: write health.probation.clean: 3s" in out
    assert "note: health.score_rtt_weight is deprecated: write health.score.rtt_weight: 0" in out

    assert main(["check-config", "--rewrite", str(path)]) == 0
    got = capsys.readouterr()
    assert got.err.count("note: health.") == 3
    doc = yaml.safe_load(got.out)
    assert doc["health"] == {"phi": {"threshold": 9}, "heartbeat": {"interval": "50ms"},
                             "probation": {"clean": "3s"}, "score": {"rtt_weight": 0}}
    new = tmp_path / "new.yaml"
    new.write_text(got.out, encoding="utf-8")
    assert load_config(new) == load_config(path) and load_config(new).notes() == []


def test_a_running_config_in_todays_names_has_no_notes() -> None:
    cfg = parse_config({**MINIMAL, "health": {"heartbeat": {"interval": "50ms"}, "drain_timeout": "2m"}})
    assert cfg.notes() == [] and cfg.health.drain_timeout.s == 120.0


def _yaml_blocks() -> list[tuple[str, str]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    block = re.compile(r"^ {0,3}```ya?ml\n(.*?)^ {0,3}```", re.M | re.S)
    return [(str(d.relative_to(ROOT)), m.group(1)) for d in docs for m in block.finditer(d.read_text("utf-8"))]


def test_the_docs_and_deploy_configs_use_todays_names() -> None:
    """Every config a doc or deploy file shows is written in today's names: rewriting it changes nothing."""
    checked = 0
    for where, text in [*_yaml_blocks(), *((str(p.relative_to(ROOT)), p.read_text("utf-8"))
                                           for p in (ROOT / "deploy").rglob("*.yaml"))]:
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError:
            continue
        inner = [yaml.safe_load(v) for d in docs if isinstance(d, dict) and d.get("kind") == "ConfigMap"
                 for v in (d.get("data") or {}).values()]  # a Kubernetes ConfigMap's files
        for doc in [*docs, *inner]:
            if isinstance(doc, dict) and {"health", "xds", "clusters", "lrs", "probe"} & set(doc):
                assert rewrite_old_names(doc, SentinelConfig) == doc, where
                checked += 1
    assert checked >= 4  # docs/health-model.md, docs/discovery.md, the compose and Kubernetes configs at least


def test_a_duration_outside_its_bounds_is_refused_naming_the_key_and_the_bound() -> None:
    from xds_server.config import AdminConfig, ProbeConfig, XdsConfig

    with pytest.raises(ValidationError, match=r"live_interval\n.*10ms is shorter than 50ms"):
        AdminConfig(live_interval="10ms")
    with pytest.raises(ValidationError, match=r"keepalive\.time\n.*500ms is shorter than 1s"):
        XdsConfig(keepalive_time_ms=500)  # an earlier name, judged in its new place
    with pytest.raises(ValidationError, match=r"transport\.telemetry_refresh\n.*2m is longer than 1m"):
        ProbeConfig(transport={"telemetry_refresh": "2m"})
    assert ProbeConfig(transport={"keepalive_time": "10ms"}).transport.keepalive_time.ms == 10.0  # the edge passes
