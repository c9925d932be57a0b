"""Vigil for a training loop of your own around a DeepSpeed engine: the step, checkpoints, rollbacks.

A few lines in an existing loop::

    from vigil.integrations import deepspeed as vigil_ds

    run = vigil.init()
    vigil_ds.register_rollback(engine)          # a rollback loads engine.load_checkpoint in place
    vigil_ds.snapshot(engine)                   # optional: in-memory snapshots (not ZeRO-3)
    step = vigil_ds.resume(engine)              # 0, or the step of the snapshot or checkpoint resumed
    while step < steps:
        loss = engine(batch(run.position(step)))
        engine.backward(loss)
        ok = vigil_ds.step(engine, loss)        # instead of engine.step(): agree, then step
        run.report(step, loss=loss.item(), grad_norm=vigil_ds.grad_norm(engine), lr=engine.get_lr()[0],
                   skipped=not engine.was_step_applied())
        if (step + 1) % every == 0:
            vigil_ds.save(engine, step + 1)     # engine.save_checkpoint, sealed with Vigil's manifest
        step = run.after_step(step + 1, ok)     # a halt waits here; a rollback returns the checkpoint's step

`step` puts this rank's loss (and, where DeepSpeed steps your optimizer directly, the gradients' norm)
into the step boundary's one all-reduce before `engine.step()`. A non-finite update is then skipped on
every rank alike, in every ZeRO stage and precision, by `skip_step`: your optimizer's `step()` is gated
(`vigil.integrations.gate`), so the weights and the optimizer state stay as they were, the LR schedule
is put back where it was, and `engine.was_step_applied()` is False. It then checks that no parameter
this rank holds changed, and refuses to go on otherwise.

Checkpoints are DeepSpeed's own files (`engine.save_checkpoint(path, tag="ds")`), every rank writing its
part into Vigil's `step_<n>` folder. Outside Vigil, `save` saves nothing and `resume` returns 0.
With `snapshot`, `run.after_step` also copies this rank's part of the engine (what its part of that
checkpoint holds) to host memory every `checkpoint.memory_every` steps, and `resume` loads the newest
snapshot every rank has whole where there is one (`vigil.snapshot`), else the disk checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vigil.integrations import ds_compat
from vigil.integrations._guard import StepLoss, verdict
from vigil.integrations._guard import grad_norm as _norm
from vigil.integrations.gate import Sample, gate

if TYPE_CHECKING:
    import torch

    from vigil.boundary import Boundary
    from vigil.run import Run

log = logging.getLogger("vigil")

TAG = "ds"  # the DeepSpeed tag (sub-folder) inside Vigil's step_<n> folder

_losses: dict[int, StepLoss] = {}  # per engine: the micro-steps' losses since its last update


def _run(run: Run | None) -> Run:
    if run is not None:
        return run
    import vigil

    return vigil.init()


def skips_non_finite(engine: Any) -> bool:
    """True where DeepSpeed itself skips a non-finite update: ZeRO 1-3, or fp16/bf16 (loss scaling)."""
    return bool(engine.zero_optimization_stage() > 0 or engine.fp16_enabled() or engine.bfloat16_enabled())


def step(engine: Any, loss: torch.Tensor, run: Run | None = None) -> Boundary | None:
    """`engine.step()` for the micro-step whose `loss` was just backpropagated. At the gradient
    accumulation boundary, first agree with every rank on whether the update is finite and which commands
    are there, and skip a non-finite update; returns what the ranks agreed on, for `run.after_step`.
    Between boundaries it only steps the engine and returns None."""
    run = _run(run)
    losses = _losses.setdefault(id(engine), StepLoss())
    losses.add(loss)
    if not engine.is_gradient_accumulation_boundary():
        engine.step()
        return None
    loss_sum, count, _ = losses.take()
    guard = not skips_non_finite(engine)
    params = list(engine.module.parameters()) if guard else []
    norm = _norm(params) if guard else None  # full gradients, after the all-reduce in backward
    mean = loss_sum / count if loss_sum is not None and count else None
    boundary = run.agree(verdict(mean, norm))  # the step's one sync
    if boundary.all_finite:
        engine.step()
    else:
        skip_step(engine)
    return boundary


def skip_step(engine: Any) -> None:
    """The accumulation boundary's `engine.step()` with its update dropped (every rank calls it alike):
    the client optimizer's `step()` gated, the LR schedule put back, the step recorded as skipped
    (`engine.was_step_applied()` False, `engine.skipped_steps` one more). DeepSpeed reduces and frees the
    gradients as for any step. Raises RuntimeError when a parameter this rank holds changed all the same.
    The built-in trainer drops its held and non-finite steps through this same call."""
    if not engine.is_gradient_accumulation_boundary():
        raise RuntimeError("vigil: skip_step drops an update: call it at the accumulation boundary only")
    g = gate(ds_compat.client_optimizer(engine))
    before, sample, blocked = ds_compat.record(engine), Sample(ds_compat.local_shards(engine)), g.blocked
    with g.shut():
        engine.step()
    # DeepSpeed skipped it itself (a non-finite norm) unless it reached the optimizer, which the gate held
    ds_compat.undo_step(engine, before, counted=g.blocked == blocked)
    if engine.was_step_applied():
        raise RuntimeError("vigil: DeepSpeed applied a skipped update; refusing to go on")
    if not sample.unchanged():
        raise RuntimeError("vigil: a skipped step changed this rank's weights; refusing to go on")


def grad_norm(engine: Any) -> float | None:
    """The gradients' norm DeepSpeed computed for its last update (None where it computed none)."""
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else None


