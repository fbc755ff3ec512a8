"""The fatal NVML Xid codes: the one home of the list, read by the agent's GPU telemetry
(:mod:`node_probe.telemetry`, which re-exports it) and by the control plane's config default
(``health.fatal_xids``). Plain values only, so the config models load no NVML or protobuf code.
"""
from __future__ import annotations

__all__ = ["FATAL_XIDS"]

#: Xid codes that mean the GPU (or its memory or links) can no longer be trusted: 48 double-bit
#: ECC, 63/64 row-remapping event/failure, 74 NVLink error, 79 fallen off the bus, 94/95
#: contained/uncontained ECC error. Any of them marks the engine FAILED.
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 94, 95})
