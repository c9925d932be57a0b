import pytest

from tests.unit.guardian.helpers import gpu
from vigil_guardian.gpu_health import DeviceHealth, GpuLimits


def test_healthy_samples_are_quiet():
    h = DeviceHealth()
    assert all(h.observe(gpu()) is None for _ in range(10))


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"temperature_c": 95.0}, "temperature_c"),
        ({"ecc_uncorrected": 2}, "ecc_uncorrected"),
        ({"xid": 79}, "xid"),
    ],
)
def test_immediate_hardware_faults_mark_the_device(kw, key):
    v = DeviceHealth().observe(gpu(**kw))
    assert v is not None and v.kind == "gpu_health"
    assert v.node == "n0" and v.device == 0 and key in v.evidence and v.evidence["mark_unhealthy"]


def test_throttling_must_be_sustained():
    h = DeviceHealth(GpuLimits(throttle_samples=3))
    hot = gpu(throttle_reasons=["hw_thermal_slowdown"])
    assert h.observe(hot) is None and h.observe(hot) is None
    assert h.observe(hot).evidence["throttle_reasons"] == ["hw_thermal_slowdown"]
    # a software power cap is normal under load
    h2 = DeviceHealth(GpuLimits(throttle_samples=1))
    assert h2.observe(gpu(throttle_reasons=["sw_power_cap"])) is None


def test_memory_nearly_full_alerts_without_marking_the_device():
    h = DeviceHealth(GpuLimits(memory_samples=2))
    full = gpu(memory_used_bytes=995, memory_total_bytes=1000)
    assert h.observe(full) is None
    v = h.observe(full)
    assert v is not None and v.device is None and v.evidence["index"] == 0
    assert not v.evidence["mark_unhealthy"]


def test_one_fault_one_incident_until_well_again():
    h = DeviceHealth()
    assert h.observe(gpu(temperature_c=95.0)) is not None
    assert h.observe(gpu(temperature_c=96.0, xid=79)) is None  # still the same sick spell
    assert h.observe(gpu()) is None
    assert h.observe(gpu(temperature_c=95.0)) is not None


def test_application_xid_alerts_but_escalates_on_hardware():
    h = DeviceHealth()
    v = h.observe(gpu(xid=13))
    assert v is not None and v.device is None
    v2 = h.observe(gpu(xid=13, ecc_uncorrected=1))
    assert v2 is not None and v2.device == 0
