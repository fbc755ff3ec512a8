"""Stall detection (node_probe.stall): running > 0 with a frozen progress counter beyond the window
is stalled; a busy engine whose counter advances never is (fc06 vs fc07)."""

from __future__ import annotations

import pytest

from node_probe.engines import VLLM, EngineLoadReading, GroupLoad
from node_probe.stall import StallDetector


def reading(running, progress, waiting=0.0, key="0") -> EngineLoadReading:
    return EngineLoadReading(requests_running=running, requests_waiting=waiting,
                             groups={key: GroupLoad(running, waiting, progress)},
                             progress_metric="vllm:generation_tokens_total")


def vllm_page(running: float, waiting: float, kv: float, tokens: float) -> str:
    lab = '{engine="0",model_name="m"}'
    return (f"vllm:num_requests_running{lab} {running}\nvllm:num_requests_waiting{lab} {waiting}\n"
            f"vllm:kv_cache_usage_perc{lab} {kv}\nvllm:generation_tokens_total{lab} {tokens}\n")


def test_running_with_frozen_tokens_is_stalled():
    """fc06: /metrics shows 1 running, 3 waiting, generation tokens frozen -> stalled after the
    1 s window (sampled every 100 ms), with a detail naming what is frozen."""
    det = StallDetector(1.0)
    adapter = VLLM
    verdicts = []
    for i in range(16):
        r = adapter.parse_metrics(vllm_page(1, 3, 0.4, 5000))
        verdicts.append(det.observe(r, 100.0 + i * 0.1))
    first = next(i for i, v in enumerate(verdicts) if v.stalled)
    assert first == 11  # 1.1 s after the first sample: frozen for > 1 s
    v = verdicts[-1]
    assert v.capable
    assert v.detail.startswith("engine 0: 1 running, 3 waiting, vllm:generation_tokens_total")
    assert "frozen at 5000 for 1.5 s" in v.detail


def test_busy_engine_with_rising_tokens_never_stalled():
    """fc07: 256 running, 1024 waiting, KV 97 %, tokens rising steadily for 60 s (probes are slow
    or 429 meanwhile): never stalled."""
    det = StallDetector(1.0)
    adapter = VLLM
    tokens = 1e6
    for i in range(600):
        tokens += 256 * 3  # ~3 decode steps of the whole batch per 100 ms
        v = det.observe(adapter.parse_metrics(vllm_page(256, 1024, 0.97, tokens)), i * 0.1)
        assert not v.stalled and v.capable
    # ... and the contrast: the same load with the counter frozen is stalled within the window
    for j in range(1, 13):
        v = det.observe(adapter.parse_metrics(vllm_page(256, 1024, 0.97, tokens)), 60.0 + j * 0.1)
    assert v.stalled and "256 running, 1024 waiting" in v.detail


def test_slow_counter_within_window_is_not_stalled():
    det = StallDetector(1.0)
    progress = 0
    for i in range(50):
        if i % 9 == 0:
            progress += 1  # one step every 0.9 s
        assert not det.observe(reading(4, progress), i * 0.1).stalled


def test_idle_time_before_a_request_does_not_count():
    det = StallDetector(1.0)
    for i in range(30):  # idle for 3 s, counter frozen (nothing to do)
        assert not det.observe(reading(0, 100), i * 0.1).stalled
    # a request arrives; its first token takes 0.8 s: not a stall
    for i in range(8):
        assert not det.observe(reading(1, 100), 3.0 + i * 0.1).stalled
    assert not det.observe(reading(1, 101), 3.8).stalled
    # then it hangs
    assert not det.observe(reading(1, 101), 4.7).stalled
    assert det.observe(reading(1, 101), 4.85).stalled


