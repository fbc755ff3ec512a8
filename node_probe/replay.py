"""Switch-back replay on the agent: run a control plane's prompts greedily through the engine.

A ``ReplayRequest`` (``protos/node_probe/``) asks the agent to run a few prompts through
its engine's OpenAI-compatible ``POST /v1/completions`` with ``temperature: 0`` (greedy), a few
dozen tokens each, ``return_token_ids: true`` (vLLM and the simulator answer the generated ids;
an engine that ignores it answers text only) and the header ``x-sentinel-probe: replay``. The
answer is one ``ReplayResult`` on the stream that asked: one ``ReplayAnswer`` per prompt (ids,
text, finish reason), or ``error`` for the replay as a whole.

Bounds (:class:`ReplayLimits`): at most ``max_prompts`` prompts of ``max_prompt_chars``
characters, ``max_tokens`` tokens each, ``timeout_ms`` for the whole replay, ``concurrency``
prompts in flight, one replay at a time per agent (a second one is refused, not queued), and
none while the engine is saturated: it queues more than ``busy_max_waiting`` requests (its
``requests_waiting`` from the latest ``/metrics`` scrape, default 0: any queue; unknown load is not
busy). Running requests alone do not block a replay: it adds a few short greedy sequences to the
batch, which a continuous-batching engine absorbs; a queue means users would wait behind it. Answers are
clipped to ``max_answer_chars`` characters and ``max_tokens`` ids. Prompt text and answers are
never logged: only counts, sizes and timings.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from node_probe.proto import probe_pb2

__all__ = ["ReplayLimits", "Replayer"]

_NO_COMPLETIONS = frozenset({"tgi", "triton"})  # engine families without an OpenAI /v1/completions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayLimits:
    """What one agent accepts from a ``ReplayRequest`` (ours: a validation needs ~8
    short prompts; the bounds keep a replay from ever becoming load).

    Attributes:
        max_prompts: prompts per request; 0 turns replay off (the agent advertises 0 in its
            heartbeats and ignores requests, as an agent without replay does).
        max_prompt_chars: characters per prompt.
        max_tokens: tokens generated per prompt (a request asking more gets this many).
        timeout_ms: deadline of the whole replay when the request gives none; also the cap.
        concurrency: prompts in flight at once.
        busy_max_waiting: refuse while the engine queues more than this many requests.
        max_answer_chars: characters of answer text kept per prompt.

    Raises:
        ValueError: (on construction) a value is out of range.
    """

    max_prompts: int = 16
    max_prompt_chars: int = 4000
    max_tokens: int = 64
    timeout_ms: int = 20_000
    concurrency: int = 2
    busy_max_waiting: int = 0
    max_answer_chars: int = 2000

    def __post_init__(self) -> None:
        if not 0 <= self.max_prompts <= 256:
            raise ValueError(f"replay max_prompts must be 0..256: {self.max_prompts!r}")
        for name in ("max_prompt_chars", "max_tokens", "timeout_ms", "concurrency", "max_answer_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"replay {name} must be >= 1: {getattr(self, name)!r}")
        if self.busy_max_waiting < 0:
            raise ValueError(f"replay busy_max_waiting must be >= 0: {self.busy_max_waiting!r}")


def _refusal(req: probe_pb2.ReplayRequest, limits: ReplayLimits) -> str:
    """Why a request is refused as a whole ("" when it is acceptable)."""
    if not req.request_id or len(req.request_id) > 128:
        return "request_id must be 1..128 characters"
    if not req.prompts:
        return "no prompts"
    if len(req.prompts) > limits.max_prompts:
        return f"too many prompts: {len(req.prompts)} > {limits.max_prompts}"
    long = [i for i, p in enumerate(req.prompts) if not p or len(p) > limits.max_prompt_chars]
    if long:
        return f"prompt {long[0]} is empty or longer than {limits.max_prompt_chars} characters"
    return ""


def _answer(doc: Any, max_tokens: int, max_chars: int) -> probe_pb2.ReplayAnswer:
    """One completion body -> ``ReplayAnswer`` (ids and text clipped to the bounds)."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return probe_pb2.ReplayAnswer(error="no choices in the completion")
    ch = choices[0]
    text = ch.get("text")
    ids = ch.get("token_ids")
    out = probe_pb2.ReplayAnswer(text=text[:max_chars] if isinstance(text, str) else "",
                                 finish_reason=str(ch.get("finish_reason") or "")[:32])
    if isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < 2**32 for t in ids):
        out.token_ids.extend(ids[:max_tokens])
    return out


