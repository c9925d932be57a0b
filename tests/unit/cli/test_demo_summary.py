"""`vigil demo`'s summary lines: a rollback names the data it skipped, and says nothing of data where it
skipped none (it printed "data skipped None")."""

from vigil_cli.demo import _rollback_line


def test_a_rollback_with_a_skip_names_its_data_window() -> None:
    rb = {"from_step": 12, "checkpoint": "/c/j/step_00000010", "to_step": 10, "data_skipped": [12, 13]}
    assert (
        _rollback_line(rb) == "  rollback from step 12 to /c/j/step_00000010 (step 10), data 12..13 skipped"
    )


def test_a_rollback_without_a_skip_says_nothing_of_data() -> None:
    rb = {"from_step": 7, "checkpoint": "/c/j/step_00000005", "to_step": 5, "data_skipped": None}
    line = _rollback_line(rb)
    assert line == "  rollback from step 7 to /c/j/step_00000005 (step 5)"
    assert "None" not in line and "skipped" not in line
