"""Tests for node_probe.telemetry with pynvml functions faked (no GPU on this machine)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pynvml
import pytest

from node_probe.proto import probe_pb2
from node_probe.telemetry import FATAL_XIDS, GpuCollector, gpu_fatal_reason, nvml_error_name


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeGpus:
    """Installs fake NVML entry points for ``n`` healthy GPUs; tests override single calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int = 2) -> None:
        self.n = n
        self.init_calls = 0
        self.handles = [SimpleNamespace(index=i) for i in range(n)]
        self.events: list[SimpleNamespace] = []
        self.registered: list[int] = []
        mp = monkeypatch

        def init() -> None:
            self.init_calls += 1

        mp.setattr(pynvml, "nvmlInit", init)
        mp.setattr(pynvml, "nvmlShutdown", lambda: None)
        mp.setattr(pynvml, "nvmlDeviceGetCount", lambda: self.n)
        mp.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: self.handles[i])
        mp.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-{h.index:04d}")
        mp.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA H200")
        mp.setattr(
            pynvml,
            "nvmlDeviceGetMemoryInfo",
            lambda h: SimpleNamespace(total=150_000_000_000, used=30_000_000_000 + h.index, free=0),
        )
        mp.setattr(pynvml, "nvmlDeviceGetUtilizationRates", lambda h: SimpleNamespace(gpu=87, memory=40))
        mp.setattr(pynvml, "nvmlDeviceGetTemperature", lambda h, sensor: 61)
        mp.setattr(pynvml, "nvmlDeviceGetPowerUsage", lambda h: 412_345)
        mp.setattr(pynvml, "nvmlDeviceGetTotalEccErrors", lambda h, kind, counter: 0)
        mp.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", lambda h: 0x4 | 0x1)
        mp.setattr(pynvml, "nvmlEventSetCreate", lambda: "event-set")
        mp.setattr(pynvml, "nvmlEventSetFree", lambda s: None)
        mp.setattr(pynvml, "nvmlDeviceGetIndex", lambda h: h.index)
        # MIG off unless a test turns it on (a real nvmlDeviceGetMigMode would need NVML).
        self.mig: dict[int, list[SimpleNamespace]] = {}
        mp.setattr(pynvml, "nvmlDeviceGetMigMode",
                   lambda h: (1, 1) if h.index in self.mig else (0, 0))
        mp.setattr(pynvml, "nvmlDeviceGetMaxMigDeviceCount", lambda h: 7)

        def mig_handle(h, i):
            slots = self.mig.get(h.index, [])
            if i >= len(slots):
                raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
            return slots[i]

        mp.setattr(pynvml, "nvmlDeviceGetMigDeviceHandleByIndex", mig_handle)

        def register(h, types, event_set) -> None:
            self.registered.append(h.index)

        def wait(event_set, timeout_ms):
            assert timeout_ms == 0  # never blocks the collector
            if self.events:
                return self.events.pop(0)
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)

        mp.setattr(pynvml, "nvmlDeviceRegisterEvents", register)
        mp.setattr(pynvml, "nvmlEventSetWait_v2", wait)


def test_error_names():
    assert nvml_error_name(nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)) == "GpuIsLost"
    assert nvml_error_name(nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)) == "NotSupported"
    assert nvml_error_name(nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)) == "NoPermission"


def test_absent_library(monkeypatch):
    def init() -> None:
        raise nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", init)
    c = GpuCollector()
    t = c.collect()
    assert t.state == probe_pb2.NVML_STATE_ABSENT
    assert "LibraryNotFound" in t.error
    assert len(t.gpus) == 0
    assert c.collect().state == probe_pb2.NVML_STATE_ABSENT  # stable, no crash
    c.close()


def test_driver_not_loaded_is_absent(monkeypatch):
    def init() -> None:
        raise nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", init)
    t = GpuCollector().collect()
    assert t.state == probe_pb2.NVML_STATE_ABSENT and "DriverNotLoaded" in t.error


def test_pynvml_not_importable_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    t = GpuCollector().collect()
    assert t.state == probe_pb2.NVML_STATE_ABSENT
    assert "pynvml" in t.error


