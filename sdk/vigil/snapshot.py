"""In-memory snapshots: each rank's shard of the training state in host memory, every N steps.

At a step boundary `Snapshots.take` copies the shard to host memory (the step's one blocking cost: a
memcpy) and hands it to a background thread, which serializes it, hashes it (SHA-256, as the disk
manifest does), writes it to the node's shared memory (`VIGIL_SNAPSHOT_DIR`, on /dev/shm: it outlives
the rank's process, not the node) and swaps it with its ring partner on another node where there is
one (`(rank + local_world) % world`, as GEMINI does) over a gloo group of its own. The next boundary
waits for that work, so a snapshot is whole, own copy and peer copy, one step after it was taken.

Layout under the job's snapshot folder on a node: `rank_<r>/step_<S>.bin` (rank r's own) and
`peer_<r>/step_<S>.bin` (rank r's shard held for it), each beside its `.json` manifest (step, data
position, skip windows, bytes, SHA-256), written last by an atomic rename: a torn snapshot has none
and is never whole. The newest `KEEP` of each are kept (`vigil.snapshot_files`).

The host copy of the newest disk checkpoint's step also stays in the process (`held`): an in-place
rollback to it (a rollback goes to a disk checkpoint's step) reads nothing. A relaunch (`resume`)
takes the newest step every rank has whole, its own copy or the one its peer holds. The choice is
`choose_step` (`vigil.snapshot_choice`, pure).
"""

from __future__ import annotations

import copy
import io
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vigil.errors import CheckpointError
from vigil.snapshot_choice import (
    Holdings,
    choose_resized,
    choose_step,
    provider,
    resized_provider,
    ring_partner,
    ring_source,
)
from vigil.snapshot_files import SnapshotFolder, SnapshotManifest, sha256_of

log = logging.getLogger("vigil")

# --- host copies ----------------------------------------------------------------------------------------


def to_host(state: Any) -> Any:
    """A copy of `state` in host memory: every tensor copied (the step's one blocking cost), containers
    rebuilt, any other object deep-copied (a loss scaler changes after the step)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: to_host(v) for k, v in state.items()}
    if isinstance(state, list):
        return [to_host(v) for v in state]
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(to_host(v) for v in state)
    if state is None or isinstance(state, int | float | str | bool | bytes):
        return state
    return copy.deepcopy(state)


def serialize(state: Any) -> memoryview:
    """`state` as torch.save writes it, in a buffer of its own (no further copy)."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getbuffer()


def deserialize(data: bytes | memoryview, safe_globals: list[Any] | None = None) -> Any:
    """Tensors and plain containers only (plus `safe_globals`), as Vigil reads any checkpoint."""
    import torch

    with torch.serialization.safe_globals(safe_globals or []):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


@dataclass
class Held:
    """A host copy kept in this process, for an in-place rollback."""

    state: Any
    manifest: SnapshotManifest


@dataclass(frozen=True)
class Restored:
    """What `Run.restore` gives a program: the snapshot's step, its state, the data position it read."""

    step: int
    state: Any  # resized: every rank's state of the job at its former size, in rank order
    data_position: int
    skip_windows: list[tuple[int, int]] = field(default_factory=list)  # those the snapshot's step had
    resized_from: int | None = None  # the job's size when the snapshot was taken, where it has changed since


@dataclass(frozen=True)
class Fetched:
    """A relaunch's shards: this rank's own (`world` is the job's size), or, where the job has changed its
    size since the snapshot, every shard of the job at its former size `world`, in rank order."""

    world: int
    shards: list[tuple[SnapshotManifest, bytes]]

    @property
    def manifest(self) -> SnapshotManifest:
        return self.shards[0][0]


@dataclass
class SnapshotCost:
    """What snapshots cost this rank so far: the step held by the copy and by waits for the background,
    and the background's own CPU time (on a CPU-only rank, taken from training's cores)."""

    taken: int = 0
    copy_s: float = 0.0
    wait_s: float = 0.0
    background_s: float = 0.0

    @property
    def each_s(self) -> float:
        """One snapshot's cost, on average: copy, wait and background CPU."""
        return (self.copy_s + self.wait_s + self.background_s) / self.taken if self.taken else 0.0


# --- a rank's snapshots ---------------------------------------------------------------------------------


