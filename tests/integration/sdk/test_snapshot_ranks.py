"""`run.snapshot` / `run.restore` on two real ranks (gloo), each on a "node" of its own (its own snapshot
folder): rank 1's own copies are lost between the run and its relaunch, and it restores its state from
the copy rank 0 holds for it."""

from __future__ import annotations

import shutil
import textwrap

import pytest

from tests.integration.byo.ranks import torchrun
from vigil.manifest import MANIFEST, step_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROGRAM = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from vigil.boundary import Boundary
    from vigil.link import NullLink
    from vigil.manifest import step_dir
    from vigil.run import Identity, Run

    phase, root, shm = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    os.environ["VIGIL_SNAPSHOT_DIR"] = str(shm / f"node{rank}" / "j")  # each rank on a node of its own
    dist.init_process_group("gloo")
    who = Identity("j", 1, rank, 2, rank, f"node{rank}")
    if phase == "train":
        run = Run(who, NullLink(), checkpoint_root=root)
        w = torch.full((4,), 10.0 * rank)
        run.snapshot(lambda: {"w": w}, every=2)
        step = 0
        while step < 5:
            w += 1
            step = run.after_step(step + 1, Boundary(all_finite=True, agreed_seq=0))
        run.after_step(step, Boundary(all_finite=True, agreed_seq=0))  # waits for the last snapshot
        print(json.dumps({"rank": rank}))
    else:
        run = Run(who, NullLink(), checkpoint_root=root, resume_from=step_dir(root, "j", 2))
        got = run.restore()
        print(json.dumps({"rank": rank, "step": got.step, "w": got.state["w"].tolist()}))
    dist.destroy_process_group()
    """
)


def test_a_rank_that_lost_its_snapshots_restores_from_its_peers_copy(tmp_path):
    program, root, shm = tmp_path / "program.py", tmp_path / "ckpt", tmp_path / "shm"
    program.write_text(PROGRAM)
    disk = step_dir(root, "j", 2)  # the job's newest disk checkpoint: step 2
    disk.mkdir(parents=True)
    (disk / MANIFEST).write_text("{}")

    trained = torchrun(str(program), "train", str(root), str(shm), cwd=tmp_path)
    assert [r.code for r in trained] == [0, 0], [r.output[-2000:] for r in trained]
    assert (shm / "node0" / "j" / "peer_1" / "step_00000004.json").is_file()
    shutil.rmtree(shm / "node1" / "j" / "rank_1")  # rank 1's node lost its memory of the job

    restored = torchrun(str(program), "restore", str(root), str(shm), cwd=tmp_path)
    assert [r.code for r in restored] == [0, 0], [r.output[-2000:] for r in restored]
    got = {r.rank: r.result for r in restored}
    assert got[0] == {"rank": 0, "step": 4, "w": [4.0] * 4}  # the snapshot of step 4: after 4 steps
    assert got[1] == {"rank": 1, "step": 4, "w": [14.0] * 4}  # rank 1's own state, from rank 0's node
    assert "rank 1 takes its snapshot of step 4 from rank 0" in restored[1].output
