"""The training loop of one rank, in nanoGPT's shape: one function, sections in order.

Per step: data, forward, backward (DeepSpeed reduces gradients at the accumulation boundary), one small
control all-reduce (finiteness guard and command boundary), optimizer step, log and emit, checkpoint,
then any command all ranks agreed on. Setup (process group, engine, data, sink) lives in `rank.py`.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vigil_common import events as ev
from vigil_common import subjects
from vigil_common.errors import CheckpointError
from vigil_common.spec import JobSpec
from vigil_worker.trainer import checkpoint as ckpt
from vigil_worker.trainer.comm import CommTimer
from vigil_worker.trainer.data import batch, first_position, next_position
from vigil_worker.trainer.faults import FaultInjector
from vigil_worker.trainer.telemetry import NullSink, Sink

log = logging.getLogger("vigil.rank")

COMMAND_ARRIVAL_TIMEOUT_S = 60.0  # an agreed command must reach every rank's bus thread by then


@dataclass
class RankContext:
    """Everything the loop needs, built once by `rank.py`."""

    job_id: str
    attempt: int
    rank: int
    world_size: int
    node: str
    spec: JobSpec
    engine: Any  # deepspeed.DeepSpeedEngine
    tokens: np.ndarray
    checkpoint_root: Path
    zero_stage: int
    precision: str
    device: torch.device
    sink: Sink = field(default_factory=NullSink)
    faults: FaultInjector | None = None
    comm: CommTimer | None = None
    bare: bool = False  # no guard, no timers, no events, no commands: plain DeepSpeed (overhead baseline)
    timings_path: Path | None = None


@dataclass
class TrainState:
    step: int = 0  # the next step to run (= optimizer updates done)
    data_position: int = 0  # the data position that step reads
    skip_windows: list[tuple[int, int]] = field(default_factory=list)
    handled_seq: int = 0  # commands handled (sequence numbers are 1-based)
    halted: bool = False
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step run, in order
    step_ends: deque[float] = field(
        default_factory=lambda: deque(maxlen=8)
    )  # time.monotonic() of recent ends


def train(ctx: RankContext, st: TrainState) -> TrainState:
    engine, spec = ctx.engine, ctx.spec
    T, B, accum = spec.model.resolved().seq_len, spec.train.micro_batch, spec.train.grad_accum
    tokens_per_step = B * T * accum
    cuda = ctx.device.type == "cuda"

    def sync() -> None:  # CPU-GPU sync point: section timings on GPU are honest only after one
        if cuda and not ctx.bare:
            torch.cuda.synchronize()

    while st.step < spec.train.steps:
        step, pos = st.step, st.data_position
        if ctx.comm:
            ctx.comm.take()  # collectives outside the step (checkpoints, rollbacks) are not its comm time
        t0 = time.perf_counter()
        if ctx.faults:
            _injected_trouble(ctx, step)
        factor = ctx.faults.loss_factor(step) if ctx.faults else 1.0
        lr = float(engine.get_lr()[0])
        t_data = t_fwd = t_bwd = 0.0
        loss_sum = torch.zeros((), device=ctx.device)
        finite = torch.ones((), device=ctx.device)

        for micro in range(accum):
            # --- data: a pure function of (seed, data position, rank, micro-step) -----------------------
            ta = time.perf_counter()
            x, y = batch(
                ctx.tokens,
                seed=spec.train.seed,
                data_position=pos,
                rank=ctx.rank,
                micro=micro,
                micro_batch=B,
                seq_len=T,
            )  # (B, T) each
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            tb = time.perf_counter()
            # --- forward ------------------------------------------------------------------------------
            loss = engine(x, y)
            if factor != 1.0:
                loss = loss * factor  # injected NaN or spike: flows into the gradients like a real one
            sync()
            tc = time.perf_counter()
            # --- backward (at the accumulation boundary DeepSpeed reduces the gradients: comm) --------
            engine.backward(loss)
            if micro < accum - 1:
                engine.step()  # not the boundary: DeepSpeed only counts the micro-step (no update)
            sync()
            td = time.perf_counter()
            t_data, t_fwd, t_bwd = t_data + tb - ta, t_fwd + tc - tb, t_bwd + td - tc
            loss_sum += loss.detach().float()
            finite = finite * torch.isfinite(loss.detach()).float()

        # --- finiteness guard and command boundary: one small all-reduce -------------------------------
        # MIN over [all finite?, -commands seen]: every rank learns whether any rank saw a non-finite
        # loss or gradient (torchtitan's guard), and the highest command sequence number any rank has
        # received, so that all ranks act on the same commands at this same step boundary.
        grad_norm: float | None = None
        agreed_seq, all_finite = 0, True
        if not ctx.bare:
            if ctx.zero_stage == 0 and ctx.precision == "fp32":
                grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)  # full gradients after the all-reduce
                grad_norm = float(norm)
                finite = finite * torch.isfinite(norm).float()
            ctrl = torch.stack([finite, torch.tensor(-float(ctx.sink.latest_seq), device=ctx.device)])
            dist.all_reduce(ctrl, op=dist.ReduceOp.MIN)
            all_finite, agreed_seq = bool(ctrl[0].item() == 1.0), int(-ctrl[1].item())
            _guard_update(ctx, all_finite)
        comm_s = ctx.comm.take() if ctx.comm else 0.0

        # --- optimizer step at the accumulation boundary (skipped when the update is not finite) -------
        te = time.perf_counter()
        engine.step()
        sync()
        tf = time.perf_counter()
        applied = bool(engine.was_step_applied())
        st.step_seconds.append(tf - t0)
        st.step_ends.append(time.monotonic())
        if not ctx.bare and not all_finite and applied:
            raise RuntimeError(f"step {step}: a non-finite update was applied; refusing to go on")

        # --- log and emit -------------------------------------------------------------------------------
        if not ctx.bare:
            loss_value = loss_sum.item() / accum  # CPU-GPU sync point (once per step)
            if grad_norm is None:
                gn = engine.get_global_grad_norm()
                grad_norm = float(gn) if gn is not None else None
            step_s = tf - t0
            ctx.sink.emit(
                subjects.step(ctx.job_id),
                ev.StepCompleted(
                    job_id=ctx.job_id,
                    attempt=ctx.attempt,
                    rank=ctx.rank,
                    node=ctx.node,
                    step=step,
                    loss=loss_value,
                    grad_norm=grad_norm,
                    lr=lr,
                    tokens=tokens_per_step,
                    tokens_per_s=tokens_per_step / step_s if step_s > 0 else 0.0,
                    data_time_s=t_data,
                    forward_time_s=t_fwd,
                    backward_time_s=t_bwd,
                    comm_time_s=comm_s,
                    optimizer_time_s=tf - te,
                    step_time_s=step_s,
                    skipped=not applied,
                    data_position=pos,
                    **_memory(ctx.device),
                ),
            )
            if step % 10 == 0 or not applied:
                log.info(
                    "step %d loss %.4f lr %.2e %s%.0f ms (comm %.0f ms)",
                    step,
                    loss_value,
                    lr,
                    "SKIPPED " if not applied else "",
                    1000 * step_s,
                    1000 * comm_s,
                )
        st.step, st.data_position = step + 1, next_position(pos, st.skip_windows)

        # --- checkpoint ---------------------------------------------------------------------------------
        if not ctx.bare and st.step % spec.checkpoint.every == 0:
            save_checkpoint(ctx, st)

        # --- commands agreed at this boundary -------------------------------------------------------------
        if agreed_seq > st.handled_seq:
            handle_commands(ctx, st, agreed_seq)
    return st


def _injected_trouble(ctx: RankContext, step: int) -> None:
    """Crash, hang or slow down here when the job spec injects it."""
    assert ctx.faults is not None
    if (code := ctx.faults.crash_code(step)) is not None:
        log.error("injected crash at step %d: exiting with code %d", step, code)
        write_exit_file(code)
        ctx.sink.close(timeout_s=5.0)
        logging.shutdown()
        os._exit(code)
    if ctx.faults.hangs(step):
        log.error("injected hang at step %d: this rank stops stepping", step)
        while True:
            time.sleep(3600)
    if delay := ctx.faults.delay_s(step):
        time.sleep(delay)


def write_exit_file(code: int) -> None:
    """Leave the exit code where the worker looks for it (VIGIL_EXIT_FILE), for a worker that restarted
    meanwhile and so is not this process's parent any more."""
    if path := os.environ.get("VIGIL_EXIT_FILE"):
        Path(path).write_text(f"{code}\n")


