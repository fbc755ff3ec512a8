"""Shared fixtures for unit tests (``serve`` is in tests/conftest.py): an aiohttp client session."""
from __future__ import annotations

import aiohttp
import pytest


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s
