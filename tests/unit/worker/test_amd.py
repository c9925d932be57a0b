"""The AMD backend through a stand-in `amdsmi` (tests/fakes/amdsmi.py: the real names and shapes):
inventory and samples as the NVML path gives them, and the backend chosen at runtime."""

from __future__ import annotations

import pytest

from tests.fakes import amdsmi as fake
from vigil.errors import ConfigError
from vigil_common.settings import Settings
from vigil_worker import inventory
from vigil_worker.inventory import Inventory


@pytest.fixture(autouse=True)
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory, "_nvml", lambda: None)


def test_an_amd_node_offers_its_gpus_with_xgmi_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    fake.install(monkeypatch, [fake.FakeGpu(), fake.FakeGpu()])
    inv = Inventory.discover(2, "mi300", "auto")
    assert inv.kind == "gpu"
    assert [(d.index, d.kind, d.name, d.memory_bytes, d.nvlink_peers) for d in inv.devices] == [
        (0, "gpu", "AMD Instinct MI300X", 205_822_885_888, [1]),
        (1, "gpu", "AMD Instinct MI300X", 205_822_885_888, [0]),
    ]
    assert [d.uuid for d in inv.devices] == [
        "1fff74a1-0000-1000-80f5-d2b3a9a7e300",
        "1fff74a1-0000-1000-80f5-d2b3a9a7e301",
    ]


def test_samples_carry_what_amdsmi_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    fake.install(
        monkeypatch, [fake.FakeGpu(active_ppt_pwr=True), fake.FakeGpu(edge_temp=48, current_socket_power=580)]
    )
    inv = Inventory.discover(2, "mi300", "amdsmi")
    busy, idle = inv.sample("mi300", lambda i: (4242, "j-1", 3) if i == 0 else None)
    assert busy.model_dump(include={"node", "index", "device_kind", "job_id", "attempt"}) == {
        "node": "mi300", "index": 0, "device_kind": "gpu", "job_id": "j-1", "attempt": 3,
    }  # fmt: skip
    assert busy.uuid == inv.devices[0].uuid
    assert busy.utilization_pct == 87.0
    assert (busy.memory_used_bytes, busy.memory_total_bytes) == (30_165_991_424, 205_822_885_888)
    assert busy.temperature_c == 52.0  # no edge sensor on MI300X: the hotspot
    assert busy.power_w == 612.0  # "N/A" current power: the average
    assert (busy.sm_clock_mhz, busy.mem_clock_mhz) == (2100, 1300)
    assert (busy.ecc_corrected, busy.ecc_uncorrected) == (2, 0)
    assert busy.throttle_reasons == ["sw_power_cap"]
    assert (idle.temperature_c, idle.power_w, idle.throttle_reasons, idle.job_id) == (48.0, 580.0, [], None)


def test_fields_a_gpu_does_not_report_are_none(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = fake.FakeGpu(
        gfx_activity="N/A", hotspot_temp=None, average_socket_power="N/A", active_ppt_pwr="N/A"
    )
    fake.install(monkeypatch, [gpu], xgmi=False)
    inv = Inventory.discover(2, "old", "auto")
    assert inv.devices[0].nvlink_peers == []
    (s,) = inv.sample("old", lambda i: None)
    assert (s.utilization_pct, s.temperature_c, s.power_w, s.throttle_reasons) == (None, None, None, [])
    assert s.memory_used_bytes == gpu.vram_used


def test_close_shuts_amdsmi_down(monkeypatch: pytest.MonkeyPatch) -> None:
    state = fake.install(monkeypatch, [fake.FakeGpu()])
    Inventory.discover(2, "n", "auto").close()
    assert state.shut_down == 1 and not state.initialised


def test_no_amd_gpu_or_driver_means_cpu_slots_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    fake.install(monkeypatch, [])
    assert Inventory.discover(2, "n", "auto").kind == "cpu"
    fake.install(monkeypatch, [fake.FakeGpu()], init_error=True)
    assert Inventory.discover(2, "n", "auto").kind == "cpu"


def test_a_forced_backend_is_used_or_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake.install(monkeypatch, [fake.FakeGpu()])
    assert Inventory.discover(3, "n", "cpu").kind == "cpu"  # AMD GPUs present, CPU slots asked for
    with pytest.raises(ConfigError, match="VIGIL_GPU_BACKEND=nvml"):
        Inventory.discover(2, "n", "nvml")
    fake.install(monkeypatch, [])
    with pytest.raises(ConfigError, match="VIGIL_GPU_BACKEND=amdsmi"):
        Inventory.discover(2, "n", "amdsmi")


def test_the_backend_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIGIL_GPU_BACKEND", "rocm")
    with pytest.raises(ConfigError, match="VIGIL_GPU_BACKEND"):
        Settings.load()
    monkeypatch.setenv("VIGIL_GPU_BACKEND", "amdsmi")
    assert Settings.load().gpu_backend == "amdsmi"
