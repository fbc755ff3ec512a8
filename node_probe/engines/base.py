"""The engine adapter contract: :class:`EngineAdapter`, a frozen value describing what differs
between engine families, and the probe request and stream-chunk verdicts it speaks in.

An adapter declares the completion endpoint and body of a 1-token probe (:meth:`probe_request`),
how a stream chunk carries a token or an error (:meth:`read_chunk`), where its ``/metrics`` page
is and the names of its load signals there (:class:`~node_probe.engines.prometheus.MetricSpec`),
and how it defeats prefix caching (a cache-salt field or a random prefix). Behaviour that
differs by wire format lives in one subclass per format (OpenAI-compatible, TGI, Triton); engines
that share a format are values of the same class (``vllm.VLLM``, ``sglang.SGLANG``). The probe
itself is :func:`node_probe.engines.sse_probe.run_probe`; metric parsing is
:func:`node_probe.engines.prometheus.parse_with_spec`.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

import aiohttp

from node_probe.engines.http_helpers import EngineRequestError, fetch_metrics_text
from node_probe.engines.prometheus import EngineLoadReading, MetricSpec, parse_with_spec
from node_probe.proto import probe_pb2

__all__ = ["ChunkError", "ChunkToken", "EngineAdapter", "ProbeRequest", "random_word"]


@dataclass(frozen=True)
class ProbeRequest:
    """One probe request: POST ``path`` with JSON ``body``."""

    path: str
    body: dict[str, Any]


@dataclass(frozen=True)
class ChunkToken:
    """A stream chunk that carries generated content: its ``text`` (may be empty for an
    end-of-sequence or special token) and ``final`` when it ends the answer."""

    text: str
    final: bool = False


@dataclass(frozen=True)
class ChunkError:
    """A stream chunk that reports an error, with the engine's ``message``."""

    message: str


def random_word(n: int = 6) -> str:
    """``n`` random letters and digits (``secrets``: unpredictable, so no cache can hold them)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(n))


@dataclass(frozen=True, kw_only=True)
class EngineAdapter:
    """Base of engine adapters: a frozen value (shared, stateless); subclasses per wire format
    override the request/chunk methods.

    Attributes:
        kind: adapter name (``--engine-kind``).
        metrics_path: path of the Prometheus page on the metrics URL.
        cache_salt_field: request field that salts the prefix cache (``None``: the adapter puts
            a random prefix in front of the prompt instead).
        needs_model: the probe request names a model (discovered when not configured).
        metrics_spec: where the load signals are (:class:`MetricSpec`); stall detection works
            when it names a progress counter and the engine exposes it.
        probe_prompt: prompt of a regular probe (a short fixed text, salted or prefixed).
    """

    kind: str = "base"
    metrics_path: str = "/metrics"
    cache_salt_field: str | None = None
    needs_model: bool = True
    metrics_spec: MetricSpec = MetricSpec()  # noqa: RUF009 - frozen, tuples only: safe to share
    probe_prompt: str = "Hi"

    # -- metrics --------------------------------------------------------------------------------

    def metrics_url(self, base_url: str, override: str | None = None) -> str:
        """URL of the engine's Prometheus page (``override`` wins when given)."""
        return override or base_url.rstrip("/") + self.metrics_path

    def parse_metrics(self, text: str) -> EngineLoadReading:
        """Parse the engine's ``/metrics`` text (raises ``ValueError`` for invalid text)."""
        return parse_with_spec(text, self.metrics_spec)

    async def read_metrics(self, session: aiohttp.ClientSession, base_url: str, timeout_s: float,
                           override: str | None = None) -> EngineLoadReading:
        """GET the engine's ``/metrics`` page (:meth:`metrics_url`) within ``timeout_s`` seconds
        and parse it.

        Raises:
            EngineRequestError: CONNECT (refused/reset/DNS), TIMEOUT, HTTP_STATUS (non-200),
                ENGINE_FATAL (non-200 whose body names a fatal error) or BAD_OUTPUT (unparseable).
        """
        url = self.metrics_url(base_url, override)
        text = await fetch_metrics_text(session, url, timeout_s)
        try:
            return self.parse_metrics(text)
        except ValueError as exc:
            raise EngineRequestError(
                probe_pb2.FAILURE_KIND_BAD_OUTPUT, f"GET {url}: unparseable metrics: {exc}", 200
            ) from exc

    # -- model ----------------------------------------------------------------------------------

    async def discover_model(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float
    ) -> str | None:
        """Return the model id to probe (``None`` when the engine needs none). Raises
        :class:`EngineRequestError` when discovery fails or finds no model."""
        return None

    # -- probe ----------------------------------------------------------------------------------

    def prompt_and_salt(self, deep_prompt: str | None = None) -> tuple[str, str | None]:
        """The prompt of one probe and its cache salt (``None`` when the adapter has no salt
        field). Regular probes defeat prefix caching with a fresh salt or, without a salt
        field, a random prefix; a deep-check prompt is never altered (a prefix would change
        its answer), only salted where the engine can."""
        salt = secrets.token_hex(8) if self.cache_salt_field else None
        if deep_prompt is not None:
            return deep_prompt, salt
        if salt is not None:
            return f"{random_word(4)}: {self.probe_prompt}", salt
        # No salt field: a random prefix of several words, longer than one KV block of the
        # usual 16 tokens, so no cached block can match the prompt.
        return " ".join(random_word(6) for _ in range(8)) + ": " + self.probe_prompt, None

    def probe_request(self, model: str | None, prompt: str, salt: str | None,
                      max_tokens: int) -> ProbeRequest:
        """The completion request of one probe (greedy, streaming)."""
        raise NotImplementedError

    def read_chunk(self, doc: Any) -> ChunkToken | ChunkError | None:
        """Classify one parsed stream chunk: a token (with its text), an error, or ``None``
        for a chunk that carries no generated content (role-only, empty, usage)."""
        raise NotImplementedError

    def read_full_answer(self, doc: Any) -> str | None:
        """Text of a non-streaming answer (an engine that ignored ``stream``), ``None`` if it
        carries none."""
        return None
