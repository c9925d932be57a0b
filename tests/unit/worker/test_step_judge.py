"""The ranks' verdict at the step boundary: the guardian's spike rule on every rank's loss, and the
spec deciding which verdicts hold a step."""

import math

from vigil.spec import GuardianSpec
from vigil.spike_rule import LossWindows
from vigil_trainer.step_judge import StepJudge


def warmed(spec: GuardianSpec, steps: int = 12) -> StepJudge:
    judge = StepJudge(spec)
    for s in range(steps):
        judge.add(s, (3.0 + 0.01 * (s % 3), 3.1 - 0.01 * (s % 2)))
    return judge


def test_a_non_finite_loss_names_its_rank_and_gradients_alone_name_none():
    judge = warmed(GuardianSpec())
    bad = judge.judge((3.0, math.nan), all_finite=False)
    assert bad is not None and (bad.kind, bad.culprits) == ("nan", [1])
    only_grads = judge.judge((3.0, 3.1), all_finite=False)
    assert only_grads is not None and (only_grads.kind, only_grads.culprits) == ("nan", [])


def test_a_spike_is_judged_by_the_guardians_rule_on_each_ranks_own_window():
    judge = warmed(GuardianSpec())
    assert judge.judge((3.02, 3.09), all_finite=True) is None
    bad = judge.judge((3.0, 60.0), all_finite=True)
    assert bad is not None and (bad.kind, bad.culprits) == ("spike", [1])
    assert bad.evidence["ranks"]["1"]["zscore"] > 6
    # the same numbers as the guardian's windows give
    windows = LossWindows(50, 10)
    for s in range(12):
        windows.add(0, s, 3.0 + 0.01 * (s % 3))
        windows.add(1, s, 3.1 - 0.01 * (s % 2))
    assert windows.judge(1, 60.0, 6.0).zscore == bad.evidence["ranks"]["1"]["zscore"]


def test_no_verdict_before_the_warmup_and_none_after_a_rewind_of_the_window():
    judge = warmed(GuardianSpec(spike_warmup=10), steps=9)
    assert judge.judge((3.0, 60.0), all_finite=True) is None  # 9 losses: still warming up
    judge.add(9, (3.0, 3.1))
    assert judge.judge((3.0, 60.0), all_finite=True) is not None
    judge.rewind(5)  # a rollback to step 5: steps 5.. forgotten
    assert judge.judge((3.0, 60.0), all_finite=True) is None


def test_only_a_rollback_action_with_replay_on_holds_a_step():
    assert warmed(GuardianSpec(spike="alert")).judge((3.0, 60.0), all_finite=True) is None
    assert warmed(GuardianSpec(nan="fail")).judge((3.0, math.nan), all_finite=False) is None
    assert warmed(GuardianSpec(replay=False)).judge((3.0, math.nan), all_finite=False) is None
    assert StepJudge(GuardianSpec()).judge((), all_finite=False) is None  # no losses carried
