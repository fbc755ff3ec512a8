"""The agent edge (xds_server.probing.edge): every field checked once, by type; nothing raises."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from node_probe.proto import probe_pb2
from xds_server.config import HealthConfig, ProbeConfig
from xds_server.health.model import ProbeResultKind
from xds_server.probing.edge import REASONS, AgentEdge, CheckedHeartbeat, CheckedResult
from xds_server.probing.telemetry import LoadCheck

EDGE = AgentEdge(HealthConfig(), ProbeConfig())
PC = ProbeConfig()

nasty_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                         st.sampled_from([1e308, -1e308, -0.0, 5e-324, 1e9 + 1, 2.0, -1.0]))
enums = st.one_of(st.integers(0, 6), st.integers(-(2 ** 31), 2 ** 31 - 1))
texts = st.one_of(st.text(max_size=40), st.integers(0, 5000).map(lambda n: "x\n\x1b" * n))


@st.composite
def agent_messages(draw) -> probe_pb2.AgentMessage:
    kind = draw(st.sampled_from(["heartbeat", "pong", "result", "empty"]))
    if kind == "empty":
        return probe_pb2.AgentMessage()
    if kind == "pong":
        return probe_pb2.AgentMessage(pong=probe_pb2.Pong(seq=draw(st.integers(0, 2 ** 64 - 1))))
    if kind == "result":
        return probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(
            ok=draw(st.booleans()), ttft_ms=draw(nasty_floats), failure=draw(enums),
            http_status=draw(st.integers(-(2 ** 31), 2 ** 31 - 1)), detail=draw(texts),
            headers_ms=draw(nasty_floats), trigger=draw(texts)))
    tel = probe_pb2.Telemetry(engine_state=draw(enums), stalled=draw(st.booleans()), stall_detail=draw(texts))
    load = tel.engine_load
    for name in ("requests_waiting", "requests_running", "kv_cache_usage_ratio", "prefix_cache_hit_ratio",
                 "generation_tokens_total"):
        if draw(st.booleans()):
            setattr(load, name, draw(nasty_floats))
    load.kv_cache_metric = draw(texts)
    tel.gpu.state = draw(enums)
    tel.gpu.error = draw(texts)
    for i in range(draw(st.sampled_from([0, 1, 2, 100]))):
        g = tel.gpu.gpus.add(index=i)
        if draw(st.booleans()):
            g.memory_total_bytes = draw(st.integers(0, 2 ** 64 - 1))
            g.memory_used_bytes = draw(st.integers(0, 2 ** 64 - 1))
        for name in ("utilization_ratio", "temperature_c", "power_w"):
            if draw(st.booleans()):
                setattr(g, name, draw(nasty_floats))
        g.xid_events.extend(draw(st.lists(st.integers(0, 2 ** 32 - 1), max_size=3)) * draw(st.sampled_from([1, 50])))
        g.errors.extend(draw(st.lists(texts, max_size=3)))
    return probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(
        seq=draw(st.integers(0, 2 ** 64 - 1)), interval_ms=draw(st.integers(0, 2 ** 32 - 1)), telemetry=tel))


def _finite_in(v, lo, hi) -> bool:
    return v is None or (math.isfinite(v) and lo <= v <= hi)


@given(agent_messages())
@settings(max_examples=150, deadline=None)
def test_any_agent_message_is_checked_without_raising_and_only_sane_values_pass(msg):
    checked, bad = EDGE.check(msg)
    assert all(b.reason in REASONS for b in bad)
    assert all(len(b.field) < 80 for b in bad)
    if isinstance(checked, CheckedHeartbeat):
        o, t = checked.observation, checked.telemetry
        assert o.engine_state in ("COLD", "WARMING", "READY", "FAILED")
        top = PC.limits.max_requests
        assert _finite_in(o.requests_waiting, 0, top) and _finite_in(o.requests_running, 0, top)
        assert _finite_in(o.gpu_free_ratio, 0, 1) and _finite_in(t.load.kv_cache_usage_ratio, 0, 1)
        assert len(o.stall_detail) <= PC.limits.max_text_chars and len(t.gpu.error) <= PC.limits.max_text_chars
        assert len(t.load.kv_cache_metric) <= PC.limits.max_text_chars and len(o.gpu_fatal) < 100
        assert t.gpu.nvml.startswith("NVML_STATE_")
    elif isinstance(checked, CheckedResult):
        o = checked.observation
        assert math.isfinite(o.ttft_ms) and 0 <= o.ttft_ms <= PC.limits.max_ttft.ms
        assert 0 <= o.http_status <= 999 and len(o.detail) <= PC.limits.max_text_chars
        assert isinstance(o.kind, ProbeResultKind)


def test_each_planted_bad_field_is_reported_by_name_and_reason():
    msg = probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(ok=True, ttft_ms=math.inf))
    assert EDGE.check(msg)[0] is None
    assert [(b.field, b.reason) for b in EDGE.check(msg)[1]] == [("inference_result.ttft_ms", "not_finite")]
    msg = probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(ok=True, ttft_ms=1e308))
    assert [(b.field, b.reason) for b in EDGE.check(msg)[1]] == [("inference_result.ttft_ms", "out_of_range")]
    msg = probe_pb2.AgentMessage(inference_result=probe_pb2.InferenceResult(ok=False, failure=77, detail="d" * 10_000))
    checked, bad = EDGE.check(msg)
    assert checked.observation.kind is ProbeResultKind.BAD_OUTPUT
    assert len(checked.observation.detail) == PC.limits.max_text_chars
    assert {(b.field, b.reason) for b in bad} == {("inference_result.failure", "unknown_enum"),
                                                   ("inference_result.detail", "too_long")}
    hb = probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(telemetry=probe_pb2.Telemetry(
        engine_state=probe_pb2.ENGINE_STATE_READY)))
    hb.heartbeat.telemetry.gpu.state = 77
    hb.heartbeat.telemetry.engine_load.requests_waiting = -3.0
    hb.heartbeat.telemetry.gpu.gpus.add(memory_total_bytes=10, memory_used_bytes=20, xid_events=[79] * 100)
    checked, bad = EDGE.check(hb)
    assert checked.telemetry.gpu.nvml == "NVML_STATE_UNKNOWN" and checked.observation.requests_waiting is None
    assert checked.observation.gpu_free_ratio == 0.0 and checked.observation.gpu_fatal == "GPU 0 Xid 79"
    assert {(b.field, b.reason) for b in bad} == {
        ("heartbeat.telemetry.gpu.state", "unknown_enum"),
        ("heartbeat.telemetry.engine_load.requests_waiting", "negative"),
        ("heartbeat.telemetry.gpu.gpus.memory_used_bytes", "out_of_range"),
        ("heartbeat.telemetry.gpu.gpus.xid_events", "too_many")}
    assert [(b.field, b.reason) for b in EDGE.check(probe_pb2.AgentMessage())[1]] == [("agent_message", "empty")]


def test_unchanged_gpu_part_gives_the_same_result_and_bad_fields_and_a_changed_one_is_checked_again():
    """The edge reuses the last GPU check while the GPU part is equal: the bad fields
    are still reported on every heartbeat, and a change (also made in place to the same message
    object) is checked again."""
    edge = AgentEdge(HealthConfig(), ProbeConfig())
    msg = probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=1, telemetry=probe_pb2.Telemetry(
        engine_state=probe_pb2.ENGINE_STATE_READY)))
    g = msg.heartbeat.telemetry.gpu.gpus.add(index=0, memory_total_bytes=100, memory_used_bytes=150)
    g.utilization_ratio = float("nan")
    for _ in range(3):
        checked, bad = edge.check(probe_pb2.AgentMessage.FromString(msg.SerializeToString()))
        assert isinstance(checked, CheckedHeartbeat) and checked.observation.gpu_free_ratio == 0.0
        assert sorted((b.field, b.reason) for b in bad) == [
            ("heartbeat.telemetry.gpu.gpus.memory_used_bytes", "out_of_range"),
            ("heartbeat.telemetry.gpu.gpus.utilization_ratio", "not_finite")]
    checked, bad = edge.check(msg)
    g.memory_used_bytes = 25
    g.utilization_ratio = 0.5
    checked, bad = edge.check(msg)  # the same object, changed in place
    assert checked.observation.gpu_free_ratio == 0.75 and bad == []
    g.xid_events.append(79)
    checked, _ = edge.check(msg)
    assert checked.observation.gpu_fatal == "GPU 0 Xid 79"


def _gpu_heartbeat(poll_seq: int, used: int, xid: int | None = None) -> probe_pb2.AgentMessage:
    msg = probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=1, telemetry=probe_pb2.Telemetry(
        engine_state=probe_pb2.ENGINE_STATE_READY)))
    gpu = msg.heartbeat.telemetry.gpu
    gpu.poll_seq = poll_seq
    gpu.gpus.add(index=0, memory_total_bytes=100, memory_used_bytes=used, xid_events=[] if xid is None else [xid])
    return msg


def test_a_numbered_gpu_part_is_checked_once_per_poll_seq_and_again_on_a_new_stream():
    """GpuTelemetry.poll_seq: the last number again reuses the last check without comparing
    (the agent's promise), a new number is checked, a new stream forgets the number. A broken
    promise keeps the last checked readings (never unchecked values): 60 % free, not 90 %."""
    edge = AgentEdge(HealthConfig(), ProbeConfig())
    first = 1_764_000_000_000_000_000
    assert edge.check(_gpu_heartbeat(first, used=40))[0].observation.gpu_free_ratio == 0.6
    same_number = edge.check(_gpu_heartbeat(first, used=10, xid=79))[0].observation
    assert same_number.gpu_free_ratio == 0.6 and same_number.gpu_fatal == ""   # not compared
    new_poll = edge.check(_gpu_heartbeat(first + 1, used=10, xid=79))[0].observation
    assert new_poll.gpu_free_ratio == 0.9 and new_poll.gpu_fatal == "GPU 0 Xid 79"
    edge.stream_started()
    again = edge.check(_gpu_heartbeat(first + 1, used=50))[0].observation
    assert again.gpu_free_ratio == 0.5 and again.gpu_fatal == ""
    unnumbered = edge.check(_gpu_heartbeat(0, used=50, xid=79))[0].observation   # 0: compared
    assert unnumbered.gpu_fatal == "GPU 0 Xid 79"


@settings(max_examples=40, deadline=None)
@given(st.lists(agent_messages(), min_size=1, max_size=6), st.lists(st.booleans(), min_size=6, max_size=6))
def test_honestly_numbered_gpu_parts_give_what_a_fresh_check_gives(msgs, repeat):
    """An agent that gives every new GPU part a new poll_seq (and repeats a part with its number):
    the reusing edge returns the same observation and bad fields as an edge checking afresh."""
    edge, seq, last = AgentEdge(HealthConfig(), ProbeConfig()), 10, None
    for msg, again in zip(msgs, repeat, strict=False):
        if msg.WhichOneof("msg") != "heartbeat":
            continue
        if again and last is not None:
            msg.heartbeat.telemetry.gpu.CopyFrom(last)   # the same part again, with its number
        else:
            seq += 1
            msg.heartbeat.telemetry.gpu.poll_seq = seq
        last = msg.heartbeat.telemetry.gpu
        got, got_bad = edge.check(msg)
        ref, ref_bad = AgentEdge(HealthConfig(), ProbeConfig()).check(msg)
        assert sorted(map(repr, got_bad)) == sorted(map(repr, ref_bad))
        assert repr(got.observation) == repr(ref.observation) and got.telemetry == ref.telemetry


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["requests_waiting", "requests_running", "kv_cache_usage_ratio",
                                           "prefix_cache_hit_ratio", "generation_tokens_total"]),
                          nasty_floats), max_size=8),
       st.sampled_from([1e9, 5.0, math.inf]))
def test_engine_load_in_range_shortcut_equals_the_full_number_check(fields, max_requests):
    """The engine load's in-range shortcut keeps exactly what ``_number`` keeps and reports the
    same bad fields (NaN, infinities, -0.0, bounds, an infinite max_requests)."""
    edge = AgentEdge(HealthConfig(), ProbeConfig(max_requests=max_requests))
    load = probe_pb2.EngineLoad()
    for name, v in fields:
        setattr(load, name, v)
    bad: list = []
    got = edge.load.check(load, bad)
    ref_bad: list = []
    bounds = {"requests_waiting": max_requests, "requests_running": max_requests, "kv_cache_usage_ratio": 1.0,
              "prefix_cache_hit_ratio": 1.0, "generation_tokens_total": math.inf}
    ref = {name: (AgentEdge._number(getattr(load, name), f"heartbeat.telemetry.engine_load.{name}", 0.0, hi,
                                    ref_bad) if load.HasField(name) else None)
           for name, hi in bounds.items()}
    assert bad == ref_bad
    for name in ("requests_waiting", "requests_running", "kv_cache_usage_ratio"):
        a, b = getattr(got, name), ref[name]
        assert (a is None and b is None) or (a == b and math.copysign(1, a) == math.copysign(1, b)), name


_LOAD_FIELDS = ("requests_waiting", "requests_running", "kv_cache_usage_ratio", "prefix_cache_hit_ratio",
                "generation_tokens_total")


@st.composite
def load_sequences(draw) -> list[probe_pb2.EngineLoad]:
    """Engine loads as a stream brings them: mostly the last one again with a new token counter
    (present or not), sometimes one field changed (NaN, infinities, -0.0 and bounds included)."""
    load = probe_pb2.EngineLoad(metrics_ok=draw(st.booleans()))
    out = []
    for _ in range(draw(st.integers(1, 12))):
        load = probe_pb2.EngineLoad.FromString(load.SerializeToString())
        change = draw(st.sampled_from(["tokens"] * 4 + ["field", "clear", "text", "same"]))
        if change == "tokens":
            load.generation_tokens_total = draw(nasty_floats)
        elif change == "field":
            setattr(load, draw(st.sampled_from(_LOAD_FIELDS)), draw(nasty_floats))
        elif change == "clear":
            load.ClearField(draw(st.sampled_from(_LOAD_FIELDS)))
        elif change == "text":
            setattr(load, draw(st.sampled_from(["kv_cache_metric", "metrics_error"])), draw(texts))
        out.append(load)
    return out


def _load_key(summary) -> tuple:
    return tuple((v, math.copysign(1.0, v)) if isinstance(v, float) else v
                 for v in (summary.metrics_ok, summary.requests_waiting, summary.requests_running,
                           summary.kv_cache_usage_ratio, summary.kv_cache_metric, summary.metrics_error))


@settings(max_examples=300, deadline=None)
@given(load_sequences(), st.sampled_from([1e9, 5.0, math.inf]))
def test_the_kept_engine_load_gives_what_a_fresh_check_gives(loads, max_requests):
    """The load check that reuses its last result for a load equal but for the token counter
    returns the same values (zero signs included) and bad fields as a check afresh, and the very
    same summary object whenever the values did not change."""
    pc = ProbeConfig(max_requests=max_requests)
    kept, last = LoadCheck(pc), None
    for load in loads:
        bad: list = []
        got = kept.check(load, bad)
        ref_bad: list = []
        ref = LoadCheck(pc).check(load, ref_bad)
        assert sorted(map(repr, bad)) == sorted(map(repr, ref_bad))
        assert _load_key(got) == _load_key(ref)
        if last is not None and _load_key(last) == _load_key(got):
            assert got is last
        last = got


def test_a_load_changed_only_in_its_token_counter_is_not_checked_again():
    """A busy engine's token counter moves every scrape: the rest is compared as a message, not
    read field by field; a NaN counter is still reported each time."""
    check, bad = LoadCheck(PC), []
    first = check.check(probe_pb2.EngineLoad(metrics_ok=True, requests_running=4.0, generation_tokens_total=1.0), bad)
    again = check.check(probe_pb2.EngineLoad(metrics_ok=True, requests_running=4.0, generation_tokens_total=9.0), bad)
    assert again is first and bad == []
    check.check(probe_pb2.EngineLoad(metrics_ok=True, requests_running=4.0, generation_tokens_total=math.nan), bad)
    assert [(b.field, b.reason) for b in bad] == [("heartbeat.telemetry.engine_load.generation_tokens_total",
                                                   "not_finite")]
    moved = check.check(probe_pb2.EngineLoad(metrics_ok=True, requests_running=5.0, generation_tokens_total=10.0), [])
    assert moved is not first and moved.requests_running == 5.0


def test_a_heartbeat_on_a_transport_stream_is_vouched_and_an_unchanged_one_is_the_same_object():
    edge = AgentEdge(HealthConfig(), ProbeConfig())
    msg = probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=1, telemetry=probe_pb2.Telemetry(
        engine_state=probe_pb2.ENGINE_STATE_READY)))
    first, _ = edge.check(msg, vouched=True)
    again, _ = edge.check(msg, vouched=True)
    assert isinstance(first, CheckedHeartbeat) and first.observation.vouched and again is first
    plain, _ = edge.check(msg)
    assert isinstance(plain, CheckedHeartbeat) and not plain.observation.vouched and plain is not first
