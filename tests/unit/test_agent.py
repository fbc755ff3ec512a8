"""Tests for node_probe.agent (real grpc.aio server and client on 127.0.0.1, fake engine in
aiohttp) and node_probe.cli."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
import types
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from node_probe.agent import AgentConfig, EngineLifecycle, ProbeAgent, run_agent
from node_probe.engines import EngineLoadReading, EngineRequestError, GroupLoad, ProbeOutcome
from node_probe.proto import probe_pb2, probe_pb2_grpc
from node_probe.shutdown import bounded
from xds_server.testing import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-cpu"
VENV_BIN = Path(sys.executable).parent
NODE_PROBE = VENV_BIN / "node-probe"
if not NODE_PROBE.exists():  # a Python outside the project's venv: the console script on PATH
    NODE_PROBE = Path(shutil.which("node-probe") or "node-probe")

MODELS_BODY = (
    '{"object":"list","data":[{"id":"local/tiny-llama-1","object":"model","owned_by":"vllm"}]}'
)
TOKEN_CHUNK = (
    'data: {"id":"cmpl-1","object":"text_completion","model":"local/tiny-llama-1",'
    '"choices":[{"index":0,"text":"&","finish_reason":"length"}]}\n\n'
)
FATAL_BODY = (
    '{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root '
    'cause.","type":"InternalServerError","param":null,"code":500}}'
)


def _fixture_metrics() -> str:
    path = FIXTURES / "13_metrics_during_load.raw"
    if path.exists():
        return path.read_bytes().partition(b"\r\n\r\n")[2].decode()
    return (
        'vllm:num_requests_running{engine="0",model_name="local/tiny-llama-1"} 3.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="local/tiny-llama-1"} 0.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="local/tiny-llama-1"} 0.00073260073260073\n'
        'vllm:generation_tokens_total{engine="0",model_name="local/tiny-llama-1"} 247.0\n'
    )


METRICS_TEXT = _fixture_metrics()
GEN_LINE = 'vllm:generation_tokens_total{engine="0",model_name="local/tiny-llama-1"} 247.0'
RUNNING_LINE = 'vllm:num_requests_running{engine="0",model_name="local/tiny-llama-1"} 3.0'
assert GEN_LINE in METRICS_TEXT and RUNNING_LINE in METRICS_TEXT



class FakeEngine:
    """Minimal vLLM look-alike serving the real vLLM /metrics page of fixture 13 (3 running).
    ``mode``: ok | fatal | frozen | overloaded (429). ``metrics_delay_s`` stalls /metrics.
    ``running`` replaces the running gauge; the generated-token counter advances by
    ``tokens_per_scrape`` at every scrape (0: frozen, as in a hung engine). ``probes`` records
    the monotonic arrival time of each /v1/completions request."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.metrics_delay_s = 0.0
        self.running = 3.0
        self.waiting = 0.0
        self.gen_tokens = 247.0
        self.tokens_per_scrape = 5.0
        self.scrapes = 0
        self.token_text = "&"
        self.health_calls = 0
        self.probes: list[float] = []
        self.probe_headers: list[dict[str, str]] = []
        self.probe_bodies: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        host, bound = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_delay_s:
            await asyncio.sleep(self.metrics_delay_s)
        self.scrapes += 1
        self.gen_tokens += self.tokens_per_scrape
        text = METRICS_TEXT.replace(GEN_LINE, GEN_LINE.replace("247.0", f"{self.gen_tokens}"))
        text = text.replace(RUNNING_LINE, RUNNING_LINE.replace("3.0", f"{self.running}"))
        text = text.replace(
            'vllm:num_requests_waiting{engine="0",model_name="local/tiny-llama-1"} 0.0',
            f'vllm:num_requests_waiting{{engine="0",model_name="local/tiny-llama-1"}} {self.waiting}')
        return web.Response(text=text, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        return web.Response(status=200)  # always 200: the engine's own health check sees nothing

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(text=MODELS_BODY, content_type="application/json")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.probes.append(time.monotonic())
        self.probe_headers.append(dict(request.headers))
        self.probe_bodies.append(await request.json())
        if self.mode == "noheaders":  # accepts, never answers (hung, or still loading weights)
            await asyncio.sleep(30)
        if self.mode == "fatal":
            return web.Response(status=500, text=FATAL_BODY, content_type="application/json")
        if self.mode == "overloaded":
            return web.json_response({"error": {"message": "Too many requests", "code": 429}},
                                     status=429)
        resp = web.StreamResponse(status=200)
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        if self.mode == "frozen":
            await asyncio.sleep(30)
        await asyncio.sleep(0.005)
        await resp.write(TOKEN_CHUNK.replace('"text":"&"', f'"text":{json.dumps(self.token_text)}').encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class FakeGpuCollector:
    def __init__(self) -> None:
        self.calls = 0
        self.closed = False

    def collect(self) -> probe_pb2.GpuTelemetry:
        self.calls += 1
        t = probe_pb2.GpuTelemetry(state=probe_pb2.NVML_STATE_OK)
        t.gpus.add(index=0, name="NVIDIA H200", memory_total_bytes=100, memory_used_bytes=40)
        return t

    def close(self) -> None:
        self.closed = True


@pytest.fixture
async def engine():
    eng = FakeEngine()
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture
async def make_agent():
    agents: list[ProbeAgent] = []

    async def make(engine_url: str, gpu: Any = None, **overrides: Any) -> tuple[ProbeAgent, int]:
        kwargs: dict[str, Any] = {
            "engine_url": engine_url,
            "listen": "127.0.0.1:0",
            "node_id": "node-a",
            "probe_interval_s": 30.0,
            "metrics_interval_ms": 50,
            "gpu_interval_s": 0.2 if gpu is not None else 0.0,
        }
        kwargs.update(overrides)
        agent = ProbeAgent(AgentConfig(**kwargs), gpu_collector=gpu)
        agents.append(agent)
        port = await agent.start()
        return agent, port

    yield make
    for agent in agents:
        await agent.stop()


class Watcher:
    """A Watch call plus a reader task, so tests can wait with timeouts without cancelling the
    RPC (cancelling a pending ``call.read()`` cancels the whole call)."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.queue: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.call.read()
                self.queue.put_nowait((time.monotonic(), msg))
                if msg is grpc.aio.EOF:
                    return
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            self.queue.put_nowait((time.monotonic(), exc))

    async def write(self, msg: probe_pb2.ControlMessage) -> None:
        await self.call.write(msg)

    async def next(self, timeout: float) -> tuple[float, Any]:
        """Next (arrival time, message); raises TimeoutError if none arrives in time."""
        return await asyncio.wait_for(self.queue.get(), timeout)

    def cancel(self) -> None:
        self.call.cancel()

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


@pytest.fixture
async def open_watch():
    channels: list[grpc.aio.Channel] = []
    watchers: list[Watcher] = []

    async def open_(port: int) -> Watcher:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        watcher = Watcher(probe_pb2_grpc.NodeProbeStub(channel).Watch())
        watchers.append(watcher)
        return watcher

    yield open_
    # bounded as the agent's own stop is (node_probe.shutdown): a grpc.aio close that hangs is said, not waited on
    for watcher in watchers:
        await bounded(watcher.close(), "watch call")
    for channel in channels:
        await bounded(channel.close(grace=None), "watch channel")


def _check(msg: Any) -> Any:
    assert msg is not grpc.aio.EOF, "stream ended"
    assert not isinstance(msg, BaseException), f"stream failed: {msg!r}"
    return msg


async def read_until(w: Watcher, pred, timeout: float = 3.0) -> tuple[list[tuple[float, Any]], Any]:
    """Read messages until ``pred(msg)``; returns (all (arrival, msg) read, the matching msg)."""
    seen: list[tuple[float, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            t, msg = await w.next(remaining)
        except TimeoutError:
            raise AssertionError(f"condition not met in {timeout}s; last: {seen[-3:]}") from None
        seen.append((t, _check(msg)))
        if pred(msg):
            return seen, msg


async def collect_for(w: Watcher, seconds: float) -> list[tuple[float, Any]]:
    out: list[tuple[float, Any]] = []
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            t, msg = await w.next(remaining)
        except TimeoutError:
            break
        out.append((t, _check(msg)))
    return out


def kind(msg) -> str:
    return msg.WhichOneof("msg")


def is_result(msg) -> bool:
    return kind(msg) == "inference_result"


def stream_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("np-stream-") and not t.done()]


# ---------------------------------------------------------------------------------------------
# Agent over gRPC


async def test_heartbeats_fixed_rate_with_cached_telemetry(engine, make_agent, open_watch):
    gpu = FakeGpuCollector()
    agent, port = await make_agent(engine.url, gpu=gpu)
    call = await open_watch(port)
    await call.write(probe_pb2.ControlMessage(hello=probe_pb2.Hello(control_plane_id="cp-1")))
    beats: list[tuple[float, probe_pb2.Heartbeat]] = []
    while len(beats) < 16:
        t, msg = await call.next(2.0)
        if kind(_check(msg)) == "heartbeat":
            beats.append((t, msg.heartbeat))
    assert [hb.seq for _, hb in beats] == list(range(1, 17))
    gaps = [(b[0] - a[0]) * 1000 for a, b in pairwise(beats[1:])]
    assert 85 <= statistics.median(gaps) <= 115, gaps
    span = beats[-1][0] - beats[1][0]
    assert 1.30 <= span <= 1.60, span  # 14 intervals, no drift accumulation
    hb = beats[-1][1]
    assert hb.interval_ms == 100 and hb.node_id == "node-a"
    load = hb.telemetry.engine_load
    assert load.metrics_ok and load.metrics_error == ""
    assert load.requests_running == 3.0 and load.requests_waiting == 0.0
    assert load.kv_cache_usage_ratio == pytest.approx(0.00073260073260073)
    assert load.kv_cache_metric == "vllm:kv_cache_usage_perc"
    assert load.generation_tokens_total > 247.0  # advancing: a busy engine, not stalled
    assert not hb.telemetry.stalled and hb.telemetry.stall_detail == ""
    assert load.age_ms < 500
    assert hb.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY  # first probe at start ok
    assert hb.telemetry.gpu.state == probe_pb2.NVML_STATE_OK
    assert hb.telemetry.gpu.gpus[0].memory_used_bytes == 40
    assert gpu.calls >= 2
    await agent.stop()
    assert gpu.closed or gpu.calls > 0


async def test_ping_pong_same_seq_fast(engine, make_agent, open_watch):
    _, port = await make_agent(engine.url)
    call = await open_watch(port)
    await read_until(call, lambda m: kind(m) == "heartbeat")
    rtts = []
    for seq in (42, 43, 1_000_000_000_007):
        sent = time.monotonic()
        await call.write(probe_pb2.ControlMessage(ping=probe_pb2.Ping(seq=seq)))
        seen, msg = await read_until(call, lambda m: kind(m) == "pong", timeout=1.0)
        rtts.append(seen[-1][0] - sent)
        assert msg.pong.seq == seq
        assert msg.pong.processing_us < 50_000
    assert min(rtts) < 0.05, rtts


async def test_two_streams_share_probe_results(engine, make_agent, open_watch):
    agent, port = await make_agent(engine.url, probe_interval_s=0.4, probe_jitter_ratio=0.0)
    a = await open_watch(port)
    b = await open_watch(port)
    await read_until(a, lambda m: kind(m) == "heartbeat")
    await read_until(b, lambda m: kind(m) == "heartbeat")
    assert agent.subscriber_count == 2
    first = agent.probe_count + 1
    t0 = time.monotonic()
    got_a, got_b = await asyncio.gather(collect_for(a, 1.5), collect_for(b, 1.5))
    last = agent.probe_count
    # let both streams catch up to the last started probe
    for call, got in ((a, got_a), (b, got_b)):
        if not any(is_result(m) and m.inference_result.seq == last for _, m in got):
            seen, _ = await read_until(call, lambda m: is_result(m) and m.inference_result.seq == last)
            got.extend(seen)
    seqs_a = [m.inference_result.seq for _, m in got_a if is_result(m) and m.inference_result.seq >= first]
    seqs_b = [m.inference_result.seq for _, m in got_b if is_result(m) and m.inference_result.seq >= first]
    assert seqs_a == seqs_b == list(range(first, last + 1))
    assert 3 <= len(seqs_a) <= 5, seqs_a
    # one probe per interval at the engine, however many control planes listen
    assert len(engine.probes) == agent.probe_count
    in_window = [t for t in engine.probes if t >= t0 - 0.05]
    gaps = [y - x for x, y in pairwise(in_window)]
    assert all(g >= 0.3 for g in gaps), gaps
    results = [m.inference_result for _, m in got_a if is_result(m)]
    assert all(r.ok and r.timeout_ms == 800 and r.ttft_ms > 0 for r in results)
    assert engine.probe_headers[-1].get("x-sentinel-probe") == "1"


async def test_engine_down_then_up_then_gone(make_agent, open_watch):
    port_engine = free_port()
    _agent, port = await make_agent(f"http://127.0.0.1:{port_engine}", probe_interval_s=0.25,
                                   probe_jitter_ratio=0.0, probe_timeout_ms=300)
    call = await open_watch(port)
    got = await collect_for(call, 0.8)
    beats = [m.heartbeat for _, m in got if kind(m) == "heartbeat"]
    results = [m.inference_result for _, m in got if is_result(m)]
    assert len(beats) >= 6
    assert all(not hb.telemetry.engine_load.metrics_ok for hb in beats[1:])
    assert beats[-1].telemetry.engine_load.metrics_error
    assert not beats[-1].telemetry.engine_load.HasField("requests_running")  # unknown, not 0
    assert beats[-1].telemetry.engine_state == probe_pb2.ENGINE_STATE_COLD
    assert results and all(r.failure == probe_pb2.FAILURE_KIND_CONNECT and not r.ok for r in results)

    eng = FakeEngine()
    await eng.start(port_engine)
    try:
        await read_until(
            call,
            lambda m: kind(m) == "heartbeat"
            and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY
            and m.heartbeat.telemetry.engine_load.metrics_ok,
        )
    finally:
        await eng.stop()
    _, msg = await read_until(
        call,
        lambda m: kind(m) == "heartbeat"
        and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_FAILED,
    )
    assert not msg.heartbeat.telemetry.engine_load.metrics_ok


async def test_frozen_engine_heartbeats_unaffected_probe_times_out(engine, make_agent, open_watch):
    engine.mode = "frozen"
    engine.metrics_delay_s = 2.0  # a scrape that hangs must not delay heartbeats
    agent, port = await make_agent(engine.url, probe_timeout_ms=300, probe_interval_s=0.5,
                                   probe_jitter_ratio=0.0, metrics_timeout_ms=1500,
                                   model="local/tiny-llama-1", engine_kind="vllm")
    call = await open_watch(port)
    got = await collect_for(call, 1.2)
    times = [t for t, m in got if kind(m) == "heartbeat"]
    gaps = [b - a for a, b in pairwise(times[1:])]
    assert len(times) >= 10 and max(gaps) < 0.2, gaps
    results = [m.inference_result for _, m in got if is_result(m)]
    assert results
    for r in results:
        assert r.failure == probe_pb2.FAILURE_KIND_TIMEOUT and r.http_status == 200
        assert r.timeout_ms == 300
    assert agent.engine_state == probe_pb2.ENGINE_STATE_WARMING  # answers, never a token


async def test_engine_fatal_marks_failed_and_stays(engine, make_agent, open_watch):
    engine.mode = "fatal"
    _agent, port = await make_agent(engine.url, probe_interval_s=0.3, probe_jitter_ratio=0.0)
    call = await open_watch(port)
    _, msg = await read_until(call, is_result)
    assert msg.inference_result.failure == probe_pb2.FAILURE_KIND_ENGINE_FATAL
    assert msg.inference_result.http_status == 500
    got = await collect_for(call, 0.4)  # /metrics keeps answering 200 (stale), still FAILED
    beats = [m.heartbeat for _, m in got if kind(m) == "heartbeat"]
    assert beats and all(hb.telemetry.engine_state == probe_pb2.ENGINE_STATE_FAILED for hb in beats)
    assert beats[-1].telemetry.engine_load.metrics_ok
    engine.mode = "ok"
    await read_until(
        call,
        lambda m: kind(m) == "heartbeat"
        and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY,
    )


async def test_probe_now_triggers_and_is_rate_limited(engine, make_agent, open_watch):
    agent, port = await make_agent(engine.url, min_probe_now_interval_ms=500)
    call = await open_watch(port)
    await collect_for(call, 0.3)  # may include the result of the probe at start (seq 1)
    assert agent.probe_count == 1  # the next scheduled probe is 30 s away
    sent = time.monotonic()
    await call.write(probe_pb2.ControlMessage(probe_now=probe_pb2.ProbeNow(reason="suspect")))
    seen, msg = await read_until(call, is_result, timeout=1.0)
    assert msg.inference_result.seq == 2 and msg.inference_result.ok
    assert seen[-1][0] - sent < 0.3
    for _ in range(5):
        await call.write(probe_pb2.ControlMessage(probe_now=probe_pb2.ProbeNow(reason="again")))
    got = await collect_for(call, 0.3)
    assert not any(is_result(m) for _, m in got)  # inside the 500 ms window
    assert len(engine.probes) == 2
    seen, msg = await read_until(call, is_result, timeout=1.0)  # coalesced into one at window end
    assert msg.inference_result.seq == 3
    assert seen[-1][0] - sent >= 0.45
    got = await collect_for(call, 0.7)
    assert not any(is_result(m) for _, m in got)
    assert len(engine.probes) == 3 == agent.probe_count


async def test_cancel_stream_cleans_up(engine, make_agent, open_watch):
    agent, port = await make_agent(engine.url)
    a = await open_watch(port)
    b = await open_watch(port)
    await read_until(a, lambda m: kind(m) == "heartbeat")
    await read_until(b, lambda m: kind(m) == "heartbeat")
    assert agent.subscriber_count == 2 and len(stream_tasks()) == 4
    a.cancel()
    for _ in range(100):
        if agent.subscriber_count == 1 and len(stream_tasks()) == 2:
            break
        await asyncio.sleep(0.01)
    assert agent.subscriber_count == 1
    assert len(stream_tasks()) == 2
    got = await collect_for(b, 0.35)  # the other stream is unaffected
    assert sum(kind(m) == "heartbeat" for _, m in got) >= 2
    b.cancel()
    for _ in range(100):
        if agent.subscriber_count == 0 and not stream_tasks():
            break
        await asyncio.sleep(0.01)
    assert agent.subscriber_count == 0 and stream_tasks() == []


async def test_stop_ends_streams_and_tasks(engine, make_agent, open_watch):
    agent, port = await make_agent(engine.url)
    call = await open_watch(port)
    await read_until(call, lambda m: kind(m) == "heartbeat")
    await agent.stop()
    await agent.stop()  # idempotent
    assert agent.subscriber_count == 0 and stream_tasks() == []
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("np-agent-") and not t.done()]
    # the stream ends (cleanly or with an error status), it does not hang
    while True:
        _, msg = await call.next(2.0)
        if msg is grpc.aio.EOF or isinstance(msg, BaseException):
            break


async def test_listen_port_in_use_raises_oserror(engine, make_agent):
    _, port = await make_agent(engine.url)
    agent = ProbeAgent(AgentConfig(engine_url=engine.url, listen=f"127.0.0.1:{port}", gpu_interval_s=0))
    with pytest.raises(OSError):
        await agent.start()
    await agent.stop()


async def test_run_agent_until_stop_event(engine, open_watch):
    stop = asyncio.Event()
    started: list[tuple[ProbeAgent, int]] = []
    cfg = AgentConfig(engine_url=engine.url, listen="127.0.0.1:0", gpu_interval_s=0)
    task = asyncio.create_task(run_agent(cfg, stop_event=stop, on_started=lambda a, p: started.append((a, p))))
    try:
        for _ in range(200):
            if started:
                break
            await asyncio.sleep(0.01)
        agent, port = started[0]
        call = await open_watch(port)
        await read_until(call, lambda m: kind(m) == "heartbeat")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert agent.subscriber_count == 0 and stream_tasks() == []


# ---------------------------------------------------------------------------------------------
# Field cases, stall detection, cadence, lifecycle, deep check, GPU


def results_of(got) -> list:
    return [m.inference_result for _, m in got if is_result(m)]


def beats_of(got) -> list:
    return [m.heartbeat for _, m in got if kind(m) == "heartbeat"]


async def test_hung_inference_times_out_probes_and_reads_stalled_despite_health_200(engine, make_agent, open_watch):
    """fc06: /health 200 at once; completions accepted but never answered; /metrics shows 1
    running, 3 waiting and frozen generation tokens. Probes time out (the control plane counts
    2 -> UNHEALTHY with an inference-timeout reason); telemetry says stalled; /health's 200 is
    never consulted and changes nothing."""
    engine.mode, engine.running, engine.waiting, engine.tokens_per_scrape = "noheaders", 1.0, 3.0, 0.0
    agent, port = await make_agent(engine.url, probe_interval_s=0.3, probe_jitter_ratio=0.0,
                                   probe_timeout_ms=200, engine_kind="vllm", model="m")
    call = await open_watch(port)
    got = await collect_for(call, 1.6)
    results = results_of(got)
    assert len(results) >= 2
    for r in results[:2]:
        assert not r.ok and r.failure == probe_pb2.FAILURE_KIND_TIMEOUT and r.http_status == 0
        assert r.headers_ms == 0.0 and "no response headers within 200 ms" in r.detail
    stalled = [hb for hb in beats_of(got) if hb.telemetry.stalled]
    assert stalled, "stall not reported"
    detail = stalled[-1].telemetry.stall_detail
    assert detail.startswith("engine 0: 1 running, 3 waiting") and "frozen at" in detail
    assert any(r.trigger == "stall" for r in results)  # the stall itself started a probe
    assert agent.engine_state != probe_pb2.ENGINE_STATE_READY
    assert engine.health_calls == 0


async def test_busy_engine_answering_429_is_never_stalled_and_stays_ready(engine, make_agent, open_watch):
    """fc07: a saturated engine answers probes 429 while its token counter rises with 256
    running and 1024 waiting: never stalled, lifecycle stays READY, probe cadence is the slow
    one (stall detection vouches for progress)."""
    agent, port = await make_agent(engine.url, probe_interval_s=1.0, probe_idle_interval_s=0.1,
                                   probe_jitter_ratio=0.0, engine_kind="vllm")
    call = await open_watch(port)
    await read_until(call, lambda m: kind(m) == "heartbeat"
                     and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY)
    engine.mode, engine.running, engine.waiting, engine.tokens_per_scrape = "overloaded", 256.0, 1024.0, 300.0
    await asyncio.sleep(0.1)
    before = agent.probe_count
    got = await collect_for(call, 2.5)
    beats = beats_of(got)
    assert beats and not any(hb.telemetry.stalled for hb in beats)
    assert all(hb.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY for hb in beats)
    assert beats[-1].telemetry.engine_load.requests_waiting == 1024
    results = results_of(got)
    assert results and all(r.failure == probe_pb2.FAILURE_KIND_HTTP_STATUS and r.http_status == 429
                           for r in results if r.seq > before + 1)
    assert "load, not death" in results[-1].detail
    assert agent.probe_count - before <= 4  # busy cadence 1 s, not the 0.1 s idle one


async def test_never_ready_before_first_good_probe_and_a_restart_rewarms(make_agent, open_watch):
    """fc08: engine answers /health and /metrics but completions block (weights loading): the
    agent reports WARMING, never READY, until the first good micro-probe. A restart (port
    refused, then back, loading again) goes FAILED -> WARMING -> READY again."""
    eng = FakeEngine()
    await eng.start()
    port_engine = int(eng.url.rsplit(":", 1)[1])
    eng.mode = "noheaders"
    _agent, port = await make_agent(eng.url, probe_interval_s=0.25, probe_jitter_ratio=0.0,
                                   probe_timeout_ms=150, engine_kind="vllm")
    call = await open_watch(port)
    try:
        got = await collect_for(call, 0.9)
        states = {hb.telemetry.engine_state for hb in beats_of(got)}
        assert probe_pb2.ENGINE_STATE_READY not in states
        assert beats_of(got)[-1].telemetry.engine_state == probe_pb2.ENGINE_STATE_WARMING
        assert all(r.failure == probe_pb2.FAILURE_KIND_TIMEOUT for r in results_of(got))
        eng.mode = "ok"
        seen, _ = await read_until(call, lambda m: kind(m) == "heartbeat"
                                   and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY)
        first_ok = next(i for i, (_, m) in enumerate(seen) if is_result(m) and m.inference_result.ok)
        ready_at = len(seen) - 1
        assert first_ok < ready_at  # READY only after the good probe
        # restart
        await eng.stop()
        t0 = time.monotonic()
        await read_until(call, lambda m: kind(m) == "heartbeat"
                         and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_FAILED)
        assert time.monotonic() - t0 < 0.5
        eng = FakeEngine()
        eng.mode = "noheaders"
        await eng.start(port_engine)
        await read_until(call, lambda m: kind(m) == "heartbeat"
                         and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_WARMING)
        got = await collect_for(call, 0.5)
        assert probe_pb2.ENGINE_STATE_READY not in {hb.telemetry.engine_state for hb in beats_of(got)}
        eng.mode = "ok"
        await read_until(call, lambda m: kind(m) == "heartbeat"
                         and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY)
    finally:
        await eng.stop()


async def test_refused_metrics_marks_failed_at_once_without_a_probe(engine, make_agent, open_watch):
    agent, port = await make_agent(engine.url, probe_interval_s=30.0)  # busy cadence: 30 s
    call = await open_watch(port)
    await read_until(call, lambda m: kind(m) == "heartbeat"
                     and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY)
    await asyncio.sleep(0.6)  # past the first idle-cadence probes; the engine is busy now
    await engine.stop()
    t0 = time.monotonic()
    await read_until(call, lambda m: kind(m) == "heartbeat"
                     and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_FAILED)
    assert time.monotonic() - t0 < 0.3  # one 50 ms scrape, not the next probe
    assert agent._lifecycle.reason.startswith("metrics:"), agent._lifecycle.reason


async def test_stall_on_simulated_engine_hang_under_load(make_agent, open_watch):
    """The simulated engine hung under load shows running > 0 with a frozen token counter
    (its /health and /metrics stay 200): the agent reports stalled about one window after
    the hang and probes at once; a busy engine before that was never stalled."""
    from node_probe.sim import SIM_ENGINE_KEY, SimConfig, build_app

    app = build_app(SimConfig(port=0, token_interval_ms=5))
    runner = web.AppRunner(app, shutdown_timeout=0.2, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, sport = runner.addresses[0][:2]
    url = f"http://{host}:{sport}"
    sim = app[SIM_ENGINE_KEY]
    http = aiohttp.ClientSession()

    async def user(i: int) -> None:
        body = {"model": "sim-model", "prompt": f"user {i}", "max_tokens": 4000, "stream": True}
        async with http.post(url + "/v1/completions", json=body) as r:
            async for _ in r.content:
                pass

    users = [asyncio.create_task(user(i)) for i in range(3)]
    try:
        _agent, port = await make_agent(url, probe_timeout_ms=300, min_probe_now_interval_ms=200)
        call = await open_watch(port)
        await read_until(call, lambda m: kind(m) == "heartbeat"
                         and m.heartbeat.telemetry.engine_load.requests_running >= 3)
        got = await collect_for(call, 1.3)
        assert not any(hb.telemetry.stalled for hb in beats_of(got))  # busy, progressing
        sim.set_fault("hang")
        t0 = time.monotonic()
        _seen, msg = await read_until(call, lambda m: kind(m) == "heartbeat" and m.heartbeat.telemetry.stalled)
        elapsed = time.monotonic() - t0
        assert 0.95 <= elapsed <= 1.5, elapsed
        assert msg.heartbeat.telemetry.engine_load.requests_running >= 3
        assert "vllm:generation_tokens_total" in msg.heartbeat.telemetry.stall_detail
        _, res = await read_until(call, lambda m: is_result(m) and m.inference_result.trigger == "stall")
        assert res.inference_result.failure == probe_pb2.FAILURE_KIND_TIMEOUT
        assert res.inference_result.http_status == 200 and res.inference_result.headers_ms > 0
        sim.set_fault("none")
        await read_until(call, lambda m: kind(m) == "heartbeat" and not m.heartbeat.telemetry.stalled)
    finally:
        for t in users:
            t.cancel()
        await asyncio.gather(*users, return_exceptions=True)
        await http.close()
        await runner.cleanup()


async def test_deep_check_checks_the_answer(engine, make_agent, open_watch):
    engine.token_text = " 2"
    agent, port = await make_agent(engine.url, deep_check_interval_s=0.3, probe_interval_s=0.15,
                                   probe_jitter_ratio=0.0, engine_kind="vllm")
    call = await open_watch(port)
    _, msg = await read_until(call, lambda m: is_result(m) and m.inference_result.trigger == "deep")
    r = msg.inference_result
    assert r.ok and r.timeout_ms == 3000
    deep_bodies = [b for b in engine.probe_bodies if b["prompt"] == "1+1="]
    assert deep_bodies and deep_bodies[0]["max_tokens"] == 4 and deep_bodies[0]["cache_salt"]
    engine.token_text = " 3"  # silently corrupt weights: fluent, wrong
    _, msg = await read_until(call, lambda m: is_result(m) and m.inference_result.trigger == "deep")
    r = msg.inference_result
    assert not r.ok and r.failure == probe_pb2.FAILURE_KIND_BAD_OUTPUT
    assert "deep check" in r.detail and "expected '2'" in r.detail and r.ttft_ms > 0
    assert agent.engine_state == probe_pb2.ENGINE_STATE_READY  # alive, just wrong
    scheduled = [m.inference_result for _, m in await collect_for(call, 0.4) if is_result(m)]
    assert any(x.trigger == "scheduled" and x.ok for x in scheduled)


class XidGpu(FakeGpuCollector):
    def __init__(self) -> None:
        super().__init__()
        self.xids: list[int] = []
        self.lost = False

    def collect(self) -> probe_pb2.GpuTelemetry:
        t = super().collect()
        t.gpus[0].xid_events.extend(self.xids)
        if self.lost:
            t.gpus[0].errors.append("memory: GpuIsLost")
            t.state = probe_pb2.NVML_STATE_ERROR
        return t


@pytest.mark.parametrize("fault", ["xid79", "lost"])
async def test_gpu_fatal_marks_failed_at_once_then_rewarms(engine, make_agent, open_watch, fault):
    gpu = XidGpu()
    agent, port = await make_agent(engine.url, gpu=gpu, gpu_interval_s=0.05,
                                   probe_interval_s=0.2, probe_jitter_ratio=0.0)
    call = await open_watch(port)
    _, ready = await read_until(call, lambda m: kind(m) == "heartbeat"
                                and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY)
    if fault == "xid79":
        gpu.xids = [13, 79]
    else:
        gpu.lost = True
    t0 = time.monotonic()
    _, msg = await read_until(call, lambda m: kind(m) == "heartbeat"
                              and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_FAILED)
    assert time.monotonic() - t0 < 0.3
    reason = agent._lifecycle.reason
    assert ("fatal Xid 79" in reason) if fault == "xid79" else ("GpuIsLost" in reason)
    got = await collect_for(call, 0.5)  # probes still succeed: the GPU verdict holds
    assert all(hb.telemetry.engine_state == probe_pb2.ENGINE_STATE_FAILED for hb in beats_of(got))
    # GpuTelemetry.poll_seq numbers the readings (the control plane reuses its check of a number it
    # saw last): one number, one GPU part; the fault came with a later number
    parts: dict[int, probe_pb2.GpuTelemetry] = {}
    for hb in [ready.heartbeat, msg.heartbeat, *beats_of(got)]:
        assert parts.setdefault(hb.telemetry.gpu.poll_seq, hb.telemetry.gpu) == hb.telemetry.gpu
    assert 0 < ready.heartbeat.telemetry.gpu.poll_seq < msg.heartbeat.telemetry.gpu.poll_seq
    gpu.xids, gpu.lost = [13], False  # Xid 13 (graphics exception) is not fatal
    await read_until(call, lambda m: kind(m) == "heartbeat"
                     and m.heartbeat.telemetry.engine_state == probe_pb2.ENGINE_STATE_READY)


async def test_two_control_planes_probe_now_coalesced_same_results(engine, make_agent, open_watch):
    agent, port = await make_agent(engine.url, min_probe_now_interval_ms=300)
    a = await open_watch(port)
    b = await open_watch(port)
    await read_until(a, lambda m: kind(m) == "heartbeat")
    await read_until(b, lambda m: kind(m) == "heartbeat")
    await asyncio.sleep(0.3)  # past the probe at start (the engine is busy: next one in 30 s)
    start = agent.probe_count
    n_engine = len(engine.probes)
    await asyncio.gather(
        a.write(probe_pb2.ControlMessage(probe_now=probe_pb2.ProbeNow(reason="cp-a"))),
        b.write(probe_pb2.ControlMessage(probe_now=probe_pb2.ProbeNow(reason="cp-b"))),
    )
    _, ra = await read_until(a, lambda m: is_result(m) and m.inference_result.seq > start)
    _, rb = await read_until(b, lambda m: is_result(m) and m.inference_result.seq > start)
    assert ra.inference_result == rb.inference_result
    assert ra.inference_result.trigger == "probe_now" and ra.inference_result.headers_ms > 0
    got = await collect_for(a, 0.5)
    assert len(engine.probes) - n_engine <= 2  # both asks -> one probe (+ at most one coalesced)
    assert agent.probe_count - start == len(engine.probes) - n_engine
    assert all(r.seq <= agent.probe_count for r in results_of(got))


# ---------------------------------------------------------------------------------------------
# Pure pieces


def test_config_validation():
    with pytest.raises(ValueError):
        AgentConfig(engine_url="127.0.0.1:8000")
    with pytest.raises(ValueError):
        AgentConfig(engine_url="http://x", probe_jitter_ratio=1.0)
    with pytest.raises(ValueError):
        AgentConfig(engine_url="http://x", heartbeat_interval_ms=0)
    with pytest.raises(ValueError):
        AgentConfig(engine_url="http://x", engine_kind="llamacpp")
    with pytest.raises(ValueError):
        AgentConfig(engine_url="http://x", stall_window_ms=0)
    with pytest.raises(ValueError):
        AgentConfig(engine_url="http://x", metrics_url="x:8002/metrics")
    cfg = AgentConfig(engine_url="http://x")
    assert (cfg.listen, cfg.heartbeat_interval_ms, cfg.metrics_interval_ms) == ("127.0.0.1:50051", 100, None)
    assert cfg.effective_metrics_interval_ms == 100  # /metrics sampled every heartbeat
    assert (cfg.probe_interval_s, cfg.probe_jitter_ratio, cfg.probe_timeout_ms) == (4.0, 0.25, 800)
    assert (cfg.probe_idle_interval_s, cfg.effective_idle_interval_s) == (0.5, 0.5)
    assert (cfg.engine_kind, cfg.stall_window_ms, cfg.deep_check_interval_s) == ("auto", 1000, None)
    assert (cfg.model, cfg.gpu_interval_s, cfg.min_probe_now_interval_ms) == (None, 1.0, 1000)
    assert cfg.fatal_xids == {48, 63, 64, 74, 79, 94, 95}
    assert cfg.node_id
    # the idle cadence is never slower than the busy one
    assert AgentConfig(engine_url="http://x", probe_interval_s=0.25).effective_idle_interval_s == 0.25


def _reading(running: float, waiting: float = 0.0, progress: float | None = 10.0) -> EngineLoadReading:
    return EngineLoadReading(requests_running=running, requests_waiting=waiting,
                             groups={"0": GroupLoad(running, waiting, progress)},
                             progress_metric="vllm:generation_tokens_total")


def _next_probe_interval(agent: ProbeAgent) -> float:
    """The wait the agent's schedule plans right after a probe ends (fresh jitter each call)."""
    agent._schedule.probe_done(0.0)
    return agent._schedule.decide(0.0).wait_s


def test_probe_interval_follows_load_with_jitter():
    agent = ProbeAgent(AgentConfig(engine_url="http://x", probe_interval_s=4.0, probe_jitter_ratio=0.25))
    # unknown load (no scrape yet) -> idle cadence: 0.5 s +- 25 %
    values = [_next_probe_interval(agent) for _ in range(2000)]
    assert 0.375 <= min(values) < 0.39 and 0.61 < max(values) <= 0.625
    agent._on_reading(_reading(running=0), "", 1.0)
    assert 0.375 <= _next_probe_interval(agent) <= 0.625
    # busy and progress observable -> slow cadence 3-5 s
    agent._on_reading(_reading(running=4, waiting=2), "", 1.1)
    values = [_next_probe_interval(agent) for _ in range(2000)]
    assert 3.0 <= min(values) < 3.1 and 4.9 < max(values) <= 5.0
    # busy but no progress counter (e.g. SGLang): stall detection cannot cover it -> idle cadence
    agent._on_reading(_reading(running=4, progress=None), "", 1.2)
    assert _next_probe_interval(agent) <= 0.625
    # scrape failing: load unknown -> idle cadence
    agent._on_reading(None, "refused", 1.3)
    assert _next_probe_interval(agent) <= 0.625


def _outcome(ok=False, failure=0, status=0) -> ProbeOutcome:
    return ProbeOutcome(ok, 1.0 if ok else None, failure, status, "")


def test_lifecycle_transitions():
    lc = EngineLifecycle()
    assert lc.state == probe_pb2.ENGINE_STATE_COLD
    lc.observe_metrics(EngineRequestError(probe_pb2.FAILURE_KIND_CONNECT, "refused"))
    assert lc.state == probe_pb2.ENGINE_STATE_COLD  # never up: refusal is just "not yet"
    lc.observe_probe(_outcome(failure=probe_pb2.FAILURE_KIND_TIMEOUT))
    assert lc.state == probe_pb2.ENGINE_STATE_COLD
    lc.observe_metrics(None)
    assert lc.state == probe_pb2.ENGINE_STATE_WARMING
    lc.observe_probe(_outcome(failure=probe_pb2.FAILURE_KIND_HTTP_STATUS, status=503))
    assert lc.state == probe_pb2.ENGINE_STATE_WARMING
    lc.observe_probe(_outcome(ok=True, status=200))
    assert lc.state == probe_pb2.ENGINE_STATE_READY
    lc.observe_probe(_outcome(failure=probe_pb2.FAILURE_KIND_CONNECT))
    assert lc.state == probe_pb2.ENGINE_STATE_FAILED  # refused after having been up
    lc.observe_metrics(None)
    assert lc.state == probe_pb2.ENGINE_STATE_WARMING  # answers again (restarted)
    lc.observe_probe(_outcome(failure=probe_pb2.FAILURE_KIND_ENGINE_FATAL, status=500))
    assert lc.state == probe_pb2.ENGINE_STATE_FAILED
    lc.observe_metrics(None)  # keep-alive server still serves stale /metrics
    assert lc.state == probe_pb2.ENGINE_STATE_FAILED
    lc.observe_metrics(EngineRequestError(probe_pb2.FAILURE_KIND_CONNECT, "refused"))
    assert lc.state == probe_pb2.ENGINE_STATE_FAILED  # process gone
    lc.observe_metrics(EngineRequestError(probe_pb2.FAILURE_KIND_HTTP_STATUS, "404", 404))
    assert lc.state == probe_pb2.ENGINE_STATE_WARMING  # a new process answers
    lc.observe_probe(_outcome(ok=True, status=200))
    assert lc.state == probe_pb2.ENGINE_STATE_READY


# ---------------------------------------------------------------------------------------------
# CLI


def _run_cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([str(NODE_PROBE), *args], capture_output=True, text=True, timeout=timeout)


def test_cli_help_exit_0():
    res = _run_cli("--help")
    assert res.returncode == 0
    assert "--engine-url" in res.stdout and "--probe-jitter" in res.stdout


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--engine-url", "http://127.0.0.1:8000", "--probe-jitter", "2"),
        ("--engine-url", "http://127.0.0.1:8000", "--heartbeat-interval-ms", "fast"),
        ("--engine-url", "http://127.0.0.1:8000", "--listen", "nope"),
        ("agent", "--engine-url", "127.0.0.1:8000"),
        ("--engine-url", "http://127.0.0.1:8000", "--engine-kind", "llamacpp"),
        ("--engine-url", "http://127.0.0.1:8000", "--fatal-xids", "79,x"),
        ("--engine-url", "http://127.0.0.1:8000", "--stall-window-ms", "0"),
        ("--engine-url", "http://127.0.0.1:8000", "--metrics-url", "h:8002/metrics"),
    ],
)
def test_cli_bad_args_exit_2(args):
    from node_probe import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(list(args))
    assert ei.value.code == 2


