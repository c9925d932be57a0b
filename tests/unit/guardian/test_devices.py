"""A guardian judges each GPU sample once, whatever the number of shares it holds, and hands a sick
device's verdict to the one share that decides about it (`vigil_guardian.devices`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.unit.guardian.helpers import JOB, T0, gpu, launch
from vigil.events import GpuSampled
from vigil_common import subjects
from vigil_guardian.core import Guardian
from vigil_guardian.devices import Devices, owner
from vigil_guardian.shares import route
from vigil_guardian.verdict import Verdict

JOB_SHARE = subjects.share_of(JOB)


class CountingDevices(Devices):
    def __init__(self) -> None:
        super().__init__()
        self.observed = 0

    def observe(self, sample: GpuSampled) -> Verdict | None:
        self.observed += 1
        return super().observe(sample)


def guardian_holding(shares: range, devices: Devices) -> dict[int, tuple[Any, None]]:
    """The shares held, each with its core (all on the guardian's `devices`), JOB launched in its share."""
    held: dict[int, tuple[Any, None]] = {}
    for share in shares:
        core = Guardian(idle_devices=share == 0, devices=devices)
        if share == JOB_SHARE:
            core.on_event(launch(), T0)  # ranks 0 and 1 on device 0 of n0 and n1
        held[share] = (SimpleNamespace(core=core), None)
    return held


def test_a_guardian_holding_every_share_judges_each_sample_once() -> None:
    devices = CountingDevices()
    held = guardian_holding(range(subjects.SHARES), devices)
    samples = [gpu(node=node, temperature_c=95.0, event_id=f"s-{node}") for node in ("n0", "n1", "n7")]
    handed = route(devices, samples, held)  # type: ignore[arg-type]
    assert devices.observed == len(samples)  # once per sample, not once per share
    assert sorted(devices.health) == [("n0", 0), ("n1", 0), ("n7", 0)]
    # the job's devices go to its share; the idle one to share 0
    assert {share: [s.node for s, _ in v] for share, v in handed.items()} == {
        JOB_SHARE: ["n0", "n1"],
        0: ["n7"],
    }
    job_core = held[JOB_SHARE][0].core
    decisions = [d for s, v in handed[JOB_SHARE] for d in job_core.judge_device(s, v, T0)]
    assert [d.incident.job_id for d in decisions] == [JOB, JOB]
    (idle,) = [d for s, v in handed[0] for d in held[0][0].core.judge_device(s, v, T0)]
    assert idle.incident.job_id is None and idle.incident.node == "n7"
    # still sick: no second verdict for anyone
    assert route(devices, samples, held) == {}  # type: ignore[arg-type]
    assert devices.levels() == {("n0", 0): 2, ("n1", 0): 2, ("n7", 0): 2}


def test_a_verdict_goes_to_the_share_held_whose_job_runs_there_else_share_0() -> None:
    devices = Devices()
    with_job = guardian_holding(range(JOB_SHARE, JOB_SHARE + 1), devices)
    cores = {share: entry[0].core for share, entry in with_job.items()}
    assert owner("n0", 0, cores) == JOB_SHARE
    assert owner("n0", 1, cores) == (0 if JOB_SHARE == 0 else None)  # no job there, share 0 not held
    cores[0] = Guardian(devices=devices)
    assert owner("n9", 0, cores) == 0
    if JOB_SHARE != 0:
        assert owner("n0", 0, cores) == JOB_SHARE  # the job's share, never share 0 as well


def test_restored_levels_keep_the_sicker() -> None:
    devices = Devices()
    devices.observe(gpu(node="n0", temperature_c=95.0))
    devices.restore({("n0", 0): 1, ("n1", 0): 2})
    assert devices.levels() == {("n0", 0): 2, ("n1", 0): 2}
    assert devices.observe(gpu(node="n1")) is None  # well again
    assert devices.levels() == {("n0", 0): 2}
