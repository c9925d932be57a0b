import math

from vigil.spec import parse_spec
from vigil_trainer.faults import FaultInjector


def spec_faults(*faults):
    return parse_spec({"name": "f", "resources": {"gpus_per_node": 2}, "faults": list(faults)}).faults


def test_sdc_fires_once_per_job_even_across_processes(tmp_path):
    faults = spec_faults({"kind": "sdc", "step": 3, "rank": 1})
    first = FaultInjector(faults, rank=1, marker_dir=tmp_path)
    assert first.loss_factor(2, 2) == 1.0
    assert math.isnan(first.loss_factor(3, 3))
    assert first.loss_factor(3, 3) == 1.0  # its replay, or the step after a rollback past it
    restarted = FaultInjector(faults, rank=1, marker_dir=tmp_path)
    assert restarted.loss_factor(3, 3) == 1.0
    assert (
        FaultInjector(faults, rank=0, marker_dir=tmp_path / "other").loss_factor(3, 3) == 1.0
    )  # not its rank
    scaled = FaultInjector(
        spec_faults({"kind": "sdc", "step": 1, "factor": 8}), rank=0, marker_dir=tmp_path / "s"
    )
    assert scaled.loss_factor(1, 1) == 8.0 and scaled.loss_factor(1, 1) == 1.0


def test_nan_and_spike_are_in_their_data_position_across_processes(tmp_path):
    faults = spec_faults({"kind": "nan", "step": 3, "rank": 1}, {"kind": "spike", "step": 5, "rank": 1})
    inj = FaultInjector(faults, rank=1, marker_dir=tmp_path)
    assert inj.loss_factor(2, 2) == 1.0
    assert math.isnan(inj.loss_factor(3, 3))
    assert math.isnan(inj.loss_factor(3, 3))  # the replay reproduces it
    assert inj.loss_factor(3, 4) == 1.0  # the step on the next data, after a skip
    restarted = FaultInjector(faults, rank=1, marker_dir=tmp_path)
    assert math.isnan(restarted.loss_factor(3, 3))  # a rollback that reads the same data again
    assert restarted.loss_factor(5, 7) == 50.0 and restarted.loss_factor(5, 7) == 50.0
    assert restarted.loss_factor(5, 8) == 1.0
    pinned = FaultInjector(
        spec_faults({"kind": "nan", "step": 4, "data_position": 6}), rank=0, marker_dir=tmp_path
    )
    assert pinned.loss_factor(4, 4) == 1.0 and math.isnan(pinned.loss_factor(4, 6))


def test_repeat_fires_every_time(tmp_path):
    inj = FaultInjector(spec_faults({"kind": "spike", "step": 1, "factor": 10, "repeat": True}), 0, tmp_path)
    assert inj.loss_factor(1, 1) == 10.0 and inj.loss_factor(1, 2) == 10.0


def test_slow_rank_from_its_step_until_a_rollback(tmp_path):
    inj = FaultInjector(spec_faults({"kind": "slow_rank", "step": 2, "delay_s": 0.5}), 0, tmp_path)
    assert [inj.delay_s(s) for s in range(5)] == [0, 0, 0.5, 0.5, 0.5]
    inj.clear_transient()
    assert [inj.delay_s(s) for s in range(5)] == [0, 0, 0, 0, 0]


def test_crash_and_hang(tmp_path):
    inj = FaultInjector(
        spec_faults({"kind": "crash", "step": 4, "exit_code": 7}, {"kind": "hang", "step": 5}), 0, tmp_path
    )
    assert inj.crash_code(3) is None and inj.crash_code(4) == 7 and inj.crash_code(4) is None
    assert not inj.hangs(4) and inj.hangs(5) and not inj.hangs(5)


def test_oom_fires_once_unless_repeated(tmp_path):
    once = FaultInjector(spec_faults({"kind": "oom", "step": 2, "rank": 1}), 1, tmp_path / "a")
    assert not once.out_of_memory(1) and once.out_of_memory(2) and not once.out_of_memory(2)
    again = FaultInjector(spec_faults({"kind": "oom", "step": 2, "repeat": True}), 0, tmp_path / "b")
    assert again.out_of_memory(2) and again.out_of_memory(2)
