"""Who a dialling agent may be: its Register checked field by field, and judged against the config
and its certificate (xds_server.probing.claims, pure)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_probe.proto import probe_pb2
from xds_server.config import SentinelConfig
from xds_server.probing.claims import claim_from, judge_claim
from xds_server.process.identity import PeerIdentity

NOBODY = PeerIdentity()


def _cfg(**tls_agents: object) -> SentinelConfig:
    return SentinelConfig.model_validate({
        "tls": {"agents": tls_agents} if tls_agents else {},
        "clusters": [
            {"name": "llm", "nodes": [
                {"id": "gpu-a", "address": "127.0.0.1:8001", "priority": 0},
                {"id": "gpu-old", "address": "127.0.0.1:8002", "probe_address": "127.0.0.1:9002"}]},
            {"name": "open", "nodes": [{"id": "x", "address": "127.0.0.1:8003"}],
             "discovery": {"agents": {"allow": ["*"]}}},
            {"name": "fleet", "nodes": [{"id": "y", "address": "127.0.0.1:8004"}],
             "discovery": {"agents": {"allow": ["spiffe://corp/agent/*", "dns:*.agents.internal"]}}},
        ]})


def _reg(node_id: str, cluster: str = "", address: str = "", **kw: object) -> probe_pb2.Register:
    return probe_pb2.Register(node_id=node_id, cluster=cluster, address=address, **kw)  # type: ignore[arg-type]  # kw: proto fields of several types


def _judge(reg: probe_pb2.Register, ident: PeerIdentity = NOBODY, *, mtls: bool = False,
           cfg: SentinelConfig | None = None, registered: frozenset[str] = frozenset()):
    return judge_claim(claim_from(reg), cfg or _cfg(), ident, identity_checked=mtls, registered=registered)


def test_a_configured_node_is_attached_when_the_agent_agrees_or_says_nothing_more():
    assert _judge(_reg("gpu-a")).action == "attach"
    v = _judge(_reg("gpu-a", "llm", "127.0.0.1:8001"))
    assert (v.action, v.cluster) == ("attach", "llm")


@pytest.mark.parametrize(("reg", "said"), [
    (_reg("gpu-a", "other"), "cluster 'other' (config: 'llm')"),
    (_reg("gpu-a", address="127.0.0.1:9999"), "address '127.0.0.1:9999' (config: '127.0.0.1:8001')"),
    (_reg("gpu-a", priority=2), "priority 2 (config: 0)"),
    (_reg("gpu-a", locality=probe_pb2.Locality(region="eu")), "locality eu// (config: //)"),
])
def test_a_claim_the_config_contradicts_is_refused_naming_the_field(reg, said):
    v = _judge(reg)
    assert (v.action, v.refusal) == ("refuse", "conflict")
    assert said in v.reason and "the config wins" in v.reason


def test_a_node_dialled_at_its_probe_address_is_not_taken_over_by_a_dialling_agent():
    v = _judge(_reg("gpu-old"))
    assert v.action == "refuse" and "probe_address 127.0.0.1:9002" in v.reason


def test_an_unknown_node_registers_only_where_the_cluster_takes_registrations():
    v = _judge(_reg("new-1", "open", "10.0.0.7:8000", capacity=4, priority=0))
    assert (v.action, v.cluster) == ("register", "open")
    assert v.node is not None and (v.node.address, v.node.capacity) == ("10.0.0.7:8000", 4)
    no = _judge(_reg("new-1", "llm", "10.0.0.7:8000"))
    assert no.action == "refuse" and "takes no registrations" in no.reason
    unknown = _judge(_reg("new-1", "nope", "10.0.0.7:8000"))
    assert unknown.action == "refuse" and "unknown cluster 'nope'" in unknown.reason
    none = _judge(_reg("new-1", address="10.0.0.7:8000"))
    assert none.action == "refuse" and "no cluster" in none.reason
    bare = _judge(_reg("new-1", "open"))
    assert bare.action == "refuse" and "register.address" in bare.reason


def test_registration_follows_the_clusters_identity_patterns():
    spiffe = PeerIdentity(uris=("spiffe://corp/agent/new-1",), has_sans=True)
    dns = PeerIdentity(dns=("new-1.agents.internal",), has_sans=True)
    other = PeerIdentity(dns=("new-1.elsewhere",), has_sans=True)
    assert _judge(_reg("new-1", "fleet", "10.0.0.7:8000"), spiffe, mtls=True).action == "register"
    assert _judge(_reg("new-1", "fleet", "10.0.0.7:8000"), dns, mtls=True).action == "register"
    v = _judge(_reg("new-1", "fleet", "10.0.0.7:8000"), other, mtls=True)
    assert (v.action, v.refusal) == ("refuse", "permission")
    assert "discovery.agents.allow" in v.reason
    assert _judge(_reg("new-1", "fleet", "10.0.0.7:8000"), NOBODY).action == "refuse"


def test_a_registered_node_may_register_again_with_new_fields_and_is_attached_when_unchanged():
    cfg = SentinelConfig.model_validate({"clusters": [
        {"name": "open", "nodes": [{"id": "new-1", "address": "10.0.0.7:8000"}],
         "discovery": {"agents": {"allow": ["*"]}}}]})
    same = _judge(_reg("new-1", "open", "10.0.0.7:8000"), cfg=cfg, registered=frozenset({"new-1"}))
    assert same.action == "attach"
    moved = _judge(_reg("new-1", "open", "10.0.0.8:8000"), cfg=cfg, registered=frozenset({"new-1"}))
    assert moved.action == "register" and moved.node is not None and moved.node.address == "10.0.0.8:8000"
    # the same id in the static config is not the agent's to move
    assert _judge(_reg("new-1", "open", "10.0.0.8:8000"), cfg=cfg).action == "refuse"


def test_under_mtls_a_certificate_naming_another_node_is_refused():
    mine = PeerIdentity(dns=("gpu-a.agents.test",), has_sans=True)
    theirs = PeerIdentity(dns=("gpu-b.agents.test",), has_sans=True)
    assert _judge(_reg("gpu-a"), mine, mtls=True).action == "attach"
    v = _judge(_reg("gpu-a"), theirs, mtls=True)
    assert (v.action, v.refusal) == ("refuse", "permission") and "does not name node 'gpu-a'" in v.reason
    assert _judge(_reg("gpu-a"), theirs, mtls=False).action == "attach"  # no certificate checked: no identity
    tpl = _cfg(identity="spiffe://corp/agent/{node_id}")
    assert _judge(_reg("gpu-a"), PeerIdentity(uris=("spiffe://corp/agent/gpu-a",), has_sans=True),
                  mtls=True, cfg=tpl).action == "attach"
    assert _judge(_reg("gpu-a"), mine, mtls=True, cfg=tpl).action == "refuse"


@pytest.mark.parametrize(("reg", "field"), [
    (_reg("bad id!"), "register.node_id"),
    (_reg("", "llm"), "register.node_id"),
    (_reg("a", address="host.example:80"), "register.address"),
    (_reg("a", address="10.0.0.1:0"), "register.address"),
    (_reg("a", priority=300), "register.priority"),
    (_reg("a", cluster="c" * 200), "register.cluster"),
])
def test_a_bad_register_field_is_named(reg, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        claim_from(reg)


_ids = st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)


@given(claimed=_ids, named=_ids, cluster=st.sampled_from(["llm", "open", "fleet", ""]))
def test_under_mtls_nothing_is_served_for_a_node_the_certificate_does_not_name(claimed, named, cluster):
    ident = PeerIdentity(dns=(f"{named}.agents.internal",), uris=(f"spiffe://corp/agent/{named}",), has_sans=True)
    v = _judge(_reg(claimed, cluster, "10.0.0.9:8000"), ident, mtls=True)
    if claimed != named:
        assert v.action == "refuse" and v.refusal == "permission"
    else:
        assert v.action != "refuse" or v.refusal == "conflict"
