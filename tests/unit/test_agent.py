"""Tests for node_probe.agent (real grpc.aio server and client on 127.0.0.1, fake engine in
aiohttp) and node_probe.cli."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web

from node_probe.agent import AgentConfig, EngineLifecycle, ProbeAgent, run_agent
from node_probe.engines.openai_compat import EngineRequestError, ProbeOutcome
from node_probe.proto import probe_pb2, probe_pb2_grpc

FIXTURES = Path("/work/shared/fixtures/vllm-0.32.0-cpu")
VENV_BIN = Path(sys.executable).parent
NODE_PROBE = VENV_BIN / "node-probe"
if not NODE_PROBE.exists():
    NODE_PROBE = Path("/work/main/.venv/bin/node-probe")

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeEngine:
    """Minimal vLLM look-alike. ``mode``: ok | fatal | frozen. ``metrics_delay_s`` stalls
    /metrics. ``probes`` records the monotonic arrival time of each /v1/completions request."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.metrics_delay_s = 0.0
        self.probes: list[float] = []
        self.probe_headers: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
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
        return web.Response(text=METRICS_TEXT, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(text=MODELS_BODY, content_type="application/json")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.probes.append(time.monotonic())
        self.probe_headers.append(dict(request.headers))
        await request.read()
        if self.mode == "fatal":
            return web.Response(status=500, text=FATAL_BODY, content_type="application/json")
        resp = web.StreamResponse(status=200)
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        if self.mode == "frozen":
            await asyncio.sleep(30)
        await asyncio.sleep(0.005)
        await resp.write(TOKEN_CHUNK.encode())
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
        kwargs: dict[str, Any] = dict(
            engine_url=engine_url,
            listen="127.0.0.1:0",
            node_id="node-a",
            probe_interval_s=30.0,
            metrics_interval_ms=50,
            gpu_interval_s=0.2 if gpu is not None else 0.0,
        )
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
    for watcher in watchers:
        await watcher.close()
    for channel in channels:
        await channel.close(grace=None)


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
    gaps = [(b[0] - a[0]) * 1000 for a, b in zip(beats[1:], beats[2:])]
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
    assert load.generation_tokens_total == 247.0
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
    gaps = [y - x for x, y in zip(in_window, in_window[1:])]
    assert all(g >= 0.3 for g in gaps), gaps
    results = [m.inference_result for _, m in got_a if is_result(m)]
    assert all(r.ok and r.timeout_ms == 800 and r.ttft_ms > 0 for r in results)
    assert engine.probe_headers[-1].get("x-sentinel-probe") == "1"


async def test_engine_down_then_up_then_gone(make_agent, open_watch):
    port_engine = free_port()
    agent, port = await make_agent(f"http://127.0.0.1:{port_engine}", probe_interval_s=0.25,
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
                                   model="local/tiny-llama-1")
    call = await open_watch(port)
    got = await collect_for(call, 1.2)
    times = [t for t, m in got if kind(m) == "heartbeat"]
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    assert len(times) >= 10 and max(gaps) < 0.2, gaps
    results = [m.inference_result for _, m in got if is_result(m)]
    assert results
    for r in results:
        assert r.failure == probe_pb2.FAILURE_KIND_TIMEOUT and r.http_status == 200
        assert r.timeout_ms == 300
    assert agent.engine_state == probe_pb2.ENGINE_STATE_WARMING  # answers, never a token


async def test_engine_fatal_marks_failed_and_stays(engine, make_agent, open_watch):
    engine.mode = "fatal"
    agent, port = await make_agent(engine.url, probe_interval_s=0.3, probe_jitter_ratio=0.0)
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
# Pure pieces


def test_config_validation():
    with pytest.raises(ValueError):
        AgentConfig(engine_url="127.0.0.1:8000")
    with pytest.raises(ValueError):
        AgentConfig(engine_url="http://x", probe_jitter_ratio=1.0)
    with pytest.raises(ValueError):
        AgentConfig(engine_url="http://x", heartbeat_interval_ms=0)
    cfg = AgentConfig(engine_url="http://x")
    assert (cfg.listen, cfg.heartbeat_interval_ms, cfg.metrics_interval_ms) == ("127.0.0.1:50051", 100, 250)
    assert (cfg.probe_interval_s, cfg.probe_jitter_ratio, cfg.probe_timeout_ms) == (4.0, 0.25, 800)
    assert (cfg.model, cfg.gpu_interval_s, cfg.min_probe_now_interval_ms) == (None, 1.0, 1000)
    assert cfg.node_id


def test_probe_interval_jitter_bounds():
    agent = ProbeAgent(AgentConfig(engine_url="http://x", probe_interval_s=4.0, probe_jitter_ratio=0.25))
    values = [agent._next_probe_interval() for _ in range(2000)]
    assert 3.0 <= min(values) < 3.1 and 4.9 < max(values) <= 5.0


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
    ],
)
def test_cli_bad_args_exit_2(args):
    from node_probe import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(list(args))
    assert ei.value.code == 2


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
