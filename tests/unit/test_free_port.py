"""xds_server.testing.free_port: ports below Linux's ephemeral range (where the kernel picks every
outgoing connection's local port, so a port chosen there can be taken before the server binds it),
never the same twice in one process, and free when handed out."""
from __future__ import annotations

import socket

from xds_server.testing import free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    ports = [free_port() for _ in range(200)]
    assert all(21000 <= p < 32000 for p in ports), ports
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # raises if it was not free



def test_each_xdist_worker_hands_out_ports_from_a_slice_of_its_own():
    from xds_server.testing._process import _slice

    slices = [_slice(21000, 32000, {"PYTEST_XDIST_WORKER": f"gw{n}", "PYTEST_XDIST_WORKER_COUNT": "4"})
              for n in range(4)]
    assert slices == [(21000, 23750), (23750, 26500), (26500, 29250), (29250, 32000)]
    assert _slice(21000, 32000, {}) == (21000, 32000)  # not under xdist: the whole range
    for odd in ({"PYTEST_XDIST_WORKER": "gw7", "PYTEST_XDIST_WORKER_COUNT": "2"},
                {"PYTEST_XDIST_WORKER": "master", "PYTEST_XDIST_WORKER_COUNT": "2"},
                {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "0"}):
        assert _slice(21000, 32000, odd) == (21000, 32000), odd
