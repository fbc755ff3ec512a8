"""Fault modes of the simulated engine: what each does and when a mid-stream fault fires.

Pure code, no I/O: :class:`Faults` holds the current fault and answers the generation loop's
questions ("does this request's next token trip a fault?"); the HTTP layer does what the answer
says. Modes (``POST /sim/fault`` body ``{"mode": ..., params}``):

=================== ==========================================================================
``none``            healthy engine.
``hang``            engine frozen (like SIGSTOP of the EngineCore): new requests get their
                    headers (streams) and then nothing, in-flight streams stop, ``/health`` and
                    ``/metrics`` stay 200 with a frozen token counter. ``none`` resumes all.
``slow``            first token of each new request after ``ttft_ms`` ms (default 1000).
``error``           inference answers HTTP 500 (CUDA error body) before any streaming.
``queue``           ``/metrics`` reports ``waiting`` waiting requests (default 120).
``freeze_after``    the engine runs until a user request has produced ``after_tokens`` tokens,
                    then the whole engine freezes exactly like ``hang`` (the mode reads
                    ``hang`` from then on; ``none`` resumes).
``reset_after``     once a user request has produced ``after_tokens`` tokens its TCP connection
                    is reset (RST): a stream is cut with no finish_reason and no ``[DONE]``; a
                    non-streaming request gets no response.
``fail_after``      like an engine process dying: at ``after_tokens`` a stream's connection is
                    closed (FIN) without the last chunk, finish_reason or ``[DONE]``; a
                    non-streaming request is answered HTTP 500 ("EngineCore encountered an
                    issue").
``error_after``     vLLM's in-band error: at ``after_tokens`` a stream gets one
                    ``data: {"error": {"message", "type": "InternalServerError", "param": null,
                    "code": 500}}`` event, then ``data: [DONE]`` (no finish_reason); a
                    non-streaming request gets that error body with HTTP 500.
``garble_after``    an engine's or a proxy's bug, not a dead node: at ``after_tokens`` a stream
                    gets one data event that is not JSON (:data:`GARBLED_EVENT`), then goes on
                    as if nothing happened; a non-streaming request is not affected.
``prefill``         one long prompt is prefilled in chunks for ``prefill_ms`` ms (default 5,500,
                    measured on vLLM 0.32: a 3,000-token prompt, ``--max-num-batched-tokens
                    256``). As in vLLM v1, which counts prompt tokens only when a prefill
                    completes, the token counters stay frozen while ``vllm:kv_cache_usage_perc``
                    rises linearly by 0.078 (0.008 -> 0.086 measured) with 1 running; requests
                    arriving meanwhile wait behind it (``waiting``) and get their first token
                    when it ends; then the prompt counter advances by 3,000, KV usage returns
                    to its idle value and the mode to ``none``. Deterministic: every value is
                    a function of the time since the fault was set.
``user_error``      real traffic fails while probes pass (a CUDA OOM on long contexts, a missing
                    LoRA adapter): user requests whose prompt has at least
                    ``min_prompt_tokens`` tokens (default 0: every prompt) are answered HTTP
                    500 (the ``error`` body) at ``rate`` (0..1, default 1; deterministic: the
                    k-th such request fails when floor(k x rate) grows). Probes always pass.
``load_slow``       a node that slows down under load (KV cache thrashing when survivors take
                    2x their share, seed 002): each token of a new request takes the engine's
                    interval x (1 + requests in flight / ``knee``) (``knee`` default 4: 4 in
                    flight double it). Probes are slowed alike (they share the batch).
``hang_after_headers`` new user requests (the next ``times``) send their headers (streams: 200
                    SSE headers; non-streaming: nothing) and then never a token; the rest of
                    the engine works. ``none`` (or any other mode) releases them.
=================== ==========================================================================

``after_tokens`` (int >= 0, default 1) counts the tokens a request has produced (all its
choices); 0 fires before its first token. ``times`` (int >= 0, default 1) is how many requests a
``*_after`` or ``hang_after_headers`` fault hits before the mode returns to ``none``; 0 means
every request. Probe requests (``x-sentinel-probe`` header) are never hit by these per-request
faults, so the node's own health probes see a healthy engine unless the engine is frozen.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "DEFAULT_PREFILL_MS",
    "DEFAULT_QUEUE_WAITING",
    "DEFAULT_SLOW_TTFT_MS",
    "FAULT_MODES",
    "GARBLED_EVENT",
    "MIDSTREAM_MODES",
    "PREFILL_KV_RISE",
    "PREFILL_PROMPT_TOKENS",
    "Faults",
]

#: Mid-stream modes: what fires when a request reaches ``after_tokens`` tokens.
MIDSTREAM_MODES = ("freeze_after", "reset_after", "fail_after", "error_after", "garble_after")
#: Fault modes accepted by ``POST /sim/fault``.
FAULT_MODES = ("none", "hang", "slow", "error", "queue", *MIDSTREAM_MODES, "hang_after_headers", "prefill",
               "user_error", "load_slow")
_COUNTED = (*MIDSTREAM_MODES, "hang_after_headers")

#: Default first-token delay for ``slow`` when the fault request gives no ``ttft_ms`` (ms).
DEFAULT_SLOW_TTFT_MS = 1000.0
#: Default waiting count for ``queue`` when the fault request gives no ``waiting``.
DEFAULT_QUEUE_WAITING = 120
#: Default length of a ``prefill`` (ms), its prompt (tokens) and KV-usage rise (ratio): measured
#: on vLLM 0.32 (CPU build, hidden 1024, 8 layers, --max-num-batched-tokens 256).
DEFAULT_PREFILL_MS = 5500.0
PREFILL_PROMPT_TOKENS = 3000
PREFILL_KV_RISE = 0.078
#: The event ``garble_after`` writes: a chunk cut short and run into the next (not JSON).
GARBLED_EVENT = b'data: {"id":"cmpl-garbled","object":"text_completion","choices":[{"index":0,"te\n\n'
#: Accepted keys of a fault request.
FAULT_FIELDS = frozenset({"mode", "ttft_ms", "waiting", "after_tokens", "times", "prefill_ms", "rate",
                          "min_prompt_tokens", "knee"})


class Faults:
    """Current fault mode and its parameters."""

    def __init__(self) -> None:
        self.mode = "none"
        self.ttft_ms = 0.0
        self.waiting = 0
        self.after_tokens = 1
        self.times = 1  # requests still to hit (0: every request)
        self.prefill_ms = 0.0  # length of the current ``prefill``, ms
        self.rate = 1.0  # ``user_error``: share of matching user requests failed (0..1)
        self.min_prompt_tokens = 0  # ``user_error``: shortest prompt (tokens) that fails
        self._matched = 0  # ``user_error``: matching user requests seen
        self.knee = 4  # ``load_slow``: requests in flight that double the token interval

    def state(self) -> dict[str, Any]:
        """JSON view: ``mode``, ``ttft_ms``, ``waiting``; plus ``after_tokens`` and ``times``
        for the modes that use them."""
        out: dict[str, Any] = {"mode": self.mode, "ttft_ms": self.ttft_ms,
                               "waiting": self.waiting}
        if self.mode == "prefill":
            out["prefill_ms"] = self.prefill_ms
        if self.mode == "user_error":
            out.update(rate=self.rate, min_prompt_tokens=self.min_prompt_tokens)
        if self.mode == "load_slow":
            out["knee"] = self.knee
        if self.mode in _COUNTED:
            out["times"] = self.times
            if self.mode in MIDSTREAM_MODES:
                out["after_tokens"] = self.after_tokens
        return out

    def set(self, mode: str, *, ttft_ms: float | None = None, waiting: int | None = None,
            after_tokens: int | None = None, times: int | None = None,
            prefill_ms: float | None = None, rate: float | None = None,
            min_prompt_tokens: int | None = None, knee: int | None = None) -> None:
        """Switch mode (all-or-nothing: on error nothing changes).

        Raises:
            ValueError: unknown mode or a value out of range, naming the field.
        """
        if mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {', '.join(FAULT_MODES)}")
        if ttft_ms is not None and not (math.isfinite(ttft_ms) and ttft_ms >= 0):
            raise ValueError("ttft_ms must be a finite number >= 0")
        if prefill_ms is not None and (isinstance(prefill_ms, bool) or not isinstance(prefill_ms, (int, float))
                                       or not (math.isfinite(prefill_ms) and prefill_ms > 0)):
            raise ValueError("prefill_ms must be a finite number > 0")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not (math.isfinite(rate) and 0 <= rate <= 1)):
            raise ValueError("rate must be a number in 0..1")
        for name, value in (("waiting", waiting), ("after_tokens", after_tokens),
                            ("times", times), ("min_prompt_tokens", min_prompt_tokens), ("knee", knee)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name} must be an integer >= 0")
        if knee is not None and knee < 1:
            raise ValueError("knee must be an integer >= 1")
        self.mode = mode
        self.ttft_ms = float(DEFAULT_SLOW_TTFT_MS if ttft_ms is None else ttft_ms) \
            if mode == "slow" else 0.0
        self.waiting = int(DEFAULT_QUEUE_WAITING if waiting is None else waiting) \
            if mode == "queue" else 0
        self.after_tokens = 1 if after_tokens is None else after_tokens
        self.times = 1 if times is None else times
        self.prefill_ms = float(DEFAULT_PREFILL_MS if prefill_ms is None else prefill_ms) \
            if mode == "prefill" else 0.0
        self.rate = 1.0 if rate is None else float(rate)
        self.min_prompt_tokens = 0 if min_prompt_tokens is None else min_prompt_tokens
        self._matched = 0
        self.knee = 4 if knee is None else knee

    def load_factor(self, in_flight: int) -> float:
        """``load_slow``: how many times the token interval a new request gets (1.0 otherwise)."""
        return 1.0 + max(0, in_flight) / self.knee if self.mode == "load_slow" else 1.0

    def fails_request(self, probe: bool, prompt_tokens: int) -> bool:
        """``user_error``: True when this user request (``prompt_tokens`` long) must get a 500."""
        if probe or self.mode != "user_error" or prompt_tokens < self.min_prompt_tokens:
            return False
        self._matched += 1
        return math.floor(self._matched * self.rate + 1e-9) > math.floor((self._matched - 1) * self.rate + 1e-9)

    def _spend(self) -> None:
        if self.times == 1:
            self.mode = "none"
        elif self.times > 1:
            self.times -= 1

    def on_token(self, produced: int, probe: bool) -> str | None:
        """Called before a request produces its next token, ``produced`` tokens so far.

        Returns the mid-stream mode that fires now (``freeze_after`` having switched the mode
        to ``hang``), or None.
        """
        if probe or self.mode not in MIDSTREAM_MODES or produced < self.after_tokens:
            return None
        fired = self.mode
        if fired == "freeze_after":
            self.mode = "hang"
        else:
            self._spend()
        return fired

    def on_headers(self, probe: bool) -> bool:
        """Called when a request starts: True when it must hang after its headers."""
        if probe or self.mode != "hang_after_headers":
            return False
        self._spend()
        return True
