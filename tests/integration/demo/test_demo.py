"""`vigil demo` end to end, as a newcomer runs it (fewer steps): real services, ranks, faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_demo_rescues_its_run(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    vigil = Path(sys.executable).parent / "vigil"
    proc = subprocess.run(
        [str(vigil), "demo", "--steps", "40", "--json", "--data-dir", str(tmp_path / "demo")],
        env=env, capture_output=True, text=True, timeout=420,
    )
    assert proc.stdout.strip(), proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["state"] == "SUCCEEDED", proc.stderr[-4000:]
    kinds = {i["kind"] for i in summary["incidents"]}
    assert {"nan", "spike"} <= kinds
    assert all(f["caught"] for f in summary["faults"]) and len(summary["faults"]) == 2
    assert len(summary["rollbacks"]) >= 2
    assert any(r["data_skipped"] for r in summary["rollbacks"])  # the spike's data window was skipped
    assert summary["ok"] is True and proc.returncode == 0
    assert Path(summary["plot"]).stat().st_size > 10_000
    assert summary["last_step"] == 39