def save(
    engine: Any, step: int, run: Run | None = None, client_state: dict[str, Any] | None = None
) -> Path | None:
    """Every rank: the engine's checkpoint of `step` (the step to run next) in Vigil's folder, sealed with
    its manifest by rank 0; `client_state` is saved with it. None, and nothing saved, outside Vigil."""
    run = _run(run)
    if not run.active or run.checkpoint_root is None:
        return None
    state = {"step": step, **(client_state or {})}
    return run.save_checkpoint(
        step, lambda path: engine.save_checkpoint(str(path), tag=TAG, client_state=state)
    )


def load(engine: Any, path: str | Path) -> dict[str, Any]:
    """Load a checkpoint `save` wrote (weights, optimizer and LR schedule) into the engine, in place;
    returns the client state saved with it (none from one saved at another data-parallel size: an
    elastic job's, re-partitioned)."""
    if ds_compat.saved_at_another_size(engine, str(path), TAG):  # an elastic job at another size
        ds_compat.load_resized_checkpoint(engine, str(path), TAG)
        _losses.pop(id(engine), None)
        return {}
    loaded, client_state = engine.load_checkpoint(str(path), tag=TAG)
    if loaded is None:
        raise RuntimeError(f"vigil: DeepSpeed found no checkpoint '{TAG}' in {path}")
    _losses.pop(id(engine), None)
    return client_state or {}


def register_rollback(engine: Any, run: Run | None = None) -> None:
    """Let Vigil's rollbacks load the checkpoint into `engine` in place (`run.after_step` then returns the
    checkpoint's step) instead of relaunching the job."""
    _run(run).on_rollback(lambda path: load(engine, path))


def snapshot(engine: Any, run: Run | None = None) -> None:
    """Every rank, before `resume`: in-memory snapshots of this rank's part of the engine (the module, its
    ZeRO optimizer partition, the LR scheduler, the step counters), taken by `run.after_step`."""
    _run(run).snapshot(lambda: ds_compat.engine_state(engine))


def resume(engine: Any, run: Run | None = None) -> int:
    """Load the newest in-memory snapshot every rank has whole (with `snapshot` registered), else the
    checkpoint Vigil relaunched this job from (verified by rank 0, the same on every rank); returns its
    step, or 0 when the job starts from scratch."""
    r = _run(run)
    if r.snapshotting and (got := r.restore(safe_globals=ds_compat.checkpoint_safe_globals())) is not None:
        if got.resized_from is not None:  # an elastic job at another size: every former rank's, re-cut
            ds_compat.load_resized_engine_state(engine, got.state, r.rank)
        else:
            ds_compat.load_engine_state(engine, got.state)
        return got.step
    chosen = r.resume_checkpoint()
    if chosen is None:
        return 0
    load(engine, chosen.path)
    return chosen.step
