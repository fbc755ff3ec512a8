"""Who may forward load reports (``lrs.peers``), pure: the rule a forwarded stream's first request
meets (:func:`~xds_server.load.peers.peer_refused`), the remote address it reads, the peers'
config forms, and what ``check-config`` says about them and about plaintext load reports."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import ConfigError, LrsConfig, parse_config
from xds_server.config.load import check_lrs, lrs_notes, lrs_plaintext_refusal
from xds_server.load.peers import peer_refused, source_ip

PEERS = LrsConfig(peers=[{"address": "10.0.0.2:18000", "replica_id": "cp-2", "identity": "dns:cp-2.internal"},
                         {"address": "10.0.0.3:18000", "replica_id": "cp-3", "identity": "spiffe://x/cp-3"},
                         "10.0.0.4:18000"], peer_tls={"mode": "plaintext"})


def _rule(marker: str, *, mtls: bool, names=(), ip: str | None = None, peer_ips=frozenset()) -> str | None:
    return peer_refused(PEERS, "cp-1", mtls, marker, names=list(names), source_ip=ip, peer_ips=peer_ips)


def test_under_mtls_the_marker_must_name_a_listed_peer_and_the_certificate_be_that_peers():
    assert _rule("cp-2", mtls=True, names=["dns:cp-2.internal"]) is None
    assert _rule("cp-3", mtls=True, names=["spiffe://x/cp-3"]) is None
    # an Envoy's certificate (or cp-3's) carrying cp-2's marker
    assert "not in lrs.peers (cp-2's identity)" in _rule("cp-2", mtls=True, names=["dns:envoy.internal"])
    assert "not in lrs.peers" in _rule("cp-2", mtls=True, names=["spiffe://x/cp-3"])
    assert "not in lrs.peers" in _rule("cp-2", mtls=True, names=[])  # no certificate
    # a CN or DNS SAN that reads like the peer's SPIFFE id is not it
    assert _rule("cp-3", mtls=True, names=["dns:spiffe://x/cp-3"]) is not None
    assert "no lrs.peers entry names" in _rule("nobody", mtls=True, names=["dns:cp-2.internal"])
    assert "this replica's own id" in _rule("cp-1", mtls=True, names=["dns:cp-2.internal"])


def test_in_plaintext_the_marker_must_name_a_listed_peer_connecting_from_its_host():
    ips = frozenset({"10.0.0.2"})
    assert _rule("cp-2", mtls=False, ip="10.0.0.2", peer_ips=ips) is None
    why = _rule("cp-2", mtls=False, ip="10.0.0.9", peer_ips=ips)
    assert why is not None and "from 10.0.0.9, not from its host 10.0.0.2" in why
    assert _rule("cp-2", mtls=False, ip=None, peer_ips=ips) is not None
    assert "does not resolve" in _rule("cp-2", mtls=False, ip="10.0.0.2", peer_ips=frozenset())
    # the older form (no replica_id) names no one: its address does not make a marker good
    assert "no lrs.peers entry names" in _rule("10.0.0.4:18000", mtls=False, ip="10.0.0.4")


def test_a_replica_without_peers_refuses_every_forwarded_stream():
    assert "has no lrs.peers" in peer_refused(LrsConfig(), "cp-1", False, "cp-2", names=[], source_ip="127.0.0.1",
                                              peer_ips=frozenset({"127.0.0.1"}))


@given(marker=st.text(min_size=1, max_size=12), names=st.lists(st.sampled_from(
    ["dns:cp-2.internal", "spiffe://x/cp-3", "dns:envoy.internal", "uri:spiffe://x/cp-3", "cn:cp-2.internal"]),
    max_size=3), mtls=st.booleans(), ip=st.sampled_from([None, "10.0.0.2", "10.0.0.3", "10.0.0.4", "127.0.0.1"]))
def test_an_accepted_forwarded_stream_is_always_the_listed_peer_it_names(marker, names, mtls, ip):
    by_id = {p.replica_id: p for p in PEERS.peers if p.replica_id}
    claimed = by_id.get(marker)
    ips = frozenset({claimed.address.split(":")[0]}) if claimed is not None else frozenset()
    if _rule(marker, mtls=mtls, names=names, ip=ip, peer_ips=ips) is None:
        assert claimed is not None and marker != "cp-1"
        if mtls:  # both identities are written as the typed name a certificate gives
            assert claimed.identity in names
        else:
            assert ip in ips


@pytest.mark.parametrize(("peer", "ip"), [("ipv4:10.0.0.2:5555", "10.0.0.2"), ("ipv6:[::1]:5555", "::1"),
                                          ("ipv6:[fe80::1%eth0]:1", "fe80::1%eth0"), ("unix:/tmp/s", None),
                                          ("", None), ("ipv4:", None)])
def test_the_remote_address_of_a_grpc_peer_string(peer, ip):
    assert source_ip(peer) == ip


def test_peers_take_the_object_form_and_the_older_string_form_with_a_note():
    lrs = LrsConfig(peers=["127.0.0.1:1", {"address": "127.0.0.1:2", "replica_id": "cp-2"}])
    assert [(p.address, p.replica_id) for p in lrs.peers] == [("127.0.0.1:1", None), ("127.0.0.1:2", "cp-2")]
    notes = lrs_notes(lrs, None, "127.0.0.1:18000")
    assert len(notes) == 1 and notes[0].startswith("lrs.peers.0 (127.0.0.1:1) has no replica_id")
    for bad, field in (([{"address": "127.0.0.1:1", "replica_id": "a"}, {"address": "127.0.0.1:2", "replica_id": "a"}],
                        "replica_id is listed twice"), (["127.0.0.1:1", "127.0.0.1:1"], "listed twice"),
                       ([{"address": "nope"}], "peers.0.address"), ([{"address": "127.0.0.1:1", "replica_id": "a b"}],
                                                                   "peers.0.replica_id"),
                       ([{"address": "127.0.0.1:1", "identity": "dns:spiffe://x"}], "looks like a URI")):
        with pytest.raises(ConfigError, match=field):
            parse_config({"lrs": {"peers": bad}, "clusters": [{"name": "c", "nodes": [
                {"id": "n", "address": "127.0.0.1:9", "probe_address": "127.0.0.1:10"}]}]})


def test_under_mtls_a_peer_with_a_replica_id_needs_its_identity():
    with pytest.raises(ValueError, match=r"lrs.peers.0.identity: required with tls.mode mtls"):
        check_lrs(LrsConfig(peers=[{"address": "127.0.0.1:1", "replica_id": "cp-2"}]), "mtls")
    check_lrs(PEERS, "mtls")
    check_lrs(LrsConfig(peers=[{"address": "127.0.0.1:1", "replica_id": "cp-2"}]), None)


def test_plaintext_load_reports_off_loopback_are_refused_unless_said_and_check_config_says_so():
    assert lrs_plaintext_refusal(LrsConfig(), "plaintext", "127.0.0.1:18000") is None
    assert lrs_plaintext_refusal(LrsConfig(), "mtls", "0.0.0.0:18000") is None
    why = lrs_plaintext_refusal(LrsConfig(), "plaintext", "0.0.0.0:18000")
    assert why is not None and "set lrs.plaintext: true" in why
    assert lrs_plaintext_refusal(LrsConfig(plaintext=True), "plaintext", "0.0.0.0:18000") is None
    assert lrs_notes(LrsConfig(), "plaintext", "0.0.0.0:18000") == [why]
    assert lrs_notes(LrsConfig(enabled=False), "plaintext", "0.0.0.0:18000") == []
    with pytest.raises(ValueError, match=r"lrs\.plaintext is used with tls\.mode plaintext only"):
        check_lrs(LrsConfig(plaintext=True), "mtls")


def test_check_config_prints_the_notes(tmp_path, capsys):
    from xds_server.cli import main

    cfg = tmp_path / "x.yaml"
    cfg.write_text("xds: {listen: '0.0.0.0:18000'}\ntls: {mode: plaintext}\nlrs: {peers: ['127.0.0.1:2']}\n"
                   "clusters: [{name: c, nodes: [{id: n, address: '127.0.0.1:9'}]}]\n")
    assert main(["check-config", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("OK (1 cluster(s), 1 node(s))")
    assert out[1].startswith("note: lrs.peers.0 (127.0.0.1:2) has no replica_id")
    assert out[2].startswith("note: load reports refused: xds.listen 0.0.0.0:18000 is not loopback")