class Replayer:
    """Runs ``ReplayRequest`` s for one agent.

    Args:
        engine_url: the engine's root URL.
        limits: the bounds.
        node_id: put in every result.
        session: returns the agent's HTTP session (None before the agent started).
        prober: the agent's :class:`~node_probe.prober.Prober`: ``replay_model(session)`` gives the
            model id to ask for (may raise: the replay then fails), ``adapter_kind`` the engine
            family (TGI and Triton have no ``/v1/completions``: replay is not advertised for them).
        load: returns the latest ``/metrics`` reading (its ``requests_waiting``; None or unset:
            unknown, not busy).
    """

    def __init__(self, engine_url: str, limits: ReplayLimits, node_id: str,
                 session: Callable[[], aiohttp.ClientSession | None],
                 prober: Any, load: Callable[[], Any]) -> None:
        self._url = engine_url.rstrip("/") + "/v1/completions"
        self.limits = limits
        self._node_id = node_id
        self._session = session
        self._prober = prober
        self._load = load
        self._running = False
        self._ids = True  # ask for token ids (vLLM, the simulator) until the engine refuses the field
        self.served = 0
        self.refused = 0

    @property
    def advertised(self) -> int:
        """``Heartbeat.replay_max_prompts``: 0 when replay is off or the engine has no completions API."""
        return 0 if self._prober.adapter_kind in _NO_COMPLETIONS else self.limits.max_prompts

    def _busy(self) -> str:
        waiting = getattr(self._load(), "requests_waiting", None)
        if waiting is not None and waiting > self.limits.busy_max_waiting:
            return f"busy: engine queues {waiting:g} requests (> {self.limits.busy_max_waiting})"
        return ""

    async def run(self, req: probe_pb2.ReplayRequest) -> probe_pb2.ReplayResult:
        """Answer one request (never raises: failures are the result's ``error`` or per-answer)."""
        out = probe_pb2.ReplayResult(request_id=req.request_id[:128], node_id=self._node_id)
        session = self._session()
        why = (_refusal(req, self.limits) or self._busy()
               or ("a replay is already running" if self._running else "")
               or ("agent not started" if session is None else ""))
        if why:
            self.refused += 1
            log.info("replay %s refused: %s", out.request_id, why)
            out.error = why
            return out
        assert session is not None
        self._running = True
        t0 = time.monotonic()
        try:
            deadline_s = min(req.timeout_ms or self.limits.timeout_ms, self.limits.timeout_ms) / 1000.0
            max_tokens = min(req.max_tokens or self.limits.max_tokens, self.limits.max_tokens)
            try:
                model = await asyncio.wait_for(self._prober.replay_model(session), deadline_s)
            except Exception as exc:  # discovery failed: the replay cannot run
                out.error = f"model discovery failed: {type(exc).__name__}: {exc}"[:300]
                return out
            out.model = model or ""
            gate = asyncio.Semaphore(self.limits.concurrency)

            async def one(prompt: str) -> probe_pb2.ReplayAnswer:
                async with gate:
                    return await self._complete(session, model, prompt, max_tokens, t0 + deadline_s)

            answers = await asyncio.gather(*(one(p) for p in req.prompts))
            out.answers.extend(answers)
            self.served += 1
            log.info("replay %s: %d prompts, %d tokens max, %.0f ms", out.request_id, len(answers),
                     max_tokens, (time.monotonic() - t0) * 1000.0)
            return out
        finally:
            self._running = False

    async def _complete(self, session: aiohttp.ClientSession, model: str | None, prompt: str,
                        max_tokens: int, deadline: float) -> probe_pb2.ReplayAnswer:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False}
        if self._ids:
            body["return_token_ids"] = True
        if model:
            body["model"] = model
        t0 = time.monotonic()
        left = deadline - t0
        if left <= 0:
            return probe_pb2.ReplayAnswer(error="replay deadline passed")
        try:
            async with session.post(self._url, json=body, headers={"x-sentinel-probe": "replay"},
                                    timeout=aiohttp.ClientTimeout(total=left)) as resp:
                raw = await resp.content.read(1 << 20)
                status = resp.status
            if status == 400 and "return_token_ids" in body:  # an engine that refuses the field: text only
                if self._ids:
                    log.info("engine refused return_token_ids (HTTP 400): replay answers carry text only")
                self._ids = False
                return await self._complete(session, model, prompt, max_tokens, deadline)
            if status != 200:
                return probe_pb2.ReplayAnswer(error=f"HTTP {status}", elapsed_ms=(time.monotonic() - t0) * 1000.0)
            doc = json.loads(raw)
        except TimeoutError:
            return probe_pb2.ReplayAnswer(error="timeout", elapsed_ms=(time.monotonic() - t0) * 1000.0)
        except (aiohttp.ClientError, ValueError, OSError) as exc:
            return probe_pb2.ReplayAnswer(error=f"{type(exc).__name__}"[:100],
                                          elapsed_ms=(time.monotonic() - t0) * 1000.0)
        ans = _answer(doc, max_tokens, self.limits.max_answer_chars)
        ans.elapsed_ms = (time.monotonic() - t0) * 1000.0
        return ans
