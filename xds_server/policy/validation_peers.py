"""Which peers a switch-back validation replays against, and what too few of them means. Pure.

A candidate is judged against two healthy peers of its cluster (seed 002). With fewer, probes
alone decide, said (a small cluster, or one coming up all at once, would otherwise keep its
nodes out for ever). That shortcut lets a node in unreplayed, so it is taken only when the
shortage is real, not a moment's:

- **peers** (:func:`plan_peers`): the cluster's HEALTHY, undrained nodes but the candidate, the
  least queued first (an agent refuses a replay while its engine queues requests);
- **held**: undrained nodes UNHEALTHY on a suspicion the count rule has not proven yet (phi's,
  or a stream ended by an unanswered PING; ejected from a routed state). The next heartbeat
  disproves it (the node is back as it was) or ``heartbeat.consecutive_misses`` prove it (cause
  ``heartbeat``: no longer held), so each is out for at most that long;
- after the peers' replay streams opened (:func:`choose_peers`): **able** peers replay at
  least the request's prompts; a peer whose stream failed to open (an error, not an agent
  that says it does not replay) may be able at the next try.

Two able: replay against the first two. Fewer, while able + failed + held reach two: retry
(the validator's ``retry``, within its ``give_up``), naming who is missing and why. Fewer
than that: probes alone decide.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xds_server.health.records import ROUTED_STATES, SUSPICIONS, NodeHealth, NodeState

__all__ = ["PeerChoice", "PeerPlan", "choose_peers", "plan_peers", "suspected"]

NEEDED = 2  # peers a judgement compares the candidate with (seed 002: the candidate and two peers)


@dataclass(frozen=True, slots=True)
class PeerPlan:
    """Who to open replay streams to (``peers``, in the order tried) and who is out for a
    moment (``held``, sorted)."""

    peers: tuple[str, ...]
    held: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PeerChoice:
    """Exactly one of: ``run`` (the two peers to replay against), ``retry`` (why it could not
    run now) or ``probes_only`` (why probes alone decide); the others empty."""

    run: tuple[str, ...] = ()
    retry: str = ""
    probes_only: str = ""
    able: tuple[str, ...] = ()  # the able peers, also when fewer than two


def _queued(nh: NodeHealth) -> float:
    return nh.engine.requests_waiting or 0.0


def suspected(nh: NodeHealth) -> bool:
    """UNHEALTHY on a suspicion (phi's, or a transport's failed liveness check) not yet proven by
    the count rule, ejected from a routed state."""
    return (nh.state is NodeState.UNHEALTHY and nh.ejection.cause in SUSPICIONS
            and nh.ejection.from_state in ROUTED_STATES)


def plan_peers(candidate: str, cluster: Mapping[str, NodeHealth]) -> PeerPlan:
    """``cluster``: node id -> health of every node in the candidate's cluster (the candidate's
    own entry is skipped)."""
    others = [(nid, nh) for nid, nh in cluster.items() if nid != candidate and not nh.drain.active]
    peers = sorted((nid for nid, nh in others if nh.state is NodeState.HEALTHY),
                   key=lambda nid: (_queued(cluster[nid]), nid))
    held = sorted(nid for nid, nh in others if suspected(nh))
    return PeerPlan(tuple(peers), tuple(held))


def choose_peers(plan: PeerPlan, caps: Mapping[str, int], errors: Mapping[str, str], prompts: int,
                 cluster_name: str) -> PeerChoice:
    """``caps``: peer -> ``replay_max_prompts`` its stream reported (0: does not replay, or it
    failed); ``errors``: peer -> why its stream failed to open (absent or "": it opened);
    ``prompts``: the request's prompt count (>= 1)."""
    able = tuple(p for p in plan.peers if not errors.get(p) and caps.get(p, 0) >= prompts)
    if len(able) >= NEEDED:
        return PeerChoice(run=able[:NEEDED], able=able)
    failed = [p for p in plan.peers if errors.get(p)]
    if len(able) + len(failed) + len(plan.held) >= NEEDED:
        out = [f"peer {p}: {errors[p]}" for p in failed] + [
            f"peer {p}: suspected, not yet proven or disproved" for p in plan.held]
        return PeerChoice(retry=f"{len(able)} healthy peer(s) in cluster {cluster_name} that replay, "
                                f"{NEEDED} needed; out for now: {'; '.join(out)}", able=able)
    return PeerChoice(probes_only=f"{len(able)} healthy peer(s) in cluster {cluster_name} that replay, "
                                  f"{NEEDED} needed: validated by probes alone", able=able)
