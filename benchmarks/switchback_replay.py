"""How long one switch-back validation's replay takes, and what judging it costs (issue 23).

Three simulated engines and three real agents in this process (the candidate and two peers); per
run, the control plane's side opens a replay stream to each (``ReplayExchange``), sends the same
request (the built-in 8 prompts, ``--max-tokens`` each, greedy) to all three at once and waits for
the three results; then :func:`~xds_server.health.replay_judge.judge` judges them. Reported: the
replay's wall time (open to last result), the judge's CPU time per validation, and the peers'
noise (deterministic simulators: none; a real engine's batch-size drift is what the margins cover).

Usage: .venv/bin/python benchmarks/switchback_replay.py [--runs 5] [--max-tokens 32] [--token-interval-ms 20]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from aiohttp import web

from node_probe.agent import AgentConfig, ProbeAgent
from node_probe.proto import probe_pb2
from node_probe.sim import SimConfig, build_app
from xds_server.config.validation import DEFAULT_PROMPTS
from xds_server.health.counters import Counters
from xds_server.health.replay_judge import Answer, PromptAnswers, judge
from xds_server.probing.replay import ReplayExchange
from xds_server.testing import free_port


async def main(args: argparse.Namespace) -> None:
    runners, agents, targets = [], [], []
    for i in range(3):
        port = free_port()
        r = web.AppRunner(build_app(SimConfig(port=port, replica_id=f"n{i}", token_interval_ms=args.token_interval_ms)))
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", port).start()
        runners.append(r)
        a = ProbeAgent(AgentConfig(engine_url=f"http://127.0.0.1:{port}", listen="127.0.0.1:0", node_id=f"n{i}",
                                   gpu_interval_s=0))
        targets.append(f"127.0.0.1:{await a.start()}")
        agents.append(a)
    print("| run | prompts x tokens | token interval | replay wall (ms) | judge CPU (us) | peers agree to token |"
          " verdict |\n|---:|---|---:|---:|---:|---:|---|")
    walls, cpus = [], []
    try:
        for run in range(1, args.runs + 1):
            req = probe_pb2.ReplayRequest(request_id=f"bench-{run}", prompts=list(DEFAULT_PROMPTS),
                                          max_tokens=args.max_tokens, timeout_ms=60_000)
            ex = [ReplayExchange(f"n{i}", t, tls=None, counters=Counters()) for i, t in enumerate(targets)]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await asyncio.gather(*(e.open(5.0) for e in ex))
            res = await asyncio.gather(*(e.ask(req, 64 * args.max_tokens, loop.time() + 60) for e in ex))
            wall = (loop.time() - t0) * 1000.0
            await asyncio.gather(*(e.close() for e in ex))
            assert not any(isinstance(r, str) for r in res), res
            ans = [[Answer(a.text, tuple(a.token_ids) or None, not a.error) for a in r.answers] for r in res
                   if not isinstance(r, str)]
            pas = [PromptAnswers(c, a, b) for c, a, b in zip(*ans, strict=True)]
            c0 = time.process_time()
            for _ in range(200):
                j = judge(pas, max_tokens=args.max_tokens, token_margin=0.25, similarity_margin=0.2,
                          min_prompt_ratio=0.75)
            cpu = (time.process_time() - c0) / 200 * 1e6
            walls.append(wall)
            cpus.append(cpu)
            print(f"| {run} | {len(DEFAULT_PROMPTS)} x {args.max_tokens} | {args.token_interval_ms:g} ms | {wall:.0f} |"
                  f" {cpu:.0f} | {j.noise['agreement_tokens']:.0f} | {j.verdict} |")
    finally:
        for a in agents:
            await a.stop()
        for r in runners:
            await r.cleanup()
    print(f"\nmedian replay wall {statistics.median(walls):.0f} ms, judge {statistics.median(cpus):.0f} us CPU")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--token-interval-ms", type=float, default=20.0)
    asyncio.run(main(p.parse_args()))
