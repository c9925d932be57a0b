"""`vigil.Client` against a running gateway: typed answers, errors that name the field, live events."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

import vigil
from vigil.api import JobDetailOut, JobOut
from vigil.events import JobStateChanged
from vigil.jobstates import JobState
from vigil_common.bus import Bus

from .conftest import TOKEN, exit_rank, launched, start_ranks

pytestmark = pytest.mark.integration

RETRY_FOR_S = 30.0  # the submit default: what retries against no gateway would take


def client(scheduler, token: str = TOKEN) -> vigil.Client:
    return vigil.Client(scheduler.base_url, token, timeout_s=10)


async def test_submit_list_inspect_cancel_with_typed_answers(scheduler, nodes, tmp_path: Path) -> None:
    await nodes(slots=2).beat()
    spec = {"name": "sdk-job", "resources": {"nodes": 1, "gpus_per_node": 2}, "train": {"steps": 10}}
    path = tmp_path / "job.yaml"
    path.write_text("name: sdk-file\nresources: {gpus_per_node: 1}\n")
    with client(scheduler) as c:
        job = await asyncio.to_thread(c.submit, spec)
        from_file = await asyncio.to_thread(c.submit, path)
        from_text = await asyncio.to_thread(c.submit, "name: sdk-text\n")
        assert isinstance(job, JobOut) and job.name == "sdk-job" and job.state == JobState.PENDING
        assert (from_file.name, from_text.name) == ("sdk-file", "sdk-text")

        page = await asyncio.to_thread(c.jobs)
        assert [j.id for j in page.items] == [from_text.id, from_file.id, job.id]
        assert [j.id for j in (await asyncio.to_thread(c.jobs, "pending", limit=1)).items] == [from_text.id]
        detail = await asyncio.to_thread(c.job, job.id)
        assert isinstance(detail, JobDetailOut) and detail.transitions[0].to_state == JobState.PENDING

        assert (await asyncio.to_thread(c.cancel, job.id)).state == JobState.CANCELLED
        with pytest.raises(vigil.VigilError) as conflict:
            await asyncio.to_thread(c.cancel, job.id)
        assert conflict.value.status == 409
        audit = await asyncio.to_thread(c.audit, job.id)
        assert [r["action"] for r in audit.items] == ["cancel", "submit"]
        assert (await asyncio.to_thread(c.steps, job.id, aggregate=True)).items == []
        assert (await asyncio.to_thread(c.checkpoints, job.id)).items == []
        assert (await asyncio.to_thread(c.incidents, job.id)).items == []
        assert [n.alive for n in (await asyncio.to_thread(c.nodes)).items] == [True]
        assert len((await asyncio.to_thread(c.gpus)).items) == 2


async def test_errors_carry_the_status_and_name_the_field(scheduler) -> None:
    with client(scheduler) as c:
        with pytest.raises(vigil.VigilError) as bad:
            await asyncio.to_thread(c.submit, {"name": "x", "train": {"lr": 5}})
        assert bad.value.status == 422 and [f.field for f in bad.value.fields] == ["train.lr"]
        assert "train.lr" in str(bad.value)
        with pytest.raises(vigil.VigilError) as missing:
            await asyncio.to_thread(c.job, "no/such?job")
        assert missing.value.status == 404
    with client(scheduler, token="y" * 24) as wrong, pytest.raises(vigil.VigilError) as denied:
        await asyncio.to_thread(wrong.jobs)
    assert denied.value.status == 401
    with vigil.Client("http://127.0.0.1:9", TOKEN) as nowhere:
        with pytest.raises(vigil.VigilError) as down:
            nowhere.jobs()
        assert down.value.status is None and "cannot reach the gateway" in str(down.value)
        started = time.monotonic()
        with pytest.raises(vigil.VigilError):  # no gateway at all: no retries
            nowhere.submit({"name": "x"}, retry_for_s=RETRY_FOR_S)
        assert time.monotonic() - started < RETRY_FOR_S / 2  # retries would have taken all of it


async def test_wait_follows_the_job_to_its_end_and_returns_at_once_for_an_ended_one(
    scheduler, nodes, bus: Bus
) -> None:
    await nodes(slots=1).beat()
    seen: list[object] = []
    with client(scheduler) as c:
        job = await asyncio.to_thread(c.submit, {"name": "waited", "resources": {"gpus_per_node": 1}})
        waiting = asyncio.create_task(asyncio.to_thread(c.wait, job.id, on_event=seen.append))
        launch = await launched(bus, job.id)
        await start_ranks(bus, launch)
        await exit_rank(bus, launch, 0, 0)
        final = await asyncio.wait_for(waiting, 20)
        assert final.state == JobState.SUCCEEDED
        changes = [e.to_state for e in seen if isinstance(e, JobStateChanged)]
        assert changes[-1] == JobState.SUCCEEDED and JobState.RUNNING in changes

        again = await asyncio.wait_for(asyncio.to_thread(c.wait, job.id), 10)
        assert again.state == JobState.SUCCEEDED


async def test_a_submit_sent_again_with_its_idempotency_key_returns_the_first_job(scheduler) -> None:
    body = {"name": "once", "resources": {"gpus_per_node": 1}}
    headers = {"Idempotency-Key": "k-" + uuid.uuid4().hex}
    first = await scheduler.http.post("/api/v1/jobs", json=body, headers=headers)
    assert first.status_code == 201, first.text
    # sent again, five at once (a client retrying while its first answer was lost)
    again = await asyncio.gather(
        *(scheduler.http.post("/api/v1/jobs", json=body, headers=headers) for _ in range(5))
    )
    assert {(r.status_code, r.json()["id"]) for r in again} == {(200, first.json()["id"])}
    other = await scheduler.http.post("/api/v1/jobs", json={**body, "priority": 5}, headers=headers)
    assert other.status_code == 409 and "Idempotency-Key" in other.json()["message"], other.text
    for bad in ("has space", "x" * 256, "é".encode()):
        refused = await scheduler.http.post("/api/v1/jobs", json=body, headers={"Idempotency-Key": bad})
        assert refused.status_code == 422 and refused.json()["fields"][0]["field"] == "Idempotency-Key"
    jobs = (await scheduler.http.get("/api/v1/jobs")).json()["items"]
    assert [j["id"] for j in jobs if j["name"] == "once"] == [first.json()["id"]]


class CutOffOnce(httpx.HTTPTransport):
    """The first submit reaches the gateway, which makes the job; its answer is lost on the way back."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method == "POST" and self.cut == 0:
            self.cut += 1
            response.read()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response


async def test_the_client_retries_a_cut_off_submit_without_making_a_second_job(scheduler) -> None:
    transport = CutOffOnce()
    with vigil.Client(scheduler.base_url, TOKEN, transport=transport) as c:
        job = await asyncio.to_thread(c.submit, {"name": "cut-off", "resources": {"gpus_per_node": 1}})
    assert transport.cut == 1
    jobs = (await scheduler.http.get("/api/v1/jobs")).json()["items"]
    assert [j["id"] for j in jobs if j["name"] == "cut-off"] == [job.id]
