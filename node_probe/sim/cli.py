"""Command line of the simulated engine: ``node-probe sim-engine`` / ``python -m node_probe.sim``.

Runs until SIGTERM or SIGINT (exit 0); SIGHUP is logged and changes nothing (faults are set
over HTTP, ``POST /sim/fault``). A port that cannot be bound is one line naming ``--port`` /
``--host`` (exit 1); bad arguments exit 2. ``--version``, ``--log-level``, ``--log-format`` as
the other programs (:mod:`xds_server.process.commandline`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import socket
import sys

from aiohttp import web

from node_probe.sim.app import build_app
from node_probe.sim.engine import SimConfig
from node_probe.sim.model import use_model_seed
from xds_server.process.commandline import add_common_options, bind_failure, run_main
from xds_server.process.logs import configure_logging

log = logging.getLogger("node_probe.sim")

__all__ = ["main"]


def _parse_args(argv: list[str] | None) -> tuple[SimConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="sim-engine",
        description="Simulated OpenAI-compatible LLM engine (vLLM-shaped) with fault injection.")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="listen port (default 8000; 0 picks a free one)")
    parser.add_argument("--replica-id", default="", help="name in x-served-by (default sim-PORT)")
    parser.add_argument("--model", default="sim-model", help="served model id (default sim-model)")
    parser.add_argument("--token-interval-ms", type=float, default=20.0,
                        help="pace between streamed tokens in ms (default 20)")
    parser.add_argument("--eos-rate", type=float, default=0.0,
                        help="chance (0..1) that the model's next token is EOS in a context "
                             "(default 0: generations run to max_tokens)")
    parser.add_argument("--byte-token-rate", type=float, default=0.0,
                        help="chance (0..1) that the next token is a lone byte, as a byte-level "
                             "BPE has (default 0: words only)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="context length in tokens (default 4096)")
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="most requests decoding at once, as vLLM's; the rest wait in arrival "
                             "order (probes too) and count in vllm:num_requests_waiting "
                             "(default 0: unlimited)")
    parser.add_argument("--model-seed", type=int, default=0,
                        help="serve another deterministic model: greedy answers differ from the "
                             "default one's from the first token (default 0: the built-in model)")
    add_common_options(parser, "sim-engine")
    args = parser.parse_args(argv)
    if args.token_interval_ms < 0 or not math.isfinite(args.token_interval_ms):
        parser.error("--token-interval-ms must be a finite number >= 0")
    if not (math.isfinite(args.eos_rate) and 0.0 <= args.eos_rate <= 1.0):
        parser.error("--eos-rate must be a ratio in 0..1")
    if not (math.isfinite(args.byte_token_rate) and 0.0 <= args.byte_token_rate <= 1.0):
        parser.error("--byte-token-rate must be a ratio in 0..1")
    if args.max_model_len < 2:
        parser.error("--max-model-len must be an integer >= 2")
    if args.max_num_seqs < 0:
        parser.error("--max-num-seqs must be an integer >= 0")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    if args.model_seed < 0:
        parser.error("--model-seed must be an integer >= 0")
    return SimConfig(host=args.host, port=args.port, replica_id=args.replica_id,
                     model=args.model, token_interval_ms=args.token_interval_ms,
                     eos_rate=args.eos_rate, max_model_len=args.max_model_len,
                     byte_token_rate=args.byte_token_rate, max_num_seqs=args.max_num_seqs), args


SIGHUP_IGNORED = "SIGHUP: nothing to reload, still running (faults are set with POST /sim/fault)"


async def _serve(cfg: SimConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(SIGHUP_IGNORED))
    runner: web.AppRunner | None = None
    try:
        if cfg.port == 0:
            # Bind first so the default replica id can name the real port.
            sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((cfg.host, 0))
            port = sock.getsockname()[1]
            if cfg.replica_id == "sim-0":
                cfg.replica_id = f"sim-{port}"
            cfg.port = port
            app = build_app(cfg)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                   shutdown_timeout=2.0)
            await runner.setup()
            site: web.BaseSite = web.SockSite(runner, sock)
        else:
            app = build_app(cfg)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                   shutdown_timeout=2.0)
            await runner.setup()
            site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        print(f"sim-engine {cfg.replica_id} listening on http://{host}:{cfg.port}", flush=True)
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        if runner is not None:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Run one simulated engine until SIGTERM or SIGINT.

    Args:
        argv: command-line arguments without the program name (``--host --port --replica-id
            --model --token-interval-ms --eos-rate
            --max-model-len --max-num-seqs``); ``None`` reads ``sys.argv[1:]``.

    Returns:
        0 after a clean shutdown; 1 when the port cannot be bound.
    """
    cfg, args = _parse_args(argv)
    use_model_seed(args.model_seed)
    configure_logging(args.log_level, args.log_format)

    def run() -> int:
        address = f"{cfg.host}:{cfg.port}"
        try:
            asyncio.run(_serve(cfg))
        except OSError as exc:
            print(f"sim-engine: {bind_failure(address, '--port', exc)}", file=sys.stderr, flush=True)
            return 1
        return 0

    return run_main("sim-engine", run, lambda: args.log_level == "DEBUG")