def _guard_update(ctx: RankContext, all_finite: bool) -> None:
    """Make DeepSpeed's next `step()` leave the weights alone. ZeRO stages and bf16/fp16 already skip a
    step whose gradient norm is not finite; plain fp32 without ZeRO steps our optimizer directly, so
    tell it to skip (`GuardedAdamW.overflow`), which DeepSpeed also reads to count the step as skipped
    and leave the LR schedule where it is."""
    if ctx.zero_stage == 0 and ctx.precision == "fp32":
        ctx.engine.optimizer.overflow = not all_finite


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that skips its step while `overflow` is set (DeepSpeed reads the same flag after the step)."""

    overflow = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.overflow:
            return None
        return super().step(closure)


def _memory(device: torch.device) -> dict[str, int | None]:
    if device.type == "cuda":
        return {
            "mem_allocated_bytes": torch.cuda.memory_allocated(),
            "mem_peak_bytes": torch.cuda.max_memory_allocated(),
        }
    with open("/proc/self/statm") as fh:  # the rank process's resident set, for CPU slots
        rss = int(fh.read().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"mem_allocated_bytes": rss, "mem_peak_bytes": peak}


# --- checkpoints ---------------------------------------------------------------------------------------


def save_checkpoint(ctx: RankContext, st: TrainState) -> None:
    """All ranks save their shards with DeepSpeed; rank 0 then writes the manifest (last) and prunes."""
    path = ckpt.step_dir(ctx.checkpoint_root, ctx.job_id, st.step)
    if ctx.rank == 0 and path.exists():  # an older timeline's checkpoint of this step (after a rollback)
        shutil.rmtree(path)
    dist.barrier()
    ctx.engine.save_checkpoint(str(path), tag=ckpt.DS_TAG, save_latest=False)
    dist.barrier()  # every rank's files are on disk
    if ctx.rank == 0:
        m = ckpt.write_manifest(
            path,
            job_id=ctx.job_id,
            step=st.step,
            data_position=st.data_position,
            skip_windows=st.skip_windows,
        )
        ckpt.retain(ctx.checkpoint_root, ctx.job_id, ctx.spec.checkpoint.keep)
        ctx.sink.emit(
            subjects.status(ctx.job_id),
            ev.CheckpointSaved(
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                step=st.step,
                path=str(path),
                bytes=m.bytes,
                manifest_sha256=m.sha256,
                data_position=st.data_position,
            ),
        )
        log.info("checkpoint step %d saved: %s (%d bytes)", st.step, path, m.bytes)
    dist.barrier()  # nobody races ahead into a rollback while the manifest is being written


def choose_checkpoint(ctx: RankContext, requested: str, requested_step: int) -> ckpt.Manifest:
    """Rank 0 verifies the requested checkpoint; if it is corrupt (or outside the root), the newest valid
    one before it. Every rank gets rank 0's choice, so all load the same checkpoint."""
    choice: list[Any] = [None, ""]
    if ctx.rank == 0:
        try:
            choice[0] = ckpt.verify(requested, root=ctx.checkpoint_root)
        except CheckpointError as exc:
            log.error("refusing checkpoint %s: %s", requested, exc)
            choice[0] = ckpt.newest_valid(ctx.checkpoint_root, ctx.job_id, at_or_before=requested_step - 1)
            choice[1] = str(exc)
            if choice[0] is not None:
                log.warning("using the newest valid earlier checkpoint instead: %s", choice[0].path)
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        raise CheckpointError(f"no valid checkpoint at or before step {requested_step}: {choice[1]}")
    return choice[0]