def test_recovers_when_counter_moves_and_counter_reset_counts_as_progress():
    det = StallDetector(0.5)
    det.observe(reading(2, 10), 0.0)
    assert det.observe(reading(2, 10), 0.6).stalled
    assert not det.observe(reading(2, 11), 0.7).stalled
    assert det.observe(reading(2, 11), 1.3).stalled
    assert not det.observe(reading(2, 0), 1.4).stalled  # engine restarted: counter went back


def test_one_stuck_engine_among_busy_ones():
    det = StallDetector(1.0)
    for i in range(15):
        r = EngineLoadReading(requests_running=9, groups={
            "0": GroupLoad(4, 0, 1000 + 50 * i),  # progressing
            "1": GroupLoad(5, 2, 700),            # stuck
        }, progress_metric="vllm:generation_tokens_total")
        v = det.observe(r, i * 0.1)
    assert v.stalled and v.detail.startswith("engine 1: 5 running, 2 waiting")


def test_no_progress_counter_means_no_verdict():
    det = StallDetector(1.0)
    for i in range(20):
        v = det.observe(reading(8, None), i * 0.1)
        assert not v.stalled and not v.capable
    assert not det.observe(None, 5.0).stalled  # failed scrape: no verdict


def test_window_validation():
    with pytest.raises(ValueError):
        StallDetector(0)


def vllm_prefill_page(running: float, waiting: float, kv: float, gen: float, prompt: float) -> str:
    lab = '{engine="0",model_name="m"}'
    return (f"vllm:num_requests_running{lab} {running}\nvllm:num_requests_waiting{lab} {waiting}\n"
            f"vllm:kv_cache_usage_perc{lab} {kv}\nvllm:generation_tokens_total{lab} {gen}\n"
            f"vllm:prompt_tokens_total{lab} {prompt}\n")


def test_long_prefill_5500ms_kv_0008_to_0086_with_frozen_counters_is_never_stalled():
    """Measured on vLLM 0.32 (CPU, --max-num-batched-tokens 256): a 3,000-token prompt prefilled
    for 5.5 s; prompt and generation counters frozen, KV usage rose every sample 0.008 -> 0.086,
    a probe queued behind it (1 waiting). Every signal must be frozen for a stall: KV moves."""
    det = StallDetector(1.0)
    for i in range(56):
        kv = 0.008 + (0.086 - 0.008) * i / 55
        v = det.observe(VLLM.parse_metrics(vllm_prefill_page(1, 1, kv, 120, 340)), 10.0 + i * 0.1)
        assert not v.stalled and v.capable
        if i:
            assert v.progress_age_s == 0.0
            assert v.progress_detail.startswith("engine 0: vllm:kv_cache_usage_perc ")
            assert v.progress_detail.endswith("0.0 s ago, 1 running, 1 waiting")
    # the same engine hung mid-prefill: KV and counters frozen -> stalled after the 1 s window
    for j in range(1, 12):
        v = det.observe(VLLM.parse_metrics(vllm_prefill_page(1, 1, 0.086, 120, 340)), 15.5 + j * 0.1)
    assert v.stalled and "frozen at 460 for 1.1 s" in v.detail
    assert "vllm:kv_cache_usage_perc frozen at 0.086 too" in v.detail
    assert abs(v.progress_age_s - 1.1) < 1e-6  # the evidence is 1.1 s old now


def test_no_evidence_while_idle_or_before_anything_moved():
    det = StallDetector(1.0)
    v = det.observe(VLLM.parse_metrics(vllm_prefill_page(0, 0, 0.0, 10, 10)), 1.0)
    assert v.progress_age_s is None and v.progress_detail == ""
    v = det.observe(VLLM.parse_metrics(vllm_prefill_page(2, 0, 0.0, 10, 10)), 1.1)
    assert v.progress_age_s is None  # running, but nothing has moved yet
    v = det.observe(VLLM.parse_metrics(vllm_prefill_page(2, 0, 0.0, 12, 10)), 1.2)
    assert abs(v.progress_age_s) < 1e-9 and "prompt_tokens_total 20 -> 22 0.0 s ago" in v.progress_detail
