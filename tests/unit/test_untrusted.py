"""Bounding and escaping client text; rate-limited complaint logging."""
from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds_server.process.untrusted import RateLimitedLog, clip, for_log


@given(st.text(), st.integers(min_value=1, max_value=300))
def test_prop_clip_never_exceeds_its_bound_and_keeps_short_text(text, n):
    out = clip(text, n)
    assert len(out) <= n
    if len(text) <= n:
        assert out == text
    else:
        assert out.endswith("…") and text.startswith(out[:-1])


def test_clip_rejects_a_zero_bound():
    with pytest.raises(ValueError, match="max_chars"):
        clip("abc", 0)


@given(st.text(max_size=400))
def test_prop_for_log_is_one_printable_line(text):
    out = for_log(text, 128)
    assert "\n" not in out and "\r" not in out
    assert out.isprintable()


def test_for_log_escapes_a_forged_log_line():
    out = for_log("gpu-a\n2026-12-01 INFO node gpu-b: HEALTHY -> UNHEALTHY")
    assert "\n" not in out and out.startswith("gpu-a\\n")


def test_rate_limited_log_writes_one_line_per_key_per_interval(caplog):
    rl = RateLimitedLog(logging.getLogger("t.rl"), per_key_interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger="t.rl"):
        written = [rl.warning(t * 0.1, "pong", "bad pong %d", t) for t in range(50)]  # 5 s of floods
        assert sum(written) == 1
        assert rl.warning(10.0, "pong", "bad pong again")
        assert rl.warning(10.0, "other", "another kind")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad pong 0", "bad pong again (49 similar suppressed)", "another kind"]


def test_rate_limited_log_bounds_the_keys_it_tracks():
    rl = RateLimitedLog(logging.getLogger("t.rl2"), per_key_interval_s=10.0, max_keys=8)
    for i in range(100):
        rl.warning(0.0, f"k{i}", "x")
    assert len(rl._last) <= 8
