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

In-memory snapshots: `run.snapshot(state_dict_fn)` registers what `after_step` copies to host memory,
and on a relaunch `run.restore()` gives the newest one every rank has whole, or None (the README's
"In-memory snapshots").

`after_step` returns the step to run next: `step + 1`, or a checkpoint's step after an in-place
rollback; the steps run again after it are reported with the next `run.generation` (0 on the attempt's
first run), so the abandoned run and the re-run stay two histories. A program that registered no loader
is stopped there (exit code 5, `vigil.exits`) and the scheduler relaunches it with `VIGIL_RESUME_FROM`
set to the checkpoint (`run.resume_from`). On a preemption notice it exits with code 4 after the
checkpoint `on_preemption` saves, if one is registered.

The built-in GPT trainer is an ordinary user of this same `Run` (`vigil_trainer`): its reports,
step boundary, commands, rollbacks (its loaders registered with `on_rollback` and `snapshot(load=)`),
checkpoints and snapshots. The checkpoint protocol is `vigil.checkpoints`, what the commands do
`vigil.recovery`, the snapshot schedule `vigil.run_snapshots`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from vigil import events as ev
from vigil import manifest, stack_dump
from vigil import protocol as proto
from vigil import snapshot as snap
from vigil.boundary import Boundary, Carrier, agree
from vigil.checkpoints import Checkpoints
from vigil.elastic import Resize, resize_of
from vigil.exits import EXIT_PREEMPTED, write_exit_file, write_last_step
from vigil.identity import Identity, first_position, parse_windows, spec_from_env
from vigil.link import AgentLink, Link, NullLink, connect_from_env
from vigil.preemption import PreemptionNotice
from vigil.recovery import Preempted, Restart, Rollback, RunCommands, RunState, act
from vigil.run_snapshots import RunSnapshots
from vigil.spec import JobSpec

__all__ = ["Identity", "Preempted", "Restart", "Rollback", "Run", "init", "parse_windows", "spec_from_env"]

log = logging.getLogger("vigil")


