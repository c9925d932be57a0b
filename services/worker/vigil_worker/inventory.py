"""What this node has, and how it is doing: NVML on an NVIDIA node, amdsmi on an AMD node (`amd`),
CPU slots otherwise.

The backend is chosen at start (`settings.gpu_backend`): "auto" takes NVML when it initialises with a
device, else amdsmi, else CPU slots; "nvml", "amdsmi" or "cpu" force one (a forced GPU backend that
finds no GPU is a configuration error, not a quiet fallback to CPU).

On a node without GPUs the worker offers `settings.cpu_slots` slots of kind "cpu", never passed off as
GPUs; their samples carry what can honestly be measured (the CPU use and resident memory of the rank
running on the slot), with the GPU-only fields left None.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vigil.errors import ConfigError
from vigil.events import Device, GpuSampled
from vigil_worker.amd import AmdGpus, open_amdsmi

log = logging.getLogger(__name__)

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _nvml() -> Any | None:
    """pynvml, initialised, or None where there is no NVIDIA driver or GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            pynvml.nvmlShutdown()
            return None
        return pynvml
    except Exception:  # no library, no driver, no device: a CPU node
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvlink_peers(nv: Any, handle: Any, index_of_pci: dict[str, int]) -> list[int]:
    peers: set[int] = set()
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                continue
            pci = _text(nv.nvmlDeviceGetNvLinkRemotePciInfo_v2(handle, link).busId).lower()
        except Exception:
            continue
        if pci in index_of_pci:
            peers.add(index_of_pci[pci])
    return sorted(peers)


@dataclass
class Inventory:
    """The node's devices and a sampler for them."""

    devices: list[Device]
    kind: str  # "gpu" or "cpu"
    _nv: Any = None
    _handles: list[Any] = field(default_factory=list)
    _amd: AmdGpus | None = None
    _cpu_prev: dict[int, tuple[float, float]] = field(default_factory=dict)  # pid -> (cpu s, wall s)

    @classmethod
    def discover(cls, cpu_slots: int, node: str, backend: str = "auto") -> Inventory:
        nv = _nvml() if backend in ("auto", "nvml") else None
        if nv is None and backend in ("auto", "amdsmi") and (smi := open_amdsmi()) is not None:
            amd = AmdGpus(smi)
            return cls(devices=amd.devices(), kind="gpu", _amd=amd)
        if nv is None and backend in ("nvml", "amdsmi"):
            raise ConfigError(
                f"VIGIL_GPU_BACKEND={backend}: no GPU found through it (driver, library, devices?); "
                "use auto to fall back to CPU slots"
            )
        if nv is None:
            total = _PAGE * os.sysconf("SC_PHYS_PAGES")
            devices = [
                Device(
                    index=i,
                    kind="cpu",
                    name=f"cpu-slot-{i}",
                    uuid=f"cpu-{node}-{i}",
                    memory_bytes=total // cpu_slots,
                )
                for i in range(cpu_slots)
            ]
            return cls(devices=devices, kind="cpu")
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        pci = {_text(nv.nvmlDeviceGetPciInfo(h).busId).lower(): i for i, h in enumerate(handles)}
        devices = [
            Device(
                index=i,
                kind="gpu",
                name=_text(nv.nvmlDeviceGetName(h)),
                uuid=_text(nv.nvmlDeviceGetUUID(h)),
                memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(h).total),
                nvlink_peers=_nvlink_peers(nv, h, pci),
            )
            for i, h in enumerate(handles)
        ]
        return cls(devices=devices, kind="gpu", _nv=nv, _handles=handles)

    def sample(self, node: str, rank_on: Callable[[int], tuple[int, str, int] | None]) -> list[GpuSampled]:
        """One sample per device. `rank_on(index)` is (pid, job id, attempt) of the rank on it, if any."""
        out = []
        for d in self.devices:
            running = rank_on(d.index)
            pid = running[0] if running else None
            if self._nv is not None:
                s = self._gpu_sample(node, d)
            elif self._amd is not None:
                s = self._amd.sample(node, d)
            else:
                s = self._cpu_sample(node, d, pid)
            if running:
                s = s.model_copy(update={"job_id": running[1], "attempt": running[2]})
            out.append(s)
        return out

    def _gpu_sample(self, node: str, d: Device) -> GpuSampled:
        nv, h = self._nv, self._handles[d.index]

        def q(fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except Exception:  # a field this GPU or driver does not report
                return None

        util = q(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = q(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        reasons = q(lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h))
        if reasons is None:
            reasons = q(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        names = {
            "gpu_idle": 0x1,
            "applications_clocks": 0x2,
            "sw_power_cap": 0x4,
            "hw_slowdown": 0x8,
            "sync_boost": 0x10,
            "sw_thermal": 0x20,
            "hw_thermal": 0x40,
            "hw_power_brake": 0x80,
        }
        ecc = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        power_mw = q(lambda: nv.nvmlDeviceGetPowerUsage(h))
        return GpuSampled(
            node=node,
            index=d.index,
            device_kind="gpu",
            uuid=d.uuid,
            utilization_pct=float(util.gpu) if util is not None else None,
            memory_used_bytes=int(mem.used) if mem is not None else None,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            temperature_c=q(lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            sm_clock_mhz=q(lambda: int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
            mem_clock_mhz=q(lambda: int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))),
            throttle_reasons=[n for n, bit in names.items() if reasons and reasons & bit],
            ecc_corrected=q(lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, ecc[0], nv.NVML_VOLATILE_ECC))),
            ecc_uncorrected=q(lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, ecc[1], nv.NVML_VOLATILE_ECC))),
            xid=None,  # XIDs come as NVML events, not as a queryable field
        )

    def _cpu_sample(self, node: str, d: Device, pid: int | None) -> GpuSampled:
        util = used = None
        if pid is not None and (stat := proc_stat(pid)) is not None:
            cpu_s, rss = stat
            now = time.monotonic()
            prev = self._cpu_prev.get(pid)
            self._cpu_prev[pid] = (cpu_s, now)
            if prev is not None and now > prev[1]:
                util = 100.0 * (cpu_s - prev[0]) / (now - prev[1])  # 100 = one core busy
            used = rss
        elif pid is None:
            util, used = 0.0, 0
        return GpuSampled(
            node=node,
            index=d.index,
            device_kind="cpu",
            uuid=d.uuid,
            utilization_pct=util,
            memory_used_bytes=used,
            memory_total_bytes=d.memory_bytes,
        )

    def close(self) -> None:
        if self._amd is not None:
            self._amd.close()
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except Exception as exc:
                log.debug("nvmlShutdown: %s", exc)


def proc_stat(pid: int) -> tuple[float, int] | None:
    """(CPU seconds used, resident bytes) of a process, from /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15, rss field 24
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK, int(fields[21]) * _PAGE
