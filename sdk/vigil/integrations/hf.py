"""Vigil for the Hugging Face `transformers.Trainer`: one callback, and where to resume from.

Two lines in an existing script::

    from vigil.integrations.hf import VigilCallback, resume_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[VigilCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint())  # None unless Vigil relaunched the job

Per optimizer step, on every rank (`on_pre_optimizer_step`, after the gradients are reduced and the
Trainer clipped them): this rank's loss (read from the model's output, as the Trainer reads it) and the
gradients' norm go into the step boundary. The norm is the Trainer's own, before clipping (read where
its accelerator computes it: `hf_compat`), so the callback neither computes nor clips again. Under DDP
the boundary rides in DDP's own gradient all-reduce (`Run.carry`: each rank's loss goes in with the
gradients, whose finiteness every rank then judges alike from the norm), so the step runs no collective
of Vigil's; elsewhere it is one small all-reduce. Where any rank's step is not finite, every rank drops
its gradients, so the optimizer leaves the weights alone. Under the Trainer's DeepSpeed
integration the engine has already stepped by then (inside `backward`): ZeRO stages 1-3 and fp16/bf16 skip
a non-finite update themselves; ZeRO-0 in fp32 does not, and from such a step on this process adopts no
more checkpoints (the guardian's rollback relaunches the job from an earlier one). Then (`on_step_end`)
the step is reported and the job's commands are acted on: a halt waits there; a rollback stops every rank
with exit code 5 and Vigil relaunches the job with `resume_checkpoint()` set, since the Trainer cannot
load a checkpoint in place mid-training.

Checkpoints: each `checkpoint-N` folder the Trainer saves (its `save_steps`; set it to the spec's
`checkpoint.every`, `vigil.init().spec.checkpoint.every`) is moved into Vigil's `step_N` folder and sealed
with Vigil's manifest. Under Vigil, the Trainer's `output_dir` keeps the final model only.

Outside Vigil the callback reports nothing and moves nothing; the finiteness guard still runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from vigil.integrations import ds_compat, hf_compat
from vigil.integrations._guard import StepLoss, drop_gradients, grad_norm, verdict

if TYPE_CHECKING:
    import torch
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from vigil.boundary import Boundary
    from vigil.run import Run

log = logging.getLogger("vigil")

CHECKPOINT_PREFIX = "checkpoint"  # the Trainer's folder name: checkpoint-<global step>


class VigilCallback(TrainerCallback):
    """Reports every optimizer step, guards it, acts on Vigil's commands and adopts the Trainer's
    checkpoints. `run` defaults to `vigil.init()`."""

    def __init__(self, run: Run | None = None) -> None:
        if run is None:
            import vigil

            run = vigil.init()
        self.run = run
        self.losses = StepLoss()
        self.boundary: Boundary | None = None
        self.poisoned = False  # a non-finite update reached the weights (DeepSpeed ZeRO-0 fp32)
        self._step: dict[str, Any] = {}
        self._hook: Any = None
        self._scale_losses = False  # the loss was normalised over the whole accumulated batch
        self._trainer: Any = None  # the Trainer running this callback (`hf_compat`), during `train()`
        self._norm: Any = None  # the Trainer's norm of this step's gradients, before clipping
        self._unwatch: Any = None
        self._carry = False  # the DDP hook is yet to be tried in this `train()`

    # --- where the loss comes from -----------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, **kwargs: Any) -> None:  # fmt: skip
        if model is None:
            raise RuntimeError("vigil: the Trainer passed no model to VigilCallback.on_train_begin")
        if self._hook is None:
            self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        self._trainer = hf_compat.calling_trainer()
        if self._trainer is not None and self._unwatch is None:
            self._unwatch = hf_compat.watch_grad_norm(self._trainer, self._keep_norm)
        self._carry = self._trainer is not None
        if self.run.skip_windows:
            log.warning(
                "vigil: data windows %s are to be skipped; the Trainer's data loader does not know them",
                self.run.skip_windows,
            )

    def _keep_norm(self, norm: Any) -> None:
        self._norm = norm

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:  # fmt: skip
        if self._carry:  # the model is wrapped by now: under DDP, the boundary rides in its all-reduce
            self._carry = False
            self.run.carry(hf_compat.wrapped_model(self._trainer), self.losses.peek)

    def _on_forward(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training:
            return  # evaluation
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.losses.add(loss, int(ids.numel()) if hasattr(ids, "numel") else 0)
        # Given num_items_in_batch, the model divides by the whole accumulated batch's label count (all
        # ranks' with average_tokens_across_devices): its losses then add up to the step's loss.
        self._scale_losses = kwargs.get("num_items_in_batch") is not None

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:  # fmt: skip
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self._trainer = None
        self.run.carry(None)

    # --- the step boundary ---------------------------------------------------------------------------

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              model: torch.nn.Module | None = None, optimizer: Any = None,
                              **kwargs: Any) -> None:  # fmt: skip
        loss_sum, count, tokens = self.losses.take()
        deepspeed = bool(getattr(args, "deepspeed", None))
        params = list(model.parameters()) if model is not None else []
        norm, self._norm = self._norm, None  # the Trainer's: after DDP's all-reduce, before its clip
        if deepspeed:
            norm = None  # the engine has stepped already; its own norm is reported below
        elif norm is None:
            norm = grad_norm(params)
        boundary = self.run.agree(verdict(loss_sum, norm))  # in DDP's all-reduce, or the step's one sync
        skipped = False
        if deepspeed:  # the engine stepped inside backward; it skipped an overflow itself, or not
            skipped = bool(getattr(optimizer, "step_was_skipped", False))
            if not boundary.all_finite and not skipped and not self.poisoned:
                self.poisoned = True
                log.error(
                    "vigil: step %d: DeepSpeed applied a non-finite update (ZeRO-0 in fp32 does not check); "
                    "no checkpoint is taken from here on",
                    state.global_step,
                )
            norm_value = ds_compat.zero_grad_norm(optimizer)
        else:
            if not boundary.all_finite:
                drop_gradients(params)
                skipped = True
            norm_value = float(norm) if norm is not None else None
        loss = math.nan if loss_sum is None else float(loss_sum)  # synchronised already: no wait
        if count and not self._scale_losses:
            loss /= count
        elif count and getattr(args, "average_tokens_across_devices", False):
            loss *= max(1, int(getattr(args, "world_size", 1)))
        groups = getattr(optimizer, "param_groups", None) or [{}]
        self._step = {
            "loss": loss,
            "grad_norm": norm_value,
            "lr": float(groups[0].get("lr", 0.0)),
            "tokens": tokens,
            "skipped": skipped,
            "local_finite": loss_sum is None or math.isfinite(loss),
        }
        self.boundary = boundary

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:  # fmt: skip
        boundary, self.boundary = self.boundary, None
        if boundary is None:
            return
        step = state.global_step - 1  # the Trainer has counted the step already
        self.run.report(step, **self._step)
        after = self.run.after_step(state.global_step, boundary)  # a halt waits here; a rollback exits
        if after != state.global_step:
            raise RuntimeError(
                "vigil: the Trainer cannot continue from another step in place; "
                "register no rollback loader with VigilCallback (Vigil then relaunches the job)"
            )

    # --- checkpoints ---------------------------------------------------------------------------------

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:  # fmt: skip
        if not self.run.active or self.run.checkpoint_root is None:
            return
        step = state.global_step
        source = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}-{step}"
        if self.poisoned:
            log.error("vigil: not adopting %s: a non-finite update was applied before it", source)
            return
        self.run.save_checkpoint(step, lambda path: adopt(source, path))


def adopt(source: Path, target: Path) -> None:
    """Move what this node wrote into `source` (the Trainer's checkpoint folder) into `target` (Vigil's):
    each node's local rank 0 moves its node's files; a rename on one filesystem."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0 or not source.is_dir():
        return
    for entry in sorted(source.iterdir()):
        with contextlib.suppress(FileNotFoundError):  # another node's leader moved it (a shared folder)
            shutil.move(str(entry), str(target / entry.name))
    with contextlib.suppress(OSError):
        source.rmdir()


def resume_checkpoint(run: Run | None = None) -> str | None:
    """The checkpoint folder Vigil relaunched this job from, verified against its manifest (rank 0 checks
    and every rank gets its choice), for `trainer.train(resume_from_checkpoint=...)`; None otherwise."""
    if run is None:
        import vigil

        run = vigil.init()
    chosen = run.resume_checkpoint()
    return None if chosen is None else str(chosen.path)
