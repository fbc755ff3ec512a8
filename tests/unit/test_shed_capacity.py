"""Shedding with the engines' own finished counters (issue 22, third round): what each node can
complete comes from Little's law on its running set (its slots over the time a request runs),
known at any load; with it the drop follows the offered load, easing keeps a Poisson margin and
the headroom grows while queues pass the budget. Pure parts, and the Shedder's sampling."""
from __future__ import annotations

import math
from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import ShedConfig
from xds_server.health.shed import ShedInputs, ShedState, shed_step
from xds_server.load.shedding import Shedder

CFG = ShedConfig(enabled=True, lift_after_s=3.0, capacity_source="engines")


def feed(sh: Shedder, node: str, clock: list[float], runs: list[tuple[float, float]], service_s: float = 0.8):
    """Evaluate once a second: each (running, waiting) pair holds for one second; the engine
    finishes running / service_s requests per second. Returns what _finishing said each time."""
    count = [0.0]
    sh.finished = lambda _n: (clock[0], count[0])
    out = []
    for running, waiting in runs:
        out.append(sh._finishing(node, waiting, running, clock[0], 3.0))
        clock[0] += 1.0
        count[0] += running / service_s
    return out


def test_capacity_is_slots_over_the_time_a_request_runs_at_any_load():
    sh, clock = Shedder(), [100.0]
    # 16 slots, 0.8 s a request: 20 per s at most. Half loaded (8 running) for 4 s, saturated once
    # (16 running, 3 waiting), then light again: the capacity reads 20 throughout, not the load
    out = feed(sh, "a", clock, [(8, 0)] * 4 + [(16, 3)] + [(6, 0)] * 6)
    assert [c for _, c in out[:4]] == [None] * 4          # slots unknown before it ever saturated
    caps = [c for _, c in out[5:]]
    assert all(c is not None and abs(c - 20.0) < 2.5 for c in caps), caps
    rates = [r for r, _ in out[8:]]
    assert all(r is not None and abs(r - 6 / 0.8) < 0.01 for r in rates), rates  # 7.5 finished per s
    # an engine restart (the counter goes back) forgets its slots
    sh.finished = lambda _n: (clock[0], 0.0)
    assert sh._finishing("a", 0.0, 4.0, clock[0], 3.0) == (None, None)
    assert "a" not in sh._slots


def exact(waiting, offered, capable=20.0, n=2, **kw):
    return ShedInputs(list(waiting), [0.2] * n, offered, offered, 1, [None] * n, admitted_rps=offered,
                      growth_rps=kw.get("growth", 0.0), node_ids=[f"gpu-{k}" for k in range(n)],
                      finished_rps=[kw.get("finished", 15.0)] * n, capable_rps=[capable] * n)


def test_the_drop_follows_the_offered_load_before_a_queue_forms():
    s = ShedState(30.0, low_since_s=0.0, capacity_rps=20.0, capacity_exact=True)
    # 2 nodes x 20 x 0.9 = 36 rps; offered rises to 60: at least 1 - 36 / 60 = 40 % at once
    t = shed_step(s, exact([0, 0], 60.0), CFG, 50, 100, 1.0)
    assert t.percent == 40.0 and t.reason.startswith("tracking 40 %") and t.capacity_exact
    # the same rise with a measured (LRS) capacity waits for a queue
    lrs = ShedState(30.0, low_since_s=0.0, capacity_rps=20.0)
    no_counts = ShedInputs([0, 0], [0.2, 0.2], 60.0, 60.0, 1, [None, None], admitted_rps=60.0, growth_rps=0.0)
    assert shed_step(lrs, no_counts, CFG, 50, 100, 1.0).percent == 30.0
    # and the engines' counts are not read unless lrs.shed.capacity_source is engines
    assert shed_step(s, exact([0, 0], 60.0), ShedConfig(enabled=True, lift_after_s=3.0), 50, 100, 1.0).percent == 30.0


def test_easing_keeps_a_poisson_margin_over_the_offered_load():
    s = ShedState(15.0, low_since_s=0.0, capacity_rps=20.0, capacity_exact=True)
    # 40 offered, easing to 10 % lets in 36 = the capacity less headroom; two standard errors of a
    # 3 s Poisson count (2 x sqrt(40 / 3) = 7.3 rps) say that is too close: held
    held = shed_step(s, exact([0, 0], 40.0), CFG, 50, 100, 3.5)
    assert held.percent == 15.0 and held.reason.startswith("holding 15 %: 10 % would let in 42.6 rps")
    eased = shed_step(s, exact([0, 0], 30.0), CFG, 50, 100, 3.5)  # (30 + 6.3) x 0.9 = 32.7 <= 36
    assert eased.percent == 10.0 and eased.reason.startswith("easing")


def test_the_headroom_grows_while_queues_pass_the_budget_and_comes_back_once_they_stay_low():
    s = ShedState(40.0, capacity_rps=20.0, capacity_exact=True)
    hot = [s]
    for k in range(3):  # a queue over the budget (9 waiting / 15 per s = 0.6 s > 0.5 s), growing
        hot.append(shed_step(hot[-1], exact([9, 1], 55.0, growth=2.0), CFG, 50, 100, float(k)))
    assert [round(h.headroom or 0.1, 2) for h in hot[1:]] == [0.15, 0.2, 0.25]
    assert all(b.percent >= a.percent for a, b in pairwise(hot))
    low = [hot[-1]]
    for k in range(30):  # queues empty from t=3 on: 0.05 back per 4 x lift_after_s (12 s)
        low.append(shed_step(low[-1], exact([0, 0], 20.0), CFG, 50, 100, 3.0 + k))
    rooms = sorted({round(x.headroom, 2) for x in low[1:] if x.headroom is not None}, reverse=True)
    assert rooms[:2] == [0.25, 0.2]
    assert any("headroom back to 0.20" in x.reason for x in low)


@given(st.lists(st.floats(0, 50), min_size=1, max_size=4), st.floats(0.1, 500), st.floats(1, 100),
       st.floats(0, 90), st.floats(0, 60), st.one_of(st.none(), st.floats(0.1, 0.5)))
def test_with_a_counted_capacity_and_low_queues_the_drop_never_lets_in_more_than_it(
        waiting, offered, capable, before, now, room):
    n = len(waiting)
    low = [0.0] * n
    s = ShedState(before, low_since_s=0.0, capacity_rps=capable, capacity_exact=True, headroom=room)
    t = shed_step(s, exact(low, offered, capable=capable, n=n), CFG, 50, 100, now)
    assert 0.0 <= t.percent <= CFG.max_percent
    if before > 0 and t.percent > 0:
        keep = 1.0 - max(room or CFG.headroom_ratio, CFG.headroom_ratio)
        let_in = offered * (1.0 - t.percent / 100.0)
        assert let_in <= capable * n * keep + 1e-6 or t.percent >= CFG.max_percent
    q = shed_step(s, exact(waiting, offered, capable=capable, n=n), CFG, 50, 100, now)
    assert 0.0 <= q.percent <= CFG.max_percent and not math.isnan(q.percent)
