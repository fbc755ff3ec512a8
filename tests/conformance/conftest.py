"""Fixtures for the xDS conformance suite (helpers in conformance_support.py). Every server and
client is closed at teardown."""
from __future__ import annotations

import pytest
from conformance_support import start_ads_server, stop_ads_server


@pytest.fixture
async def ads():
    """An in-process ADS server (see :class:`AdsServer`), stopped with its clients at teardown."""
    s = await start_ads_server()
    yield s
    await stop_ads_server(s)


@pytest.fixture
async def control_plane():
    """A started ControlPlane (see conformance_support.control_plane_config) with its assignments
    published; yields ``(cp, admin_url)``; stopped at teardown."""
    import asyncio

    from conformance_support import control_plane_config

    from xds_server.config import parse_config
    from xds_server.server import ControlPlane

    cp = ControlPlane(parse_config(control_plane_config()))
    await cp.start()
    try:
        for _ in range(200):
            if all(cp.cla_version(c.name) for c in cp.config.clusters):
                break
            await asyncio.sleep(0.01)
        yield cp, f"http://127.0.0.1:{cp.admin_port}"
    finally:
        await cp.stop()
