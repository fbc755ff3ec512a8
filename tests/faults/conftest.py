"""Fixtures of the fault tests."""
from __future__ import annotations

import aiohttp
import pytest


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s
