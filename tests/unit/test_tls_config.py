"""TLS pieces without a network: the allow-list check, loopback rule, ``tls:`` config validation,
certificate reload decisions, client credential caching, the Envoy transport_socket and the
agent's and relay's TLS options. End to end (real Envoy, agents, feed): tests/integration/test_tls_envoy.py.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2, tls_pb2
from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st

from node_probe.agent import AgentConfig
from sentinel_relay.config import RelayConfigError, load_relay_config
from xds_server.cli import main as xds_main
from xds_server.config import ConfigError, XdsConfig, parse_config
from xds_server.envoy.tls import xds_tls_sds_secrets, xds_tls_transport_socket
from xds_server.process.identity import check_pattern, identity_matches
from xds_server.process.tls import (
    ClientTls,
    PeerIdentity,
    ServerCertFiles,
    channel_credentials,
    is_loopback,
    node_allowed,
    peer_certificate_sha256,
    peer_identities,
    peer_identity,
    refused_client,
)
from xds_server.testing import TestCA

ENVOY = "spiffe://cluster.local/ns/llm/sa/envoy"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = TestCA(d, "ca")
    return ca, ca.issue("srv", dns=["xds.test"], ips=["127.0.0.1"]), ca.issue("cli", uris=[ENVOY], client=True)


def _cfg(tls=None, listen="127.0.0.1:18000", probe="127.0.0.1:50051"):
    doc = {"xds": {"listen": listen},
           "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "10.0.0.1:8000", "probe_address": probe}]}]}
    if tls is not None:
        doc["tls"] = tls
    return parse_config(doc)


# -- the allow-list: typed identities (one matcher for ADS, the feed and the agent) ---------------

RULES = [("spiffe://cluster.local/ns/llm/sa/envoy", ["envoy-llm-*"]), ("gw.example.com", ["gw-1", "gw-2"]),
         ("cn:legacy-gw", ["legacy-*"])]


def _id(uris=(), dns=(), cn=None, other_sans=False):
    return PeerIdentity(tuple(uris), tuple(d.lower() for d in dns), cn, bool(uris or dns or other_sans))


@pytest.mark.parametrize("ident, node, allowed", [
    (_id(uris=[ENVOY]), "envoy-llm-gw-1", True),
    (_id(uris=[ENVOY]), "gw-1", False),                                   # its identity does not cover this id
    (_id(dns=["gw.example.com"]), "gw-2", True),                          # untyped pattern: a DNS SAN
    (_id(dns=["GW.Example.COM"]), "gw-1", True),                          # DNS is case-insensitive
    (_id(uris=["spiffe://cluster.local/ns/other/sa/envoy"]), "envoy-llm-1", False),  # unknown identity
    (_id(), "envoy-llm-1", False),                                        # no certificate
    (_id(uris=[ENVOY]), "", False),                                       # no node id
    (_id(dns=["other.example"], uris=[ENVOY]), "envoy-llm-a", True),      # any of the certificate's names
    # the known tricks: a name of another kind reading like the SPIFFE id never passes
    (_id(cn=ENVOY), "envoy-llm-1", False),                                # CN-trick, no SANs
    (_id(cn=ENVOY, dns=["x.example"]), "envoy-llm-1", False),             # CN-trick next to SANs
    (_id(dns=[ENVOY]), "envoy-llm-1", False),                             # DNS-trick
    (_id(uris=["gw.example.com"]), "gw-1", False),                        # a URI SAN is not a DNS name
    (_id(cn="gw.example.com"), "gw-1", False),                            # nor is a CN
    (_id(cn="legacy-gw"), "legacy-1", True),                              # cn: for a certificate without SANs
    (_id(cn="legacy-gw", dns=["a.example"]), "legacy-1", False),          # never when SANs exist
    (_id(cn="legacy-gw", other_sans=True), "legacy-1", False),            # an IP SAN is a SAN too
])
def test_node_allowed_table(ident, node, allowed):
    reason = node_allowed(RULES, ident, node)
    assert (reason is None) is allowed
    if not allowed:
        assert reason
    assert (node_allowed(RULES, ident.names(), node) is None) is allowed  # the typed names say the same


_text = st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1, max_size=12)


@given(_text, st.sampled_from(["spiffe://", "uri:", "dns:", "cn:", ""]))
def test_a_name_of_one_kind_never_passes_a_pattern_of_another(value, prefix):
    """Whatever a requester puts in a CN or DNS SAN, it passes only the pattern of its own kind."""
    exact = value.replace("[", "[[]").replace("*", "[*]").replace("?", "[?]")
    pattern = prefix + exact
    kind = {"spiffe://": "uri", "uri:": "uri", "dns:": "dns", "cn:": "cn", "": "dns"}[prefix]
    if check_pattern(pattern) is not None:
        return
    full = ("spiffe://" + value) if prefix == "spiffe://" else value
    as_uri, as_dns, as_cn = _id(uris=[full]), _id(dns=[full]), _id(cn=full)
    assert identity_matches(pattern, as_uri) is (kind == "uri")
    assert identity_matches(pattern, as_dns) is (kind == "dns")
    assert identity_matches(pattern, as_cn) is (kind == "cn")
    assert not identity_matches(pattern, _id(cn=full, other_sans=True)) or kind != "cn"


def test_peer_identity_from_grpc_auth_context_keeps_kinds_apart():
    """The auth_context keys grpc fills (measured: peer_uri, peer_dns, x509_common_name)."""
    auth = {"x509_common_name": [ENVOY.encode()], "peer_dns": [ENVOY.encode(), b"A.B"],
            "peer_uri": [b"spiffe://x/uri", b"https://foo/bar"],
            "x509_subject_alternative_name": [ENVOY.encode(), b"a.b", b"spiffe://x/uri", b"https://foo/bar"]}
    ident = peer_identity(auth)
    assert ident == PeerIdentity(("spiffe://x/uri", "https://foo/bar"), (ENVOY, "a.b"), ENVOY, True)
    assert peer_identities(auth) == ["spiffe://x/uri", "uri:https://foo/bar", f"dns:{ENVOY}", "dns:a.b"]
    assert peer_identities({"x509_common_name": [b"envoy"]}) == ["cn:envoy"]
    assert peer_identities({"transport_security_type": [b"insecure"]}) == []
    assert refused_client([ENVOY], auth, "X") == ("client identity spiffe://x/uri, uri:https://foo/bar, "
                                                  f"dns:{ENVOY} (+1) is not in X")
    assert refused_client(["spiffe://x/*"], auth) is None and refused_client([], {}) is None


def test_allow_list_patterns_are_checked_at_load(pki):
    ca, srv, _ = pki
    base = {"mode": "mtls", "cert_file": srv.cert, "key_file": srv.key, "client_ca_file": ca.cert}
    with pytest.raises(ConfigError, match=r"tls.node_allow.0.identity.*looks like a URI.*uri:https://a/b"):
        _cfg({**base, "node_allow": [{"identity": "https://a/b", "node_ids": ["*"]}]})
    with pytest.raises(ConfigError, match=r"nothing to match after 'dns:'"):
        _cfg({**base, "node_allow": [{"identity": "dns:", "node_ids": ["*"]}]})
    with pytest.raises(ValueError, match=r"--tls-allow-client/tls_allow_clients: 'cn:' has nothing"):
        AgentConfig(engine_url="http://127.0.0.1:1", tls_cert_file=srv.cert, tls_key_file=srv.key,
                    tls_client_ca_file=ca.cert, tls_allow_clients=("cn:",))


def test_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "gpu-a", "example.com"))


def test_a_dot_localhost_name_is_loopback_only_when_it_resolves_only_to_loopback():
    """Any *.localhost used to count as loopback, wherever it resolved."""
    assert is_loopback("gw.localhost", lambda h: ["127.0.0.1", "::1"])
    assert not is_loopback("gw.localhost", lambda h: ["127.0.0.1", "10.0.0.5"])   # /etc/hosts sends it off
    assert not is_loopback("gw.localhost", lambda h: [])                           # does not resolve
    assert not is_loopback("nothing-here-28.localhost")  # the real resolver: not in this machine's hosts


# -- config -------------------------------------------------------------------------------------


def test_plaintext_off_loopback_must_be_said():
    assert _cfg().tls.mode is None  # loopback everywhere: existing configs keep working
    with pytest.raises(ConfigError, match=r"xds.listen 0.0.0.0:18000 is not a loopback address: set tls.mode"):
        _cfg(listen="0.0.0.0:18000")
    with pytest.raises(ConfigError, match=r"clusters.0.nodes.0.probe_address 10.0.0.2:50051 .*tls.agents.mode"):
        _cfg(probe="10.0.0.2:50051")
    ok = _cfg({"mode": "plaintext", "agents": {"mode": "plaintext"}}, listen="0.0.0.0:18000", probe="10.0.0.2:1")
    assert ok.tls.mode == "plaintext" and ok.tls.agents.client("a") is None


def test_tls_section_names_missing_and_misplaced_fields(pki, tmp_path):
    ca, srv, cli = pki
    with pytest.raises(ConfigError, match=r"tls: cert_file and key_file are required with mode tls"):
        _cfg({"mode": "tls"})
    with pytest.raises(ConfigError, match=r"tls: client_ca_file is required with mode mtls"):
        _cfg({"mode": "mtls", "cert_file": srv.cert, "key_file": srv.key})
    with pytest.raises(ConfigError, match=r"node_allow are used with mode mtls only"):
        _cfg({"mode": "tls", "cert_file": srv.cert, "key_file": srv.key,
              "node_allow": [{"identity": "*", "node_ids": ["*"]}]})
    with pytest.raises(ConfigError, match=r"cert_file: cannot read '.*nope.pem'"):
        _cfg({"mode": "tls", "cert_file": str(tmp_path / "nope.pem"), "key_file": srv.key})
    with pytest.raises(ConfigError, match=r"tls.agents: ca_file is required with mode tls"):
        _cfg({"agents": {"mode": "tls"}})
    with pytest.raises(ConfigError, match=r"tls.node_allow.0.node_ids"):
        _cfg({"mode": "mtls", "cert_file": srv.cert, "key_file": srv.key, "client_ca_file": ca.cert,
              "node_allow": [{"identity": ENVOY, "node_ids": []}]})
    c = _cfg({"mode": "mtls", "cert_file": srv.cert, "key_file": srv.key, "client_ca_file": ca.cert,
              "agents": {"mode": "mtls", "ca_file": ca.cert, "cert_file": cli.cert, "key_file": cli.key,
                         "server_name": "{node_id}.agents.internal"}}, listen="0.0.0.0:18000", probe="10.0.0.2:1")
    assert c.tls.agents.client("gpu-a") == ClientTls(ca.cert, cli.cert, cli.key, "gpu-a.agents.internal")


# -- certificate reload -------------------------------------------------------------------------


def test_peer_certificate_sha256_is_the_der_fingerprint(pki):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    pem = Path(pki[2].cert).read_bytes()
    want = x509.load_pem_x509_certificate(pem).fingerprint(hashes.SHA256()).hex()
    assert peer_certificate_sha256({"x509_pem_cert": [pem]}) == want
    assert peer_certificate_sha256({"transport_security_type": [b"insecure"]}) is None  # plaintext
    assert peer_certificate_sha256({"x509_pem_cert": [b"not a certificate"]}) is None


def test_connection_age_reaches_the_grpc_server_options_only_when_set():
    opts = dict(_cfg().xds.grpc_server_options())
    assert "grpc.max_connection_age_ms" not in opts and opts["grpc.so_reuseport"] == 0
    aged = XdsConfig(max_connection_age_s=1800, max_connection_age_grace_s=0.5)
    opts = dict(aged.grpc_server_options())
    assert opts["grpc.max_connection_age_ms"] == 1_800_000 and opts["grpc.max_connection_age_grace_ms"] == 500
    doc = {"xds": {"max_connection_age_s": -1},
           "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:8000"}]}]}
    with pytest.raises(ConfigError, match=r"xds\.keepalive\.max_connection_age: -1s must not be negative"):
        parse_config(doc)


def test_server_cert_files_take_a_good_pair_and_refuse_a_half_written_one(tmp_path):
    ca = TestCA(tmp_path, "ca")
    first = ca.issue("srv", dns=["a"])
    files = ServerCertFiles(first.cert, first.key, ca.cert)
    assert files.fetch() is None  # unchanged
    other = ca.issue("other", dns=["a"])
    shutil.copy(other.cert, first.cert)  # the new certificate before its key: refused, old pair stays
    assert files.fetch() is None and files.reload_errors == 1 and files.reloads == 0
    assert "SSLError" in files.last_error or "KEY_VALUES_MISMATCH" in files.last_error
    shutil.copy(other.key, first.key)
    assert files.fetch() is not None and files.reloads == 1
    assert files.fetch() is None


def test_client_credentials_are_reread_when_files_change(tmp_path):
    ca = TestCA(tmp_path, "ca")
    pair = ca.issue("cli", client=True)
    tls = ClientTls(ca.cert, pair.cert, pair.key)
    first = channel_credentials(tls)
    assert channel_credentials(tls) is first
    ca.issue("cli", client=True)  # rotated in place (atomic renames)
    assert channel_credentials(tls) is not first
    with pytest.raises(ValueError, match="go together"):
        ClientTls(ca.cert, pair.cert)


# -- Envoy bootstrap ----------------------------------------------------------------------------


def _upstream(ts: dict) -> tls_pb2.UpstreamTlsContext:
    body = {k: v for k, v in ts["typed_config"].items() if k != "@type"}
    return json_format.ParseDict(body, tls_pb2.UpstreamTlsContext())


def test_transport_socket_parses_as_envoy_types():
    files = _upstream(xds_tls_transport_socket("/p/ca.pem", "/p/e.pem", "/p/e.key", "xds.test"))
    assert files.sni == "xds.test"
    assert files.common_tls_context.tls_certificates[0].certificate_chain.filename == "/p/e.pem"
    vc = files.common_tls_context.validation_context
    assert vc.trusted_ca.filename == "/p/ca.pem" and vc.match_typed_subject_alt_names[0].matcher.exact == "xds.test"
    sds = _upstream(xds_tls_transport_socket("/p/ca.pem", "/p/e.pem", "/p/e.key", sds_dir="/s"))
    cfg = sds.common_tls_context.tls_certificate_sds_secret_configs[0]
    assert cfg.name == "xds_client_cert" and cfg.sds_config.path_config_source.watched_directory.path == "/s"
    docs = xds_tls_sds_secrets("/p/ca.pem", "/p/e.pem", "/p/e.key")
    assert sorted(docs) == ["xds-ca-sds.yaml", "xds-client-sds.yaml"]
    for doc in docs.values():
        (res,) = doc["resources"]
        json_format.ParseDict({k: v for k, v in res.items() if k != "@type"}, secret_pb2.Secret())
    with pytest.raises(ValueError):
        xds_tls_transport_socket("/p/ca.pem", "/p/e.pem")


def test_envoy_bootstrap_command_emits_tls(tmp_path, capsys, monkeypatch):
    out = tmp_path / "envoy.yaml"
    monkeypatch.chdir(tmp_path)
    assert xds_main(["envoy-bootstrap", "--xds-tls-ca", "ca.pem", "--xds-tls-cert", "e.pem", "--xds-tls-key",
                     "e.key", "--xds-tls-server-name", "xds.test", "--xds-tls-sds", "sds", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    xds = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "xds_cluster")
    up = _upstream(xds["transport_socket"])
    assert up.sni == "xds.test"
    client = yaml.safe_load((tmp_path / "sds" / "xds-client-sds.yaml").read_text())
    assert client["resources"][0]["tls_certificate"]["private_key"]["filename"] == str(tmp_path / "e.key")
    assert xds_main(["envoy-bootstrap", "--xds-tls-cert", "e.pem"]) == 2
    assert "need --xds-tls-ca" in capsys.readouterr().err


# -- agent and relay options --------------------------------------------------------------------


def test_agent_and_relay_refuse_implicit_plaintext_off_loopback(pki):
    ca, srv, _ = pki
    with pytest.raises(ValueError, match=r"listen 0.0.0.0:50051 is not a loopback address.*--plaintext"):
        AgentConfig(engine_url="http://127.0.0.1:8000", listen="0.0.0.0:50051")
    assert AgentConfig(engine_url="http://127.0.0.1:8000", listen="0.0.0.0:50051", plaintext=True).plaintext
    a = AgentConfig(engine_url="http://127.0.0.1:8000", listen="0.0.0.0:50051", tls_cert_file=srv.cert,
                    tls_key_file=srv.key, tls_client_ca_file=ca.cert)
    assert a.tls_client_ca_file == ca.cert
    with pytest.raises(ValueError, match="tls_client_ca_file needs"):
        AgentConfig(engine_url="http://127.0.0.1:8000", tls_client_ca_file=ca.cert)
    with pytest.raises(RelayConfigError, match=r"routing_feed 10.0.0.5:18000 is not a loopback address"):
        load_relay_config(routing_feed="10.0.0.5:18000")
    r = load_relay_config(routing_feed="10.0.0.5:18000", feed_tls_ca_file=ca.cert,
                          feed_tls_cert_file=srv.cert, feed_tls_key_file=srv.key)
    assert r.feed_tls() == ClientTls(ca.cert, srv.cert, srv.key, None)
    assert load_relay_config(routing_feed="10.0.0.5:18000", feed_plaintext=True).feed_tls() is None


def test_readme_tls_example_is_valid(pki, tmp_path, monkeypatch):
    """docs/tls.md's mTLS config block parses once its files exist."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "tls.md").read_text()
    block = text.split("<!-- tls-example:begin -->")[1].split("<!-- tls-example:end -->")[0]
    doc = yaml.safe_load(block.split("```yaml")[1].split("```")[0])
    monkeypatch.chdir(tmp_path)
    ca = TestCA(tmp_path / "certs", "ca")
    for name in ("xds-server", "xds-client"):
        ca.issue(name)
    (tmp_path / "certs" / "admin-token").write_text("t0ken\n")
    cfg = parse_config(doc)
    assert cfg.tls.mode == "mtls" and cfg.tls.node_allow and cfg.tls.agents.identity == "dns:{node_id}.agents.internal"
    assert cfg.admin.token == "t0ken" and cfg.admin.tls is not None and cfg.feed.allow_identities
    assert cfg.lrs.traffic_ejection.min_reporters == 2
    del doc["admin"]["token_file"]
    with pytest.raises(ConfigError, match=r"admin.token: admin.listen 0.0.0.0:19000 is not a loopback address"):
        parse_config(doc)


