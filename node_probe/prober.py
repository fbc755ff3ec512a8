"""One micro-probe through the engine's adapter (:class:`Prober`): the adapter is detected
first when ``engine_kind`` is auto, the model discovered when the adapter needs one and none
is configured, and a deep check's answer is checked against the expected text.

The probe's TTFT is timed on the agent's own event loop, so a pause of that loop (a GC, a slow
call, the host's CPU taken) while the probe is in flight would be counted as the engine's. A
:class:`LoopPause` watch runs beside each probe; a probe that spanned a pause of
:data:`OWN_PAUSE_MS` or more is run once more and that second one is reported."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import aiohttp

from node_probe.config import AgentConfig
from node_probe.engines import (
    ADAPTERS,
    EngineAdapter,
    EngineRequestError,
    ProbeOutcome,
    detect_engine_kind,
    run_probe,
)
from node_probe.proto import probe_pb2

__all__ = ["OWN_PAUSE_MS", "LoopPause", "Prober"]

log = logging.getLogger(__name__)

OWN_PAUSE_MS = 100.0
"""A pause of the agent's own loop this long (ms) makes a probe's timing unreliable: it is run
again (ours: half the seed's 200 ms healthy TTFT; the loop ticks every 20 ms otherwise)."""
_TICK_S = 0.02


class LoopPause:
    """While entered (``async with``), the longest time the running loop was late to wake a
    20 ms tick (``longest_ms``): how long the loop itself was paused."""

    def __init__(self) -> None:
        self.longest_ms = 0.0
        self._task: asyncio.Task[None] | None = None
        self._due = 0.0  # when the pending tick is due (loop time, s)

    def _late_ms(self, loop: asyncio.AbstractEventLoop) -> float:
        return max(0.0, (loop.time() - self._due) * 1000.0)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._due = loop.time() + _TICK_S
            await asyncio.sleep(_TICK_S)
            self.longest_ms = max(self.longest_ms, self._late_ms(loop))

    async def __aenter__(self) -> LoopPause:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + _TICK_S
        self._task = loop.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        # after a pause the loop runs the probe's I/O before the due tick: a probe that ends in
        # that turn is read here, from the tick still pending
        self.longest_ms = max(self.longest_ms, self._late_ms(asyncio.get_running_loop()))
        if self._task is not None:
            self._task.cancel()


def _not_an_engine(path: str, status: int, model: str | None = None) -> str:
    """The hint in front of a failure's detail when ``path`` answered a status no inference engine
    gives for its own API (404 Not Found, 405 Method Not Allowed): the URL is most likely
    something else (the most common slip), or for a configured ``model`` one it does
    not serve; "" for any other status."""
    if status not in (404, 405):
        return ""
    serving = f" serving --model {model}" if model else ""
    return f"{path} answered {status}: is --engine-url an inference engine{serving}? "


class Prober:
    """The engine's adapter and model, and the probe through them.

    Args:
        cfg: the agent's settings (engine URL and kind, model, probe and deep-check settings).
    """

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self._adapter: EngineAdapter | None = None if cfg.engine_kind == "auto" else ADAPTERS[cfg.engine_kind]
        self._adapter_lock = asyncio.Lock()
        self._model: str | None = cfg.model
        self._model_discovered = False

    @property
    def adapter_kind(self) -> str | None:
        """Adapter in use (``None`` while ``auto`` has not detected the engine yet)."""
        return None if self._adapter is None else self._adapter.kind

    def forget_adapter(self) -> None:
        """With ``engine_kind`` auto, detect the engine afresh next time (the process behind the
        URL went away: whatever comes back may be another engine). No-op otherwise."""
        if self.cfg.engine_kind == "auto":
            self._adapter = None

    async def adapter(self, session: aiohttp.ClientSession) -> EngineAdapter:
        """The adapter in use, detecting the engine first when ``engine_kind`` is auto.

        Raises:
            EngineRequestError: detection found no answering engine (CONNECT / TIMEOUT).
        """
        if self._adapter is not None:
            return self._adapter
        async with self._adapter_lock:
            if self._adapter is None:
                kind = await detect_engine_kind(
                    session, self.cfg.engine_url, self.cfg.metrics_timeout_ms / 1000.0, self.cfg.metrics_url,
                )
                self._adapter = ADAPTERS[kind]
                log.info("engine detected as %s", kind)
            return self._adapter

    async def _resolve_model(self, session: aiohttp.ClientSession, adapter: EngineAdapter,
                             timeout_s: float) -> str | None:
        """The model to probe (raises :class:`EngineRequestError` when discovery fails)."""
        if self._model or not adapter.needs_model:
            return self._model
        try:
            model = await adapter.discover_model(session, self.cfg.engine_url, timeout_s)
        except EngineRequestError as err:
            hint = _not_an_engine("/v1/models", err.http_status)
            detail = f"{hint}(model discovery: {err.detail})" if hint else f"model discovery: {err.detail}"
            raise EngineRequestError(err.kind, detail, err.http_status) from err
        self._model = model
        self._model_discovered = True
        log.info("probing model %s (discovered)", model)
        return model

    async def replay_model(self, session: aiohttp.ClientSession) -> str | None:
        """The model a switch-back replay asks for (the probe's; raises
        :class:`EngineRequestError` when detection or discovery fails)."""
        adapter = await self.adapter(session)
        return await self._resolve_model(session, adapter, self.cfg.probe_timeout_ms / 1000.0)

    async def probe(self, session: aiohttp.ClientSession, deep: bool) -> ProbeOutcome:
        """One probe: a regular 1-token probe within ``probe_timeout_ms``, or (``deep``) the deep
        check within ``deep_check_timeout_ms``, whose answer must contain ``deep_check_expect``
        (else BAD_OUTPUT). A 404 forgets a discovered model (the engine restarted with another).
        Never raises for engine behaviour (see :func:`~node_probe.engines.run_probe`)."""
        cfg = self.cfg
        timeout_s = (cfg.deep_check_timeout_ms if deep else cfg.probe_timeout_ms) / 1000.0
        try:
            adapter = await self.adapter(session)
            model = await self._resolve_model(session, adapter, cfg.probe_timeout_ms / 1000.0)
        except EngineRequestError as err:
            return ProbeOutcome(False, None, err.kind, err.http_status, err.detail)
        for attempt in (1, 2):
            async with LoopPause() as pause:
                outcome = await run_probe(
                    session, adapter, cfg.engine_url, model, timeout_s,
                    deep_prompt=cfg.deep_check_prompt if deep else None,
                    max_tokens=cfg.deep_check_max_tokens if deep else 1,
                )
            if pause.longest_ms < OWN_PAUSE_MS or attempt == 2:
                break
            log.info("probe timed across a %.0f ms pause of the agent's own loop: probing again", pause.longest_ms)
        if outcome.http_status == 404 and self._model_discovered:
            self._model = None  # engine restarted with another model: rediscover
            self._model_discovered = False
        elif not outcome.ok and _not_an_engine("", outcome.http_status):
            hint = _not_an_engine(adapter.probe_request(model, "", None, 1).path, outcome.http_status, model)
            outcome = replace(outcome, detail=f"{hint}{outcome.detail}")
        if deep and outcome.ok and cfg.deep_check_expect not in outcome.text:
            outcome = ProbeOutcome(
                False, outcome.ttft_ms, probe_pb2.FAILURE_KIND_BAD_OUTPUT, outcome.http_status,
                f"deep check: {cfg.deep_check_prompt!r} answered {outcome.text[:80]!r}, "
                f"expected {cfg.deep_check_expect!r}",
                outcome.headers_ms, outcome.text,
            )
        return outcome
