"""The engines' finished-request counter at the agent edge: a valid
count is kept for shedding on every heartbeat, also when the rest of the load repeats (the memo
path); a negative, NaN or infinite one is a bad field and is not kept (hypothesis)."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from node_probe.proto import probe_pb2
from xds_server.config import ProbeConfig
from xds_server.probing.telemetry import BadField, LoadCheck


def load(finished: float | None, waiting: float = 3.0) -> probe_pb2.EngineLoad:
    m = probe_pb2.EngineLoad(metrics_ok=True, requests_waiting=waiting, requests_running=8.0)
    if finished is not None:
        m.requests_finished_total = finished
    return m


def test_the_count_is_kept_on_every_heartbeat_even_when_the_summary_is_reused():
    chk = LoadCheck(ProbeConfig())
    bad: list[BadField] = []
    first = chk.check(load(10.0), bad)
    assert chk.finished == 10.0
    again = chk.check(load(17.0), bad)  # only the counter moved: the same summary object
    assert again is first and chk.finished == 17.0 and bad == []
    chk.check(load(None), bad)
    assert chk.finished is None  # a heartbeat without it: unknown, not the old value


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none()), st.booleans())
def test_a_bad_count_is_a_bad_field_and_never_kept(value, repeat):
    chk = LoadCheck(ProbeConfig())
    if repeat:
        chk.check(load(1.0), [])
    bad: list[BadField] = []
    chk.check(load(value), bad)
    good = value is not None and 0.0 <= value < math.inf
    assert chk.finished == (value if good else None)
    names = [b.field for b in bad]
    assert ("heartbeat.telemetry.engine_load.requests_finished_total" in names) == (value is not None and not good)
