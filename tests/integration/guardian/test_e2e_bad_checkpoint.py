"""A checkpoint that fails to load is marked bad, and the relaunch takes the previous valid one: real
DeepSpeed ranks through the whole stack, a real checkpoint corrupted on disk between its save and the
relaunch that would load it (the rank crashes two steps later: an injected `crash` fault).

- bytes flipped in a shard: rank 0's verify refuses it (hash), the ranks resume from the checkpoint before;
- bytes flipped and the manifest rewritten to match (what a program that can write the folder does): it
  verifies, DeepSpeed's load raises, the checkpoint is refused (load), and the next attempt resumes from
  the one before instead of failing max_attempts times on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.guardian.test_e2e_ranks import TINY, TRAIN, Run, Stack, whole_stack
from vigil.events import (
    TERMINAL_STATES,
    CheckpointRefused,
    CheckpointSaved,
    JobStateChanged,
    LaunchJob,
    StepCompleted,
)
from vigil.manifest import MANIFEST, write_manifest
from vigil_common import subjects

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EVERY, CRASH_AT, STEPS = 3, 8, 12  # checkpoints 0, 3, 6; the crash at 8 relaunches from 6 (corrupted)


@pytest.fixture(scope="module")
async def stack(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    data = tmp_path_factory.mktemp("e2e-bad-ckpt")
    async with whole_stack(nats_url, database_url, data, "badckpt") as running:
        yield running


def flip_bytes(ckpt: Path, *, rewrite_manifest: bool) -> Path:
    """Flip the first bytes of the checkpoint's model-state shard (its zip header: no torch reader takes
    it); with `rewrite_manifest`, re-hash the folder so that the checkpoint verifies."""
    (shard,) = sorted(ckpt.rglob("*model_states.pt"))
    raw = bytearray(shard.read_bytes())
    raw[:16] = bytes(b ^ 0xFF for b in raw[:16])
    shard.write_bytes(bytes(raw))
    if rewrite_manifest:
        body = json.loads((ckpt / MANIFEST).read_text())
        write_manifest(
            ckpt,
            job_id=body["job_id"],
            step=body["step"],
            data_position=body["data_position"],
            skip_windows=[tuple(w) for w in body["skip_windows"]],
        )
    return shard


async def train_corrupting(stack: Stack, spec: dict[str, Any], step: int, *, rewrite: bool) -> Run:
    """Submit `spec`; the moment the checkpoint of `step` is reported saved, corrupt it (the crash two
    steps later relaunches the job, which would load it); collect the job's events until it ends."""
    run: Run | None = None
    ended, corrupted = asyncio.Event(), asyncio.Event()
    watched = (subjects.ALL_LAUNCHES, subjects.ALL_STEPS, subjects.ALL_STATUS, subjects.ALL_INCIDENTS)
    async with stack.bus.watch(*watched) as events:

        async def collect() -> None:
            async for e in events:
                if run is None or e.job_id != run.job_id:
                    continue
                run.events.append(e)
                if isinstance(e, CheckpointSaved) and e.step == step and not corrupted.is_set():
                    flip_bytes(Path(e.path), rewrite_manifest=rewrite)
                    corrupted.set()
                if isinstance(e, JobStateChanged) and e.to_state in TERMINAL_STATES:
                    ended.set()

        collector = asyncio.create_task(collect())
        response = await stack.http.post("/api/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        run = Run(response.json()["id"])
        try:
            await asyncio.wait_for(ended.wait(), 300)
        finally:
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
    assert corrupted.is_set()
    return run


def spec(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "resources": {"nodes": 1, "gpus_per_node": 2},
        "model": TINY,
        "train": {**TRAIN, "steps": STEPS},
        "checkpoint": {"every": EVERY, "keep": 10, "memory_every": 0},  # the relaunch reads the disk
        "faults": [{"kind": "crash", "step": CRASH_AT, "rank": 1}],
    }


async def checkpoint_rows(stack: Stack, job_id: str) -> dict[int, tuple[int, bool, str | None]]:
    """step -> (attempt that saved it, valid, why it was refused) in the scheduler's table."""
    rows = await stack.pool.fetch(
        "SELECT step, attempt, valid, refused FROM scheduler_checkpoints WHERE job_id = $1", job_id
    )
    return {r["step"]: (r["attempt"], r["valid"], r["refused"]) for r in rows}


def first_steps(run: Run) -> dict[int, int]:
    """Each attempt's first step (where it resumed)."""
    out: dict[int, int] = {}
    for e in run.of(StepCompleted):
        out[e.attempt] = min(out.get(e.attempt, e.step), e.step)
    return out


async def test_a_shard_with_flipped_bytes_is_refused_and_the_job_resumes_from_the_one_before(stack: Stack):
    run = await train_corrupting(stack, spec("bad-ckpt-hash"), 6, rewrite=False)
    assert run.of(JobStateChanged)[-1].to_state == "SUCCEEDED"
    assert [launch.resume_from for launch in run.of(LaunchJob)][1].endswith("step_00000006")
    (refused,) = run.of(CheckpointRefused)
    assert (refused.step, refused.reason, refused.attempt) == (6, "hash", 2)
    assert "SHA-256" in refused.message
    assert first_steps(run) == {1: 0, 2: 3}  # resumed from step 3, the newest valid one before 6
    assert max(e.step for e in run.of(StepCompleted) if e.attempt == 2) == STEPS - 1
    rows = await checkpoint_rows(stack, run.job_id)
    assert rows[6] == (2, True, None)  # saved again by the resumed attempt: a new, sound checkpoint


async def test_a_checkpoint_that_verifies_but_does_not_load_is_marked_bad_and_skipped(stack: Stack):
    run = await train_corrupting(stack, spec("bad-ckpt-load"), 6, rewrite=True)
    assert run.of(JobStateChanged)[-1].to_state == "SUCCEEDED"
    resumed = {launch.attempt: launch.resume_from for launch in run.of(LaunchJob)}
    assert resumed[2].endswith("step_00000006")  # the scheduler knew nothing against it yet
    assert resumed[3].endswith("step_00000003")  # marked bad: the relaunch takes the one before
    assert max(resumed) == 3  # not max_attempts relaunches on the same checkpoint
    refusals = run.of(CheckpointRefused)
    assert refusals and {(r.step, r.reason, r.attempt) for r in refusals} == {(6, "load", 2)}
    assert first_steps(run)[3] == 3
    assert max(e.step for e in run.of(StepCompleted) if e.attempt == 3) == STEPS - 1
    rows = await checkpoint_rows(stack, run.job_id)
    assert rows[3] == (1, True, None) and rows[6] == (3, True, None)  # step 6 saved again, sound
