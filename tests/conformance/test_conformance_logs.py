"""Per-Envoy connect / ACK / NACK / disconnect log lines, with structured fields,
client text escaped."""
from __future__ import annotations

import logging

from conformance_support import CDS, EDS

from xds_server.testing import wait_for


async def test_connect_ack_nack_disconnect_lines(ads, caplog):
    with caplog.at_level(logging.INFO, logger="xds_server.xds.ads"):
        c = await ads.sotw()
        await c.send(type_url=CDS, node_id="envoy\nforged")
        r = await c.recv()
        await c.send(type_url=CDS, version=r.version_info, nonce=r.nonce)  # ACK
        await wait_for(lambda: ads.servicer.stats.requests[("sotw", "Cluster", "ack")] == 1, timeout_s=5.0,
                       step_s=0.02)
        await c.send(type_url=EDS, names=["llm"])
        r3 = await c.recv()
        await c.send(type_url=EDS, names=["llm"], nonce=r3.nonce, error="bad cla")  # NACK
        await wait_for(lambda: ads.servicer.stats.nacks[("sotw", "ClusterLoadAssignment")] == 1, timeout_s=5.0,
                       step_s=0.02)
        await c.close()
        ads.clients.remove(c)
        await wait_for(lambda: not ads.servicer.streams, timeout_s=5.0, step_s=0.02)
        await wait_for(lambda: any("disconnected" in r.getMessage() for r in caplog.records), timeout_s=5.0,
                       step_s=0.02)
    recs = [r for r in caplog.records if r.name == "xds_server.xds.ads"]
    msgs = [r.getMessage() for r in recs]
    assert sum(" connected (sotw stream" in m for m in msgs) == 1
    acks = [r for r in recs if "ACKed Cluster" in r.getMessage()]
    assert len(acks) == 1 and acks[0].version == r.version_info and acks[0].type == "Cluster"
    nacks = [r for r in recs if r.getMessage().startswith("NACK from")]
    assert len(nacks) == 1 and nacks[0].reason == "bad cla" and nacks[0].type == "ClusterLoadAssignment"
    assert sum("disconnected" in m for m in msgs) == 1
    for m in msgs:
        assert "\n" not in m, m
    assert all(getattr(r, "client", None) == "envoy\nforged" for r in recs if " connected" in r.getMessage())
