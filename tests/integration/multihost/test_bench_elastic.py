"""`vigil bench elastic` (issue 40 §5) once, with small sizes, in a process of its own as `vigil bench` runs it
(its namespaces are named after it, and go with it whatever happens): its last line is the JSON result with
the paths run, and each path recovered from the lost host (a first step after the kill, steps redone
counted, a goodput). The spare and elastic paths run here; the requeue path (the behaviour before issue
40: the whole job relaunched when capacity comes back) is the slowest, and what it does is tested in
tests/integration/multihost/test_training.py (a host cut off, the job finished on the other). No timing is
asserted: speed is the bench's to report, not a test's to hold."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys

import pytest

from vigil_bench.hosts import cannot_make_hosts

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]

RUN = ("spare", "elastic")
SMALL = (
    "import asyncio, json; from vigil_common.settings import Settings; from vigil_bench.elastic import measure; "
    "print(json.dumps(asyncio.run(measure(Settings.load(), steps=16, kill_at=6, warmup_steps=0, "
    f"paths={RUN!r}))))"
)


@pytest.mark.timeout(1200)
async def test_the_elastic_bench_reports_each_path_recovered() -> None:
    if reason := cannot_make_hosts():
        pytest.skip(reason)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SMALL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), 1100)
    finally:
        if proc.returncode is None:  # SIGTERM first: the bench removes its hosts on the way out
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 60)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-5000:]
    lines = text.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["bench"] == "elastic"
    assert any(line.startswith("path ") for line in lines[:-1]), text[-3000:]  # the table, before the JSON
    assert tuple(out["paths"]) == RUN
    for name, path in out["paths"].items():
        assert {"detect_s", "first_step_s", "steps_redone", "goodput"} <= set(path), name
        assert math.isfinite(path["first_step_s"]) and path["first_step_s"] > 0, (name, path)
        assert path["steps_redone"] >= 0, (name, path)
        assert path["goodput"] > 0, (
            name,
            path,
        )  # not <= 1: on a loaded machine the faulted run may be the faster
        assert path["detect_s"] is not None, (name, path)
    assert out["ratio"] == out["paths"]["spare"]["goodput"]
    assert out["paths"]["elastic"]["ranks_after"] == 1  # shrunk to hosta
    assert any(n.startswith("hostc-") for n in out["paths"]["spare"]["placed_on"])  # the spare