# -- reload ---------------------------------------------------------------------------------------


async def test_reload_applies_the_allow_list_and_keeps_the_ads_tls_mode(pki):
    from xds_server.server import ControlPlane
    from xds_server.testing import InMemoryProbes, ManualClock

    ca, srv, _ = pki
    base = {"mode": "mtls", "cert_file": srv.cert, "key_file": srv.key, "client_ca_file": ca.cert}
    cp = ControlPlane(_cfg(base), clock=ManualClock(), probe_sources=InMemoryProbes())
    cp.open()
    names = peer_identities({"peer_spiffe_id": [ENVOY.encode()]})  # the names ADS hands the check
    try:
        assert cp.ads.authorize(names, "anything") is None  # no allow-list: any node id
        changes = await cp.reload(_cfg({**base, "node_allow": [{"identity": ENVOY, "node_ids": ["gw-*"]}]}))
        assert changes["restart_needed"] == []
        assert cp.ads.authorize(names, "gw-1") is None
        assert "may not use node id 'other'" in cp.ads.authorize(names, "other")
        changes = await cp.reload(_cfg({"mode": "plaintext"}))
        assert changes["restart_needed"] == ["tls.mode", "tls.cert_file", "tls.key_file", "tls.client_ca_file"]
        assert cp.config.tls.mode == "mtls"  # the running listener's mode stays until a restart
    finally:
        await cp.stop()


