"""What the gateway refuses at submit (422 naming the field) because no worker of this cluster would run it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil.errors import SpecError
from vigil.spec import JobSpec
from vigil_common.settings import Settings
from vigil_scheduler import admission


def own(workdir: str | None) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "own", "entrypoint": {"argv": ["python", "t.py"], "workdir": workdir}}
    )


def test_entrypoints_turned_off_refuse_a_program_but_not_the_builtin_trainer(tmp_path: Path) -> None:
    off = Settings.load(data_dir=tmp_path, entrypoints=False)
    with pytest.raises(SpecError) as refused:
        admission.check(own("proj"), off)
    assert refused.value.errors[0]["field"] == "entrypoint" and "VIGIL_ENTRYPOINTS" in str(refused.value)
    admission.check(JobSpec(name="builtin"), off)


@pytest.mark.parametrize("workdir", ["../elsewhere", "proj/../../x", "/etc", "/"])
def test_a_workdir_that_leaves_the_code_roots_is_refused(tmp_path: Path, workdir: str) -> None:
    with pytest.raises(SpecError) as refused:
        admission.check(own(workdir), Settings.load(data_dir=tmp_path))
    assert refused.value.errors[0]["field"] == "entrypoint.workdir"


def test_a_workdir_under_a_code_root_is_taken(tmp_path: Path) -> None:
    settings = Settings.load(data_dir=tmp_path, code_roots=[tmp_path / "code", tmp_path / "more"])
    for workdir in (None, "proj", "proj/sub", str(tmp_path / "more" / "proj")):
        admission.check(own(workdir), settings)


def test_a_time_limit_over_the_clusters_maximum_is_refused_naming_the_field(tmp_path: Path) -> None:
    capped = Settings.load(data_dir=tmp_path, time_limit_max_s=3600)
    long = JobSpec.model_validate({"name": "long", "scheduling": {"time_limit": "2h"}})
    with pytest.raises(SpecError) as refused:
        admission.check(long, capped)
    error = refused.value.errors[0]
    assert error["field"] == "scheduling.time_limit" and "2h" in error["message"] and "1h" in error["message"]
    admission.check(JobSpec.model_validate({"name": "ok", "scheduling": {"time_limit": "1h"}}), capped)
    admission.check(JobSpec(name="unset"), capped)  # the default applies, not the maximum
    admission.check(long, Settings.load(data_dir=tmp_path))  # no maximum set
