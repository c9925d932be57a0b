"""In-memory snapshots' pure logic and files, in one process (no process group): the ring partner, the
step every rank can load, the auto interval, the files' manifest and hashes, the host copies."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from vigil.errors import CheckpointError
from vigil.manifest import MANIFEST, step_dir
from vigil.snapshot import Snapshots, deserialize, serialize, to_host
from vigil.snapshot_choice import (
    Holdings,
    auto_interval,
    choose_resized,
    choose_step,
    provider,
    resized_provider,
    ring_partner,
    ring_source,
)
from vigil.snapshot_files import KEEP, SnapshotFolder, SnapshotManifest
from vigil.spec import CheckpointSpec


def test_the_ring_partner_is_on_the_next_node_and_every_rank_is_held_once():
    assert [ring_partner(r, 2, 4) for r in range(4)] == [2, 3, 0, 1]  # 2 nodes of 2: the other node
    assert [ring_partner(r, 1, 2) for r in range(2)] == [1, 0]
    assert [ring_partner(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]  # one node: the next rank
    assert ring_partner(0, 1, 1) is None
    for world, local in ((4, 2), (6, 3), (2, 1), (3, 3)):
        partners = [ring_partner(r, local, world) for r in range(world)]
        assert sorted(partners) == list(range(world)) and all(p != r for r, p in enumerate(partners))
        assert [ring_source(p, local, world) for p in partners] == list(range(world))  # type: ignore[arg-type]


def test_the_newest_step_every_rank_can_load_own_or_from_its_peer():
    both = [Holdings(0, (4, 6), {1: (4, 6)}), Holdings(1, (4, 6), {0: (4, 6)})]
    assert choose_step(both, 2, lo=0) == 6
    lost = [Holdings(0, (4, 6), {1: (4, 6)}), Holdings(1, (), {0: (4, 6)})]  # rank 1 lost its own copies
    assert choose_step(lost, 2, lo=0) == 6 and provider(lost, 1, 6) == 0 and provider(lost, 0, 6) == 0
    torn = [Holdings(0, (4, 6), {1: (4,)}), Holdings(1, (4,), {0: (4, 6)})]  # step 6 of rank 1 nowhere whole
    assert choose_step(torn, 2, lo=0) == 4
    assert choose_step(both, 2, lo=7) is None  # nothing as new as the disk checkpoint
    assert choose_step(both, 2, lo=4, hi=4) == 4  # a rollback's relaunch: that very step at most
    assert choose_step([Holdings(0, (6,))], 2, lo=0) is None  # rank 1 said nothing


def test_auto_takes_one_every_step_under_two_percent_of_the_step_else_spaces_them_under_one():
    assert auto_interval(0.001, 0.1) == 1
    assert auto_interval(0.002, 0.1) == 1
    assert auto_interval(0.0021, 0.1) == 3  # 2.1 ms per 100 ms step: every 3 steps is 0.7 %
    assert auto_interval(0.005, 0.1) == 5  # 5 ms: every 5 steps is 1 %
    assert auto_interval(0.5, 0.0) == 1


def test_memory_every_is_a_count_auto_or_zero_and_a_bad_one_names_the_field():
    assert CheckpointSpec().memory_every == "auto"
    assert CheckpointSpec(memory_every=0).memory_every == 0
    assert CheckpointSpec(memory_every=5).memory_every == 5
    with pytest.raises(ValueError, match="memory_every"):
        CheckpointSpec(memory_every=-1)
    with pytest.raises(ValueError, match="memory_every"):
        CheckpointSpec(memory_every="often")  # type: ignore[arg-type]


def _manifest(step: int, data: bytes, rank: int = 0) -> SnapshotManifest:
    import hashlib

    return SnapshotManifest(
        job_id="j",
        rank=rank,
        step=step,
        data_position=step,
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def test_a_snapshot_file_is_whole_only_with_its_manifest_and_matching_hash(tmp_path):
    folder = SnapshotFolder(tmp_path, "j")
    for step in (2, 4, 6):
        folder.write("rank", _manifest(step, b"x" * step), b"x" * step)
    assert folder.steps("rank", 0) == [4, 6][-KEEP:]  # the oldest pruned
    assert folder.read("rank", 0, 6)[1] == b"x" * 6

    (folder.shard_dir("rank", 0) / "step_00000006.bin").write_bytes(b"y" * 6)  # same size, other bytes
    with pytest.raises(CheckpointError, match="SHA-256"):
        folder.read("rank", 0, 6)
    assert folder.whole("rank", 0) == (4,)  # the corrupt one refused, and removed
    assert folder.steps("rank", 0) == [4]

    (folder.shard_dir("rank", 0) / "step_00000008.bin").write_bytes(
        b"z" * 8
    )  # torn: died before its manifest
    assert folder.whole("rank", 0) == (4,)
    other = SnapshotFolder(tmp_path, "another-job")
    with pytest.raises(CheckpointError, match="names j"):
        other.read("rank", 0, 4)
    bad = json.loads((folder.shard_dir("rank", 0) / "step_00000004.json").read_text()) | {"bytes": -1}
    (folder.shard_dir("rank", 0) / "step_00000004.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="unreadable"):
        folder.read("rank", 0, 4)


def test_a_host_copy_does_not_follow_the_live_tensors_and_round_trips():
    w = torch.ones(3)
    state = {"w": w, "groups": [{"lr": 0.1, "params": [0]}], "pair": (w, 2)}
    host = to_host(state)
    w.add_(1)
    assert torch.equal(host["w"], torch.ones(3)) and torch.equal(host["pair"][0], torch.ones(3))
    back = deserialize(serialize(host))
    assert torch.equal(back["w"], torch.ones(3)) and back["groups"] == [{"lr": 0.1, "params": [0]}]


def test_one_rank_takes_keeps_drops_and_resumes_its_snapshots(tmp_path):
    root = tmp_path / "ckpt"
    folder = SnapshotFolder(tmp_path / "shm", "j")
    snaps = Snapshots(folder, job_id="j", rank=0, world=1, local_world=1)
    w = torch.zeros(2)
    for step in range(1, 6):
        w += 1
        snaps.take(step, {"w": w}, data_position=step, skip_windows=[], pin=step == 2)
    snaps.wait()
    assert sorted(snaps.held) == [2]  # the pinned one (a disk checkpoint's) stays in the process
    assert torch.equal(snaps.in_process(2).state["w"], torch.full((2,), 2.0))  # type: ignore[union-attr]
    assert folder.steps("rank", 0) == [4, 5]
    assert snaps.cost.taken == 5

    # a relaunch from the newest disk checkpoint (step 2) takes the newest whole snapshot
    for step in (2,):
        d = step_dir(root, "j", step)
        d.mkdir(parents=True)
        (d / MANIFEST).write_text("{}")
    again = Snapshots(folder, job_id="j", rank=0, world=1, local_world=1)
    got = again.resume(step_dir(root, "j", 2), root, skip=False)
    assert got is not None and got.manifest.step == 5 and got.world == 1
    assert torch.equal(deserialize(got.shards[0][1])["w"], torch.full((2,), 5.0))
    # with data to skip it is a rollback's relaunch: nothing newer than its checkpoint (none of step 2)
    assert again.resume(step_dir(root, "j", 2), root, skip=True) is None
    assert folder.steps("rank", 0) == []  # the abandoned steps' snapshots dropped

    snaps.take(6, {"w": w}, data_position=6, skip_windows=[(1, 2)], pin=True)
    assert sorted(snaps.held) == [6]
    snaps.drop_after(5)
    assert not snaps.held and folder.steps("rank", 0) == []
    snaps.take(7, {"w": w}, data_position=7, skip_windows=[], pin=True)
    snaps.remove_all()
    assert not (tmp_path / "shm" / "rank_0").exists() and not snaps.held


def test_a_program_snapshots_through_its_run_and_restores_on_a_relaunch(tmp_path, monkeypatch):
    from vigil import protocol as proto
    from vigil.boundary import Boundary
    from vigil.link import NullLink
    from vigil.run import Identity, Run

    monkeypatch.setenv(proto.SNAPSHOT_DIR_ENV, str(tmp_path / "shm"))
    root, who = tmp_path / "ckpt", Identity("j", 1, 0, 1, 0, "n")
    run = Run(who, NullLink(), checkpoint_root=root)
    w = torch.zeros(2)
    run.snapshot(lambda: {"w": w}, every=2)
    step = 0
    while step < 5:
        w += 1
        step = run.after_step(step + 1, Boundary(all_finite=True, agreed_seq=0))
    run.wait_snapshots()
    d = step_dir(root, "j", 2)
    d.mkdir(parents=True)
    (d / MANIFEST).write_text("{}")

    relaunched = Run(who, NullLink(), checkpoint_root=root, resume_from=d)
    got = relaunched.restore()
    assert got is not None and got.step == 4 and got.data_position == 4
    assert torch.equal(got.state["w"], torch.full((2,), 4.0))  # what the state was after step 3
    assert Run(who, NullLink(), checkpoint_root=root).restore() is None  # a first launch: nothing


def test_a_run_ends_only_after_its_last_snapshot_is_written(tmp_path, monkeypatch):
    """The snapshot of a checkpoint's step is written in the background; a rank that closes its run
    right after (a preemption's emergency checkpoint) waits for it: a daemon thread still inside torch
    when the interpreter finalizes aborts the process."""
    from vigil import protocol as proto
    from vigil.link import NullLink
    from vigil.run import Identity, Run

    monkeypatch.setenv(proto.SNAPSHOT_DIR_ENV, str(tmp_path / "shm"))
    written = threading.Event()
    write = SnapshotFolder.write

    def slow_write(self, *args, **kwargs):
        threading.Event().wait(0.5)  # a large shard on a busy node
        write(self, *args, **kwargs)
        written.set()

    monkeypatch.setattr(SnapshotFolder, "write", slow_write)
    run = Run(Identity("j", 1, 0, 1, 0, "n"), NullLink(), checkpoint_root=tmp_path / "ckpt")
    run.snapshot(lambda: {"w": torch.ones(2)}, every=1000)
    run.save_checkpoint(3, lambda path: torch.save({}, path / "state.pt"))
    run.close()
    assert written.is_set() and not any(t.name == "vigil-snapshot" for t in threading.enumerate())
    assert SnapshotFolder(tmp_path / "shm", "j").steps("rank", 0) == [3]


def test_a_job_that_changed_size_takes_every_shard_of_its_former_size(tmp_path):
    root, folder = tmp_path / "ckpt", SnapshotFolder(tmp_path / "shm", "j")
    d = step_dir(root, "j", 2)
    d.mkdir(parents=True)
    (d / MANIFEST).write_text("{}")
    # two ranks on this node took steps 3 and 4 (no peer exchange: both shards are here)
    for rank in (0, 1):
        two = Snapshots(folder, job_id="j", rank=rank, world=2, local_world=2)
        for step in (3, 4):
            two.take(step, {"w": torch.full((2,), 10.0 * rank + step)}, data_position=step, skip_windows=[])
            two.wait()
    assert folder.at_world(2).steps("rank", 1) == [3, 4]

    one = Snapshots(folder, job_id="j", rank=0, world=1, local_world=1)
    got = one.resume(step_dir(root, "j", 2), root, skip=False)
    assert got is not None and got.world == 2 and got.manifest.step == 4
    assert [deserialize(data)["w"].tolist() for _, data in got.shards] == [[4.0, 4.0], [14.0, 14.0]]

    # the job at its new size takes a snapshot of its own: its former size's files go
    one.take(5, {"w": torch.zeros(2)}, data_position=5, skip_windows=[])
    one.wait()
    assert folder.at_world(1).other_worlds() == []
    assert not (tmp_path / "shm" / "world_2").exists()
    again = Snapshots(folder, job_id="j", rank=0, world=1, local_world=1)
    got = again.resume(step_dir(root, "j", 2), root, skip=False)
    assert got is not None and got.world == 1 and got.manifest.step == 5


def test_a_former_size_is_chosen_only_where_every_shard_is_held_and_newer_than_the_present_size():
    h0 = Holdings(0, own=(6,), elsewhere={(2, 0): (4, 8), (2, 1): (4,)})
    h1 = Holdings(1, own=(6,), elsewhere={(2, 1): (4, 8)})
    assert choose_resized([h0, h1], lo=0) == (2, 8)  # rank 1's node holds the other shard of step 8
    assert choose_resized([h0], lo=0) == (2, 4)  # alone, only step 4 is whole
    assert choose_resized([h0, h1], lo=0, hi=5) == (2, 4)
    assert choose_resized([h0, h1], lo=9) is None
    assert choose_resized([Holdings(0, own=(6,))], lo=0) is None
    assert resized_provider([h0, h1], 2, 1, 8) == 1


def test_a_rank_never_makes_its_nodes_snapshot_folder(tmp_path):
    """The node's folder is its worker's (0711): a rank that made it would own it and lock every other
    job's ranks out; the job's own folder under it a rank may make again."""
    gone = SnapshotFolder(tmp_path / "vigil-node" / "j", "j")
    with pytest.raises(FileNotFoundError):
        gone.write("rank", _manifest(1, b"x"), b"x")
    assert not (tmp_path / "vigil-node").exists()
    (tmp_path / "vigil-node").mkdir()
    gone.write("rank", _manifest(1, b"x"), b"x")
    assert gone.read("rank", 0, 1)[1] == b"x"
