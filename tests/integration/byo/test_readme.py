"""The Hugging Face `Trainer` script of the guide "Your own training code" (docs/guides/own-code.md; the
README's until the documentation site), as printed there, as two ranks started the way torchrun starts
them: it reads the job's spec (`run.spec`), trains `train.steps` steps and saves every `checkpoint.every`
into `$HOME/out/my-run`. Without an agent the SDK is inert; the spec still comes from `VIGIL_JOB_SPEC`,
as the worker sets it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.byo.ranks import torchrun
from vigil import protocol as proto

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.byo]

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guides" / "own-code.md"


def guide_script(marker: str) -> str:
    """The guide's one Python block that holds `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_the_guides_trainer_script_reads_its_spec_and_saves_every_checkpoint_every(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(guide_script("VigilCallback()"))
    home = tmp_path / "home"
    home.mkdir()
    spec = {"name": "readme", "train": {"steps": 6}, "checkpoint": {"every": 3, "keep": 2}}
    env = {"HOME": str(home), proto.JOB_SPEC_ENV: json.dumps(spec)}
    ranks = torchrun(str(script), cwd=tmp_path, extra_env=env)
    for r in ranks:
        assert r.code == 0, f"rank {r.rank} exited {r.code}:\n{r.output[-4000:]}"
    saved = sorted(p.name for p in (home / "out" / "my-run").glob("checkpoint-*"))
    assert saved == ["checkpoint-3", "checkpoint-6"]
    state = json.loads((home / "out" / "my-run" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and state["max_steps"] == 6
