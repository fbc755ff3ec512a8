"""The local channel between the main process and a probe worker: length-prefixed pickle frames
over a Unix socketpair (asyncio streams on both ends).

Frame: 4-byte big-endian length, then ``pickle.dumps(message, protocol=5)``. Both ends are the
same program, started by the main process with the socket inherited (nothing else can connect),
so pickle is a trusted encoding here. The health model's frozen dataclasses are pickled as
``(class, field values)`` (registered with :mod:`copyreg` here, in both processes): half the CPU
of the default slots state and ~10 % fewer bytes (benchmarks/worker_scaling.py measures bytes and
CPU per node report).

Messages are tuples whose first item names them (docs/DESIGN.md section 12):

main -> worker: ``("init", index, HealthConfig, ProbeConfig, ident, grace_s, log_level)``,
``("config", HealthConfig, ProbeConfig, ident)`` (ident: replica id, ``tls.agents``, ramp anchor),
``("add", NodeConfig, mirror NodeHealth, kept NodeHealth | None)``, ``("remove", node_id)``,
``("fail_static_ended", burst_start_s)``, ``("stop",)``.

worker -> main: ``("report", nodes, heartbeats, probe_results, counters, links, pinging)`` (see
:meth:`xds_server.probing.workers._detector.Detector.take` and ``_worker.Worker.flush``).
"""
from __future__ import annotations

import asyncio
import copyreg
import dataclasses
import pickle
import struct
from typing import Any

from xds_server.health import phi, records
from xds_server.probing.workers._detector import NodeReport

__all__ = ["MAX_FRAME_BYTES", "FrameTooLarge", "encode", "read_frame"]

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 256 * 1024 * 1024
"""A frame longer than this is refused (ours: a report of 10,000 changed nodes is ~5 MB)."""


def _by_fields(cls: type) -> None:
    names = tuple(f.name for f in dataclasses.fields(cls))
    copyreg.pickle(cls, lambda o: (cls, tuple(getattr(o, n) for n in names)))


for _cls in (records.NodeHealth, records.Heartbeats, records.Rtt, records.Probes, records.Engine,
             records.Ejection, records.Ramp, records.Drain, records.Event, phi.ArrivalStats, NodeReport):
    _by_fields(_cls)


class FrameTooLarge(Exception):
    """A frame header announced more than :data:`MAX_FRAME_BYTES`."""


def encode(message: Any) -> bytes:
    """One frame (header + pickle) for ``message``."""
    body = pickle.dumps(message, protocol=5)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame of {len(body)} bytes > {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any | None:
    """The next message, or None at end of stream (the other end exited or closed).

    Raises :class:`FrameTooLarge` for an oversized header."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (n,) = _HEADER.unpack(header)
        if n > MAX_FRAME_BYTES:
            raise FrameTooLarge(f"frame header announces {n} bytes > {MAX_FRAME_BYTES}")
        return pickle.loads(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
