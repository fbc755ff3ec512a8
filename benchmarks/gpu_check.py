"""Print every NVML reading node_probe uses, on a real GPU, then the agent's GpuTelemetry message.

Usage: python benchmarks/gpu_check.py        (from the repository root, with the project installed
                                              or its dependencies importable: nvidia-ml-py, protobuf)

For each GPU: name, UUID, PCI bus, memory (v1 and v2), utilization, temperature, power and its
limit, ECC mode and uncorrected volatile/aggregate counts, remapped rows, retired pages pending,
clocks-event (throttle) reasons decoded, SM/memory clocks, P-state, PCIe replays, MIG mode and
each MIG instance's memory. Each call's error is printed by name (NotSupported, NoPermission,
GpuIsLost...) and never stops the script. Then it registers for critical Xid events (what the
agent does), runs node_probe's GpuCollector twice (timing each collect) and prints its message
and the fatal verdict the agent would act on.

Exit status: 0 = NVML answered and the collector read every GPU without a serious error;
1 = a serious error (e.g. GpuIsLost, a fatal Xid); 2 = no NVML on this host (nothing to check).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_probe.telemetry import FATAL_XIDS, GpuCollector, gpu_fatal_reason, nvml_error_name

_REASONS = (
    ("GpuIdle", 0x1), ("ApplicationsClocksSetting", 0x2), ("SwPowerCap", 0x4), ("HwSlowdown", 0x8),
    ("SyncBoost", 0x10), ("SwThermalSlowdown", 0x20), ("HwThermalSlowdown", 0x40),
    ("HwPowerBrakeSlowdown", 0x80), ("DisplayClockSetting", 0x100),
)


def decode_reasons(mask: int) -> str:
    names = [name for name, bit in _REASONS if mask & bit]
    return f"0x{mask:x} ({', '.join(names) or 'none'})"


def call(nvml, label: str, fn_name: str, *args, fmt=lambda v: v):
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        print(f"    {label:<28} (not in this pynvml)")
        return None
    try:
        value = fn(*args)
    except Exception as exc:  # every failure is a reading here
        print(f"    {label:<28} ERROR {nvml_error_name(exc)}")
        return None
    try:
        shown = fmt(value)
    except Exception:
        shown = value
    print(f"    {label:<28} {shown}")
    return value


def text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def mib(v) -> str:
    return f"total {v.total / 2**20:.0f} MiB, used {v.used / 2**20:.0f} MiB, free {v.free / 2**20:.0f} MiB"


def print_gpu(nvml, i: int) -> None:
    print(f"\n== GPU {i}")
    h = call(nvml, "handle", "nvmlDeviceGetHandleByIndex", i, fmt=lambda v: "ok")
    if h is None:
        return
    call(nvml, "name", "nvmlDeviceGetName", h, fmt=text)
    call(nvml, "uuid", "nvmlDeviceGetUUID", h, fmt=text)
    call(nvml, "pci bus id", "nvmlDeviceGetPciInfo", h, fmt=lambda v: text(v.busId))
    call(nvml, "memory", "nvmlDeviceGetMemoryInfo", h, fmt=mib)
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        call(nvml, "memory (v2)", "nvmlDeviceGetMemoryInfo", h, v2,
             fmt=lambda v: mib(v) + f", reserved {getattr(v, 'reserved', 0) / 2**20:.0f} MiB")
    call(nvml, "utilization", "nvmlDeviceGetUtilizationRates", h,
         fmt=lambda v: f"gpu {v.gpu} %, memory {v.memory} %")
    call(nvml, "temperature C", "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)
    call(nvml, "power W", "nvmlDeviceGetPowerUsage", h, fmt=lambda v: f"{v / 1000:.1f}")
    call(nvml, "power limit W", "nvmlDeviceGetEnforcedPowerLimit", h, fmt=lambda v: f"{v / 1000:.1f}")
    call(nvml, "ecc mode (current, pending)", "nvmlDeviceGetEccMode", h)
    call(nvml, "ecc uncorrected volatile", "nvmlDeviceGetTotalEccErrors", h,
         nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    call(nvml, "ecc uncorrected aggregate", "nvmlDeviceGetTotalEccErrors", h,
         nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_AGGREGATE_ECC)
    call(nvml, "remapped rows (c,u,pend,fail)", "nvmlDeviceGetRemappedRows", h)
    call(nvml, "retired pages pending", "nvmlDeviceGetRetiredPagesPendingStatus", h)
    call(nvml, "clocks-event reasons", "nvmlDeviceGetCurrentClocksEventReasons", h, fmt=decode_reasons)
    call(nvml, "throttle reasons (legacy)", "nvmlDeviceGetCurrentClocksThrottleReasons", h, fmt=decode_reasons)
    call(nvml, "sm clock MHz", "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM)
    call(nvml, "memory clock MHz", "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_MEM)
    call(nvml, "p-state", "nvmlDeviceGetPerformanceState", h)
    call(nvml, "pcie replay counter", "nvmlDeviceGetPcieReplayCounter", h)
    call(nvml, "compute processes", "nvmlDeviceGetComputeRunningProcesses", h,
         fmt=lambda v: [(p.pid, f"{(p.usedGpuMemory or 0) / 2**20:.0f} MiB") for p in v])
    mode = call(nvml, "mig mode (current, pending)", "nvmlDeviceGetMigMode", h)
    if mode and mode[0] == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        count = call(nvml, "mig max devices", "nvmlDeviceGetMaxMigDeviceCount", h) or 0
        for j in range(count):
            try:
                mh = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except Exception as exc:
                if nvml_error_name(exc) != "NotFound":
                    print(f"    mig {j:<24} ERROR {nvml_error_name(exc)}")
                continue
            call(nvml, f"mig {j} uuid", "nvmlDeviceGetUUID", mh, fmt=text)
            call(nvml, f"mig {j} memory", "nvmlDeviceGetMemoryInfo", mh, fmt=mib)
            call(nvml, f"mig {j} utilization", "nvmlDeviceGetUtilizationRates", mh,
                 fmt=lambda v: f"gpu {v.gpu} %")


def check_xid_registration(nvml, n: int) -> None:
    print("\n== Xid events (critical), as the agent registers them")
    try:
        es = nvml.nvmlEventSetCreate()
    except Exception as exc:
        print(f"    event set                    ERROR {nvml_error_name(exc)}")
        return
    try:
        for i in range(n):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, es)
                print(f"    gpu {i} registered")
            except Exception as exc:
                print(f"    gpu {i} register             ERROR {nvml_error_name(exc)}")
        try:
            data = nvml.nvmlEventSetWait_v2(es, 0)
            print(f"    pending event: Xid {data.eventData}")
        except Exception as exc:
            print(f"    wait(0)                      {nvml_error_name(exc)} (Timeout = no pending event)")
    finally:
        try:
            nvml.nvmlEventSetFree(es)
        except Exception:
            pass


def main() -> int:
    try:
        import pynvml as nvml
    except Exception as exc:
        print(f"pynvml not importable ({type(exc).__name__}: {exc}): install nvidia-ml-py")
        return 2
    try:
        nvml.nvmlInit()
    except Exception as exc:
        print(f"nvmlInit failed: {nvml_error_name(exc)} -- no NVML/driver on this host, nothing to check")
        return 2
    try:
        print("== system")
        call(nvml, "driver version", "nvmlSystemGetDriverVersion", fmt=text)
        call(nvml, "nvml version", "nvmlSystemGetNVMLVersion", fmt=text)
        call(nvml, "cuda driver version", "nvmlSystemGetCudaDriverVersion")
        n = call(nvml, "device count", "nvmlDeviceGetCount") or 0
        for i in range(n):
            print_gpu(nvml, i)
        check_xid_registration(nvml, n)
    finally:
        nvml.nvmlShutdown()

    print("\n== node_probe GpuCollector (what each heartbeat carries)")
    collector = GpuCollector()
    times = []
    tel = None
    for _ in range(3):
        t0 = time.perf_counter()
        tel = collector.collect()
        times.append((time.perf_counter() - t0) * 1000)
    collector.close()
    print(tel)
    print(f"collect() took {', '.join(f'{t:.2f}' for t in times)} ms (first includes nvmlInit)")
    fatal = gpu_fatal_reason(tel, FATAL_XIDS)
    print(f"fatal verdict (engine FAILED if set): {fatal or 'none'}")
    from node_probe.proto import probe_pb2

    if tel.state == probe_pb2.NVML_STATE_ABSENT:
        return 2
    if tel.state != probe_pb2.NVML_STATE_OK or fatal or not tel.gpus:
        print(f"NOT OK: state {probe_pb2.NvmlState.Name(tel.state)} {tel.error}")
        return 1
    print(f"OK: {len(tel.gpus)} GPU(s) read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
