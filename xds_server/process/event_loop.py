"""Which event loop a process runs: asyncio's own or uvloop's.

uvloop is optional (``pip install 'xds-sentinel[uvloop]'``, also in the ``relay`` extra). On this
project's 2-core machine it took ~9 % off the control plane's CPU per heartbeat (300-500 nodes)
and 10 % off gRPC's receive path alone at 1,000 streams (benchmarks/RESULTS.md, "gRPC's floor
without our code, and uvloop").

Choices (``xds-server serve --loop``, ``sentinel-relay --loop``):

- ``asyncio``: the standard loop.
- ``uvloop``: uvloop's; :class:`LoopUnavailable` when it is not installed.
- ``auto``: uvloop's when installed, else the standard one.

Probe worker processes run the loop their parent runs (:func:`running_loop_name`).

uvloop's ``loop.time()`` counts whole milliseconds (libuv's clock). Deadlines, heartbeat
arrivals and phi (its deviation floor is 20 ms) do not notice; ping RTTs are timed on
``time.monotonic()`` instead (:mod:`xds_server.probing.session`), so a LAN's sub-millisecond RTT keeps its
precision on either loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LOOPS", "LoopUnavailable", "resolve", "run", "running_loop_name"]

LOOPS = ("asyncio", "uvloop", "auto")
"""The names a ``--loop`` option takes."""

T = TypeVar("T")


class LoopUnavailable(RuntimeError):
    """``uvloop`` was asked for and is not installed."""


def resolve(choice: str) -> str:
    """The loop ``choice`` gives here: ``asyncio`` or ``uvloop``. Raises ValueError for a name not
    in :data:`LOOPS` and :class:`LoopUnavailable` for ``uvloop`` when it is not installed."""
    if choice not in LOOPS:
        raise ValueError(f"--loop: {choice!r} is not one of {', '.join(LOOPS)}")
    if choice == "asyncio":
        return choice
    try:
        import uvloop  # noqa: F401 - optional: the uvloop extra
    except ImportError:
        if choice == "uvloop":
            raise LoopUnavailable("--loop uvloop: uvloop is not installed "
                                  "(pip install 'xds-sentinel[uvloop]')") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], choice: str = "asyncio") -> T:
    """Run ``main`` to its end on a new loop of ``choice`` (see the module docstring) and return
    its result. Raises as :func:`resolve` does (``main`` is then closed unrun)."""
    try:
        name = resolve(choice)
    except (ValueError, LoopUnavailable):
        main.close()
        raise
    if name == "uvloop":
        import uvloop
        return uvloop.run(main)
    return asyncio.run(main)


def running_loop_name() -> str:
    """``uvloop`` when the running loop is uvloop's, else ``asyncio``. Raises RuntimeError when
    no loop is running."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
