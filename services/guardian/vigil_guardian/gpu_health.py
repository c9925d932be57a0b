"""GPU health from NVML samples: heat, sustained throttling, ECC and XID errors, memory nearly full.

One `DeviceHealth` per device. A device raises one verdict when it turns sick and stays quiet
until a sample shows it well again (one fault, one incident). Conditions that point at the
hardware (heat, throttling, uncorrectable ECC, hardware XIDs) mark the device unhealthy for the
scheduler: the verdict carries its `device` index. Memory nearly full is usually the job's doing,
not the device's: that verdict leaves `device` unset (the index is in the evidence).
"""

from __future__ import annotations

from dataclasses import dataclass

from vigil.events import GpuSampled
from vigil_guardian.verdict import Verdict


@dataclass(frozen=True)
class GpuLimits:
    temperature_c: float = 90.0
    throttle_samples: int = 3  # consecutive samples throttled for heat or power before it counts
    memory_fraction: float = 0.99
    memory_samples: int = 3


# NVML throttle reasons that mean heat or power trouble; a software power cap is normal under load.
THROTTLE_FAULTS = ("thermal", "power_brake", "hw_slowdown", "hwslowdown", "powerbrake")
# XIDs that point at the hardware (ECC, row remapping, NVLink, fallen off the bus, GSP); others are
# often the application's (e.g. 13, 31, 43) and only alert.
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120, 140})


class DeviceHealth:
    """The health of one device, fed one sample at a time."""

    def __init__(self, limits: GpuLimits | None = None) -> None:
        self.limits = limits or GpuLimits()
        self._throttled = 0
        self._memory_full = 0
        self.level = 0  # 0 well, 1 in trouble (job-caused), 2 unhealthy (hardware)

    def observe(self, s: GpuSampled) -> Verdict | None:
        """Feed a sample; returns a verdict when the device turns sick (or from in trouble to unhealthy)."""
        lim = self.limits
        hardware: dict[str, object] = {}
        other: dict[str, object] = {}
        if s.temperature_c is not None and s.temperature_c > lim.temperature_c:
            hardware["temperature_c"] = s.temperature_c
        faults = [
            r for r in s.throttle_reasons if any(f in r.lower().replace(" ", "_") for f in THROTTLE_FAULTS)
        ]
        self._throttled = self._throttled + 1 if faults else 0
        if self._throttled >= lim.throttle_samples:
            hardware["throttle_reasons"] = faults
        if s.ecc_uncorrected:
            hardware["ecc_uncorrected"] = s.ecc_uncorrected
        if s.xid:
            (hardware if s.xid in HARDWARE_XIDS else other)["xid"] = s.xid
        full = (
            s.memory_used_bytes is not None
            and bool(s.memory_total_bytes)
            and s.memory_used_bytes / s.memory_total_bytes >= lim.memory_fraction  # type: ignore[operator]
        )
        self._memory_full = self._memory_full + 1 if full else 0
        if self._memory_full >= lim.memory_samples:
            other["memory_used_fraction"] = round(s.memory_used_bytes / s.memory_total_bytes, 4)  # type: ignore[operator]
        level = 2 if hardware else 1 if other else 0
        if level == 0:
            self.level = 0
            return None
        if level <= self.level:
            return None
        self.level = level
        found = {**hardware, **other}
        what = ", ".join(f"{k}={v}" for k, v in found.items())
        return Verdict(
            kind="gpu_health",
            node=s.node,
            device=s.index if hardware else None,
            message=f"device {s.index} on {s.node} is "
            + ("unhealthy" if hardware else "in trouble")
            + f": {what}",
            evidence={
                **found,
                "index": s.index,
                "uuid": s.uuid,
                "mark_unhealthy": bool(hardware),
                "limits": {"temperature_c": lim.temperature_c, "memory_fraction": lim.memory_fraction},
            },
        )
