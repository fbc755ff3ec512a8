"""The wake-up socket is read down to its last byte (xds_server.process.grpc_wakeups.read_all_but_one),
which gRPC's own handler then reads."""
from __future__ import annotations

import os
import socket

import pytest

from xds_server.process.grpc_wakeups import read_all_but_one


@pytest.mark.parametrize("written", [0, 1, 2, 60])  # under what a unix socket takes unread
def test_every_byte_but_one_is_read(written: int) -> None:
    reader, writer = socket.socketpair()
    try:
        reader.setblocking(False)
        writer.settimeout(5.0)  # a host whose socket buffer takes fewer fails, not hangs
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


def test_what_cannot_say_its_bytes_waiting_reads_nothing() -> None:
    fd = os.open(".", os.O_RDONLY)  # a directory: FIONREAD fails (ENOTTY)
    try:
        assert read_all_but_one(fd) == 0
    finally:
        os.close(fd)
