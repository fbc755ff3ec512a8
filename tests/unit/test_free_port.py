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