def test_other_init_failure_is_error_and_retried(monkeypatch):
    calls = []

    def init() -> None:
        calls.append(1)
        raise nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlInit", init)
    now = [100.0]
    c = GpuCollector(init_retry_s=30.0, clock=lambda: now[0])
    t = c.collect()
    assert t.state == probe_pb2.NVML_STATE_ERROR and "nvmlInit" in t.error
    c.collect()
    assert len(calls) == 1  # not retried every collect
    now[0] += 31
    c.collect()
    assert len(calls) == 2


def test_normal_gpus(monkeypatch):
    fake = FakeGpus(monkeypatch, n=2)
    c = GpuCollector()
    t = c.collect()
    c.collect()
    assert fake.init_calls == 1  # nvmlInit once
    assert t.state == probe_pb2.NVML_STATE_OK, t.error
    assert [g.index for g in t.gpus] == [0, 1]
    g = t.gpus[1]
    assert g.uuid == "GPU-0001" and g.name == "NVIDIA H200"
    assert g.memory_total_bytes == 150_000_000_000
    assert g.memory_used_bytes == 30_000_000_001
    assert g.utilization_ratio == pytest.approx(0.87)
    assert g.temperature_c == 61.0
    assert g.power_w == pytest.approx(412.345)
    assert g.HasField("ecc_uncorrected") and g.ecc_uncorrected == 0
    assert g.throttle_reasons == 0x5
    assert list(g.errors) == []
    assert fake.registered == [0, 1]
    c.close()


def test_not_supported_and_no_permission_fields_unavailable(monkeypatch):
    FakeGpus(monkeypatch, n=2)

    def util(h):
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def mem(h):
        if h.index == 0:
            raise nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
        return SimpleNamespace(total=10, used=4, free=6)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", util)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", mem)
    t = GpuCollector().collect()
    assert t.state == probe_pb2.NVML_STATE_OK  # benign: fields just unavailable
    g0, g1 = t.gpus
    assert not g0.HasField("utilization_ratio")
    assert not g0.HasField("memory_total_bytes") and not g0.HasField("memory_used_bytes")
    assert "utilization: NotSupported" in g0.errors
    assert "memory: NoPermission" in g0.errors
    # the collector kept going: other fields and the next GPU are read
    assert g0.temperature_c == 61.0 and g0.power_w == pytest.approx(412.345)
    assert g1.memory_used_bytes == 4
    assert list(g1.errors) == ["utilization: NotSupported"]


def test_gpu_is_lost(monkeypatch):
    FakeGpus(monkeypatch, n=2)

    def lost(*args):
        raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)

    orig_mem = pynvml.nvmlDeviceGetMemoryInfo
    for name in ("nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetUtilizationRates",
                 "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors",
                 "nvmlDeviceGetCurrentClocksEventReasons"):
        orig = getattr(pynvml, name)
        monkeypatch.setattr(pynvml, name, lambda h, *a, _o=orig: lost() if h.index == 1 else _o(h, *a))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: lost() if h.index == 1 else orig_mem(h))
    t = GpuCollector().collect()
    assert t.state == probe_pb2.NVML_STATE_ERROR
    assert "gpu 1: GpuIsLost" in t.error
    g0, g1 = t.gpus
    assert g0.memory_total_bytes == 150_000_000_000 and list(g0.errors) == []
    assert "memory: GpuIsLost" in g1.errors
    assert not g1.HasField("memory_total_bytes")


def test_handle_lost(monkeypatch):
    FakeGpus(monkeypatch, n=1)

    def handle(i):
        raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    t = GpuCollector().collect()
    assert t.state == probe_pb2.NVML_STATE_ERROR
    assert list(t.gpus[0].errors) == ["handle: GpuIsLost"]


def test_throttle_falls_back_to_legacy_name(monkeypatch):
    FakeGpus(monkeypatch, n=1)

    def missing(h):
        raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", missing)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", lambda h: 0x40)
    t = GpuCollector().collect()
    assert t.gpus[0].throttle_reasons == 0x40
    assert list(t.gpus[0].errors) == []

    monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
    t = GpuCollector().collect()
    assert t.gpus[0].throttle_reasons == 0x40