def test_node_probe_command_refuses_implicit_plaintext_off_loopback(capsys):
    from node_probe.cli import main as probe_main

    with pytest.raises(SystemExit) as e:
        probe_main(["--engine-url", "http://127.0.0.1:8000", "--listen", "0.0.0.0:0", "--tls-allow-client", "x"])
    assert e.value.code == 2
    assert "tls_allow_clients needs tls_client_ca_file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        probe_main(["--engine-url", "http://127.0.0.1:8000", "--listen", "0.0.0.0:0"])
    assert e.value.code == 2
    assert "is not a loopback address" in capsys.readouterr().err


def test_relay_command_flags_reach_the_feed_tls(pki):
    from sentinel_relay.cli import _parser, config_fields

    ca, srv, _ = pki
    args = _parser().parse_args(["--routing-feed", "xds.internal:18000", "--feed-tls-ca", ca.cert,
                                 "--feed-tls-cert", srv.cert, "--feed-tls-key", srv.key,
                                 "--feed-tls-server-name", "xds.internal"])
    fields = config_fields(args)
    assert load_relay_config(None, **fields).feed_tls() == ClientTls(ca.cert, srv.cert, srv.key, "xds.internal")


async def test_start_refuses_a_certificate_whose_key_does_not_match(tmp_path):
    from xds_server.server import ControlPlane
    from xds_server.testing import InMemoryProbes

    ca = TestCA(tmp_path, "ca")
    srv, other = ca.issue("srv"), ca.issue("other")
    cfg = parse_config({"xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
                        "tls": {"mode": "tls", "cert_file": srv.cert, "key_file": other.key},
                        "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:1",
                                                                 "probe_address": "127.0.0.1:2"}]}]})
    cp = ControlPlane(cfg, probe_sources=InMemoryProbes())
    try:
        with pytest.raises(OSError, match=r"cannot load the certificate \(tls.cert_file .*srv.pem"):
            await cp.start()
    finally:
        await cp.stop()


def test_replicas_peer_example_is_valid(tmp_path, monkeypatch):
    """docs/replicas.md's lrs.peers block (mTLS, a peer with its identity) parses once its files
    exist, and names no older form."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "replicas.md").read_text()
    section = text[text.index("## Load reports across replicas"):]
    doc = yaml.safe_load(section.split("```yaml")[1].split("```")[0])
    monkeypatch.chdir(tmp_path)
    ca = TestCA(tmp_path / "certs", "ca")
    for name in ("xds-server", "cp-1-client"):
        ca.issue(name)
    cfg = parse_config(doc)
    (peer,) = cfg.lrs.peers
    assert peer.replica_id == "cp-2" and peer.identity and cfg.lrs.traffic_ejection.min_reporters == 2
    assert cfg.notes() == []
