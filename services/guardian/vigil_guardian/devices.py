"""GPU health, judged once per guardian.

Every guardian hears every GPU sample. One `Devices` per guardian keeps each device's health (before,
each share it held kept its own copy and judged every sample again: up to 16 times). A verdict goes to
one share (`owner`): the one whose job runs on the device, or, when no share this guardian holds runs a
job there, share 0 if it is held here (it judges idle devices, once it has checked that no job of a
share held elsewhere runs there). A guardian holding neither drops the verdict: the guardian that holds
the job's share hears the same samples and judges them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from vigil.events import GpuSampled
from vigil_guardian.gpu_health import DeviceHealth, GpuLimits
from vigil_guardian.verdict import Verdict

if TYPE_CHECKING:
    from vigil_guardian.core import Guardian


class Devices:
    """The health of every device heard, one `DeviceHealth` each."""

    def __init__(self, limits: GpuLimits | None = None) -> None:
        self.limits = limits or GpuLimits()
        self.health: dict[tuple[str, int], DeviceHealth] = {}

    def observe(self, sample: GpuSampled) -> Verdict | None:
        """Feed one sample; the verdict when its device turns sick (see `DeviceHealth.observe`)."""
        key = (sample.node, sample.index)
        health = self.health.get(key)
        if health is None:
            health = self.health[key] = DeviceHealth(self.limits)
        return health.observe(sample)

    def levels(self) -> dict[tuple[str, int], int]:
        """The devices not well, and how sick (what share 0 saves)."""
        return {k: h.level for k, h in self.health.items() if h.level}

    def restore(self, levels: Mapping[tuple[str, int], int]) -> None:
        """Levels saved earlier; a device heard since keeps the sicker of the two (its next well sample
        clears it)."""
        for key, level in levels.items():
            health = self.health.setdefault(key, DeviceHealth(self.limits))
            health.level = max(health.level, level)


def owner(node: str, index: int, cores: Mapping[int, Guardian]) -> int | None:
    """The share (of those held, `cores`) that judges a verdict on device `index` of `node`: the one whose
    job runs there, else share 0 when held; None when neither is held here."""
    for share, core in cores.items():
        if core.device_job(node, index) is not None:
            return share
    return 0 if 0 in cores else None
