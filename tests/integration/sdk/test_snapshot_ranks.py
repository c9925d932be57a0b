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
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (shm / f"node{rank}").mkdir(parents=True, exist_ok=True)  # its node's folder, as its worker makes it
    os.environ["VIGIL_SNAPSHOT_DIR"] = str(shm / f"node{rank}" / "j")  # each rank on a node of its own
    dist.init_process_group("gloo")
    who = Identity("j", 1, rank, world, rank, f"node{rank}")
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
        if got.resized_from:  # every former rank's state
            w = [state["w"].tolist() for state in got.state]
            print(json.dumps({"rank": rank, "step": got.step, "w": w, "from": got.resized_from}))
        else:
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
    assert (shm / "node0" / "j" / "world_2" / "peer_1" / "step_00000004.json").is_file()
    shutil.rmtree(shm / "node1" / "j" / "world_2" / "rank_1")  # rank 1's node lost its memory of the job

    restored = torchrun(str(program), "restore", str(root), str(shm), cwd=tmp_path)
    assert [r.code for r in restored] == [0, 0], [r.output[-2000:] for r in restored]
    got = {r.rank: r.result for r in restored}
    assert got[0] == {"rank": 0, "step": 4, "w": [4.0] * 4}  # the snapshot of step 4: after 4 steps
    assert got[1] == {"rank": 1, "step": 4, "w": [14.0] * 4}  # rank 1's own state, from rank 0's node
    assert "rank 1 takes its snapshot of step 4 from rank 0" in restored[1].output


@pytest.mark.parametrize("world", [1, 3])
def test_a_job_that_shrank_or_grew_gets_every_shard_of_its_former_size(tmp_path, world):
    """Elastic: 2 ranks took snapshots; node 1 is lost. The job goes on with 1 rank (shrank) on node 0, or
    with 3 (grew: nodes 1 and 2 new, nothing in their memory): every rank gets both former shards, node
    0's own copy of rank 0 and the peer copy it holds of rank 1, to re-partition."""
    program, root, shm = tmp_path / "program.py", tmp_path / "ckpt", tmp_path / "shm"
    program.write_text(PROGRAM)
    disk = step_dir(root, "j", 2)
    disk.mkdir(parents=True)
    (disk / MANIFEST).write_text("{}")
    trained = torchrun(str(program), "train", str(root), str(shm), cwd=tmp_path)
    assert [r.code for r in trained] == [0, 0], [r.output[-2000:] for r in trained]
    shutil.rmtree(shm / "node1")  # node 1 is gone, and its memory with it

    restored = torchrun(str(program), "restore", str(root), str(shm), world=world, cwd=tmp_path)
    assert [r.code for r in restored] == [0] * world, [r.output[-2000:] for r in restored]
    for r in restored:
        assert r.result == {"rank": r.rank, "step": 4, "w": [[4.0] * 4, [14.0] * 4], "from": 2}
    assert f"the job had 2 ranks at step 4, {world} now" in restored[0].output
