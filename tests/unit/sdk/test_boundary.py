"""The step boundary's one all-reduce over a real gloo process group of two ranks: every rank learns
every rank's loss, bit for bit the same on both, a non-finite one as NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vigil.boundary import agree

LOSSES = (2.718281828459045, float("inf"))  # rank 1's loss is not finite


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        loss = torch.tensor(LOSSES[rank], dtype=torch.float32)
        got = agree(
            torch.isfinite(loss).float(), latest_seq=3 + rank, rank=rank, world_size=2, oom=False, loss=loss
        )
        Path(out, f"{rank}.json").write_text(json.dumps(list(got)))  # NaN as JSON's NaN
    finally:
        dist.destroy_process_group()


def test_every_rank_learns_every_ranks_loss_in_the_same_collective(tmp_path):
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    a, b = ((tmp_path / f"{r}.json").read_text() for r in (0, 1))
    assert a == b  # the same numbers on both ranks
    all_finite, agreed_seq, oom_rank, preempt, losses = json.loads(a)
    assert (all_finite, agreed_seq, oom_rank, preempt) == (False, 4, None, False)
    assert losses[0] == float(torch.tensor(LOSSES[0], dtype=torch.float32)) and math.isnan(losses[1])


def test_without_a_process_group_the_answer_is_this_ranks_own():
    got = agree(torch.tensor(1.0), latest_seq=2, rank=0, world_size=1, loss=torch.tensor(1.5))
    assert got.all_finite and got.agreed_seq == 2 and got.losses == (1.5,)
    assert agree(torch.tensor(1.0), latest_seq=0, rank=0, world_size=1).losses is None
