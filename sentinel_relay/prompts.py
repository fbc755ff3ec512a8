"""Live prompt sampling, the I/O side (``--sample-prompts RATIO``; off by default).

:class:`PromptSampler`: the relay asks :meth:`~PromptSampler.draw` once per forwarded completion
or chat request (a uniform draw < ``sample_prompts``) and, for a drawn request answered 200,
hands :meth:`~PromptSampler.offer` its already parsed body and the cluster it went to (the
routing feed's ``NodeRouting.cluster`` of the node Envoy named; "" when unknown). The prompt
(:func:`~sentinel_relay.sampling.extract_prompt`) waits in a bounded buffer (``sample_buffer``,
oldest dropped); every ``sample_interval_s`` the waiting ones go to the control plane in one
``RoutingFeed/SubmitPrompts`` call over the routing feed's connection (its target, its TLS).
A call that fails (no feed connection, UNIMPLEMENTED from an older control plane, a timeout
after ``sample_interval_s``) drops its prompts, counted; requests never wait on any of it.
Prompt text is never logged, at any level.

Metrics (:class:`~sentinel_relay.metrics.RelayMetrics`): ``sentinel_relay_prompts_sampled_total``,
``sentinel_relay_prompts_sent_total{answer}`` (accepted, refused: the control plane's
``PromptAck``), ``sentinel_relay_prompts_dropped_total{reason}`` (too_long, no_text,
buffer_full, no_feed, submit_failed) and ``sentinel_relay_prompt_submit_failures_total{code}``
(a gRPC status name, or no_feed).
"""
from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import grpc

from xds_server.proto import routing_pb2, routing_pb2_grpc

from .config import RelayConfig
from .metrics import RelayMetrics
from .sampling import PromptBuffer, extract_prompt

__all__ = ["PromptSampler"]

log = logging.getLogger("sentinel_relay.prompts")


class PromptSampler:
    """See the module docstring. ``rand``: the uniform draw in [0, 1) (tests)."""

    def __init__(self, cfg: RelayConfig, metrics: RelayMetrics, rand: Callable[[], float] = random.random) -> None:
        self.ratio = cfg.sample_prompts
        self.max_chars = cfg.sample_max_chars
        self.interval_s = cfg.sample_interval_s
        self.buffer = PromptBuffer(cfg.sample_buffer)
        self.metrics = metrics
        self._rand = rand
        self._task: asyncio.Task | None = None

    def draw(self) -> bool:
        """Whether this request's prompt is sampled (probability ``sample_prompts``)."""
        return self._rand() < self.ratio

    def offer(self, kind: str, body: Any, cluster: str) -> None:
        """Queue the prompt of a drawn request (``kind`` "completions" or "chat", its parsed body)
        for ``cluster`` ("" unknown); counted as dropped when it has no text prompt or is longer
        than ``sample_max_chars``, or when it pushes the oldest out of a full buffer."""
        prompt = extract_prompt(kind, body)
        m = self.metrics
        if prompt is None:
            m.prompts_dropped.labels("no_text").inc()
            return
        if len(prompt) > self.max_chars:
            m.prompts_dropped.labels("too_long").inc()
            return
        m.prompts_sampled.inc()
        if self.buffer.add(cluster, prompt):
            m.prompts_dropped.labels("buffer_full").inc()

    async def flush(self, channel: grpc.aio.Channel | None, subscriber_id: str) -> None:
        """Send every waiting prompt in one SubmitPrompts call on ``channel`` (None: no feed
        connection now, they are dropped). Never raises but for cancellation."""
        batch = self.buffer.take()
        if not batch:
            return
        m = self.metrics
        if channel is None:
            m.prompt_submit_failures.labels("no_feed").inc()
            m.prompts_dropped.labels("no_feed").inc(len(batch))
            return
        req = routing_pb2.PromptSample(subscriber_id=subscriber_id, prompts=[
            routing_pb2.SampledPrompt(cluster=c, prompt=p) for c, p in batch])
        try:
            ack = await routing_pb2_grpc.RoutingFeedStub(channel).SubmitPrompts(req, timeout=self.interval_s)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            m.prompt_submit_failures.labels(code).inc()
            m.prompts_dropped.labels("submit_failed").inc(len(batch))
            log.debug("sampled prompts not submitted: %s (%d prompts dropped)", code, len(batch))  # no text
            return
        except Exception as e:  # a closed channel, a bug: the requests never notice
            m.prompt_submit_failures.labels(type(e).__name__).inc()
            m.prompts_dropped.labels("submit_failed").inc(len(batch))
            return
        m.prompts_sent.labels("accepted").inc(ack.accepted)
        m.prompts_sent.labels("refused").inc(ack.refused)

    def start(self, channel: Callable[[], grpc.aio.Channel | None], subscriber_id: str) -> None:
        """Flush every ``sample_interval_s``; ``channel()``: the routing feed's connection now."""
        async def run() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                await self.flush(channel(), subscriber_id)
        self._task = asyncio.get_running_loop().create_task(run(), name="prompt-sampler")

    async def stop(self) -> None:
        """Stop flushing; prompts still waiting are dropped (never written anywhere)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
