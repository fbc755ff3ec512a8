"""Relay rescue benchmark through the real Envoy: the pause a client sees across a node freeze
and a node kill (p50/p99 over N trials), and chaos (streaming load while a random node is killed
or frozen every few seconds: share of streams interrupted). Both paths in one run: clients
straight to Envoy, and through ``sentinel-relay`` (a real process fed by the routing feed).

    .venv/bin/python benchmarks/relay_rescue.py [--trials 20] [--direct-trials 5] [--chaos-s 30]

Simulated engines at 20 ms/token (as in issue 8); Envoy's per-try idle timeout 2 s (the bound
without the relay); FAST health (a healed node is back in ~2 s, so trials do not wait long).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xds_server.testing import Fleet, ManagedProcess, free_port

HEADER = "x-sentinel-upstream-host"
FAST = {"probation_clean_s": 1.0, "ramp_step_percent": 50, "ramp_step_s": 0.2}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))], 3) if xs else float("nan")


async def stream(http, url: str, body: dict, strike=None, strike_at: int = 20, timeout_s: float = 20.0) -> dict:
    """One SSE request; ``await strike(address)`` after ``strike_at`` chunks. Returns the text,
    whether it completed ([DONE]), the largest gap between data events (s)."""
    text, done, chunks, gap, cut = [], False, 0, 0.0, False
    last = time.monotonic()
    try:
        async with http.post(url + "/v1/completions", json=body,
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            addr = r.headers.get(HEADER)
            buf = b""
            async for data in r.content.iter_any():
                buf += data
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: "):
                        continue
                    now = time.monotonic()
                    gap, last = max(gap, now - last), now
                    if ev == b"data: [DONE]":
                        done = True
                        continue
                    o = json.loads(ev[6:])
                    if "error" in o:
                        continue
                    for ch in o.get("choices", []):
                        text.append(ch.get("text") or "")
                    chunks += 1
                    if strike is not None and chunks == strike_at:
                        await strike(addr)
    except (TimeoutError, aiohttp.ClientError):
        cut = True
    return {"text": "".join(text), "done": done and not cut, "gap_s": gap, "chunks": chunks,
            "tail_s": time.monotonic() - last}


class Rig:
    def __init__(self, fleet: Fleet, relay_url: str) -> None:
        self.fleet, self.relay_url = fleet, relay_url

    def node(self, address: str):
        return next(n for n in self.fleet.nodes if n.address == address)

    def freeze(self, n) -> None:
        n.engine.freeze()
        n.agent.freeze()

    def kill(self, n) -> None:
        os.killpg(n.engine.pid, signal.SIGKILL)

    async def heal(self, http) -> None:
        for n in self.fleet.nodes:
            if not n.engine.alive():
                n.engine.start()
            if getattr(n.engine, "frozen", False):
                n.engine.thaw()
            if getattr(n.agent, "frozen", False):
                n.agent.thaw()
        await self.fleet.wait_all_routed(http, timeout_s=60)


async def pauses(rig: Rig, http, fault: str, url: str, trials: int, ref: str, tokens: int) -> dict:
    out, tails, wrong = [], [], 0
    for _i in range(trials):
        async def strike(addr: str) -> None:
            n = rig.node(addr)
            rig.freeze(n) if fault == "freeze" else rig.kill(n)
        r = await stream(http, url, {"prompt": "The relay benchmark", "max_tokens": tokens,
                                     "stream": True}, strike=strike, timeout_s=15)
        if r["done"] and r["text"] == ref:
            out.append(r["gap_s"])
        else:
            wrong += 1
            tails.append(r["tail_s"])  # from the last chunk to the cut (or our 15 s timeout)
        await rig.heal(http)
    return {"trials": trials, "whole": len(out), "not_whole": wrong,
            "pause_p50_s": pct(out, 0.5), "pause_p99_s": pct(out, 0.99),
            "pause_max_s": round(max(out), 3) if out else None,
            "cut_after_silence_p50_s": pct(tails, 0.5) if tails else None}


async def chaos(rig: Rig, http, url: str, seconds: float, concurrency: int, every_s: float,
                refs: dict[str, str], tokens: int, seed: int) -> dict:
    rnd = random.Random(seed)
    stop_at = time.monotonic() + seconds
    stats = {"streams": 0, "interrupted": 0, "wrong_text": 0, "faults": 0}

    async def worker(i: int) -> None:
        while time.monotonic() < stop_at:
            prompt = rnd.choice(list(refs))
            r = await stream(http, url, {"prompt": prompt, "max_tokens": tokens, "stream": True},
                             timeout_s=30)
            stats["streams"] += 1
            if not r["done"]:
                stats["interrupted"] += 1
            elif r["text"] != refs[prompt]:
                stats["wrong_text"] += 1

    async def monkey() -> None:
        while time.monotonic() < stop_at - every_s:
            await asyncio.sleep(every_s)
            live = [n for n in rig.fleet.nodes if n.engine.alive() and not getattr(n.engine, "frozen", False)]
            if len(live) < 2:
                continue
            n = rnd.choice(live)
            rig.freeze(n) if rnd.random() < 0.5 else rig.kill(n)
            stats["faults"] += 1
            await asyncio.sleep(every_s / 2)
            await rig.heal(http)
    await asyncio.gather(monkey(), *(worker(i) for i in range(concurrency)))
    await rig.heal(http)
    stats["interrupted_share"] = round(stats["interrupted"] / max(1, stats["streams"]), 4)
    return stats


async def main(args: argparse.Namespace) -> dict:
    fleet = Fleet(n_nodes=3, token_interval_ms=20.0, health=FAST, per_try_timeout_s=None,
                  per_try_idle_timeout_s=2.0)
    relay = None
    res: dict = {"tokens_per_stream": args.tokens, "token_interval_ms": 20}
    try:
        fleet.start()
        async with aiohttp.ClientSession() as http:
            await fleet.wait_all_routed(http)
            port = free_port()
            relay = ManagedProcess("relay", [
                sys.executable, "-m", "sentinel_relay.cli", "--listen", f"127.0.0.1:{port}",
                "--upstream", fleet.url, "--routing-feed", f"127.0.0.1:{fleet.xds_port}",
                "--admin-listen", f"127.0.0.1:{free_port()}", "--log-level", "WARNING"],
                fleet.workdir / "relay.log", ready_pattern="ready on").start()
            rig = Rig(fleet, f"http://127.0.0.1:{port}")
            ref = (await stream(http, fleet.url, {"prompt": "The relay benchmark",
                                                  "max_tokens": args.tokens, "stream": True}))["text"]
            for fault in (("freeze", "kill") if args.trials > 0 else ()):
                res[f"{fault}_relay"] = await pauses(rig, http, fault, rig.relay_url, args.trials, ref, args.tokens)
                res[f"{fault}_direct"] = await pauses(rig, http, fault, fleet.url, args.direct_trials, ref, args.tokens)
                print(fault, json.dumps(res[f"{fault}_relay"]), json.dumps(res[f"{fault}_direct"]), flush=True)
            if args.chaos_s > 0:
                prompts = [f"chaos prompt {i}" for i in range(4)]
                refs = {p: (await stream(http, fleet.url, {"prompt": p, "max_tokens": args.tokens,
                                                           "stream": True}))["text"] for p in prompts}
                for name, url in (("direct", fleet.url), ("relay", rig.relay_url)):
                    res[f"chaos_{name}"] = await chaos(rig, http, url, args.chaos_s, args.concurrency,
                                                       args.fault_every_s, refs, args.tokens, seed=1)
                    print("chaos", name, json.dumps(res[f"chaos_{name}"]), flush=True)
    finally:
        if relay is not None:
            relay.stop()
        fleet.stop()
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--direct-trials", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--chaos-s", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--fault-every-s", type=float, default=3.0)
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=1))
