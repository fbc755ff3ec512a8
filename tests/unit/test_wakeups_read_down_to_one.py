"""The wake-up socket is read down to its last byte (xds_server.process.grpc_wakeups.read_all_but_one),
which gRPC's own handler then reads."""
from __future__ import annotations

import socket

import pytest

from xds_server.process.grpc_wakeups import read_all_but_one


@pytest.mark.parametrize("written", [0, 1, 2, 250])  # under the ~277 a socket takes unread
def test_every_byte_but_one_is_read(written: int) -> None:
    reader, writer = socket.socketpair()
    try:
        reader.setblocking(False)
        for _ in range(written):  # one byte per write, as gRPC's poller thread writes them
            writer.send(b"1")
        assert read_all_but_one(reader.fileno()) == max(0, written - 1)
        left = b""
        try:
            left = reader.recv(1000)
        except BlockingIOError:
            pass
        assert len(left) == min(written, 1)
    finally:
        reader.close()
        writer.close()


def test_a_closed_socket_reads_nothing() -> None:
    reader, writer = socket.socketpair()
    fd = reader.fileno()
    reader.close()
    writer.close()
    assert read_all_but_one(fd) == 0
