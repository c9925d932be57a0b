"""`vigil.init()` and `Run`: the rank side of Vigil for any training program.

A few lines in an existing loop::

    run = vigil.init()                    # inert outside Vigil: every call below does nothing
    run.on_rollback(load)                 # optional: load(path) restores a checkpoint in place
    step = load(run.resume_from) if run.resume_from else 0
    while step < steps:
        loss = model(batch(run.position(step))); loss.backward()
        ok = run.agree(torch.isfinite(loss))      # every rank, same step: one small all-reduce
        if ok.all_finite:
            optimizer.step()
        optimizer.zero_grad()
        run.report(step, loss=loss.item(), lr=lr, tokens=tokens)
        if (step + 1) % 100 == 0:
            run.save_checkpoint(step + 1, save)   # save(path) writes this rank's files
        step = run.after_step(step + 1, ok)       # halt, roll back or stop here, on every rank

In-memory snapshots (`vigil.snapshot`): `run.snapshot(state_dict_fn)` registers what to copy; every
`checkpoint.memory_every` steps `after_step` copies it to host memory (the rest, its files on /dev/shm
and its peer copy on another node, happens in the background), and on a relaunch `run.restore()` gives
the newest snapshot every rank has whole, newer than `run.resume_from`, or None (load the disk one)::

    run.snapshot(lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()})
    if (got := run.restore()) is not None:
        model.load_state_dict(got.state["model"]); optimizer.load_state_dict(got.state["optim"])
        step = got.step
    elif run.resume_from:
        step = load(run.resume_from)

`after_step` returns the step to run next: `step + 1`, or a checkpoint's step after an in-place
rollback; the steps run again after it are reported with the next `run.generation` (0 on the attempt's
first run), so the abandoned run and the re-run stay two histories. A program that registered no loader
is stopped there (exit code 5, `vigil.exits`) and the scheduler relaunches it with `VIGIL_RESUME_FROM`
set to the checkpoint (`run.resume_from`). On a preemption notice it exits with code 4 after the
checkpoint `on_preemption` saves, if one is registered.

The built-in GPT trainer runs on this same `Run`: its link, its step boundary, its command handling and
its checkpoints (`vigil_worker.trainer`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vigil import events as ev
from vigil import manifest, stack_dump
from vigil import protocol as proto
from vigil import snapshot as snap
from vigil.boundary import Boundary, agree
from vigil.commands import act
from vigil.exits import EXIT_PREEMPTED, EXIT_RESTART, write_last_step
from vigil.link import AgentLink, Link, NullLink, connect_from_env
from vigil.preemption import PreemptionNotice
from vigil.spec import JobSpec

log = logging.getLogger("vigil")


class Restart(SystemExit):
    """Raised by `after_step` on every rank when the job must be relaunched from a checkpoint."""

    def __init__(self) -> None:
        super().__init__(EXIT_RESTART)


class Preempted(SystemExit):
    """Raised by `after_step` on every rank when the node is being preempted (the job is requeued)."""

    def __init__(self) -> None:
        super().__init__(EXIT_PREEMPTED)


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


class Run:
    """One rank's session with Vigil. Built by `vigil.init()`; inert (`active` False) outside Vigil."""

    def __init__(
        self,
        identity: Identity,
        link: Link,
        *,
        checkpoint_root: Path | None = None,
        keep: int = 5,
        resume_from: Path | None = None,
        skip_windows: list[tuple[int, int]] | None = None,
        spec: JobSpec | None = None,
    ) -> None:
        self.identity = identity
        self._spec = spec
        self.link = link
        self.checkpoint_root = checkpoint_root
        self.keep = keep
        self.resume_from = resume_from
        self.skip_windows: list[tuple[int, int]] = list(skip_windows or [])
        self.notice = PreemptionNotice()
        self.handled_seq = 0  # commands acted on (numbered from 1)
        self.halted = False
        self.generation = 0  # in-place rollbacks done in this attempt: which run of its steps this is
        self._loader: Callable[[Path], Any] | None = None
        self._emergency: Callable[[int], Any] | None = None
        self._next_step = 0
        self._snapshot_fn: Callable[[], Any] | None = None
        self._snapshots: snap.Snapshots | None = None
        self._last_report = time.perf_counter()
        self._closed = False

    # --- who and where ---------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True under Vigil (linked to an agent); False when the program runs alone."""
        return not isinstance(self.link, NullLink)

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    @property
    def spec(self) -> JobSpec | None:
        """The job's spec as submitted (read-only: a frozen `vigil.spec.JobSpec`), so a program
        reads `spec.train.steps` or `spec.checkpoint.every` instead of repeating them in its argv; None
        when the program runs alone (no `VIGIL_JOB_SPEC`). `spec.entrypoint.env` is empty: those
        variables are in `os.environ`."""
        return self._spec

    def checkpoint_dir(self, step: int) -> Path:
        """Where the checkpoint of `step` goes: `<root>/<job>/step_<step:08d>`."""
        if self.checkpoint_root is None:
            raise RuntimeError(f"vigil: no checkpoint root ({proto.CHECKPOINT_ROOT_ENV} is not set)")
        return manifest.step_dir(self.checkpoint_root, self.identity.job_id, step)

    # --- data positions --------------------------------------------------------------------------------

    def position(self, step: int) -> int:
        """The data position step `step` reads: the step itself, moved past every skipped window."""
        return self.first_position(step)

    def first_position(self, position: int) -> int:
        """`position`, or the end of the skipped window(s) it falls into."""
        moved = True
        while moved:
            moved = False
            for start, end in self.skip_windows:
                if start <= position < end:
                    position, moved = end, True
        return position

    def skipped(self, position: int) -> bool:
        """True when the guardian asked to skip the data at `position`."""
        return any(start <= position < end for start, end in self.skip_windows)

    # --- reporting -------------------------------------------------------------------------------------

    def emit(self, event: ev.Message) -> None:
        """Send any rank event (`protocol.FromRanks`) to the agent; never blocks."""
        self.link.emit(event)

    def report(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float | None = None,
        lr: float = 0.0,
        tokens: int = 0,
        step_time_s: float | None = None,
        data_position: int | None = None,
        skipped: bool = False,
        local_finite: bool | None = None,
        **timings: Any,
    ) -> None:
        """Report one step of this rank (every rank, every step). `step_time_s` defaults to the time since
        the last report; `timings` are StepCompleted's other fields (forward_time_s, comm_time_s, ...)."""
        now = time.perf_counter()
        seconds = step_time_s if step_time_s is not None else now - self._last_report
        self._last_report = now
        if not self.active:
            return
        loss = float(loss)
        self.link.emit(
            ev.StepCompleted(
                job_id=self.identity.job_id,
                attempt=self.identity.attempt,
                rank=self.identity.rank,
                node=self.identity.node,
                step=step,
                loss=loss,
                grad_norm=grad_norm,
                lr=float(lr),
                tokens=int(tokens),
                tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
                step_time_s=seconds,
                skipped=skipped,
                data_position=self.position(step) if data_position is None else data_position,
                local_finite=(loss == loss and abs(loss) != float("inf"))
                if local_finite is None
                else local_finite,
                generation=self.generation,
                **timings,
            )
        )

    # --- the step boundary -----------------------------------------------------------------------------

    def agree(self, finite: Any = True, *, oom: bool = False) -> Boundary:
        """Every rank, before its optimizer step: is the step finite everywhere, which commands are there,
        is a node preempted. One small all-reduce; `finite` a bool or a 0-d tensor."""
        return agree(
            finite,
            latest_seq=self.link.latest_seq,
            rank=self.identity.rank,
            world_size=self.identity.world_size,
            oom=oom,
            preempt=self.notice.requested,
        )

    def after_step(self, next_step: int, boundary: Boundary) -> int:
        """Every rank, after the step is reported: act on what the ranks agreed on. Returns the step to run
        next (`next_step`, or a checkpoint's after an in-place rollback). Halted, it waits here."""
        self._next_step = next_step
        if self._snapshots is not None and self._snapshot_fn is not None:
            self._snapshots.wait()  # the last one is whole (own and peer copy) one step after it was taken
            if next_step % self._snapshots.every == 0:
                self._take(next_step)
        if boundary.preempt:
            if self._emergency is not None:
                self._emergency(next_step)
            self.link.flush()
            log.warning("vigil: preempted after step %d; exiting to be requeued", next_step - 1)
            raise Preempted
        if boundary.agreed_seq > self.handled_seq or self.halted:
            act(self.link, self, boundary.agreed_seq, self.identity.attempt, _RunHandler(self))
        return self._next_step

    def on_rollback(self, load: Callable[[Path], Any]) -> None:
        """Register how to load a checkpoint folder in place; without it a rollback relaunches the job."""
        self._loader = load

    # --- in-memory snapshots ----------------------------------------------------------------------------

    def snapshot(self, state_dict_fn: Callable[[], Any], *, every: int | None = None) -> None:
        """Every rank, once, before its loop: `after_step` copies `state_dict_fn()` (this rank's shard:
        tensors and plain containers) to host memory every `every` steps (default: the spec's
        `checkpoint.memory_every`, "auto" taken as 1 here; 0: never)."""
        self._snapshot_fn = state_dict_fn
        if every is None:
            spec_every = self._spec.checkpoint.memory_every if self._spec is not None else 1
            every = 1 if spec_every == "auto" else int(spec_every)
        if every < 0:
            raise ValueError(f"vigil: snapshot every must be 0 (never) or more (got {every})")
        self._open_snapshots().every = every or 2**62

    @property
    def snapshotting(self) -> bool:
        """`snapshot` was called: `after_step` takes in-memory snapshots."""
        return self._snapshot_fn is not None

    def restore(self, *, safe_globals: list[Any] | None = None) -> snap.Restored | None:
        """Every rank, on a relaunch: the newest in-memory snapshot every rank has whole (its own copy, or
        the one its peer holds), no older than `resume_from`; None: none, load `resume_from` from disk.
        The state is read with `weights_only=True`: tensors, plain containers and `safe_globals`."""
        if self.resume_from is None or self.checkpoint_root is None:
            return None
        got = self._open_snapshots().resume(
            self.resume_from, self.checkpoint_root, skip=bool(self.skip_windows)
        )
        if got is None:
            return None
        m, data = got
        state = snap.deserialize(data, safe_globals)
        self.skip_windows = [tuple(w) for w in m.skip_windows]  # type: ignore[misc]
        log.info("vigil: restoring the in-memory snapshot of step %d", m.step)
        return snap.Restored(step=m.step, state=state, data_position=m.data_position)

    def _open_snapshots(self) -> snap.Snapshots:
        """Made once, by every rank together (the peer exchange's gloo group)."""
        if self._snapshots is None:
            folder = snap.snapshot_folder_from_env(self.identity.job_id)
            group = None
            if _distributed():
                import torch.distributed as dist

                everywhere: list[Any] = [None] * self.world_size
                dist.all_gather_object(everywhere, folder is not None)
                if all(everywhere):  # a rank without a folder: none of them writes (the exchange pairs)
                    group = dist.new_group(backend="gloo")
                else:
                    folder = None
            self._snapshots = snap.Snapshots(
                folder,
                job_id=self.identity.job_id,
                rank=self.rank,
                world=self.world_size,
                local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                group=group,
            )
        return self._snapshots

    def _take(self, step: int) -> None:
        assert self._snapshots is not None and self._snapshot_fn is not None
        self._snapshots.take(
            step, self._snapshot_fn(), data_position=self.position(step), skip_windows=self.skip_windows
        )

    def on_preemption(self, save: Callable[[int], Any]) -> None:
        """Register what to do before exiting on a preemption notice (e.g. save_checkpoint(step, ...))."""
        self._emergency = save

    # --- checkpoints -----------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        step: int,
        save: Callable[[Path], Any],
        *,
        data_position: int | None = None,
        skip_windows: list[tuple[int, int]] | None = None,
    ) -> Path:
        """Every rank: `save(path)` writes this rank's files of the checkpoint of `step` into `path` (rank 0
        alone, for a program whose rank 0 holds everything); then rank 0 hashes them into the manifest
        (written last, by an atomic rename), keeps the newest `keep` and reports `CheckpointSaved`."""
        path = self.checkpoint_dir(step)
        if self.rank == 0 and path.exists():  # an older timeline's checkpoint of this step
            shutil.rmtree(path)
        _barrier()
        path.mkdir(parents=True, exist_ok=True)
        save(path)
        _barrier()  # every rank's files are on disk
        if self.rank == 0:
            position = self.position(step) if data_position is None else data_position
            m = manifest.write_manifest(
                path,
                job_id=self.identity.job_id,
                step=step,
                data_position=position,
                skip_windows=self.skip_windows if skip_windows is None else skip_windows,
            )
            assert self.checkpoint_root is not None
            manifest.retain(self.checkpoint_root, self.identity.job_id, self.keep)
            self.emit(
                ev.CheckpointSaved(
                    job_id=self.identity.job_id,
                    attempt=self.identity.attempt,
                    step=step,
                    path=str(path),
                    bytes=m.bytes,
                    manifest_sha256=m.sha256,
                    data_position=position,
                )
            )
            log.info("vigil: checkpoint of step %d saved in %s (%d bytes)", step, path, m.bytes)
        _barrier()
        return path

    def resume_checkpoint(self) -> manifest.Manifest | None:
        """The checkpoint Vigil relaunched this job from (`resume_from`), verified as `choose_checkpoint`
        verifies one (the same choice on every rank); None when the job starts from scratch. What every
        integration's resume reads (hf's and lightning's `resume_checkpoint`, deepspeed's `resume`)."""
        if self.resume_from is None:
            return None
        chosen = self.choose_checkpoint(str(self.resume_from), manifest.step_of(self.resume_from))
        log.info("vigil: resuming from %s (step %d)", chosen.path, chosen.step)
        return chosen

    def choose_checkpoint(self, requested: str, requested_step: int | None) -> manifest.Manifest:
        """Rank 0 verifies the checkpoint asked for (or falls back to the newest valid one before it) and
        every rank gets its choice, so all load the same one. CheckpointError when there is none."""
        from vigil.errors import CheckpointError

        assert self.checkpoint_root is not None
        choice: list[Any] = [None, ""]
        if self.rank == 0:
            job = manifest.job_dir(self.checkpoint_root, self.identity.job_id)
            try:
                choice[0] = manifest.verify(requested, root=job)
            except CheckpointError as exc:
                log.error("vigil: refusing checkpoint %s: %s", requested, exc)
                if requested_step is not None:
                    self.refuse_checkpoint(requested, requested_step, "hash", exc)
                before = None if requested_step is None else requested_step - 1
                choice[0] = manifest.newest_valid(
                    self.checkpoint_root, self.identity.job_id, at_or_before=before
                )
                choice[1] = str(exc)
        _broadcast(choice)
        if choice[0] is None:
            raise CheckpointError(f"no valid checkpoint at or before step {requested_step}: {choice[1]}")
        return choice[0]

    def refuse_checkpoint(
        self, path: str | Path, step: int, reason: ev.CheckpointRefusal, error: BaseException | str
    ) -> None:
        """Report that the checkpoint `path` (of `step`) did not load on this rank (`reason` "hash": it
        failed its manifest; "load": it verified and still raised): the scheduler marks it bad and no
        relaunch or rollback takes it again. Waits until the report is stored (the rank may exit next)."""
        self.emit(
            ev.CheckpointRefused(
                job_id=self.identity.job_id,
                attempt=self.identity.attempt,
                step=step,
                path=str(path),
                reason=reason,
                message=str(error)[:2000],
                node=self.identity.node,
            )
        )
        self.link.flush()

    # --- the end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Send what is queued and disconnect (also run at exit)."""
        if self._closed:
            return
        self._closed = True
        self.link.close()
        last = getattr(self.link, "last_step", None)
        if last is not None:
            with contextlib.suppress(OSError):
                write_last_step(last)  # the worker's RankExited.last_step


