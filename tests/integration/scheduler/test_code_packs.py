"""Who may run and read a code package (`vigil_scheduler.code_packs`), through the gateway of a real
scheduler: its uploader and their team name it in a spec and download the job's pack; another team's user
gets a 422 naming `entrypoint.code` for the same hash, and the job's pack as a job that does not exist; a
pack no job runs is swept after its grace period, one a job runs is kept."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from vigil import codepack
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_scheduler import code_packs

from .conftest import Running

pytestmark = pytest.mark.integration


def spec(code: str) -> dict[str, object]:
    return {
        "name": "packed",
        "resources": {"nodes": 1, "gpus_per_node": 1},
        "entrypoint": {"argv": ["python", "train.py"], "code": code},
    }


async def upload(client: httpx.AsyncClient, folder: Path) -> str:
    r = await client.post("/api/v1/code", content=codepack.pack(folder).data)
    assert r.status_code == 201, r.text
    return str(r.json()["sha256"])


async def test_a_pack_is_its_uploaders_and_their_teams_only(
    scheduler: Running, as_user, tmp_path: Path
) -> None:
    alice, bob, carol = (
        await as_user("alice", "vision"),
        await as_user("bob", "vision"),
        await as_user("carol", "nlp"),
    )
    (tmp_path / "train.py").write_text(f"print('{tmp_path.name}')\n")
    code = await upload(alice, tmp_path)
    r = await carol.post("/api/v1/jobs", json=spec(code))
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "entrypoint.code", r.text
    r = await bob.post("/api/v1/jobs", json=spec(code))  # a teammate's pack
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    for reader in (alice, bob, scheduler.http):
        got = await reader.get(f"/api/v1/jobs/{job}/code")
        assert got.status_code == 200 and codepack.digest(got.content) == code
    assert (await carol.get(f"/api/v1/jobs/{job}/code")).status_code == 404
    assert (await carol.get(f"/api/v1/jobs/{job}-none/code")).status_code == 404


async def test_the_sweep_deletes_a_pack_no_job_runs_and_keeps_one_a_job_does(
    scheduler: Running, bus: Bus, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "train.py").write_text(f"print('a {tmp_path.name}')\n")
    (tmp_path / "b" / "train.py").write_text(f"print('b {tmp_path.name}')\n")
    kept, dropped = await upload(scheduler.http, tmp_path / "a"), await upload(scheduler.http, tmp_path / "b")
    assert (await scheduler.http.post("/api/v1/jobs", json=spec(kept))).status_code == 201
    gone = await code_packs.sweep(scheduler.pool, bus, scheduler.settings, grace_s=0)
    assert dropped in gone and kept not in gone
    assert await bus.has_object(subjects.CODE, kept) and not await bus.has_object(subjects.CODE, dropped)