def test_xid_events_reported_within_window(monkeypatch):
    fake = FakeGpus(monkeypatch, n=2)
    now = [0.0]
    c = GpuCollector(xid_window_s=60.0, clock=lambda: now[0])
    c.collect()  # registers
    fake.events.append(SimpleNamespace(device=fake.handles[1], eventData=79, eventType=0))
    t = c.collect()
    assert list(t.gpus[1].xid_events) == [79]
    assert list(t.gpus[0].xid_events) == []
    now[0] += 61
    assert list(c.collect().gpus[1].xid_events) == []


def test_xid_registration_not_supported_is_reported_not_fatal(monkeypatch):
    FakeGpus(monkeypatch, n=1)

    def register(h, types, event_set):
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceRegisterEvents", register)
    t = GpuCollector().collect()
    assert t.state == probe_pb2.NVML_STATE_OK
    assert "xid: NotSupported" in t.gpus[0].errors


def test_device_count_failure_is_error(monkeypatch):
    FakeGpus(monkeypatch, n=1)

    def count():
        raise nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", count)
    t = GpuCollector().collect()
    assert t.state == probe_pb2.NVML_STATE_ERROR and t.error.startswith("device_count:")


# ---------------------------------------------------------------------------------------------
# MIG, fatal Xids, every error kind


def test_mig_slice_memory_is_read_from_the_mig_handle(monkeypatch):
    """fc11: MIG on; the parent handle's memory query raises NoPermission and utilization is
    NotSupported; the MIG handle reports 19968 MiB total, 14366 MiB used. The reading carries
    the MIG memory (used ratio ~0.72), utilization unset (unavailable, reported), state OK, and
    the collector keeps running."""
    fake = FakeGpus(monkeypatch, n=1)
    mib = 1024 * 1024
    mig = SimpleNamespace(index=100)
    fake.mig[0] = [mig]

    def mem(h):
        if h is mig:
            return SimpleNamespace(total=19968 * mib, used=14366 * mib, free=5602 * mib)
        raise nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)

    def util(h):
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", mem)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", util)
    c = GpuCollector()
    for _ in range(3):  # keeps running
        t = c.collect()
    assert t.state == probe_pb2.NVML_STATE_OK, t.error
    g = t.gpus[0]
    assert g.memory_total_bytes == 19968 * mib and g.memory_used_bytes == 14366 * mib
    assert g.memory_used_bytes / g.memory_total_bytes == pytest.approx(0.72, abs=0.005)
    assert not g.HasField("utilization_ratio")
    assert "utilization: NotSupported" in g.errors and "memory: NoPermission" in g.errors
    assert gpu_fatal_reason(t) is None


def test_mig_two_instances_summed_and_empty_slots_skipped(monkeypatch):
    fake = FakeGpus(monkeypatch, n=1)
    a, b = SimpleNamespace(index=101), SimpleNamespace(index=102)
    fake.mig[0] = [a, b]
    orig = pynvml.nvmlDeviceGetMemoryInfo
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda h: SimpleNamespace(total=10, used=h.index - 100, free=0) if h in (a, b) else orig(h))
    g = GpuCollector().collect().gpus[0]
    assert (g.memory_total_bytes, g.memory_used_bytes) == (20, 3)
    assert list(g.errors) == []  # NotFound for the 5 empty MIG slots is not an error


def test_fatal_xid_is_error_and_fatal_reason(monkeypatch):
    fake = FakeGpus(monkeypatch, n=2)
    c = GpuCollector()
    c.collect()
    fake.events.append(SimpleNamespace(device=fake.handles[0], eventData=13, eventType=0))
    t = c.collect()
    assert t.state == probe_pb2.NVML_STATE_OK and list(t.gpus[0].xid_events) == [13]
    assert gpu_fatal_reason(t) is None  # Xid 13 (graphics engine exception): not fatal
    for xid in sorted(FATAL_XIDS):
        fake.events.append(SimpleNamespace(device=fake.handles[1], eventData=xid, eventType=0))
    t = c.collect()
    assert t.state == probe_pb2.NVML_STATE_ERROR
    assert "gpu 1: fatal Xid 79" in t.error and "gpu 1: fatal Xid 48" in t.error
    assert gpu_fatal_reason(t) == "gpu 1: fatal Xid 95"
    assert FATAL_XIDS == {48, 63, 64, 74, 79, 94, 95}
    custom = GpuCollector(fatal_xids={13})
    custom.collect()
    fake.events.append(SimpleNamespace(device=fake.handles[0], eventData=13, eventType=0))
    assert "gpu 0: fatal Xid 13" in custom.collect().error


