"""carry_drop_change: a drop change that Envoy 1.40 would not apply on its own (no host-set
rebuild, docs/xds_protocol.md 2.5) goes out with overprovisioning_factor moved by one."""
from __future__ import annotations

from google.protobuf import any_pb2
from hypothesis import given
from hypothesis import strategies as st

from xds_server.config import parse_config
from xds_server.config.cluster import DropOverloadConfig
from xds_server.health.model import Routing
from xds_server.xds.resources import build_cla, carry_drop_change
from xds_server.xds.validation import validate_cla

BASE = parse_config({"clusters": [{"name": "llm", "nodes": [
    {"id": "a", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:1"},
    {"id": "b", "address": "127.0.0.1:8002", "probe_address": "127.0.0.1:2"}]}]}).clusters[0]
HALF = {"a": Routing(100, "HEALTHY"), "b": Routing(100, "UNHEALTHY")}
drops = st.one_of(st.none(), st.sampled_from([5.0, 10.0, 25.0, 50.0, 100.0]))


def _cla(percent: float | None, shed: float = 0.0, flip: bool = False, factor: int = 140):
    c = BASE.model_copy(update={"overprovisioning_factor": factor, "drop_overloads": [] if percent is None else [
        DropOverloadConfig(drop_percent=percent, below_routable_capacity_ratio=0.6)]})
    return build_cla(c, HALF, shed_percent=shed, shed_flip=flip)


@given(a=drops, b=drops, flip_a=st.booleans(), flip_b=st.booleans(), shed=st.sampled_from([0.0, 60.0]),
       factor=st.sampled_from([1, 100, 140, 141]), packed=st.booleans())
def test_every_drop_change_reaches_envoy_with_a_factor_change(a, b, flip_a, flip_b, shed, factor, packed):
    prev, new = _cla(a, shed, flip_a, factor), _cla(b, shed, flip_b, factor)
    before = new.SerializeToString()
    arg = prev
    if packed:
        arg = any_pb2.Any()
        arg.Pack(prev)
    out = carry_drop_change(arg, new)
    assert new.SerializeToString() == before  # pure: the input is not modified
    assert list(out.policy.drop_overloads) == list(new.policy.drop_overloads)
    assert list(out.endpoints) == list(new.endpoints)
    changed = list(prev.policy.drop_overloads) != list(new.policy.drop_overloads)
    if changed:  # Envoy rebuilds: the factor differs from the one it has
        assert out.policy.overprovisioning_factor.value != prev.policy.overprovisioning_factor.value
        assert abs(out.policy.overprovisioning_factor.value - new.policy.overprovisioning_factor.value) <= 1
    else:
        assert out is new
    assert validate_cla("llm", out) == []


def test_first_assignment_and_a_foreign_any_are_left_alone():
    new = _cla(50)
    assert carry_drop_change(None, new) is new
    assert carry_drop_change(any_pb2.Any(type_url="type.googleapis.com/other.Type"), new) is new
