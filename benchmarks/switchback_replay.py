"""How long one switch-back validation's replay takes, and what judging it costs (issue 23).

Three simulated engines and three real agents in this process (the candidate and two peers); per
run, the control plane's side opens a replay stream to each (``ReplayExchange``), sends the same
request (the built-in 8 prompts, ``--max-tokens`` each, greedy) to all three at once and waits for
the three results; then :func:`~xds_server.policy.replay_judge.judge` judges them. Reported: the
replay's wall time (open to last result), the judge's CPU time per validation, and the peers'
noise (deterministic simulators: none; a real engine's batch-size drift is what the margins cover).

With ``--engine-url`` given three times (the candidate's, peer A's, peer B's engine; a URL may
repeat) the agents front those engines instead, a real vLLM say, and ``--batch-load N`` keeps N
sampled streams running on peer B's engine through each replay, so the two peers decode the same
prompts in different batches: the peers' noise is then that engine's batch-size drift.

Usage: .venv/bin/python benchmarks/switchback_replay.py [--runs 5] [--max-tokens 32] [--token-interval-ms 20]
    [--engine-url URL --engine-url URL --engine-url URL [--batch-load 4]]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp
from aiohttp import web

from node_probe.agent import AgentConfig, ProbeAgent
from node_probe.proto import probe_pb2
from node_probe.sim import SimConfig, build_app
from xds_server.config.validation import DEFAULT_PROMPTS
from xds_server.policy.replay_judge import Answer, PromptAnswers, judge
from xds_server.probing.replay import ReplayExchange
from xds_server.process.counters import Counters
from xds_server.testing import free_port


async def _batch_load(url: str, stop: asyncio.Event) -> None:
    """Keep one sampled stream after another running on ``url`` until ``stop`` (one of N loops)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        while not stop.is_set():
            body = {"model": model, "prompt": "alpha beta gamma", "max_tokens": 48, "temperature": 1.0,
                    "stream": True}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                async for _ in r.content:
                    if stop.is_set():
                        break


async def main(args: argparse.Namespace) -> None:
    runners, agents, targets = [], [], []
    if args.engine_url and len(args.engine_url) != 3:
        raise SystemExit("--engine-url: give it three times (candidate, peer A, peer B)")
    for i in range(3):
        if args.engine_url:
            url = args.engine_url[i].rstrip("/")
        else:
            port = free_port()
            r = web.AppRunner(build_app(SimConfig(port=port, replica_id=f"n{i}",
                                                  token_interval_ms=args.token_interval_ms)))
            await r.setup()
            await web.TCPSite(r, "127.0.0.1", port).start()
            runners.append(r)
            url = f"http://127.0.0.1:{port}"
        a = ProbeAgent(AgentConfig(engine_url=url, listen="127.0.0.1:0", node_id=f"n{i}", gpu_interval_s=0))
        targets.append(f"127.0.0.1:{await a.start()}")
        agents.append(a)
    print("| run | prompts x tokens | token interval | replay wall (ms) | judge CPU (us) | peers agree to token |"
          " peers' similarity | candidate agrees to token | verdict |\n|---:|---|---:|---:|---:|---:|---:|---:|---|")
    walls, cpus = [], []
    if args.engine_url:
        await asyncio.sleep(3.0)  # the agents have found their engines (kind, model) before the first replay
    try:
        for run in range(1, args.runs + 1):
            req = probe_pb2.ReplayRequest(request_id=f"bench-{run}", prompts=list(DEFAULT_PROMPTS),
                                          max_tokens=args.max_tokens, timeout_ms=60_000)
            ex = [ReplayExchange(f"n{i}", t, tls=None, counters=Counters()) for i, t in enumerate(targets)]
            loop = asyncio.get_running_loop()
            stop = asyncio.Event()
            load = [asyncio.create_task(_batch_load(args.engine_url[2].rstrip("/"), stop))
                    for _ in range(args.batch_load if args.engine_url else 0)]
            await asyncio.sleep(1.0 if load else 0.0)  # peer B's batch is full before the replay
            t0 = loop.time()
            await asyncio.gather(*(e.open(5.0) for e in ex))
            res = await asyncio.gather(*(e.ask(req, 64 * args.max_tokens, loop.time() + 60) for e in ex))
            wall = (loop.time() - t0) * 1000.0
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)
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
            if j.noise["agreement_tokens"] is None:  # no prompt both peers answered: say why
                errs = {a.error for r in res if not isinstance(r, str) for a in r.answers if a.error}
                raise SystemExit(f"run {run}: {j.detail}; answer errors: {sorted(errs)[:3]}")
            walls.append(wall)
            cpus.append(cpu)
            print(f"| {run} | {len(DEFAULT_PROMPTS)} x {args.max_tokens} | {args.token_interval_ms:g} ms | {wall:.0f} |"
                  f" {cpu:.0f} | {j.noise['agreement_tokens']:.0f} | {j.noise['similarity']:.2f} |"
                  f" {j.candidate['agreement_tokens']:.0f} | {j.verdict} |")
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
    p.add_argument("--engine-url", action="append", default=[],
                   help="a real engine per role (candidate, peer A, peer B), given three times; default: simulators")
    p.add_argument("--batch-load", type=int, default=0, help="sampled streams kept running on peer B's engine")
    asyncio.run(main(p.parse_args()))
