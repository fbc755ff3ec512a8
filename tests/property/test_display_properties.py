"""The shown state of a node (xds_server/admin/display.py) over every combination of inputs:
it is always one of DISPLAY_STATES, "routed" always matches what was published, and a routed
node never carries a not-routed reason (the contradiction fail-static nodes once showed)."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from xds_server.admin.display import DISPLAY_STATES, DisplayInputs, node_display
from xds_server.health import model as hm

states = st.sampled_from(list(hm.NodeState))
published = st.one_of(st.none(), st.builds(hm.Routing, st.integers(1, 10_000),
                                           st.sampled_from(["HEALTHY", "UNHEALTHY", "DRAINING"])))
text = st.sampled_from(["", "UNHEALTHY: 3 missed heartbeats", "queue: 150 waiting > 100", "CONNECT: refused"])


@given(state=states, pub=published, why=text, held=text, fs=st.booleans(), connected=st.booleans(),
       dials=st.integers(0, 50), err=text, engine=text, drained=st.booleans())
def test_display_is_consistent_with_what_was_published(state, pub, why, held, fs, connected, dials, err, engine,
                                                       drained):
    nh = replace(hm.initial("n", 0.0), state=state, reason="r")
    if drained:
        nh = replace(nh, drain=hm.Drain(active=True, since_s=0.0))
    d = node_display(DisplayInputs(nh, pub, why, held, fs, connected, dials, err, engine,
                                   1.0 if drained else None, None))
    routed = pub is not None and pub.health_status == "HEALTHY"
    assert d.state in DISPLAY_STATES
    assert d.routed is routed
    assert (d.shown_weight is None) is (not routed)
    assert (d.not_routed_because is None) is routed
    assert d.reason
    if drained:
        assert d.state == "DRAINING"
    elif d.state == "FAIL_STATIC":
        assert fs and routed and d.verdict_not_applied == why
    if d.state == "HELD_BACK":
        assert routed and held


def test_display_02_cold_node_with_12_failed_dials_reads_unreachable_with_the_error():
    d = node_display(DisplayInputs(hm.initial("n", 0.0), None, failed_dials=12,
                                   agent_error="UNAVAILABLE: connection refused"))
    assert d.state == "UNREACHABLE" and "12 dial(s) failed" in d.reason and "connection refused" in d.reason


def test_display_03_warming_node_with_engine_connect_error_says_why():
    nh = replace(hm.initial("n", 0.0), state=hm.NodeState.WARMING, reason="agent up, no good probe yet")
    d = node_display(DisplayInputs(nh, hm.Routing(100, "UNHEALTHY"), why_not_routed="WARMING: agent up",
                                   agent_connected=True, engine_error="CONNECT: Cannot connect to 127.0.0.1:8000"))
    assert d.state == "WARMING" and "engine not answering: CONNECT: Cannot connect" in d.reason
    assert "engine not answering" in d.not_routed_because
