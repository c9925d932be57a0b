"""A real worker service (real NATS) on a node whose GPUs answer through `amdsmi` (the stand-in of
tests/fakes/amdsmi.py): its heartbeat offers them and its samples reach the bus like NVML's."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.fakes import amdsmi as fake
from tests.helpers import service
from tests.integration.scheduler.conftest import next_event
from vigil.events import GpuSampled, NodeHeartbeat
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.settings import Settings
from vigil_worker import inventory
from vigil_worker.main import run

pytestmark = pytest.mark.integration


async def test_an_amd_worker_heartbeats_its_gpus_and_samples_them(
    nats_url: str, bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inventory, "_nvml", lambda: None)
    fake.install(monkeypatch, [fake.FakeGpu(), fake.FakeGpu()])
    node = "amd-" + uuid.uuid4().hex[:8]
    settings = Settings.load(
        nats_url=nats_url,
        data_dir=tmp_path,
        node_name=node,
        heartbeat_interval_s=0.2,
        gpu_sample_interval_s=0.2,
    )
    async with service(run, settings):
        beat = await next_event(bus, subjects.heartbeat(node), lambda e: isinstance(e, NodeHeartbeat), 30)
        assert [(d.kind, d.name, d.nvlink_peers) for d in beat.devices] == [
            ("gpu", "AMD Instinct MI300X", [1]),
            ("gpu", "AMD Instinct MI300X", [0]),
        ]
        assert beat.free == [0, 1]
        sample = await next_event(
            bus, subjects.gpu(node), lambda e: isinstance(e, GpuSampled) and e.index == 1, 30
        )
        assert (sample.device_kind, sample.power_w, sample.temperature_c) == ("gpu", 612.0, 52.0)
        assert sample.uuid == beat.devices[1].uuid
