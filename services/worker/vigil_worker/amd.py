"""AMD GPUs through `amdsmi` (ROCm's AMD SMI Python library), behind the same interface as NVML.

`open_amdsmi()` initialises the library (None where there is no library, driver or AMD GPU);
`AmdGpus` lists the devices and samples them into the same `Device` and `GpuSampled` the NVML path
gives. Units as amdsmi reports them: activity in percent, power in watts, temperatures in degrees
Celsius, memory in bytes, clocks in MHz; a value the GPU does not report comes back as "N/A" (or
raises), and becomes None here. XGMI links stand where NVLink does (`Device.nvlink_peers`: the
indices joined to a device by the GPUs' own fabric).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vigil.events import Device, GpuSampled

log = logging.getLogger(__name__)

# amdsmi_get_violation_status' "active_*" flags, as the throttle reasons GpuSampled names (NVML's words)
_VIOLATIONS = {
    "active_ppt_pwr": "sw_power_cap",
    "active_socket_thrm": "hw_thermal",
    "active_prochot_thrm": "hw_slowdown",
    "active_vr_thrm": "hw_thermal",
    "active_hbm_thrm": "hw_thermal",
}


def open_amdsmi() -> Any | None:
    """amdsmi, initialised for AMD GPUs, or None where there is no library, driver or GPU."""
    try:
        import amdsmi

        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except Exception:  # no library, no driver: not an AMD node
        return None
    try:
        if amdsmi.amdsmi_get_processor_handles():
            return amdsmi
    except Exception as exc:
        log.debug("amdsmi_get_processor_handles: %s", exc)
    amdsmi.amdsmi_shut_down()
    return None


def _query(fn: Callable[[], Any]) -> Any:
    try:
        value = fn()
    except Exception:  # a field this GPU or driver does not report
        return None
    return None if value == "N/A" else value


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class AmdGpus:
    """The node's AMD GPUs: their devices, and one sample of each."""

    def __init__(self, smi: Any) -> None:
        self.smi = smi
        self.handles = list(smi.amdsmi_get_processor_handles())

    def devices(self) -> list[Device]:
        smi = self.smi
        vram = smi.AmdSmiMemoryType.VRAM
        return [
            Device(
                index=i,
                kind="gpu",
                name=str(_query(lambda h=h: smi.amdsmi_get_gpu_asic_info(h)["market_name"]) or "AMD GPU"),
                uuid=str(_query(lambda h=h: smi.amdsmi_get_gpu_device_uuid(h)) or f"amd-gpu-{i}"),
                memory_bytes=int(_query(lambda h=h: smi.amdsmi_get_gpu_memory_total(h, vram)) or 0),
                nvlink_peers=self._xgmi_peers(i),
            )
            for i, h in enumerate(self.handles)
        ]

    def _xgmi_peers(self, index: int) -> list[int]:
        smi, src = self.smi, self.handles[index]
        peers = []
        for j, dst in enumerate(self.handles):
            if j == index:
                continue
            link = _query(lambda dst=dst: smi.amdsmi_topo_get_link_type(src, dst))
            if link and link.get("type") == smi.AmdSmiIoLinkType.XGMI and link.get("hops") == 1:
                peers.append(j)
        return peers

    def sample(self, node: str, d: Device) -> GpuSampled:
        smi, h = self.smi, self.handles[d.index]
        vram = smi.AmdSmiMemoryType.VRAM
        activity = _query(lambda: smi.amdsmi_get_gpu_activity(h)) or {}
        power = _query(lambda: smi.amdsmi_get_power_info(h)) or {}
        watts = _number(power.get("current_socket_power"))
        if watts is None:  # MI300-class GPUs report only the average
            watts = _number(power.get("average_socket_power"))
        ecc = _query(lambda: smi.amdsmi_get_gpu_total_ecc_count(h)) or {}
        violations = _query(lambda: smi.amdsmi_get_violation_status(h)) or {}
        return GpuSampled(
            node=node,
            index=d.index,
            device_kind="gpu",
            uuid=d.uuid,
            utilization_pct=_number(activity.get("gfx_activity")),
            memory_used_bytes=_query(lambda: int(smi.amdsmi_get_gpu_memory_usage(h, vram))),
            memory_total_bytes=_query(lambda: int(smi.amdsmi_get_gpu_memory_total(h, vram))),
            temperature_c=self._temperature(h),
            power_w=watts,
            sm_clock_mhz=self._clock(h, smi.AmdSmiClkType.GFX),
            mem_clock_mhz=self._clock(h, smi.AmdSmiClkType.MEM),
            throttle_reasons=sorted(
                {why for flag, why in _VIOLATIONS.items() if violations.get(flag) is True}
            ),
            ecc_corrected=_query(lambda: int(ecc["correctable_count"])),
            ecc_uncorrected=_query(lambda: int(ecc["uncorrectable_count"])),
        )

    def _temperature(self, h: Any) -> float | None:
        smi = self.smi
        current = smi.AmdSmiTemperatureMetric.CURRENT
        for sensor in (smi.AmdSmiTemperatureType.EDGE, smi.AmdSmiTemperatureType.HOTSPOT):  # MI300: no edge
            value = _number(_query(lambda sensor=sensor: smi.amdsmi_get_temp_metric(h, sensor, current)))
            if value is not None and value > 0:
                return value
        return None

    def _clock(self, h: Any, kind: Any) -> int | None:
        clk = _number(_query(lambda: self.smi.amdsmi_get_clock_info(h, kind)["clk"]))
        return int(clk) if clk is not None else None

    def close(self) -> None:
        try:
            self.smi.amdsmi_shut_down()
        except Exception as exc:
            log.debug("amdsmi_shut_down: %s", exc)
