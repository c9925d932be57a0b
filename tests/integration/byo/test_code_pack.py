"""Code packages through the whole stack (scheduler and gateway, worker, real NATS and Postgres; one process,
as `vigil up`): a tiny plain-Python program submitted from a folder outside the node's code roots with
`Client.submit(spec, code=DIR)`, the folder edited while it runs, the job crashed once. The relaunch runs
the first hash, not the edited folder; a file the program wrote in its working directory is there later in
the same attempt. A pack whose stored bytes are not its hash fails the attempt with the reason and runs
nothing; a pack with a link out of itself is a 422 naming the entry."""

from __future__ import annotations

import asyncio
import gzip
import io
import re
import tarfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers import eventually
from tests.integration.guardian.test_e2e_ranks import TOKEN, Stack, whole_stack
from vigil import codepack
from vigil.client import Client
from vigil.events import JobStateChanged, LaunchJob, RankExited, RankStarted
from vigil.jobstates import TERMINAL_STATES
from vigil_cli.main import cli
from vigil_common import subjects

pytestmark = [pytest.mark.integration, pytest.mark.byo]

# Attempt 1 writes a file in its working directory, waits for the test's `go` (dropped in that directory),
# reads its file back and crashes; attempt 2 says which code it is and succeeds.
PROGRAM = """\
import os, pathlib, sys, time
VERSION = "first"
attempt = os.environ["VIGIL_ATTEMPT"]
print(f"version={VERSION} attempt={attempt} cwd={os.getcwd()}", flush=True)
pathlib.Path("written.txt").write_text(f"by attempt {attempt}")
if attempt == "1":
    deadline = time.monotonic() + 120
    while not pathlib.Path("go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("kept=" + pathlib.Path("written.txt").read_text(), flush=True)
    sys.exit(3)
"""


