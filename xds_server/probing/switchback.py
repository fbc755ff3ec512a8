"""Switch-back validation, the I/O side: replay against the candidate and two healthy peers.

Every ``health.validation.check_interval`` (:meth:`SwitchbackValidator.check`) the validator
looks for nodes the health model holds in PROBATION with a PENDING validation
(:mod:`xds_server.health.switchback_rules`) and validates each (all due nodes at once, each check waiting for them):

1. peers: the HEALTHY, undrained nodes of the same cluster (same model), the least queued first
   (:mod:`xds_server.policy.validation_peers`, which also decides what too few of them means);
2. it opens a replay stream to the candidate's agent and the peers' (:mod:`.replay`); an agent
   whose first heartbeat says ``replay_max_prompts`` 0 (older, or ``--no-replay``) cannot be
   replayed: a candidate like that is validated by probes alone and says so; fewer than two
   peers that replay: said, and probes alone decide (documented choice: refusing would keep a
   recovered node out of a small cluster forever), unless peers are out only for a moment (a
   stream that failed to open, a suspicion not yet proven): then it is retried;
3. the same ``ReplayRequest`` (``sample`` prompts from the configured JSONL file or the built-in
   set, with ``live_prompts`` some sampled from live traffic by relays (:mod:`.live_prompts`,
   :attr:`SwitchbackValidator.live`; only their count is shown), ``max_tokens`` each, greedy)
   goes to all three at once;
4. :func:`~xds_server.policy.replay_judge.judge` (optionally with embedding cosines from the
   operator's ``embeddings_url``) gives the verdict, fed to the model as
   :class:`~xds_server.health.switchback_records.ValidationObserved` for that PROBATION. FAILED: UNHEALTHY
   with the evidence as the reason. A replay that could not run (an agent busy, unreachable, a
   timeout, an inconclusive judgement) is retried after ``retry_s``; the node stays held, for at
   most ``give_up``, then probes alone decide (said). Peers are tried least queued first (an
   agent refuses a replay while its engine queues requests).

Each verdict is an event (kind ``switchback_validation``) and, with the peers' noise, the
node's ``validation`` in ``/nodes`` (:meth:`SwitchbackValidator.node_view`). Prompt text is
never logged. In-process probing only (``probe.workers: 0``; the config refuses otherwise).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from node_probe.proto import probe_pb2
from xds_server.config import NodeConfig, SentinelConfig
from xds_server.config.validation import DEFAULT_PROMPTS, ValidationConfig
from xds_server.health import model as hm
from xds_server.policy.replay_judge import Answer, Judgement, PromptAnswers, judge
from xds_server.policy.validation_peers import choose_peers, plan_peers
from xds_server.probing.dial_in import DialInSession
from xds_server.probing.live_prompts import LivePromptPool, draw_prompts
from xds_server.probing.replay import ReplayExchange, StreamReplay
from xds_server.process.clock import Clock
from xds_server.process.counters import Counters

__all__ = ["SwitchbackValidator", "load_prompts"]

log = logging.getLogger("xds_server.probing")
V = hm.ValidationVerdict


def load_prompts(cfg: ValidationConfig) -> tuple[str, ...]:
    """The prompt pool: ``prompts_file`` (JSONL: one ``{"prompt": "..."}`` per line; blank lines
    skipped) or :data:`DEFAULT_PROMPTS`. Raises ValueError naming the file and line of a bad
    line, OSError when the file cannot be read."""
    if cfg.prompts_file is None:
        return DEFAULT_PROMPTS
    out: list[str] = []
    for i, line in enumerate(Path(cfg.prompts_file).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{cfg.prompts_file}:{i}: not JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str) or not doc["prompt"]:
            raise ValueError(f"{cfg.prompts_file}:{i}: expected an object with a non-empty 'prompt' string")
        out.append(doc["prompt"])
    if not out:
        raise ValueError(f"{cfg.prompts_file}: no prompts")
    return tuple(out)


class _Events(Protocol):  # what the validator writes of xds_server.control.events.EventLog
    def record(self, wall_s: float, cluster: str, node_id: str, kind: str, reason: str,
               from_state: str | None = None, to_state: str | None = None) -> object: ...


class _Core(Protocol):  # what the validator reads of xds_server.control.core.ControlCore
    @property
    def health(self) -> Mapping[str, hm.NodeHealth]: ...
    @property
    def node_cfg(self) -> Mapping[str, NodeConfig]: ...
    @property
    def node_cluster(self) -> Mapping[str, str]: ...
    @property
    def events(self) -> _Events: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def clock(self) -> Clock: ...


def _answer(a: probe_pb2.ReplayAnswer) -> Answer:
    return Answer(a.text, tuple(a.token_ids) if a.token_ids else None, not a.error)


class SwitchbackValidator:
    """Runs switch-back validations for a control plane (see the module docstring).

    Args:
        config: returns the serving config. core: the control core (health, node config, events).
        observe: ``observe(node_id, observation, now_s)``, the control plane's. tls: returns how to
            dial a node's agent (``ClientTls`` or None).
    """

    def __init__(self, config: Callable[[], SentinelConfig], core: _Core,
                 observe: Callable[[str, hm.Observation, float], object], tls: Callable[[str], Any],
                 control_plane_id: str = "xds-sentinel", *, sessions: Mapping[str, object] | None = None) -> None:
        self._config = config
        self._sessions = sessions if sessions is not None else {}  # dial-in nodes replay on their stream
        self._core = core
        self._observe = observe
        self._tls = tls
        self._cp_id = control_plane_id
        self._retry_at: dict[tuple[str, float], float] = {}
        self._first_try: dict[tuple[str, float], float] = {}  # (node, probation since) -> first attempt, s
        self._prompts: tuple[str, ...] | None = None
        self._prompts_key: str | None = None
        self._rng = random.Random()
        self.last: dict[str, dict[str, Any]] = {}
        self.live = LivePromptPool()  # filled by RoutingFeed/SubmitPrompts (health.validation.live_prompts)

    # -- scanning ------------------------------------------------------------------------------

    async def check(self) -> None:
        """Validate every node waiting for it, all at once; returns when they are done (so a
        cancelled check cancels them, and their streams close)."""
        config = self._config()
        cfg = config.health.validation
        if not cfg.enabled:
            return
        if cfg.live_prompts.enabled:
            self.live.forget({c.name for c in config.clusters})  # a cluster reloaded away
        now = self._core.clock.now()
        due = [(nid, nh.since_s) for nid, nh in list(self._core.health.items())
               if nh.state is hm.NodeState.PROBATION and nh.validation.verdict is V.PENDING
               and now >= self._retry_at.get((nid, nh.since_s), 0.0)]
        if due:
            await asyncio.gather(*(self._guarded(nid, since) for nid, since in due))

    def node_view(self, node_id: str, nh: hm.NodeHealth, now_s: float) -> dict[str, Any] | None:
        """``/nodes``' ``validation``: the model's verdict for the node's current (or last)
        PROBATION and the last validation's numbers (peers, their noise, the candidate's)."""
        v = nh.validation
        if v.at_s is None and node_id not in self.last:
            return None
        out: dict[str, Any] = {"verdict": v.verdict.value, "detail": v.detail or None,
                               "since_s_ago": None if v.at_s is None else round(now_s - v.at_s, 3)}
        if node_id in self.last:
            out["last"] = self.last[node_id]
        return out

    # -- one validation ------------------------------------------------------------------------

    async def _guarded(self, nid: str, since_s: float) -> None:
        try:
            await self._validate(nid, since_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("switch-back validation of %s failed", nid)
            self._retry(nid, since_s, "internal error")

    def _retry(self, nid: str, since_s: float, why: str) -> None:
        cfg = self._config().health.validation
        now = self._core.clock.now()
        first = self._first_try.get((nid, since_s), now)
        if now - first >= cfg.give_up.s:
            self._verdict(nid, since_s, V.PROBES_ONLY, f"no replay for {now - first:.0f} s (last: {why}): "
                          "validated by probes alone", {})
            return
        self._retry_at = {k: t for k, t in self._retry_at.items() if k[0] != nid}
        self._retry_at[(nid, since_s)] = now + cfg.retry.s
        self.last[nid] = {"verdict": "not run", "detail": why, "retry_in_s": cfg.retry.s}
        self._event(nid, f"switch-back validation could not run, retry in {cfg.retry.s:g} s: {why}")

    def _event(self, nid: str, reason: str) -> None:
        core = self._core
        core.events.record(core.clock.wall(), core.node_cluster.get(nid, "?"), nid, "switchback_validation", reason)

    def _pool(self, cfg: ValidationConfig) -> tuple[str, ...]:
        key = cfg.prompts_file or ""
        if self._prompts is None or key != self._prompts_key:
            self._prompts, self._prompts_key = load_prompts(cfg), key
        return self._prompts

    def _verdict(self, nid: str, since_s: float, verdict: hm.ValidationVerdict, detail: str,
                 numbers: dict[str, Any]) -> None:
        self.last[nid] = {"verdict": verdict.value, "detail": detail, **numbers}
        self._event(nid, f"{verdict.value}: {detail}")
        self._observe(nid, hm.ValidationObserved(verdict, detail, since_s), self._core.clock.now())

    async def _validate(self, nid: str, since_s: float) -> None:
        config = self._config()
        cfg = config.health.validation
        core = self._core
        key = (nid, since_s)
        self._first_try = {k: t for k, t in self._first_try.items() if k[0] != nid or k == key}
        self._first_try.setdefault(key, core.clock.now())
        cluster = core.node_cluster[nid]
        plan = plan_peers(nid, {p: h for p, c in core.node_cluster.items()
                                if c == cluster and (h := core.health.get(p)) is not None})
        try:
            pool = self._pool(cfg)
        except (OSError, ValueError) as e:  # the operator's file: named in the event, retried after a fix
            self._retry(nid, since_s, f"health.validation.prompts_file: {e}")
            return
        lp = cfg.live_prompts
        prompts, n_live = draw_prompts(pool, self.live.prompts(cluster) if lp.enabled else (), cfg.sample,
                                       lp.share, self._rng)
        ids = [nid, *plan.peers]
        ex = {i: self._exchange(i) for i in ids}
        try:
            open_s = min(cfg.timeout.s, 5.0)
            caps = dict(zip(ids, await asyncio.gather(*(ex[i].open(open_s) for i in ids)), strict=True))
            if not caps[nid]:
                if ex[nid].error:
                    self._retry(nid, since_s, f"candidate's agent: {ex[nid].error}")
                    return
                self._verdict(nid, since_s, V.PROBES_ONLY, "its agent does not replay (replay_max_prompts 0: an "
                              "older agent or --no-replay): validated by probes alone", {"peers": []})
                return
            if caps[nid] < len(prompts):
                self._verdict(nid, since_s, V.PROBES_ONLY, f"its agent replays at most {caps[nid]} prompts, "
                              f"{len(prompts)} asked: validated by probes alone", {"peers": []})
                return
            choice = choose_peers(plan, caps, {p: ex[p].error for p in plan.peers}, len(prompts), cluster)
            if choice.retry:
                self._retry(nid, since_s, choice.retry)
                return
            if choice.probes_only:
                self._verdict(nid, since_s, V.PROBES_ONLY, choice.probes_only, {"peers": list(choice.able)})
                return
            req = probe_pb2.ReplayRequest(request_id=f"{nid}-{uuid.uuid4().hex[:12]}", prompts=prompts,
                                          max_tokens=cfg.max_tokens, timeout_ms=int(cfg.timeout.s * 1000))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + cfg.timeout.s
            trio = [nid, *choice.run]
            got = await asyncio.gather(*(ex[i].ask(req, 64 * cfg.max_tokens, deadline) for i in trio))
        finally:
            await asyncio.gather(*(e.close() for e in ex.values()), return_exceptions=True)
        for i, r in zip(trio, got, strict=True):
            why = r if isinstance(r, str) else r.error
            if why:
                self._retry(nid, since_s, f"{'candidate' if i == nid else 'peer ' + i}: {why}")
                return
        res = [r for r in got if not isinstance(r, str)]
        answers = [PromptAnswers(_answer(c), _answer(a), _answer(b))
                   for c, a, b in zip(res[0].answers, res[1].answers, res[2].answers, strict=True)]
        if cfg.embeddings_url:
            answers = await self._with_cosines(cfg, answers)
        j = judge(answers, max_tokens=cfg.max_tokens, token_margin=cfg.token_margin,
                  similarity_margin=cfg.similarity_margin, min_prompt_ratio=cfg.min_prompt_ratio,
                  cosine_min=cfg.cosine_min)
        numbers = {**self._numbers(j, choice.run, res[0].model), "live_prompts": n_live}
        detail = f"{j.detail}; {n_live} of {len(prompts)} prompts sampled live" if n_live else j.detail
        if j.verdict == "inconclusive":
            self._retry(nid, since_s, detail)
            self.last[nid].update(numbers)
            return
        self._verdict(nid, since_s, V.PASSED if j.verdict == "passed" else V.FAILED, detail, numbers)

    def _exchange(self, nid: str) -> ReplayExchange | StreamReplay:
        """How to ask ``nid``'s agent for a replay: on its own stream when it dials in, else a
        stream of its own to the agent's probe address."""
        core = self._core
        target = core.node_cfg[nid].probe_address
        s = self._sessions.get(nid)
        if target is None and isinstance(s, DialInSession):
            return StreamReplay(nid, s, counters=core.counters)
        return ReplayExchange(nid, target or "", tls=self._tls(nid), counters=core.counters,
                              control_plane_id=self._cp_id)

    @staticmethod
    def _numbers(j: Judgement, peers: Sequence[str], model: str) -> dict[str, Any]:
        return {"peers": list(peers), "model": model, "prompts": j.prompts, "judged": j.judged, "within": j.within,
                "peers_noise": j.noise, "candidate_vs_peers": j.candidate}

    async def _with_cosines(self, cfg: ValidationConfig, answers: list[PromptAnswers]) -> list[PromptAnswers]:
        """Answers with embedding cosines from ``embeddings_url``; unchanged (logged) when the
        endpoint fails: the token and text measures still judge."""
        texts = [t for pa in answers for t in (pa.candidate.text, pa.peer_a.text, pa.peer_b.text)]
        body: dict[str, Any] = {"input": [t or " " for t in texts]}
        if cfg.embeddings_model:
            body["model"] = cfg.embeddings_model
        assert cfg.embeddings_url is not None
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=cfg.timeout.s)) as s, \
                    s.post(cfg.embeddings_url, json=body) as r:
                r.raise_for_status()
                data = (await r.json())["data"]
            vecs = [[float(x) for x in d["embedding"]] for d in sorted(data, key=lambda d: d["index"])]
            if len(vecs) != len(texts):
                raise ValueError(f"{len(vecs)} embeddings for {len(texts)} inputs")
        except Exception as e:
            log.warning("embeddings at %s failed, judged without cosine: %s", cfg.embeddings_url, type(e).__name__)
            return answers
        out = []
        for k, pa in enumerate(answers):
            c, a, b = vecs[3 * k:3 * k + 3]
            out.append(PromptAnswers(pa.candidate, pa.peer_a, pa.peer_b, (_cos(c, a), _cos(c, b), _cos(a, b))))
        return out


def _cos(x: Sequence[float], y: Sequence[float]) -> float:
    nx = sum(v * v for v in x) ** 0.5
    ny = sum(v * v for v in y) ** 0.5
    if not nx or not ny or len(x) != len(y):
        return 0.0
    return sum(a * b for a, b in zip(x, y, strict=True)) / (nx * ny)