def test_gpu_is_lost_is_fatal_reason(monkeypatch):
    FakeGpus(monkeypatch, n=1)

    def lost(h, *a):
        raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", lost)
    t = GpuCollector().collect()
    assert gpu_fatal_reason(t) == "gpu 0: GpuIsLost (temperature)"
    assert t.gpus[0].memory_total_bytes == 150_000_000_000  # the other fields still read


@pytest.mark.parametrize("code,name,serious", [
    (pynvml.NVML_ERROR_NOT_SUPPORTED, "NotSupported", False),
    (pynvml.NVML_ERROR_NO_PERMISSION, "NoPermission", False),
    (pynvml.NVML_ERROR_GPU_IS_LOST, "GpuIsLost", True),
    (pynvml.NVML_ERROR_UNKNOWN, "Unknown", True),
    (pynvml.NVML_ERROR_TIMEOUT, "Timeout", True),
])
@pytest.mark.parametrize("fn,field_", [
    ("nvmlDeviceGetPowerUsage", "power"),
    ("nvmlDeviceGetTotalEccErrors", "ecc"),
    ("nvmlDeviceGetCurrentClocksEventReasons", "throttle"),
    ("nvmlDeviceGetMemoryInfo", "memory"),
])
def test_every_error_kind_on_every_call_is_reported_and_collector_continues(
        monkeypatch, code, name, serious, fn, field_):
    FakeGpus(monkeypatch, n=2)

    def boom(h, *a):
        if h.index == 0:
            raise nvml_error(code)
        return {"nvmlDeviceGetPowerUsage": 1000, "nvmlDeviceGetTotalEccErrors": 2,
                "nvmlDeviceGetCurrentClocksEventReasons": 0x20,
                "nvmlDeviceGetMemoryInfo": SimpleNamespace(total=8, used=2, free=6)}[fn]

    monkeypatch.setattr(pynvml, fn, boom)
    c = GpuCollector()
    t = c.collect()
    g0, g1 = t.gpus
    assert f"{field_}: {name}" in g0.errors
    assert g0.temperature_c == 61.0  # later fields on the same GPU still read
    assert list(g1.errors) == []  # and the next GPU
    assert (t.state == probe_pb2.NVML_STATE_ERROR) == serious
    assert (f"gpu 0: {name}" in t.error) == serious
    assert c.collect().gpus[1].temperature_c == 61.0  # the next collect works too


def test_non_nvml_exception_in_a_call_is_reported(monkeypatch):
    FakeGpus(monkeypatch, n=1)

    def broken(h):
        raise RuntimeError("wrapper bug")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", broken)
    t = GpuCollector().collect()
    assert "power: RuntimeError" in t.gpus[0].errors and t.gpus[0].temperature_c == 61.0


def test_gpu_check_script_runs_on_faked_nvml(monkeypatch, capsys):
    """benchmarks/gpu_check.py (for a machine with a GPU) prints every reading and the agent's
    message; here against faked NVML calls (unfaked ones answer Uninitialized, printed)."""
    import importlib.util
    from pathlib import Path

    fake = FakeGpus(monkeypatch, n=2)
    fake.mig[1] = [SimpleNamespace(index=200)]
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main() == 0
    out = capsys.readouterr().out
    assert "== GPU 1" in out and "power W" in out and "412.3" in out
    assert "0x5 (GpuIdle, SwPowerCap)" in out and "mig 0 memory" in out
    assert "gpu 0 registered" in out and "OK: 2 GPU(s) read" in out
    assert "pci bus id" in out and "ERROR" in out  # unfaked calls: reported, not fatal
    # a lost GPU makes it fail (exit 1), with the verdict printed
    def lost(h, *a):
        raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", lost)
    assert mod.main() == 1
    assert "fatal verdict (engine FAILED if set): gpu 0: GpuIsLost (power)" in capsys.readouterr().out


def test_control_plane_default_fatal_xids_come_from_the_agent_list():
    # One home: node_probe.xids.FATAL_XIDS; the control plane's config default reads it.
    from xds_server.config import HealthConfig

    assert HealthConfig().load.fatal_xids == sorted(FATAL_XIDS) == [48, 63, 64, 74, 79, 94, 95]