@pytest.fixture(scope="module")
async def stack(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    data_dir = tmp_path_factory.mktemp("codepack")
    async with whole_stack(nats_url, database_url, data_dir, "code", cpu_slots=1) as running:
        yield running


def spec(name: str) -> dict[str, object]:
    return {
        "name": f"{name}-{uuid.uuid4().hex[:4]}",
        "resources": {"nodes": 1, "gpus_per_node": 1},
        "entrypoint": {"argv": ["python", "train.py"]},
    }


def client(stack: Stack) -> Client:
    return Client(str(stack.http.base_url), TOKEN)


async def test_the_relaunch_runs_the_first_hash_in_a_writable_copy(stack: Stack, tmp_path: Path) -> None:
    src = tmp_path / "laptop"  # not under the node's code roots
    src.mkdir()
    (src / "train.py").write_text(PROGRAM)
    (src / ".vigilignore").write_text("data/\n")
    (src / "data").mkdir()
    (src / "data" / "big.bin").write_bytes(b"\0" * 1024)
    first = codepack.pack(src)
    job_id = ""
    with client(stack) as api:
        async with stack.bus.watch(subjects.ALL_LAUNCHES, subjects.ALL_STATUS) as events:
            job = await asyncio.to_thread(api.submit, spec("code"), code=src)
            job_id = job.id
            launches: list[LaunchJob] = []
            exits: list[RankExited] = []
            async with asyncio.timeout(120):
                async for event in events:
                    if event.job_id != job_id:
                        continue
                    if isinstance(event, LaunchJob):
                        launches.append(event)
                    if isinstance(event, RankExited):
                        exits.append(event)
                    if isinstance(event, RankStarted) and event.attempt == 1:
                        # edited mid-run on the user's machine: no attempt may run this
                        (src / "train.py").write_text(PROGRAM.replace('"first"', '"second"'))
                        work = (
                            stack.settings.data_dir.resolve()
                            / "runs"
                            / job_id
                            / "attempt-1"
                            / f"code-{stack.node}"
                        )

                        async def written(work: Path = work) -> bool:
                            return (work / "written.txt").exists()

                        await eventually(written, timeout=60, what="the program's own file")
                        (work / "go").touch()
                    if isinstance(event, JobStateChanged) and event.to_state in TERMINAL_STATES:
                        break
        assert event.to_state == "SUCCEEDED", event
        assert [launch.attempt for launch in launches] == [1, 2]
        assert {launch.spec.entrypoint.code for launch in launches if launch.spec.entrypoint} == {
            first.sha256
        }
        assert exits[0].exit_code == 3 and exits[-1].exit_code == 0
        logs = stack.settings.log_dir / job_id
        one = (logs / "attempt-1-rank-0.log").read_text()
        two = (logs / "attempt-2-rank-0.log").read_text()
        assert "version=first attempt=1" in one and "kept=by attempt 1" in one
        assert "version=first attempt=2" in two and "second" not in two
        assert (
            f"/runs/{job_id}/attempt-2/code-{stack.node}" in two
        )  # its own copy, not the folder it came from
        detail = await asyncio.to_thread(api.job, job_id)
        assert [a.code for a in detail.attempts] == [first.sha256, first.sha256]
        downloaded = await asyncio.to_thread(api.code, job_id)
        assert codepack.digest(downloaded) == first.sha256
        with tarfile.open(fileobj=io.BytesIO(downloaded), mode="r:gz") as tar:
            names = tar.getnames()
        assert "train.py" in names and not any(n.startswith("data") for n in names)


async def test_a_pack_whose_bytes_are_not_its_hash_fails_the_attempt_and_runs_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text("print('must not run')\n")
    wrong = "0" * 64  # stored under a name its bytes do not hash to (a damaged store)
    await stack.bus.put_object(subjects.CODE, wrong, codepack.pack(tmp_path).data)
    await stack.pool.execute(
        "INSERT INTO code_uploads (sha256, owner, bytes) VALUES ($1, 'admin', 1) ON CONFLICT DO NOTHING",
        wrong,
    )
    body = spec("damaged")
    body["entrypoint"] = {"argv": ["python", "train.py"], "code": wrong}
    async with stack.bus.watch(subjects.ALL_STATUS) as events:
        response = await stack.http.post("/api/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        async with asyncio.timeout(60):
            async for event in events:
                if event.job_id == job_id and isinstance(event, RankStarted):
                    pytest.fail("a rank ran code that is not its pack")
                if event.job_id == job_id and isinstance(event, RankExited):
                    break
    assert event.failure == "error" and "hash to" in (event.log_tail or ""), event
    await stack.http.post(f"/api/v1/jobs/{job_id}/cancel")


def crafted(name: str, link: str) -> bytes:
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, link
        tar.addfile(info)
    return raw.getvalue()


async def test_a_pack_with_a_link_out_of_itself_or_an_unknown_hash_is_a_422(stack: Stack) -> None:
    response = await stack.http.post(
        "/api/v1/code",
        content=crafted("src/keys", "../../../root/.ssh"),
        headers={"content-type": "application/octet-stream"},
    )
    assert response.status_code == 422, response.text
    assert "src/keys" in response.json()["fields"][0]["message"]
    body = spec("unknown")
    body["entrypoint"] = {"argv": ["python", "train.py"], "code": "f" * 64}
    response = await stack.http.post("/api/v1/jobs", json=body)
    assert response.status_code == 422 and response.json()["fields"][0]["field"] == "entrypoint.code"


async def test_the_guides_command_as_printed(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("import pathlib\npathlib.Path('out.txt').write_text('ok')\n")
    (project / "job.yaml").write_text(
        "name: guide\nresources: {nodes: 1, gpus_per_node: 1}\nentrypoint: {argv: [python, train.py]}\n"
    )
    monkeypatch.chdir(project)
    env = {"VIGIL_API_TOKEN": TOKEN, "VIGIL_API_URL": str(stack.http.base_url), "COLUMNS": "200"}

    async def vigil(*args: str) -> str:  # the CLI is synchronous: beside the loop that serves the gateway
        done = await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)
        assert done.exit_code == 0, done.output
        return done.output

    async with stack.bus.watch(subjects.ALL_STATUS) as events:
        printed = await vigil(*["submit", "job.yaml", "--code", "."])  # docs/guides/own-code.md
        found = re.search(r"submitted (\S+)", printed)
        assert found, printed
        async with asyncio.timeout(60):
            async for event in events:
                ended = isinstance(event, JobStateChanged) and event.to_state in TERMINAL_STATES
                if event.job_id == found[1] and ended:
                    break
    assert event.to_state == "SUCCEEDED", event
    await vigil("jobs", "code", found[1], "--extract", "-o", str(tmp_path / "back"))
    assert (tmp_path / "back" / "train.py").read_text() == (project / "train.py").read_text()


async def test_a_job_from_a_code_root_writes_in_its_own_view_and_never_in_the_root(stack: Stack) -> None:
    project = stack.settings.allowed_code_roots[0] / f"project-{uuid.uuid4().hex[:6]}"
    project.mkdir(parents=True)
    (project / "train.py").write_text(
        "import os, pathlib\n"
        "pathlib.Path('written.txt').write_text('by the job')\n"
        "print('kept=' + pathlib.Path('written.txt').read_text() + ' cwd=' + os.getcwd(), flush=True)\n"
    )
    body = spec("root")
    body["entrypoint"] = {"argv": ["python", "train.py"], "workdir": project.name}
    async with stack.bus.watch(subjects.ALL_STATUS) as events:
        response = await stack.http.post("/api/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        async with asyncio.timeout(60):
            async for event in events:
                ended = isinstance(event, JobStateChanged) and event.to_state in TERMINAL_STATES
                if event.job_id == job_id and ended:
                    break
    assert event.to_state == "SUCCEEDED", event
    view = stack.settings.data_dir.resolve() / "runs" / job_id / "attempt-1" / f"work-{stack.node}"
    log = (stack.settings.log_dir / job_id / "attempt-1-rank-0.log").read_text()
    assert f"kept=by the job cwd={view}" in log, log
    assert sorted(p.name for p in project.iterdir()) == ["train.py"]  # the code root is never written

    async def released() -> bool:  # the attempt's overlay (where the node has one) goes with its ranks
        return not view.is_mount()

    await eventually(released, timeout=30, what="the attempt's view unmounted")