def test_cli_new_flags_and_harness_flags_parse():
    from node_probe import cli

    args = cli.build_parser().parse_args([
        "--engine-url", "http://h:8000", "--listen", "127.0.0.1:0", "--node-id", "n",
        "--heartbeat-interval-ms", "100", "--probe-interval-s", "1.0", "--probe-timeout-ms", "800",
        "--engine-kind", "triton", "--metrics-url", "http://h:8002/metrics",
        "--stall-window-ms", "1500", "--fatal-xids", "79,48", "--deep-check-interval-s", "30",
        "--deep-check-prompt", "2+2=", "--deep-check-expect", "4"])
    assert (args.engine_kind, args.metrics_url, args.stall_window_ms) == ("triton", "http://h:8002/metrics", 1500)
    assert args.fatal_xids == frozenset({79, 48}) and args.deep_check_interval_s == 30.0
    assert (args.deep_check_prompt, args.deep_check_expect) == ("2+2=", "4")
    d = cli.build_parser().parse_args(["--engine-url", "http://h:8000"])
    assert (d.engine_kind, d.metrics_interval_ms, d.probe_idle_interval_s, d.probe_interval_s) == \
        ("auto", None, 0.5, 4.0)
    assert (d.stall_window_ms, d.deep_check_interval_s, d.fatal_xids) == (1000, 0.0, None)


