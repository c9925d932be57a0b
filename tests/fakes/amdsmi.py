"""A stand-in for ROCm's `amdsmi` Python module, for machines without AMD GPUs: the real function
names, enums and return shapes (py-interface/amdsmi_interface.py of ROCm/amdsmi), with values an
8-GPU MI300X node reports. `install(monkeypatch, gpus)` puts it in sys.modules as `amdsmi`.

As in the real library: handles are opaque objects checked by type; a value the GPU does not report
is "N/A" in a dict, and an unsupported query raises AmdSmiLibraryException; temperatures are degrees
Celsius, power watts, memory bytes, clocks MHz.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import IntEnum
from types import ModuleType
from typing import Any

import pytest


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1 << 0
    INIT_AMD_GPUS = 1 << 1


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1


class AmdSmiIoLinkType(IntEnum):
    UNDEFINED = 0
    PCIEXPRESS = 1
    XGMI = 2


class AmdSmiLibraryException(Exception):
    def __init__(self, err_code: int) -> None:
        self.err_code = err_code
        super().__init__(f"Error code:\n\t{err_code} | AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported")

    def get_error_code(self) -> int:
        return self.err_code


NOT_SUPPORTED = 2


@dataclass(eq=False)
class amdsmi_processor_handle:  # the real ctypes type's name
    index: int


@dataclass
class FakeGpu:
    """What one GPU reports; None: the query raises (not supported)."""

    market_name: str = "AMD Instinct MI300X"
    uuid: str = "1fff74a1-0000-1000-80f5-d2b3a9a7e3c1"
    vram_total: int = 205_822_885_888  # 192 GiB
    vram_used: int = 30_165_991_424
    gfx_activity: int | str = 87
    edge_temp: int | None = None  # MI300X has no edge sensor
    hotspot_temp: int | None = 52
    current_socket_power: int | str = "N/A"  # MI300X reports the average only
    average_socket_power: int | str = 612
    gfx_clk: int = 2100
    mem_clk: int = 1300
    correctable: int = 2
    uncorrectable: int = 0
    active_ppt_pwr: bool | str = False


@dataclass
class State:
    gpus: list[FakeGpu] = field(default_factory=list)
    xgmi: bool = True
    initialised: bool = False
    init_error: bool = False
    shut_down: int = 0


STATE = State()


def _handle(h: Any) -> FakeGpu:
    if not isinstance(h, amdsmi_processor_handle):
        raise TypeError(f"{h!r} is not an amdsmi_processor_handle")
    if not STATE.initialised:
        raise AmdSmiLibraryException(32)  # AMDSMI_STATUS_NOT_INIT
    return STATE.gpus[h.index]


def amdsmi_init(flag: AmdSmiInitFlags = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
    if STATE.init_error:
        raise AmdSmiLibraryException(8)  # AMDSMI_STATUS_DRIVER_NOT_LOADED
    STATE.initialised = True


def amdsmi_shut_down() -> None:
    STATE.initialised = False
    STATE.shut_down += 1


def amdsmi_get_processor_handles() -> list[amdsmi_processor_handle]:
    if not STATE.initialised:
        raise AmdSmiLibraryException(32)
    return [amdsmi_processor_handle(i) for i in range(len(STATE.gpus))]


def amdsmi_get_gpu_asic_info(h: Any) -> dict[str, Any]:
    g = _handle(h)
    return {"market_name": g.market_name, "vendor_id": "0x1002", "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002", "device_id": "0x74a1", "rev_id": "0x00", "asic_serial": "0x5F1C2A4B3E2D1F00",
            "oam_id": h.index, "num_compute_units": 304, "target_graphics_version": "gfx942"}  # fmt: skip


def amdsmi_get_gpu_device_uuid(h: Any) -> str:
    g = _handle(h)
    return g.uuid[:-2] + f"{h.index:02x}"


def amdsmi_get_gpu_memory_total(h: Any, mem_type: AmdSmiMemoryType) -> int:
    if not isinstance(mem_type, AmdSmiMemoryType):
        raise TypeError(mem_type)
    return _handle(h).vram_total


def amdsmi_get_gpu_memory_usage(h: Any, mem_type: AmdSmiMemoryType) -> int:
    if not isinstance(mem_type, AmdSmiMemoryType):
        raise TypeError(mem_type)
    return _handle(h).vram_used


def amdsmi_get_gpu_activity(h: Any) -> dict[str, Any]:
    return {"gfx_activity": _handle(h).gfx_activity, "umc_activity": 41, "mm_activity": "N/A"}


def amdsmi_get_power_info(h: Any) -> dict[str, Any]:
    g = _handle(h)
    return {"current_socket_power": g.current_socket_power, "average_socket_power": g.average_socket_power,
            "gfx_voltage": "N/A", "soc_voltage": "N/A", "mem_voltage": "N/A", "power_limit": 750}  # fmt: skip


def amdsmi_get_temp_metric(h: Any, sensor: AmdSmiTemperatureType, metric: AmdSmiTemperatureMetric) -> int:
    g = _handle(h)
    if not isinstance(sensor, AmdSmiTemperatureType) or not isinstance(metric, AmdSmiTemperatureMetric):
        raise TypeError((sensor, metric))
    value = {AmdSmiTemperatureType.EDGE: g.edge_temp, AmdSmiTemperatureType.HOTSPOT: g.hotspot_temp}.get(
        sensor
    )
    if value is None:
        raise AmdSmiLibraryException(NOT_SUPPORTED)
    return value


def amdsmi_get_clock_info(h: Any, clock_type: AmdSmiClkType) -> dict[str, Any]:
    g = _handle(h)
    clk = {AmdSmiClkType.GFX: g.gfx_clk, AmdSmiClkType.MEM: g.mem_clk}.get(clock_type)
    if clk is None:
        raise AmdSmiLibraryException(NOT_SUPPORTED)
    return {"clk": clk, "min_clk": 500, "max_clk": 2100, "clk_locked": False, "clk_deep_sleep": False}


def amdsmi_get_gpu_total_ecc_count(h: Any) -> dict[str, Any]:
    g = _handle(h)
    return {"correctable_count": g.correctable, "uncorrectable_count": g.uncorrectable, "deferred_count": 0}


def amdsmi_get_violation_status(h: Any) -> dict[str, Any]:
    g = _handle(h)
    return {"reference_timestamp": 1_700_000_000_000_000, "violation_timestamp": 1_700_000_000_000_000,
            "active_prochot_thrm": False, "active_ppt_pwr": g.active_ppt_pwr, "active_socket_thrm": False,
            "active_vr_thrm": False, "active_hbm_thrm": "N/A"}  # fmt: skip


def amdsmi_topo_get_link_type(src: Any, dst: Any) -> dict[str, int]:
    _handle(src), _handle(dst)
    return {"hops": 1, "type": AmdSmiIoLinkType.XGMI if STATE.xgmi else AmdSmiIoLinkType.PCIEXPRESS}


def install(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu], **state: Any) -> State:
    """Put this module in sys.modules as `amdsmi`, reporting `gpus`; the state it keeps."""
    global STATE
    STATE = State(gpus=gpus, **state)
    module = ModuleType("amdsmi")
    module.__dict__.update({k: v for k, v in globals().items() if k.startswith(("amdsmi_", "AmdSmi"))})
    monkeypatch.setitem(sys.modules, "amdsmi", module)
    return STATE