class Run:
    """One rank's session with Vigil. Built by `vigil.init()`; inert (`active` False) outside Vigil.

    What a program reads: `identity`, `spec`, `active`, `rank`, `world_size`, `checkpoint_root`,
    `resume_from`, `skip_windows`, `generation`, `last_rollback`, `notice`. What it calls: below, each
    section in the order a loop meets it."""

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
        self._link = link
        self.checkpoint_root = checkpoint_root
        self.resume_from = resume_from
        self.notice = PreemptionNotice()  # listens once installed (`init` does, in the main thread)
        checkpoints = Checkpoints(checkpoint_root, identity, keep=keep, emit=self.emit, flush=link.flush)
        # where the run is in its steps, and what its commands use: shared with them (`vigil.recovery`)
        self._state = RunState(identity, link, checkpoints, skip_windows=list(skip_windows or []))
        self._commands = RunCommands(self._state)
        self._emergency: Callable[[int], Any] | None = None
        self._carrier: Carrier | None = None  # the boundary inside DDP's gradient all-reduce (`carry`)
        self._last_report = time.perf_counter()
        self._step_s = 0.0  # the last reported step's seconds
        self._closed = False

    # --- who and where ---------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True under Vigil (linked to an agent); False when the program runs alone."""
        return not isinstance(self._link, NullLink)

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    @property
    def generation(self) -> int:
        """In-place rollbacks done in this attempt: which run of its steps this is (0: the first)."""
        return self._state.generation

    @property
    def last_rollback(self) -> Rollback | None:
        """The newest in-place rollback of this attempt, as this rank did it."""
        return self._state.last_rollback

    @property
    def skip_windows(self) -> list[tuple[int, int]]:
        """The data windows skipped, [start, end) in data positions."""
        return self._state.skip_windows

    @skip_windows.setter
    def skip_windows(self, windows: list[tuple[int, int]]) -> None:
        self._state.skip_windows = list(windows)

    @property
    def spec(self) -> JobSpec | None:
        """The job's spec as submitted (read-only: a frozen `vigil.spec.JobSpec`), so a program
        reads `spec.train.steps` or `spec.checkpoint.every` instead of repeating them in its argv; None
        when the program runs alone (no `VIGIL_JOB_SPEC`). `spec.entrypoint.env` is empty: those
        variables are in `os.environ`."""
        return self._spec

    # --- data positions --------------------------------------------------------------------------------

    def position(self, step: int) -> int:
        """The data position step `step` reads: the step itself, moved past every skipped window."""
        return first_position(step, self.skip_windows)

    # --- reporting -------------------------------------------------------------------------------------

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
        self._last_report, self._step_s = now, seconds
        if not self.active:
            return
        loss = float(loss)
        self._link.emit(
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

    def emit(self, event: ev.Message) -> None:
        """Send any other rank event (`protocol.FromRanks`: a replayed step, an out-of-memory halt) to the
        agent; never blocks."""
        self._link.emit(event)

    # --- the step boundary -----------------------------------------------------------------------------

    def agree(self, finite: Any = True, *, oom: bool = False, loss: Any = None) -> Boundary:
        """Every rank, before its optimizer step: is the step finite everywhere, which commands are there,
        did a rank run out of memory (`oom`: this one did), is a node preempted, and (given `loss`, a
        0-d tensor) every rank's loss. One small all-reduce; `finite` a bool or a 0-d tensor.

        After `carry`, where this step's backward carried the boundary in DDP's all-reduce, no
        all-reduce runs here: `finite` must then judge only this rank's loss and the gradients after
        DDP's all-reduce (the same on every rank), and the losses are those `carry`'s `loss` gave. An
        out-of-memory rank always agrees through the all-reduce (its backward did not finish)."""
        if self._carrier is not None and not oom:
            got = self._carrier.take(finite, losses=loss is not None)
            if got is not None:
                return got
        return agree(
            finite,
            latest_seq=self._link.latest_seq,
            rank=self.identity.rank,
            world_size=self.identity.world_size,
            oom=oom,
            preempt=self.notice.requested,
            loss=loss,
        )

    def carry(self, ddp: Any, loss: Callable[[], Any] | None = None) -> bool:
        """Every rank alike: carry the step boundary inside `ddp`'s gradient all-reduce (a
        `DistributedDataParallel` over every rank; `vigil.boundary.Carrier`), so that `agree` after a
        backward that synchronised gradients runs no collective of its own. `loss()` gives this rank's
        loss for the step (a 0-d tensor) when the backward reaches DDP's all-reduce. False, and `agree`
        stays one all-reduce, where DDP takes no such hook; `carry(None)` stops carrying."""
        self._carrier = None
        if ddp is None:
            return False
        carrier = Carrier(
            rank=self.identity.rank,
            world_size=self.identity.world_size,
            news=lambda: (self._link.latest_seq, self.notice.requested),
            loss=loss or (lambda: None),
        )
        if not carrier.attach(ddp):
            return False
        self._carrier = carrier
        return True

    def after_step(self, next_step: int, boundary: Boundary, *, data_position: int | None = None) -> int:
        """Every rank, after the step is reported: act on what the ranks agreed on. Returns the step to run
        next (`next_step`, or a checkpoint's after an in-place rollback: `last_rollback` says which and
        from where). Halted, it waits here. `data_position`: what `next_step` reads, for a program that
        keeps its own data cursor (default `position(next_step)`)."""
        self._state.next_step = next_step
        if self._state.snapshots is not None:
            self._state.snapshots.at_boundary(
                next_step,
                step_s=self._step_s,
                data_position=self.position(next_step) if data_position is None else data_position,
                skip_windows=self.skip_windows,
            )
        if boundary.preempt:
            if self._emergency is not None:
                self._emergency(next_step)
            self._link.flush()
            log.warning("vigil: preempted after step %d; exiting to be requeued", next_step - 1)
            write_exit_file(EXIT_PREEMPTED)  # declared: an abort in the interpreter's teardown keeps it
            raise Preempted
        inbox = self._state.inbox
        if boundary.agreed_seq > inbox.handled_seq or inbox.halted:
            act(self._link, inbox, boundary.agreed_seq, self.identity.attempt, self._commands)
        return self._state.next_step

    def halt(self, reason: str, incident_id: str) -> None:
        """Every rank: stop on the program's own account (an out-of-memory past its retry): rank 0 reports
        the ranks halted under `incident_id`, and the next `after_step` waits for a resume, a rollback or
        a cancel, as after the guardian's halt."""
        self._state.inbox.halted = True
        self._commands.report_halt(reason, incident_id)

    def on_rollback(self, load: Callable[[Path], Any]) -> None:
        """Register how to load a checkpoint folder in place; without it a rollback relaunches the job."""
        self._state.loader = load

    def on_preemption(self, save: Callable[[int], Any]) -> None:
        """Register what to do before exiting on a preemption notice (e.g. save_checkpoint(step, ...))."""
        self._emergency = save

    def on_resize(self, fn: Callable[[Resize], Any], *, grad_accum: int | None = None) -> None:
        """`fn(resize)` when this attempt runs at another size than its spec asks for: an elastic job
        (`resources.elastic`) that lost a node and went on with fewer, or grew back. `resize` says how many
        micro-steps each rank runs to keep the global batch (`resize.grad_accum`) and which of the
        spec-size ranks' batches each reads (`resize.source(rank, micro)`), for ranks that accumulate
        `grad_accum` micro-steps at the spec's size (default: the spec's `train.grad_accum`). A program's
        ranks start anew at each size (Vigil relaunches them): `fn` is called at most once, here. A
        program that registers none is relaunched at the new size all the same, its global batch
        changed with it."""
        if self._spec is None:
            return
        shape = resize_of(self._spec, self.world_size, grad_accum)
        if shape.resized:
            log.warning(
                "vigil: %d ranks, the spec's %d: %d micro-steps each keep its global batch",
                shape.world,
                shape.spec_world,
                shape.grad_accum,
            )
            fn(shape)

    # --- in-memory snapshots ----------------------------------------------------------------------------

    def snapshot(
        self,
        state_dict_fn: Callable[[], Any],
        *,
        load: Callable[[Any], Any] | None = None,
        every: int | Literal["auto"] | None = None,
    ) -> None:
        """Every rank, once, before its loop: `after_step` copies `state_dict_fn()` (this rank's shard:
        tensors and plain containers) to host memory every `every` steps (default: the spec's
        `checkpoint.memory_every`, 1 without a spec; 0: never). With `load(state)`, an in-place rollback
        to a step every rank holds in memory (a disk checkpoint's step is kept) loads it from there."""
        if every is None:
            every = self._spec.checkpoint.memory_every if self._spec is not None else 1
        if every != "auto" and int(every) < 0:
            raise ValueError(f"vigil: snapshot every must be 0 (never), 'auto' or more (got {every})")
        if every == 0:
            return
        self._open_snapshots().register(state_dict_fn, load, every)
        if self.resume_from is None:  # a start from scratch: no step of an older timeline is kept
            self._open_snapshots().drop_after(0)

    @property
    def snapshotting(self) -> bool:
        """`snapshot` was called: `after_step` takes in-memory snapshots."""
        return self._state.snapshots is not None and self._state.snapshots.taking

    @property
    def snapshot_cost(self) -> tuple[int, snap.SnapshotCost] | None:
        """Snapshotting: every how many steps they are taken, and what they cost this rank so far."""
        if self._state.snapshots is None or not self._state.snapshots.taking:
            return None
        return self._state.snapshots.every, self._state.snapshots.cost

    def wait_snapshots(self) -> None:
        """Wait until every snapshot taken so far is written (copied to host memory, its files and its peer
        copy, in the background): what a relaunch on this node would find."""
        if self._state.snapshots is not None:
            self._state.snapshots.wait()

    def restore(self, *, safe_globals: list[Any] | None = None) -> snap.Restored | None:
        """Every rank, on a relaunch: the newest in-memory snapshot every rank has whole (its own copy, or
        the one its peer holds), no older than `resume_from`; None: none, load `resume_from` from disk.
        The state is read with `weights_only=True`: tensors, plain containers and `safe_globals`. Where
        the job changed its size since (an elastic job that shrank or grew: `got.resized_from`), the
        state is a list: every former rank's state, in rank order, to re-partition."""
        if self.resume_from is None or self.checkpoint_root is None:
            return None
        got = self._open_snapshots().restore(
            self.resume_from, self.checkpoint_root, skip=bool(self.skip_windows), safe_globals=safe_globals
        )
        if got is None:
            return None
        self._add_windows(got.skip_windows)
        self._state.next_step = got.step
        former = f" (taken with {got.resized_from} ranks, {self.world_size} now)" if got.resized_from else ""
        log.info("vigil: restoring the in-memory snapshot of step %d%s", got.step, former)
        return got

    def _open_snapshots(self) -> RunSnapshots:
        """Made once, by every rank together (the peer exchange's gloo group)."""
        if self._state.snapshots is None:
            self._state.snapshots = RunSnapshots.open(
                job_id=self.identity.job_id, rank=self.rank, world=self.world_size
            )
        return self._state.snapshots

    # --- checkpoints (`vigil.checkpoints`) ---------------------------------------------------------------

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
        (written last, by an atomic rename), keeps the newest `keep` and reports `CheckpointSaved`.
        Snapshotting, the step is kept in memory too (a rollback to it loads from there)."""
        position = self.position(step) if data_position is None else data_position
        windows = self.skip_windows if skip_windows is None else skip_windows
        path = self._state.checkpoints.save(step, save, data_position=position, skip_windows=windows)
        if self._state.snapshots is not None:
            self._state.snapshots.take(step, data_position=position, skip_windows=windows, pin=True)
        return path

    def resume_checkpoint(self) -> manifest.Manifest | None:
        """The checkpoint Vigil relaunched this job from (`resume_from`), verified as `choose_checkpoint`
        verifies one (the same choice on every rank; its skip windows join `skip_windows`); None when the
        job starts from scratch. What every integration's resume reads."""
        if self.resume_from is None:
            return None
        chosen = self.choose_checkpoint(str(self.resume_from), manifest.step_of(self.resume_from))
        self._add_windows(chosen.skip_windows)
        self._state.next_step = chosen.step
        if self._state.snapshots is not None:  # none of an abandoned timeline
            self._state.snapshots.drop_after(chosen.step)
        log.info("vigil: resuming from %s (step %d)", chosen.path, chosen.step)
        return chosen

    def choose_checkpoint(self, requested: str, requested_step: int | None) -> manifest.Manifest:
        """Rank 0 verifies the checkpoint asked for (or falls back to the newest valid one before it) and
        every rank gets its choice, so all load the same one. CheckpointError when there is none."""
        return self._state.checkpoints.choose(requested, requested_step)

    def refuse_checkpoint(
        self, path: str | Path, step: int, reason: ev.CheckpointRefusal, error: BaseException | str
    ) -> None:
        """Report that the checkpoint `path` (of `step`) did not load on this rank (`reason` "hash": it
        failed its manifest; "load": it verified and still raised): the scheduler marks it bad and no
        relaunch or rollback takes it again. Waits until the report is stored (the rank may exit next)."""
        self._state.checkpoints.refuse(path, step, reason, error)

    def _add_windows(self, windows: list[tuple[int, int]]) -> None:
        """A checkpoint's skip windows, before those of this launch (each once)."""
        merged = [(int(a), int(b)) for a, b in windows]
        self.skip_windows = merged + [w for w in self.skip_windows if w not in merged]

    # --- the end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Send what is queued and disconnect (also run at exit). In-memory snapshots stay (a relaunch on
        this node takes them) unless `done` said the job finished."""
        if self._closed:
            return
        self._closed = True
        if self._state.snapshots is not None:
            self._state.snapshots.finish()  # its thread must not be inside torch when the interpreter ends
        self._link.close()
        last = getattr(self._link, "last_step", None)
        if last is not None:
            with contextlib.suppress(OSError):
                write_last_step(last)  # the worker's RankExited.last_step

    def done(self) -> None:
        """Every rank, when training finished: its in-memory snapshots go (the job needs none now)."""
        if self._state.snapshots is not None:
            self._state.snapshots.remove_all()


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