def test_cli_bad_args_exit_2_subprocess():
    res = _run_cli("--engine-url", "http://127.0.0.1:8000", "--bogus")
    assert res.returncode == 2 and "usage:" in res.stderr


def test_cli_sim_engine_delegates(monkeypatch):
    import node_probe
    from node_probe import cli

    calls = []
    fake = types.ModuleType("node_probe.sim")
    fake.main = lambda argv: calls.append(argv) or 7
    monkeypatch.setitem(sys.modules, "node_probe.sim", fake)
    monkeypatch.setattr(node_probe, "sim", fake, raising=False)
    assert cli.main(["sim-engine", "--port", "0", "--help-me"]) == 7
    assert calls == [["--port", "0", "--help-me"]]


def test_cli_runs_until_sigterm():
    engine_port = free_port()
    proc = subprocess.Popen(
        [str(NODE_PROBE), "agent", "--engine-url", f"http://127.0.0.1:{engine_port}",
         "--listen", "127.0.0.1:0", "--node-id", "cli-node", "--gpu-interval-s", "0",
         "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("node-probe cli-node listening on 127.0.0.1:"), line
        assert line.rstrip().endswith(f"engine=http://127.0.0.1:{engine_port}")
        port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
        assert port > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_counter_that_went_back_across_failed_scrapes_is_a_restart():
    # the engine replaced between two scrapes that found it down (CI: the old one stopped, a scrape
    # refused, a probe reached the new one first): READY again, then its counter is below the last
    # one read, a restart; the same counter after the gap is only a gap
    def reading(tokens: float) -> EngineLoadReading:
        return EngineLoadReading(requests_running=0, requests_waiting=0, generation_tokens_total=tokens)

    for after, restarted in ((3.0, True), (120.0, False)):
        agent = ProbeAgent(AgentConfig(engine_url="http://x"))
        agent._lifecycle.observe_probe(_outcome(ok=True))
        agent._on_reading(reading(120.0), "", 1.0)
        agent._on_reading(None, "metrics: connection refused", 1.1)
        agent._lifecycle.observe_probe(_outcome(ok=True))  # READY again before the next scrape
        assert agent.engine_state == probe_pb2.ENGINE_STATE_READY
        agent._on_reading(reading(after), "", 1.2)
        assert (agent.engine_state == probe_pb2.ENGINE_STATE_WARMING) == restarted, after