class Snapshots:
    """One rank's snapshots: host copies, its files on the node, and the exchange with its ring partner.

    `group`: a gloo process group of all ranks, used by the background thread only (the exchange's
    sends never interleave with the training's collectives); None: no peer copies."""

    def __init__(
        self,
        folder: SnapshotFolder | None,
        *,
        job_id: str,
        rank: int,
        world: int,
        local_world: int,
        group: Any = None,
    ) -> None:
        self.folder = folder.at_world(world) if folder is not None else None
        self.job_id, self.rank, self.world = job_id, rank, world
        self.partner = ring_partner(rank, local_world, world) if group is not None else None
        self.source = ring_source(rank, local_world, world) if group is not None else None
        self.group = group
        self.held: dict[int, Held] = {}  # the newest disk checkpoint's step, in this process
        self.cost = SnapshotCost()
        self._pending: threading.Thread | None = None  # a daemon: a rank that dies does not wait for it
        self._error: BaseException | None = None

    # --- taking one ---------------------------------------------------------------------------------

    def take(
        self,
        step: int,
        state: Any,
        *,
        data_position: int,
        skip_windows: list[tuple[int, int]],
        pin: bool = False,
    ) -> float:
        """Every rank at the same step: copy `state` (references to the live tensors) to host memory, and
        persist and exchange it in the background; `pin` (the step of a disk checkpoint): keep the copy
        in the process too, for an in-place rollback to it. Returns the seconds the step was held."""
        waited = self.wait()
        t0 = time.perf_counter()
        host = to_host(state)
        copied = time.perf_counter() - t0
        m = SnapshotManifest(
            job_id=self.job_id,
            rank=self.rank,
            step=step,
            data_position=data_position,
            skip_windows=[tuple(w) for w in skip_windows],  # type: ignore[misc]
            bytes=0,
            sha256="0" * 64,
            world=self.world,
        )
        if pin:  # a rollback goes to a disk checkpoint's step: the newest one stays here, no other
            self.held = {step: Held(host, m)}
        self.cost.taken += 1
        self.cost.copy_s += copied
        if self.folder is not None:
            self._pending = threading.Thread(
                target=self._background, args=(host, m), name="vigil-snapshot", daemon=True
            )
            self._pending.start()
        return waited + copied

    def wait(self) -> float:
        """Wait for the last snapshot's background work (every rank at the same step); its seconds."""
        if self._pending is None:
            return 0.0
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        pending.join()
        waited = time.perf_counter() - t0
        self.cost.wait_s += waited
        if self._error is not None:  # an exchange that failed (its peer is gone) ends this rank too
            error, self._error = self._error, None
            raise RuntimeError(f"in-memory snapshot: {error}") from error
        return waited

    def finish(self, timeout_s: float = 120.0) -> None:
        """Before the process ends: let the last snapshot's background work end (up to `timeout_s`). A
        daemon thread still inside torch when the interpreter finalizes aborts the process (its C++
        frames cannot unwind), which would turn a clean exit, or a preemption, into a signal. An
        exchange that failed there is logged: the rank is leaving anyway."""
        pending = self._pending
        if pending is None:
            return
        pending.join(timeout_s)
        if pending.is_alive():
            log.error("vigil: in-memory snapshot still being written after %.0f s at exit", timeout_s)
            return
        self._pending = None
        if self._error is not None:
            log.warning("vigil: the last in-memory snapshot did not complete: %s", self._error)
            self._error = None

    def _background(self, host: Any, m: SnapshotManifest) -> None:
        t0 = time.thread_time()
        try:
            self._persist(host, m)
        except BaseException as exc:  # handed to the training thread at its next boundary
            self._error = exc
        finally:
            self.cost.background_s += time.thread_time() - t0

    def _persist(self, host: Any, m: SnapshotManifest) -> None:
        assert self.folder is not None
        data = serialize(host)
        m = m.model_copy(update={"bytes": len(data), "sha256": sha256_of(data)})
        try:
            self.folder.write("rank", m, data)
        except OSError as exc:  # a full tmpfs: no own copy of this step; the exchange still runs
            log.error("vigil: in-memory snapshot of step %d not written: %s", m.step, exc)
        if self.partner is not None:
            peer_m, peer_data = self._exchange(m, data)
            self.folder.write("peer", peer_m, peer_data)
        for former in self.folder.other_worlds():  # the job resized: this size has a snapshot of its own
            former.remove_world()

    def _exchange(self, m: SnapshotManifest, data: memoryview) -> tuple[SnapshotManifest, memoryview]:
        """Send this shard to the partner and receive the source's, on the snapshot group. Its hash is
        checked when it is loaded (as every snapshot's), not here: one SHA-256 less per snapshot."""
        head = m.model_dump_json().encode()
        got_head = _swap(head, self.partner, self.source, self.group)
        peer_m = SnapshotManifest.model_validate_json(bytes(got_head))
        peer_data = _swap(data, self.partner, self.source, self.group)
        if len(peer_data) != peer_m.bytes or (peer_m.job_id, peer_m.rank) != (self.job_id, self.source):
            raise CheckpointError(f"the peer copy of rank {peer_m.rank} step {peer_m.step} arrived cut short")
        return peer_m, peer_data

    # --- what this rank holds -------------------------------------------------------------------------

    def holdings(self) -> Holdings:
        if self.folder is None:
            return Holdings(self.rank)
        peer = {self.source: self.folder.whole("peer", self.source)} if self.source is not None else {}
        elsewhere: dict[tuple[int, int], tuple[int, ...]] = {}
        for former in self.folder.other_worlds():
            for kind, r in former.shards():
                steps = set(elsewhere.get((former.world, r), ())) | set(former.whole(kind, r))
                elsewhere[(former.world, r)] = tuple(sorted(steps))
        return Holdings(self.rank, self.folder.whole("rank", self.rank), peer, elsewhere)

    def in_process(self, step: int) -> Held | None:
        return self.held.get(step)

    def drop_after(self, step: int) -> None:
        """Forget every snapshot newer than `step` (a rollback's abandoned steps), here and on the node."""
        self.wait()
        self.held = {s: h for s, h in self.held.items() if s <= step}
        if self.folder is None:
            return
        shards: list[tuple[Literal["rank", "peer"], int]] = [("rank", self.rank)]
        if self.source is not None:
            shards.append(("peer", self.source))
        for kind, r in shards:
            for s in self.folder.steps(kind, r):
                if s > step:
                    self.folder.remove(kind, r, s)
        for former in self.folder.other_worlds():  # the job at its former size: abandoned steps too
            for kind, r in former.shards():
                for s in former.steps(kind, r):
                    if s > step:
                        former.remove(kind, r, s)

    def remove_all(self) -> None:
        """The job is done: this rank's files go (its own and those it held for its peer)."""
        self.wait()
        self.held.clear()
        if self.folder is not None:
            self.folder.remove_shard("rank", self.rank)
            if self.source is not None:
                self.folder.remove_shard("peer", self.source)
            for former in self.folder.other_worlds():
                former.remove_world()

    # --- a relaunch: agree on a step, then each rank gets its shard -----------------------------------

    def agree(self, *, lo: int, hi: int | None = None) -> tuple[int | None, list[Holdings]]:
        """Every rank (collective, main thread, on the snapshot group where there is one: the background
        thread is idle then): the newest step in [lo, hi] every rank can load."""
        import torch.distributed as dist

        mine = self.holdings()
        everyone: list[Any] = [mine]
        if dist.is_initialized() and self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, mine, group=self.group)
        return choose_step(everyone, self.world, lo=lo, hi=hi), everyone

    def resume(self, resume_from: str | Path, checkpoint_root: Path, *, skip: bool) -> Fetched | None:
        """Every rank (collective), on a relaunch from the disk checkpoint `resume_from`: this rank's shard
        of the newest snapshot every rank has whole, no older than that checkpoint; None: load the disk.

        Steps newer than the checkpoint are taken only on a relaunch from the job's newest checkpoint
        with no data to skip (`skip` False: a crash, a hang, a preemption); a rollback's relaunch to an
        older step takes a snapshot of that very step at most (the steps after it are abandoned). Every
        snapshot newer than the step loaded is dropped either way. Where the job changed its size since
        (elastic), the newest step of its former size whose every shard some node holds is taken, when it
        is newer than any of its present size: every rank gets every shard (`fetch_resized`)."""
        import torch.distributed as dist

        from vigil.manifest import checkpoints, step_of

        lo = step_of(resume_from)
        if self.folder is None or lo is None:
            return None
        newest: list[Any] = [None]
        if self.rank == 0:
            newest[0] = max((s for s, _ in checkpoints(checkpoint_root, self.job_id)), default=None)
        if dist.is_initialized() and self.world > 1:
            dist.broadcast_object_list(newest, src=0, group=self.group)
        hi = None if newest[0] == lo and not skip else lo
        step, holdings = self.agree(lo=lo, hi=hi)
        resized = choose_resized(holdings, lo=lo, hi=hi)
        got: Fetched | None = None
        if resized is not None and (step is None or resized[1] > step):
            world, step = resized
            got = Fetched(world, self.fetch_resized(world, step, holdings))
        elif step is not None:
            got = Fetched(self.world, [self.fetch(step, holdings)])
        self.drop_after(lo if step is None else step)
        return got

    def fetch(self, step: int, holdings: list[Holdings]) -> tuple[SnapshotManifest, bytes]:
        """Every rank (collective): its shard of `step`, from its own file or sent by the peer holding
        it (checked against the manifest on arrival, as on disk)."""
        assert self.folder is not None
        mine: tuple[SnapshotManifest, bytes] | None = None
        for r in range(self.world):
            src = provider(holdings, r, step)
            if src == r == self.rank:
                mine = self.folder.read("rank", r, step)
            elif src != r and self.rank in (src, r):
                assert src is not None
                if self.rank == src:
                    m, data = self.folder.read("peer", r, step)
                    _send(m.model_dump_json().encode(), r, self.group)
                    _send(data, r, self.group)
                else:
                    m = SnapshotManifest.model_validate_json(bytes(_recv(src, self.group)))
                    data = bytes(_recv(src, self.group))
                    if len(data) != m.bytes or sha256_of(data) != m.sha256 or (m.rank, m.step) != (r, step):
                        raise CheckpointError(f"the peer copy of rank {r} step {step} arrived corrupt")
                    mine = (m, data)
                    log.warning("vigil: rank %d takes its snapshot of step %d from rank %d", r, step, src)
        assert mine is not None
        return mine

    def fetch_resized(
        self, world: int, step: int, holdings: list[Holdings]
    ) -> list[tuple[SnapshotManifest, bytes]]:
        """Every rank (collective): every shard of `step` of the job at its former size `world`, in rank
        order, each sent by a rank whose node holds it (checked against its manifest on arrival). Every
        rank gets all of them: re-partitioning them to the present size needs the whole state."""
        import torch.distributed as dist

        assert self.folder is not None
        former = self.folder.at_world(world)
        out: list[tuple[SnapshotManifest, bytes]] = []
        for r in range(world):
            src = resized_provider(holdings, world, r, step)
            assert src is not None
            if self.rank == src:
                m, data = _read_any(former, r, step)
            if self.world > 1 and dist.is_initialized():
                head = _broadcast(m.model_dump_json().encode() if self.rank == src else b"", src, self.group)
                data = bytes(_broadcast(data if self.rank == src else b"", src, self.group))
                if self.rank != src:
                    m = SnapshotManifest.model_validate_json(bytes(head))
                    if len(data) != m.bytes or sha256_of(data) != m.sha256 or (m.rank, m.step) != (r, step):
                        raise CheckpointError(
                            f"the copy of rank {r} (of {world}) step {step} arrived corrupt"
                        )
            out.append((m, data))
        log.warning(
            "vigil: the job had %d ranks at step %d, %d now: every rank takes all %d shards",
            world,
            step,
            self.world,
            world,
        )
        return out


