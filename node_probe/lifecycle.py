"""The engine's lifecycle as the agent reports it in telemetry (:class:`EngineLifecycle`):
COLD, WARMING, READY, FAILED (``probe_pb2.EngineState``), fed by scrapes, probes and GPU
verdicts."""

from __future__ import annotations

from collections.abc import Callable

from node_probe.engines import EngineRequestError, ProbeOutcome
from node_probe.proto import probe_pb2

__all__ = ["STATE_NAMES", "EngineLifecycle"]

#: ``probe_pb2.EngineState`` value -> its name, for logs.
STATE_NAMES = {v: k for k, v in probe_pb2.EngineState.items()}


class EngineLifecycle:
    """Engine lifecycle state machine (``probe_pb2.EngineState`` values).

    * COLD until the engine first answers HTTP (``/metrics`` or a probe, any status);
    * WARMING while it answers but no probe has succeeded yet (weights loading, compiling: the
      control plane counts no failures here), and again after a restart;
    * READY after a successful probe (from any state but a GPU-fatal FAILED);
    * FAILED on ENGINE_FATAL, on a refused/reset connection after the engine had been up
      (WARMING or READY), or while the GPU is lost / has a fatal Xid. From FAILED it goes back
      to WARMING when the engine answers again, except after a fatal error: an engine kept
      alive after its EngineCore died keeps serving ``/metrics`` (stale), so only a refused
      connection (process gone) or a successful probe clears a fatal FAILED. A GPU-fatal
      FAILED lasts while the GPU telemetry says so, then goes to WARMING.
    """

    def __init__(self, on_change: Callable[[int, int, str], None] | None = None) -> None:
        self.state: probe_pb2.EngineState = probe_pb2.ENGINE_STATE_COLD
        self.reason = "no engine answer yet"
        #: what caused the last transition: "answered", "refused", "fatal", "probe_ok",
        #: "restart" or "gpu".
        self.cause = ""
        self._fatal_latched = False
        self._gpu_fatal: str | None = None
        self._on_change = on_change

    def _set(self, new: probe_pb2.EngineState, reason: str, cause: str = "") -> None:
        if new != self.state:
            self.cause = cause
            old, self.state = self.state, new
            self.reason = reason
            if self._on_change is not None:
                self._on_change(old, new, reason)

    def _answered(self, reason: str) -> None:
        if self._gpu_fatal:
            return
        if self.state == probe_pb2.ENGINE_STATE_COLD or (
            self.state == probe_pb2.ENGINE_STATE_FAILED and not self._fatal_latched
        ):
            self._set(probe_pb2.ENGINE_STATE_WARMING, reason, "answered")

    def _refused(self, reason: str) -> None:
        self._fatal_latched = False
        if self.state in (probe_pb2.ENGINE_STATE_WARMING, probe_pb2.ENGINE_STATE_READY):
            self._set(probe_pb2.ENGINE_STATE_FAILED, reason, "refused")

    def _fatal(self, reason: str) -> None:
        self._fatal_latched = True
        self._set(probe_pb2.ENGINE_STATE_FAILED, reason, "fatal")

    def _failed(self, source: str, kind: probe_pb2.FailureKind, detail: str, http_status: int) -> None:
        """A failed request from ``source`` ("metrics" or "probe"): ENGINE_FATAL latches FAILED,
        CONNECT means the process is gone, any other failure with an HTTP answer means it is up."""
        if kind == probe_pb2.FAILURE_KIND_ENGINE_FATAL:
            self._fatal(f"{source}: {detail}")
        elif kind == probe_pb2.FAILURE_KIND_CONNECT:
            self._refused(f"{source}: {detail}")
        elif http_status:
            self._answered(f"{source} answered HTTP {http_status}")

    def observe_metrics(self, error: EngineRequestError | None) -> None:
        """Feed the result of one ``/metrics`` scrape (``None`` = success)."""
        if error is None:
            self._answered("metrics answered")
        else:
            self._failed("metrics", error.kind, error.detail, error.http_status)

    def observe_probe(self, outcome: ProbeOutcome) -> None:
        """Feed the outcome of one micro-probe (or of its model discovery)."""
        if outcome.ok:
            self._fatal_latched = False
            if not self._gpu_fatal:
                self._set(probe_pb2.ENGINE_STATE_READY, "probe ok", "probe_ok")
        else:
            self._failed("probe", outcome.failure, outcome.detail, outcome.http_status)

    def observe_restart(self, reason: str) -> None:
        """The engine restarted without us seeing it down (its counters went back): a READY
        engine goes back through WARMING."""
        if self.state == probe_pb2.ENGINE_STATE_READY and not self._gpu_fatal:
            self._set(probe_pb2.ENGINE_STATE_WARMING, reason, "restart")

    def observe_gpu(self, fatal_reason: str | None) -> None:
        """Feed the GPU verdict of one NVML collection (``None``: nothing fatal)."""
        if fatal_reason:
            self._gpu_fatal = fatal_reason
            self._set(probe_pb2.ENGINE_STATE_FAILED, f"gpu: {fatal_reason}", "gpu")
        elif self._gpu_fatal:
            self._gpu_fatal = None
            if self.state == probe_pb2.ENGINE_STATE_FAILED and not self._fatal_latched:
                self._set(probe_pb2.ENGINE_STATE_WARMING, "gpu fault cleared", "gpu")
