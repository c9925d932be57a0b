"""Who a rank is and what its worker told it, from the environment the worker launches it with: its
identity (job, attempt, rank, node), the job's spec, the data windows to skip (and how a data position
moves past them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from vigil import protocol as proto
from vigil.spec import JobSpec


@dataclass(frozen=True)
class Identity:
    """Which rank of which job this process is, from the environment the worker gives it."""

    job_id: str
    attempt: int
    rank: int
    world_size: int
    local_rank: int
    node: str

    @classmethod
    def from_env(cls) -> Identity | None:
        env = os.environ
        if proto.JOB_ID_ENV not in env:
            return None
        return cls(
            job_id=env[proto.JOB_ID_ENV],
            attempt=int(env.get(proto.ATTEMPT_ENV, "1")),
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            node=env.get(proto.NODE_ENV, "local"),
        )


def spec_from_env(env: Mapping[str, str]) -> JobSpec | None:
    """The job's spec the worker put in `VIGIL_JOB_SPEC`; None without one."""
    text = env.get(proto.JOB_SPEC_ENV)
    if not text:
        return None
    try:
        return JobSpec.model_validate_json(text)
    except ValueError as exc:
        raise ValueError(f"{proto.JOB_SPEC_ENV} is not a job spec: {exc}") from exc


def parse_windows(text: str | None) -> list[tuple[int, int]]:
    """`"10:12,40:41"` -> [(10, 12), (40, 41)]; ValueError naming the bad part."""
    windows = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        start, sep, end = part.partition(":")
        if not sep or not start.strip().isdigit() or not end.strip().isdigit() or int(end) <= int(start):
            raise ValueError(f"{proto.SKIP_DATA_ENV}: {part!r} is not a window 'start:end' with end > start")
        windows.append((int(start), int(end)))
    return windows


def first_position(position: int, skip_windows: list[tuple[int, int]]) -> int:
    """`position` itself, or the end of the skip window(s) [start, end) it falls into."""
    moved = True
    while moved:
        moved = False
        for start, end in skip_windows:
            if start <= position < end:
                position, moved = end, True
    return position