def _read_any(folder: SnapshotFolder, rank: int, step: int) -> tuple[SnapshotManifest, bytes]:
    """Rank `rank`'s shard of `step` from this node: its own copy, else the peer copy held for it."""
    try:
        return folder.read("rank", rank, step)
    except CheckpointError:
        return folder.read("peer", rank, step)


def _broadcast(data: bytes | memoryview, src: int, group: Any) -> memoryview:
    """`data` from rank `src` to every rank of `group` (its length first)."""
    import torch
    import torch.distributed as dist

    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(n, src, group=group)
    buf = _tensor(data) if dist.get_rank() == src else torch.empty(int(n.item()), dtype=torch.uint8)
    if int(n.item()):
        dist.broadcast(buf, src, group=group)
    return memoryview(buf.numpy())


def _send(data: bytes | memoryview, dst: int, group: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    dist.send(_tensor(data), dst, group=group)


def _recv(src: int, group: Any) -> memoryview:
    import torch
    import torch.distributed as dist

    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(buf, src, group=group)
    return memoryview(buf.numpy())


def _swap(data: bytes | memoryview, dst: int | None, src: int | None, group: Any) -> memoryview:
    """Send `data` to `dst` while receiving from `src` (both may be the same rank); no copy of either."""
    import torch
    import torch.distributed as dist

    assert dst is not None and src is not None
    n_out = torch.tensor([len(data)], dtype=torch.int64)
    n_in = torch.zeros(1, dtype=torch.int64)
    req = dist.isend(n_out, dst, group=group)
    dist.recv(n_in, src, group=group)
    req.wait()
    out = _tensor(data)
    buf = torch.empty(int(n_in.item()), dtype=torch.uint8)
    req = dist.isend(out, dst, group=group)
    dist.recv(buf, src, group=group)
    req.wait()
    return memoryview(buf.numpy())


def _tensor(data: bytes | memoryview) -> Any:
    """A uint8 tensor over `data`'s own memory where it is writable (a serialized snapshot), else a copy."""
    import torch

    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    if isinstance(data, memoryview) and not data.readonly:
        return torch.frombuffer(data, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
