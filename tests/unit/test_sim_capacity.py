"""The simulator's capacity model (``--max-num-seqs``): at most N requests decode at once, the
rest wait in arrival order (probes too), the vLLM gauges tell the truth and TTFT includes the
wait. The pure bookkeeping (:class:`node_probe.sim.capacity.Admission`) under hypothesis; the
engine through its HTTP app."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from node_probe.sim import PROBE_HEADER, SIM_ENGINE_KEY, SimConfig, build_app
from node_probe.sim.capacity import Admission
from node_probe.sim.cli import _parse_args

MODEL = "sim-model"


# ------------------------------------------------------------------------------ pure model
@given(limit=st.integers(0, 4),
       ops=st.lists(st.tuples(st.sampled_from(["arrive", "finish", "withdraw"]), st.integers(0, 50)),
                    max_size=60))
def test_admission_never_exceeds_the_limit_is_work_conserving_and_fifo(limit: int, ops: list[tuple[str, int]]) -> None:
    a = Admission(limit)
    order: list[int] = []  # tickets in the order they got a slot
    arrived: list[int] = []
    ticket = 0
    for op, k in ops:
        if op == "arrive":
            ticket += 1
            arrived.append(ticket)
            if a.arrive(ticket):
                order.append(ticket)
        elif op == "finish":
            if a.running == 0:
                with pytest.raises(ValueError, match="nothing running"):
                    a.finish()
            else:
                order.extend(a.finish())
        else:
            queued = a.queued()
            if queued:
                t = queued[k % len(queued)]
                assert a.withdraw(t) and not a.withdraw(t)
                arrived.remove(t)
        assert limit == 0 or a.running <= limit
        assert a.waiting == 0 or a.running == limit  # nothing waits while a slot is free
        assert a.waiting == len(a.queued())
    # FIFO: the slots went out in arrival order (withdrawn tickets aside), then the queue in order
    assert order + a.queued() == arrived
    if limit == 0:
        assert a.waiting == 0


def test_admission_refuses_bad_limits_and_a_ticket_twice() -> None:
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 0"):
            Admission(bad)  # type: ignore[arg-type]  # bad input on purpose
    a = Admission(1)
    assert a.arrive(1) and not a.arrive(2)
    with pytest.raises(ValueError, match="already waiting"):
        a.arrive(2)
    assert not a.withdraw(1)  # running, not waiting
    assert a.finish() == [2] and a.running == 1 and a.waiting == 0


def test_config_and_cli_name_max_num_seqs() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SimConfig(max_num_seqs=-1)
    assert _parse_args(["--max-num-seqs", "3"])[0].max_num_seqs == 3
    assert _parse_args([])[0].max_num_seqs == 0  # default: unlimited, as before
    with pytest.raises(SystemExit):
        _parse_args(["--max-num-seqs", "-2"])


# ------------------------------------------------------------------------------ the engine
async def _client(**kw: Any) -> TestClient:
    client = TestClient(TestServer(build_app(SimConfig(replica_id="cap", **kw))))
    await client.start_server()
    return client


async def _gauges(client: TestClient) -> tuple[float, float]:
    text = await (await client.get("/metrics")).text()
    vals = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return vals["vllm:num_requests_running"], vals["vllm:num_requests_waiting"]


async def _ttft_s(client: TestClient, max_tokens: int, probe: bool = False) -> tuple[float, float]:
    """(seconds to the first token event, seconds to [DONE]) of one streamed completion."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    t0 = time.monotonic()
    first = None
    async with client.post("/v1/completions", json=body,
                           headers={PROBE_HEADER: "1"} if probe else {}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {") and first is None:
                first = time.monotonic() - t0
    assert first is not None
    return first, time.monotonic() - t0


async def test_two_slots_four_streams_two_wait_and_the_gauges_tell_the_truth() -> None:
    client = await _client(token_interval_ms=20.0, max_num_seqs=2)
    try:
        tasks = [asyncio.create_task(_ttft_s(client, 10)) for _ in range(4)]
        await asyncio.sleep(0.08)  # all four arrived; two decode (10 x 20 ms = 0.2 s each)
        assert await _gauges(client) == (2.0, 2.0)
        stats = await (await client.get("/sim/stats")).json()
        assert (stats["running"], stats["waiting"], stats["in_flight"], stats["max_num_seqs"]) == (2, 2, 4, 2)
        # a probe queues like any request (a real engine's does): it waits behind both
        probe = asyncio.create_task(_ttft_s(client, 1, probe=True))
        await asyncio.sleep(0.03)
        assert await _gauges(client) == (2.0, 3.0)
        results = sorted(await asyncio.gather(*tasks))
        probe_ttft, _ = await probe
        # the first two start at once (both stream before either ends); the next two only once
        # one of them ended (a whole generation, ~0.2 s); the probe after the second pair's.
        # Orderings, not wall-clock bounds: a loaded machine delays every stream
        first_end = min(results[0][1], results[1][1])
        assert results[1][0] < first_end
        assert results[2][0] >= first_end - 0.05 and results[2][0] >= 0.18 and results[3][0] >= 0.18
        assert probe_ttft >= 0.3
        assert await _gauges(client) == (0.0, 0.0)
    finally:
        await client.close()


async def test_unlimited_by_default_nothing_waits() -> None:
    client = await _client(token_interval_ms=20.0)
    try:
        tasks = [asyncio.create_task(_ttft_s(client, 5)) for _ in range(6)]
        await asyncio.sleep(0.05)
        assert await _gauges(client) == (6.0, 0.0)
        results = await asyncio.gather(*tasks)
        assert max(first for first, _ in results) < min(done for _, done in results)  # all at once
    finally:
        await client.close()


async def test_a_waiting_client_that_leaves_frees_its_place_and_shutdown_ends_the_queue() -> None:
    client = await _client(token_interval_ms=20.0, max_num_seqs=1)
    engine = client.server.app[SIM_ENGINE_KEY]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 15, "stream": True}
    try:
        running = asyncio.create_task(_ttft_s(client, 15))
        await asyncio.sleep(0.05)
        leaver = await client.post("/v1/completions", json=body)  # headers at once, then waits
        assert leaver.status == 200
        await asyncio.sleep(0.05)
        assert await _gauges(client) == (1.0, 1.0)
        leaver.close()  # the client goes away while waiting
        for _ in range(30):
            await asyncio.sleep(0.05)
            if engine.admission.waiting == 0:
                break
        assert engine.admission.waiting == 0 and engine.admission.running == 1
        await running
        assert engine.admission.running == 0
        # waiting requests end at shutdown (no slot is ever given)
        holders = [await client.post("/v1/completions", json=body) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert engine.admission.waiting == 2
        engine.close()
        assert engine.admission.waiting == 0
        for h in holders:
            h.close()
    finally:
        await client.close()


async def test_hang_freezes_the_batch_new_requests_queue_and_resume_in_order() -> None:
    client = await _client(token_interval_ms=10.0, max_num_seqs=1)
    try:
        first = asyncio.create_task(_ttft_s(client, 20))
        await asyncio.sleep(0.05)
        await client.post("/sim/fault", json={"mode": "hang"})
        second = asyncio.create_task(_ttft_s(client, 2))
        await asyncio.sleep(0.2)
        assert await _gauges(client) == (1.0, 1.0)  # the hung one holds its slot; the new one waits
        await client.post("/sim/fault", json={"mode": "none"})
        (first_ttft, first_done), (second_ttft, _) = await asyncio.gather(first, second)
        assert first_ttft < 0.1 and first_done > 0.2 + 0.15
        assert second_ttft > 0.2 + 0.1  # waited through the hang and the rest of the first
    finally:
        await client.close()
