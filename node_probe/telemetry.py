"""GPU telemetry through NVML (``import pynvml``, from the ``nvidia-ml-py`` package).

:class:`GpuCollector` turns NVML readings into ``probe_pb2.GpuTelemetry``. A host without the
NVML library or driver is a reported state (``NVML_STATE_ABSENT``), not a crash, and every NVML
call is wrapped: a failing call is recorded in the reading's ``errors`` as ``"field: ErrorName"``
(e.g. ``"utilization: NotSupported"``) and the collector carries on with the next field and the
next GPU.

:meth:`GpuCollector.collect` is synchronous and may block inside the driver (NVML calls can hang
on a failing GPU), so the agent runs it in a dedicated worker thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from node_probe.proto import probe_pb2
from node_probe.xids import FATAL_XIDS

__all__ = ["FATAL_XIDS", "GpuCollector", "gpu_fatal_reason", "nvml_error_name"]

log = logging.getLogger(__name__)

# Errors that say "this field is not available here", not "the GPU is in trouble".
_BENIGN_ERRORS = frozenset({"NotSupported", "NoPermission", "FunctionNotFound", "NoData"})
# Init failures that mean "no NVIDIA GPU stack on this host".
_ABSENT_ERRORS = frozenset({"LibraryNotFound", "DriverNotLoaded"})

_MAX_XIDS_PER_COLLECT = 64

# MIG-query errors that only mean "this GPU has no MIG".
_NO_MIG_ERRORS = frozenset({"NotSupported", "FunctionNotFound", "InvalidArgument"})


def gpu_fatal_reason(
    tel: probe_pb2.GpuTelemetry, fatal_xids: frozenset[int] | set[int] = FATAL_XIDS
) -> str | None:
    """Why this GPU telemetry makes the engine unusable, or ``None``.

    Fatal: any NVML call that answered ``GpuIsLost`` (the GPU fell off the bus, typically after
    Xid 79), or a fatal Xid (``fatal_xids``, default :data:`FATAL_XIDS`) still inside the
    collector's Xid window.
    """
    if "GpuIsLost" in tel.error and not tel.gpus:
        return tel.error
    for g in tel.gpus:
        for err in g.errors:
            if err.endswith(": GpuIsLost"):
                return f"gpu {g.index}: GpuIsLost ({err.split(':', 1)[0]})"
        fatal = [x for x in g.xid_events if x in fatal_xids]
        if fatal:
            return f"gpu {g.index}: fatal Xid {fatal[-1]}"
    return None


def nvml_error_name(exc: BaseException) -> str:
    """Short name of an NVML error: ``NVMLError_GpuIsLost`` -> ``"GpuIsLost"``.

    Never calls into the NVML library (``str()`` of an NVMLError does, and can fail itself).
    """
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return name[len("NVMLError_") :]
    value = getattr(exc, "value", None)
    if name == "NVMLError" and value is not None:
        return f"NVMLError({value})"
    return name


class GpuCollector:
    """Reads per-GPU health from NVML.

    ``nvmlInit`` is called once, on the first :meth:`collect`. If it fails because there is no
    NVML library or driver (``LibraryNotFound``, ``DriverNotLoaded``, ``pynvml`` not importable),
    every collect reports ``NVML_STATE_ABSENT`` without retrying. Other init failures report
    ``NVML_STATE_ERROR`` and init is retried at most every ``init_retry_s`` seconds.

    Per GPU (index, uuid, name): memory total/used bytes (``nvmlDeviceGetMemoryInfo``),
    utilization ratio 0..1 (``nvmlDeviceGetUtilizationRates().gpu / 100``), temperature in
    degrees C, power in W (``nvmlDeviceGetPowerUsage`` mW / 1000), uncorrected volatile ECC
    count, clocks-event (throttle) reason bit mask (``nvmlDeviceGetCurrentClocksEventReasons``,
    falling back to the legacy ``...ThrottleReasons``) and Xid codes seen in the last
    ``xid_window_s`` seconds (critical-Xid event set, drained without blocking).

    MIG: on a GPU in MIG mode the memory reading comes from its MIG device handles (summed over
    the instances this process can see): the parent handle often answers NoPermission there,
    and its numbers would count other tenants' slices anyway. Utilization is NotSupported on MIG
    and stays unset (reported, never 0).

    Overall state: ``NVML_STATE_OK`` when every failed call was benign (NotSupported,
    NoPermission, FunctionNotFound, NoData: the field is just unavailable), otherwise
    ``NVML_STATE_ERROR`` with the serious errors in ``error`` (e.g. ``"gpu 0: GpuIsLost"``,
    ``"gpu 1: fatal Xid 79"``).

    Args:
        init_retry_s: seconds between init retries after a non-absent init failure.
        xid_window_s: how long an Xid stays in ``xid_events``, in seconds.
        watch_xids: register for critical Xid events (needs root on most hosts; failures are
            reported as ``"xid: ErrorName"``).
        fatal_xids: Xid codes reported as serious (``NVML_STATE_ERROR``).
        clock: monotonic clock (tests).

    Thread-safety: calls are serialised by an internal lock; use one collector per process.
    """

    def __init__(
        self,
        *,
        init_retry_s: float = 30.0,
        xid_window_s: float = 300.0,
        watch_xids: bool = True,
        fatal_xids: frozenset[int] | set[int] = FATAL_XIDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fatal_xids = frozenset(fatal_xids)
        self._init_retry_s = init_retry_s
        self._xid_window_s = xid_window_s
        self._watch_xids = watch_xids
        self._clock = clock
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._initialized = False
        self._absent_message: str | None = None
        self._init_error: str | None = None
        self._last_init_attempt: float | None = None
        self._event_set: Any = None
        self._xid_register_errors: dict[int, str] = {}
        self._xids: dict[int, deque[tuple[float, int]]] = {}

    # -- init / shutdown ----------------------------------------------------------------------

    def _try_init(self) -> None:
        now = self._clock()
        if self._last_init_attempt is not None and now - self._last_init_attempt < self._init_retry_s:
            return
        self._last_init_attempt = now
        try:
            import pynvml  # (optional at runtime: absent GPU stack is a state)
        except Exception as exc:  # ImportError, or a broken install
            self._absent_message = f"pynvml not importable: {type(exc).__name__}: {exc}"
            log.info("GPU telemetry: %s", self._absent_message)
            return
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            name = nvml_error_name(exc)
            if name in _ABSENT_ERRORS:
                self._absent_message = f"no NVML on this host: {name}"
                log.info("GPU telemetry: %s", self._absent_message)
            else:
                self._init_error = f"nvmlInit: {name}"
                log.warning("GPU telemetry: %s", self._init_error)
            return
        except Exception as exc:  # e.g. OSError from ctypes
            self._init_error = f"nvmlInit: {type(exc).__name__}: {exc}"
            log.warning("GPU telemetry: %s", self._init_error)
            return
        self._initialized = True
        self._init_error = None
        log.info("GPU telemetry: NVML initialised")

    def close(self) -> None:
        """Free the Xid event set and call ``nvmlShutdown`` (errors are ignored)."""
        with self._lock:
            if not self._initialized:
                return
            nvml = self._nvml
            if self._event_set is not None:
                try:
                    nvml.nvmlEventSetFree(self._event_set)
                except Exception:  # shutting down anyway
                    pass
                self._event_set = None
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
            self._initialized = False

    # -- collect ------------------------------------------------------------------------------

    def collect(self) -> probe_pb2.GpuTelemetry:
        """Read every GPU once and return the telemetry message. Blocking; never raises
        ``NVMLError`` (each failure is reported in the message instead)."""
        with self._lock:
            if not self._initialized and self._absent_message is None:
                self._try_init()
            if self._absent_message is not None:
                return probe_pb2.GpuTelemetry(
                    state=probe_pb2.NVML_STATE_ABSENT, error=self._absent_message
                )
            if not self._initialized:
                return probe_pb2.GpuTelemetry(
                    state=probe_pb2.NVML_STATE_ERROR, error=self._init_error or "NVML not initialised"
                )
            return self._collect_locked()

    def _call(self, errors: list[str], field: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            errors.append(f"{field}: {nvml_error_name(exc)}")
        except Exception as exc:  # a wrapper bug must not stop the collector
            errors.append(f"{field}: {type(exc).__name__}")
        return None

    def _collect_locked(self) -> probe_pb2.GpuTelemetry:
        nvml = self._nvml
        out = probe_pb2.GpuTelemetry(state=probe_pb2.NVML_STATE_OK)
        serious: list[str] = []
        count_errors: list[str] = []
        count = self._call(count_errors, "device_count", nvml.nvmlDeviceGetCount)
        if count is None:
            out.state = probe_pb2.NVML_STATE_ERROR
            out.error = count_errors[0]
            return out
        handles: dict[int, Any] = {}
        for index in range(int(count)):
            reading = out.gpus.add(index=index)
            errors: list[str] = []
            handle = self._call(errors, "handle", nvml.nvmlDeviceGetHandleByIndex, index)
            if handle is not None:
                handles[index] = handle
                self._read_gpu(nvml, handle, reading, errors)
            reading.errors.extend(errors)
            serious.extend(
                f"gpu {index}: {e.split(': ', 1)[-1]}"
                for e in errors
                if e.split(": ", 1)[-1] not in _BENIGN_ERRORS
            )
        if self._watch_xids:
            self._drain_xids(nvml, handles, out)
            for reading in out.gpus:
                serious.extend(
                    f"gpu {reading.index}: fatal Xid {x}"
                    for x in dict.fromkeys(reading.xid_events)
                    if x in self._fatal_xids
                )
        if serious:
            out.state = probe_pb2.NVML_STATE_ERROR
            out.error = "; ".join(dict.fromkeys(serious))
        return out

    def _read_gpu(self, nvml: Any, handle: Any, reading: Any, errors: list[str]) -> None:
        uuid = self._call(errors, "uuid", nvml.nvmlDeviceGetUUID, handle)
        if uuid is not None:
            reading.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        name = self._call(errors, "name", nvml.nvmlDeviceGetName, handle)
        if name is not None:
            reading.name = name.decode() if isinstance(name, bytes) else str(name)

        mem = self._call(errors, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        if mem is not None:
            reading.memory_total_bytes = int(mem.total)
            reading.memory_used_bytes = int(mem.used)
        mig = self._mig_handles(nvml, handle, errors)
        if mig:
            total = used = 0
            read_any = False
            for i, mig_handle in mig:
                mig_mem = self._call(errors, f"mig {i} memory", nvml.nvmlDeviceGetMemoryInfo, mig_handle)
                if mig_mem is not None:
                    total += int(mig_mem.total)
                    used += int(mig_mem.used)
                    read_any = True
            if read_any:
                reading.memory_total_bytes = total
                reading.memory_used_bytes = used
        util = self._call(errors, "utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
        if util is not None:
            reading.utilization_ratio = float(util.gpu) / 100.0
        temp = self._call(
            errors, "temperature", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
        )
        if temp is not None:
            reading.temperature_c = float(temp)
        power_mw = self._call(errors, "power", nvml.nvmlDeviceGetPowerUsage, handle)
        if power_mw is not None:
            reading.power_w = float(power_mw) / 1000.0
        ecc = self._call(
            errors,
            "ecc",
            nvml.nvmlDeviceGetTotalEccErrors,
            handle,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        if ecc is not None:
            reading.ecc_uncorrected = int(ecc)
        reasons = self._throttle_reasons(nvml, handle, errors)
        if reasons is not None:
            reading.throttle_reasons = int(reasons)

    def _mig_handles(self, nvml: Any, handle: Any, errors: list[str]) -> list[tuple[int, Any]]:
        """MIG device handles of a GPU in MIG mode (empty when MIG is off or unsupported)."""
        get_mode = getattr(nvml, "nvmlDeviceGetMigMode", None)
        if get_mode is None:
            return []
        try:
            current, _pending = get_mode(handle)
        except self._nvml.NVMLError as exc:
            name = nvml_error_name(exc)
            if name not in _NO_MIG_ERRORS:
                errors.append(f"mig: {name}")
            return []
        except Exception:  # e.g. a handle this pynvml cannot pass to C
            return []
        if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        count = self._call(errors, "mig", nvml.nvmlDeviceGetMaxMigDeviceCount, handle)
        out: list[tuple[int, Any]] = []
        for i in range(int(count or 0)):
            try:
                out.append((i, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)))
            except self._nvml.NVMLError as exc:
                name = nvml_error_name(exc)
                if name != "NotFound":  # an empty MIG slot
                    errors.append(f"mig {i}: {name}")
            except Exception as exc:
                errors.append(f"mig {i}: {type(exc).__name__}")
        return out

    def _throttle_reasons(self, nvml: Any, handle: Any, errors: list[str]) -> int | None:
        new_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        legacy_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        if new_fn is not None:
            probe_errors: list[str] = []
            value = self._call(probe_errors, "throttle", new_fn, handle)
            if value is not None:
                return value
            # Old drivers lack the new entry point: try the legacy name before reporting.
            if legacy_fn is None or not probe_errors[0].endswith("FunctionNotFound"):
                errors.extend(probe_errors)
                return None
        if legacy_fn is None:
            errors.append("throttle: FunctionNotFound")
            return None
        return self._call(errors, "throttle", legacy_fn, handle)

    # -- Xid events ---------------------------------------------------------------------------

    def _drain_xids(self, nvml: Any, handles: dict[int, Any], out: Any) -> None:
        if self._event_set is None and not self._xid_register_errors:
            self._register_xids(nvml, handles)
        now = self._clock()
        if self._event_set is not None:
            for _ in range(_MAX_XIDS_PER_COLLECT):
                try:
                    data = nvml.nvmlEventSetWait_v2(self._event_set, 0)
                except nvml.NVMLError:
                    break  # Timeout = no pending event; anything else: try again next time
                except Exception:
                    break
                index = self._event_index(nvml, data, handles)
                if index is not None:
                    self._xids.setdefault(index, deque(maxlen=32)).append((now, int(data.eventData)))
        for reading in out.gpus:
            if reading.index in self._xid_register_errors:
                reading.errors.append(f"xid: {self._xid_register_errors[reading.index]}")
            recent = self._xids.get(reading.index)
            if recent:
                while recent and now - recent[0][0] > self._xid_window_s:
                    recent.popleft()
                reading.xid_events.extend(code for _, code in recent)

    def _register_xids(self, nvml: Any, handles: dict[int, Any]) -> None:
        try:
            event_set = nvml.nvmlEventSetCreate()
        except Exception as exc:
            for index in handles:
                self._xid_register_errors[index] = _short(nvml, exc)
            return
        registered = False
        for index, handle in handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
                registered = True
            except Exception as exc:
                self._xid_register_errors[index] = _short(nvml, exc)
        if registered:
            self._event_set = event_set
        else:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception:
                pass
            if not handles:
                self._xid_register_errors[-1] = "no devices"

    @staticmethod
    def _event_index(nvml: Any, data: Any, handles: dict[int, Any]) -> int | None:
        device = getattr(data, "device", None)
        for index, handle in handles.items():
            if handle is device:
                return index
        try:
            return int(nvml.nvmlDeviceGetIndex(device))
        except Exception:
            return None


def _short(nvml: Any, exc: BaseException) -> str:
    if isinstance(exc, nvml.NVMLError):
        return nvml_error_name(exc)
    return type(exc).__name__
