"""Who a dialling agent may be: its Register checked, and judged against the config. Pure: no
gRPC, no I/O, no clock.

An agent that dials in (``ProbeHub.Connect``) says which node it watches in its first message
(``Register``). The claim is accepted for

- a node of the config (static, a targets file, Kubernetes, or one that registered earlier) that
  has no ``probe_address`` (those are dialled by us), when what the agent says agrees with the
  config: a cluster, serving address, locality, priority or capacity the agent sets and the config
  holds otherwise is a conflict, refused (the config wins; the operator hears of it);
- a node the config does not hold, in a cluster whose ``discovery.agents.allow`` matches the
  agent's identity (``*``: any agent): the node is made from the claim (registration). A node
  registered earlier may register again with other fields (a moved agent).

Under mutual TLS (``identity_checked``) the agent's certificate must also name the node it claims
(:func:`~xds_server.process.identity.names_node`, ``tls.agents.identity``).

Shape::

    claim = claim_from(register)            # Claim; ValueError("register.address: ...")
    verdict = judge_claim(claim, config, identity, identity_checked=True, registered=ids)
    verdict.action in ("attach", "register", "refuse"); verdict.reason; verdict.refusal
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

from node_probe.proto import probe_pb2
from xds_server.config import ClusterConfig, Locality, NodeConfig, SentinelConfig
from xds_server.process.identity import PeerIdentity, identity_matches, names_node

__all__ = ["Claim", "ClaimVerdict", "claim_from", "judge_claim"]


@dataclass(frozen=True, slots=True)
class Claim:
    """A Register, checked: ``node`` as the agent describes it, its ``cluster`` ("" unsaid) and
    which optional fields it set (``said``: of "address", "locality", "priority", "capacity")."""

    node: NodeConfig
    cluster: str
    said: frozenset[str]


@dataclass(frozen=True, slots=True)
class ClaimVerdict:
    """``attach``: serve the node's stream; ``register``: add ``node`` to ``cluster`` first;
    ``refuse``: end the stream (``refusal``: the counted reason, ``permission`` for an identity,
    ``conflict`` for a claim the config contradicts or cannot take); ``reason``: what is said."""

    action: Literal["attach", "register", "refuse"]
    reason: str = ""
    cluster: str = ""
    node: NodeConfig | None = None
    refusal: Literal["", "permission", "conflict"] = ""


_PLACEHOLDER = "0.0.0.0:1"  # an address for a claim that names none (NodeConfig requires one)


def claim_from(reg: probe_pb2.Register) -> Claim:
    """The node an agent's Register describes. Raises ValueError naming the field
    (``register.node_id``, ``register.address``, ...) and the reason when a field is not valid."""
    loc = reg.locality
    said = {name for name, on in (("address", bool(reg.address)),
                                  ("locality", bool(loc.region or loc.zone or loc.sub_zone)),
                                  ("priority", reg.priority > 0), ("capacity", reg.capacity > 0)) if on}
    try:
        node = NodeConfig.model_validate({
            "id": reg.node_id, "address": reg.address or _PLACEHOLDER,
            "locality": {"region": loc.region, "zone": loc.zone, "sub_zone": loc.sub_zone},
            "priority": reg.priority, "capacity": reg.capacity or 1})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "register"
        where = {"id": "node_id"}.get(where, where)
        raise ValueError(f"register.{where}: {err['msg']}") from None
    if reg.cluster and len(reg.cluster) > 128:
        raise ValueError("register.cluster: longer than 128 characters")
    return Claim(node, reg.cluster, frozenset(said))


def _conflicts(claim: Claim, cluster: str, node: NodeConfig) -> list[str]:
    c = claim.node
    out = [f"cluster {claim.cluster!r} (config: {cluster!r})"] if claim.cluster and claim.cluster != cluster else []
    for name in sorted(claim.said):
        mine, theirs = getattr(c, name), getattr(node, name)
        if mine != theirs:
            out.append(f"{name} {_show(mine)} (config: {_show(theirs)})")
    return out


def _show(v: object) -> str:
    return "/".join((v.region, v.zone, v.sub_zone)) if isinstance(v, Locality) else repr(v)


def _allows(c: ClusterConfig, ident: PeerIdentity) -> bool | None:
    """None: the cluster takes no registrations; else whether ``ident`` may register in it."""
    if c.discovery is None or c.discovery.agents is None:
        return None
    return any(p == "*" or identity_matches(p, ident) for p in c.discovery.agents.allow)


def judge_claim(claim: Claim, cfg: SentinelConfig, ident: PeerIdentity, *, identity_checked: bool,
                registered: Container[str] = frozenset()) -> ClaimVerdict:
    """What to do with an agent's claim (see the module docstring). ``cfg``: the serving config
    (discovered nodes included); ``registered``: ids of the nodes that came from agents'
    registrations; ``identity_checked``: the port verified a client certificate (mTLS)."""
    nid = claim.node.id
    if identity_checked and (why := names_node(ident, nid, cfg.tls.agents.identity)):
        return ClaimVerdict("refuse", why, refusal="permission")
    where = {n.id: (c, n) for c in cfg.clusters for n in c.nodes}
    if nid in where and nid not in registered:
        c, node = where[nid]
        if node.probe_address is not None:
            return ClaimVerdict("refuse", f"node {nid!r} is dialled by the control plane at its probe_address "
                                f"{node.probe_address}: remove probe_address to let its agent dial in",
                                refusal="conflict")
        bad = _conflicts(claim, c.name, node)
        if bad:
            return ClaimVerdict("refuse", f"node {nid!r} claims " + "; ".join(bad) + ": the config wins",
                                refusal="conflict")
        return ClaimVerdict("attach", cluster=c.name, node=node)
    name = claim.cluster or (where[nid][0].name if nid in where else "")
    cluster = next((c for c in cfg.clusters if c.name == name), None)
    if cluster is None:
        return ClaimVerdict("refuse", f"node {nid!r} is not in the config and claims "
                            f"{'no cluster' if not name else f'unknown cluster {name!r}'}", refusal="conflict")
    allowed = _allows(cluster, ident)
    if allowed is None:
        return ClaimVerdict("refuse", f"node {nid!r} is not in the config and cluster {name!r} takes no "
                            "registrations (clusters[].discovery.agents)", refusal="conflict")
    if not allowed:
        return ClaimVerdict("refuse", f"client identity {ident.describe()} is not in cluster {name!r}'s "
                            "discovery.agents.allow", refusal="permission")
    if "address" not in claim.said:
        return ClaimVerdict("refuse", f"node {nid!r} registers without register.address (the serving "
                            "HOST:PORT Envoy routes to)", refusal="conflict")
    if nid in where and where[nid][0].name == name and where[nid][1] == claim.node:
        return ClaimVerdict("attach", cluster=name, node=claim.node)
    return ClaimVerdict("register", cluster=name, node=claim.node)
