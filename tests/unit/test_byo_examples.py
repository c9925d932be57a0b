"""The job specs in examples/byo/ parse, run their own program, and name a script that is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil.spec import parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "byo"
SPECS = sorted(EXAMPLES.glob("*.yaml"))


def test_there_is_a_spec_per_framework() -> None:
    assert {p.stem for p in SPECS} == {
        "hf_trainer",
        "hf_deepspeed",
        "lightning_ddp",
        "deepspeed_loop",
        "ddp_loop",
    }


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_an_example_spec_parses_and_names_its_script(path: Path) -> None:
    spec = parse_spec(path.read_bytes(), content_type="application/yaml")
    assert spec.entrypoint is not None and spec.entrypoint.workdir == "byo"
    script = next(a for a in spec.entrypoint.argv if a.endswith(".py"))
    assert (EXAMPLES / script).is_file(), script
    assert spec.train.steps == int(spec.entrypoint.argv[spec.entrypoint.argv.index("--steps") + 1])