def load_checkpoint(ctx: RankContext, st: TrainState, m: ckpt.Manifest) -> float:
    """Load `m` in place into the running engine; returns DeepSpeed's load time in seconds."""
    t0 = time.perf_counter()
    loaded, _ = ctx.engine.load_checkpoint(
        str(m.path), tag=ckpt.DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {m.path}")
    seconds = time.perf_counter() - t0
    st.step, st.skip_windows = m.step, list(m.skip_windows)
    st.data_position = first_position(m.data_position, st.skip_windows)
    return seconds


# --- commands ------------------------------------------------------------------------------------------


def handle_commands(ctx: RankContext, st: TrainState, agreed_seq: int) -> None:
    """Act on commands up to `agreed_seq` in order (every rank does the same), and while halted, on
    each next command as it comes. Halted ranks wait here, outside any collective."""
    while st.handled_seq < agreed_seq or st.halted:
        seq = st.handled_seq + 1
        try:
            cmd = ctx.sink.command(seq, COMMAND_ARRIVAL_TIMEOUT_S)
        except TimeoutError:
            if st.halted and seq > agreed_seq:
                continue  # halted: wait as long as it takes
            raise
        st.handled_seq = seq
        if cmd.attempt != ctx.attempt:
            log.info("ignoring %s for attempt %d (this is attempt %d)", cmd.type, cmd.attempt, ctx.attempt)
            continue
        if isinstance(cmd, ev.HaltJob) and not st.halted:
            st.halted = True
            log.warning("halted after step %d: %s", st.step - 1, cmd.reason)
            if ctx.rank == 0:
                ctx.sink.emit(
                    subjects.status(ctx.job_id),
                    ev.RanksHalted(
                        job_id=ctx.job_id,
                        attempt=ctx.attempt,
                        step=max(st.step - 1, 0),
                        command_id=cmd.event_id,
                        node=ctx.node,
                    ),
                )
        elif isinstance(cmd, ev.RollbackJob) and not cmd.restart:
            rollback(ctx, st, cmd, seq)
        elif isinstance(cmd, ev.ResumeJob) and st.halted:
            st.halted = False
            log.warning("resumed at step %d", st.step)
        # CancelJob and restart rollbacks are the worker's: it ends these processes.


def rollback(ctx: RankContext, st: TrainState, cmd: ev.RollbackJob, seq: int) -> None:
    """Load a checkpoint in place (no process restart), add the data-skip window, and train on."""
    t0 = time.perf_counter()
    now, arrived = time.monotonic(), ctx.sink.arrival(seq)
    from_step = max(st.step - 1, 0)
    m = choose_checkpoint(ctx, cmd.checkpoint, cmd.step)
    load_s = load_checkpoint(ctx, st, m)
    if cmd.skip_data:
        st.skip_windows.append(tuple(cmd.skip_data))  # type: ignore[arg-type]
        st.data_position = first_position(st.data_position, st.skip_windows)
    if ctx.faults:
        ctx.faults.clear_transient()
    st.halted = False
    duration = time.perf_counter() - t0
    log.warning("rolled back from step %d to %d (%s) in %.3fs", from_step, st.step, m.path, duration)
    timing: dict[str, Any] = {"event": "rollback", "load_s": load_s, "total_s": duration, "to_step": st.step}
    if arrived is not None:
        # waited: command arrival to acting on it. in_flight: arrival to the end of the step that was
        # running then, which any in-place rollback has to let finish (ranks cannot leave mid-collective)
        ends = [e for e in st.step_ends if e >= arrived]
        timing.update(waited_s=now - arrived, in_flight_s=(ends[0] if ends else now) - arrived)
    record_timing(ctx, timing)
    if ctx.rank == 0:
        ctx.sink.emit(
            subjects.status(ctx.job_id),
            ev.RollbackCompleted(
                job_id=ctx.job_id,
                attempt=ctx.attempt,
                from_step=from_step,
                to_step=st.step,
                checkpoint=str(m.path),
                skip_data=cmd.skip_data,
                command_id=cmd.event_id,
                duration_s=duration,
                node=ctx.node,
            ),
        )


def record_timing(ctx: RankContext, record: dict[str, Any]) -> None:
    """Timings the benches read (one JSON object per line)."""
    if ctx.timings_path is not None:
        with ctx.timings_path.open("a") as fh:
            fh.write(json.dumps({"rank": ctx.rank, **record}) + "\n")