class _RunHandler:
    """What the job's commands do to a program driven through `Run`."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def halt(self, command: ev.HaltJob) -> None:
        run = self.run
        log.warning("vigil: halted after step %d: %s", run._next_step - 1, command.reason)
        if run.rank == 0:
            run.emit(
                ev.RanksHalted(
                    job_id=run.identity.job_id,
                    attempt=run.identity.attempt,
                    step=max(run._next_step - 1, 0),
                    command_id=command.event_id,
                    node=run.identity.node,
                )
            )

    def rollback(self, command: ev.RollbackJob, seq: int) -> None:
        run = self.run
        if run._snapshots is not None:  # the steps after the checkpoint are abandoned, in memory too
            run._snapshots.drop_after(command.step)
        if run._loader is None:  # no way to load in place: stop, and be relaunched from the checkpoint
            if run.rank == 0:
                run.emit(
                    ev.RestartRequested(
                        job_id=run.identity.job_id,
                        attempt=run.identity.attempt,
                        checkpoint=command.checkpoint,
                        step=command.step,
                        skip_data=command.skip_data,
                        command_id=command.event_id,
                        node=run.identity.node,
                    )
                )
                run.link.flush()
            _barrier()  # nobody exits before rank 0's request is stored
            log.warning("vigil: rollback to step %d asks for a relaunch (no in-place loader)", command.step)
            raise Restart
        t0 = time.perf_counter()
        from_step = max(run._next_step - 1, 0)
        m = run.choose_checkpoint(command.checkpoint, command.step)
        run._loader(m.path)
        if run._snapshots is not None:  # an older one than asked, where that one was refused
            run._snapshots.drop_after(m.step)
        run.skip_windows = list(m.skip_windows)
        if command.skip_data:
            run.skip_windows.append(tuple(command.skip_data))  # type: ignore[arg-type]
        run._next_step = m.step
        run.generation += 1  # the steps from m.step on are a new run of them, beside the abandoned one
        duration = time.perf_counter() - t0
        log.warning(
            "vigil: rolled back from step %d to %d (%s) in %.3fs", from_step, m.step, m.path, duration
        )
        if run.rank == 0:
            run.emit(
                ev.RollbackCompleted(
                    job_id=run.identity.job_id,
                    attempt=run.identity.attempt,
                    from_step=from_step,
                    to_step=m.step,
                    checkpoint=str(m.path),
                    skip_data=command.skip_data,
                    command_id=command.event_id,
                    duration_s=duration,
                    node=run.identity.node,
                )
            )

    def resume(self, command: ev.ResumeJob) -> None:
        log.warning("vigil: resumed at step %d", self.run._next_step)


def _distributed() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        import torch.distributed as dist

        dist.barrier()


def _broadcast(objects: list[Any]) -> None:
    if _distributed():
        import torch.distributed as dist

        dist.broadcast_object_list(objects, src=0)


_current: Run | None = None
_lock = threading.Lock()


def init() -> Run:
    """This rank's `Run` (the same one on every call): linked to the agent that started the process, or
    inert, with one log line, when the program runs outside Vigil."""
    global _current
    with _lock:
        if _current is not None:
            return _current
        identity = Identity.from_env()
        if identity is None or not os.environ.get(proto.AGENT_SOCKET_ENV):
            log.warning("vigil: not running under Vigil (no %s): reporting is off", proto.AGENT_SOCKET_ENV)
            identity = identity or Identity("local", 1, 0, 1, 0, "local")
            _current = Run(identity, NullLink(), spec=spec_from_env(os.environ))
            return _current
        link: Link = connect_from_env(identity.job_id, identity.attempt, identity.rank) or NullLink()
        env = os.environ
        root = env.get(proto.CHECKPOINT_ROOT_ENV)
        resume = env.get(proto.RESUME_FROM_ENV)
        _current = Run(
            identity,
            link,
            checkpoint_root=Path(root) if root else None,
            keep=int(env.get(proto.CHECKPOINT_KEEP_ENV, "5")),
            resume_from=Path(resume) if resume else None,
            skip_windows=parse_windows(env.get(proto.SKIP_DATA_ENV)),
            spec=spec_from_env(env),
        )
        if threading.current_thread() is threading.main_thread():
            _current.notice.install()  # SIGUSR1 from the worker: a preemption notice
        stack_dump.install()  # SIGUSR2 from the worker: every thread's stack (when py-spy cannot read us)
        atexit.register(_current.close)
        if isinstance(link, AgentLink):
            log.info(
                "vigil: rank %d of %s attempt %d linked to its agent",
                identity.rank,
                identity.job_id,
                identity.attempt,
            )
        return _current
