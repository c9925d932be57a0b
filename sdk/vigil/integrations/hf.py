"""Vigil for the Hugging Face `transformers.Trainer`: one callback, and where to resume from.

Two lines in an existing script::

    from vigil.integrations.hf import VigilCallback, resume_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[VigilCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint())  # None unless Vigil relaunched the job

Per optimizer step, on every rank (`on_pre_optimizer_step`, after the gradients are reduced): this rank's
loss (read from the model's output, as the Trainer reads it) and the gradients' norm before clipping go
into the step boundary's one all-reduce. The callback clips in the Trainer's place (it takes
`max_grad_norm` over for the run, and gives it back at the end), with the norm it reports: the Trainer
would clip before any callback sees the gradients, so the norm reported would be the clipped one. The
Trainer's own logged `grad_norm` stays the norm before clipping. Where any rank's step is not finite,
every rank drops its gradients, so the optimizer leaves the weights alone. Under the Trainer's DeepSpeed
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

from vigil.integrations import ds_compat
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
        self._clip: float | None = None  # the Trainer's max_grad_norm, while this callback clips for it

    # --- where the loss comes from -----------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, **kwargs: Any) -> None:  # fmt: skip
        if model is None:
            raise RuntimeError("vigil: the Trainer passed no model to VigilCallback.on_train_begin")
        if self._hook is None:
            self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        if takes_over_clipping(args) and self._clip is None:
            self._clip, args.max_grad_norm = float(args.max_grad_norm), 0.0
        if self.run.skip_windows:
            log.warning(
                "vigil: data windows %s are to be skipped; the Trainer's data loader does not know them",
                self.run.skip_windows,
            )

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
        if self._clip is not None:  # the user's arguments as they were
            args.max_grad_norm, self._clip = self._clip, None

    # --- the step boundary ---------------------------------------------------------------------------

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              model: torch.nn.Module | None = None, optimizer: Any = None,
                              **kwargs: Any) -> None:  # fmt: skip
        loss_sum, count, tokens = self.losses.take()
        deepspeed = bool(getattr(args, "deepspeed", None))
        params = list(model.parameters()) if model is not None else []
        norm = None if deepspeed else grad_norm(params)  # full gradients, after DDP's all-reduce, unclipped
        boundary = self.run.agree(verdict(loss_sum, norm))  # the step's one sync
        if self._clip is not None and norm is not None and boundary.all_finite:
            import torch

            torch.nn.utils.clip_grads_with_norm_(params, self._clip, norm)  # as the Trainer would have
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


def takes_over_clipping(args: TrainingArguments) -> bool:
    """Whether the callback clips for the Trainer: it has a `max_grad_norm` and holds the whole gradients
    (plain PyTorch or DDP; DeepSpeed clips inside its engine and reports its own norm before clipping,
    and FSDP's shards would need its own clip)."""
    max_norm = getattr(args, "max_grad_norm", None)
    return (
        bool(max_norm)
        and max_norm > 0
        and not getattr(args, "deepspeed", None)
        and not getattr(args, "fsdp", None)
    )


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
