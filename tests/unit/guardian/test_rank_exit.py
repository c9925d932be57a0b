import pytest

from vigil.events import RankExited
from vigil_guardian.rank_exit import rank_exit


@pytest.mark.parametrize(
    ("exit_code", "signal", "failure", "incident"),
    [
        (0, None, "ok", False),
        (3, None, "error", True),
        (None, 9, "oom", True),
        (None, 11, "signal", True),
        (None, 15, "killed_by_vigil", False),
        (137, None, "killed_by_vigil", False),
    ],
)
def test_rank_exit(exit_code, signal, failure, incident):
    e = RankExited(
        job_id="j-1",
        attempt=1,
        rank=2,
        node="n2",
        exit_code=exit_code,
        signal=signal,
        failure=failure,
        last_step=41,
        log_tail="Traceback ...",
    )
    v = rank_exit(e)
    assert (v is not None) == incident
    if v:
        assert (v.kind, v.rank, v.node, v.step) == ("rank_exit", 2, "n2", 41)
        assert v.evidence["log_tail"] == "Traceback ..."
