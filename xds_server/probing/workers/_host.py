"""What the probe workers' main side needs of the rest of the control plane, as protocols:
the decision layer it reports to (:class:`HealthHost`) and the probe hub that judges agents'
claims when the workers accept agents (:class:`Admitter`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import grpc

from xds_server.config import SentinelConfig
from xds_server.health.model import Event, NodeHealth
from xds_server.probing.claims import Claim
from xds_server.process.identity import PeerIdentity

__all__ = ["Admitter", "HealthHost"]


class HealthHost(Protocol):
    """What the pool needs of the control plane's decision layer (the
    :class:`~xds_server.control.core.ControlCore` satisfies it): the config in force, each node's
    current health (``health``, node id -> :class:`~xds_server.health.model.NodeHealth`) and the
    kept state still to resume (``restored``), and ``adopt`` to apply a worker's report. The core
    gets :meth:`WorkerPool.forward_fail_static_end` in its own constructor (the pool is built
    first, reaching the core through a function: each needs the other)."""

    config: SentinelConfig

    @property
    def health(self) -> Mapping[str, NodeHealth]: ...

    @property
    def restored(self) -> Mapping[str, NodeHealth]: ...

    def adopt(self, node_id: str, nh: NodeHealth, events: list[Event], now_s: float) -> None: ...


class Admitter(Protocol):
    """What the pool needs of the control plane's probe hub
    (:class:`~xds_server.probing.hub.ProbeHub`) when its workers accept agents: the verdict on a
    claim (refusals counted there, registrations applied) and the streams that begin and end."""

    async def admit(self, claim: Claim, ident: PeerIdentity, peer: str,
                    kind: type) -> tuple[object | None, grpc.StatusCode, str]: ...

    def streamed(self, node_id: str, opened: bool) -> None: ...
