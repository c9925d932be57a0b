"""Vigil for Lightning (`lightning.pytorch`, else `pytorch_lightning`): one callback, the ranks Vigil
started, and where to resume from.

Three lines in an existing script::

    from vigil.integrations import lightning as vigil_pl

    trainer = L.Trainer(accelerator="cpu", strategy="ddp", max_steps=100,
                        callbacks=[vigil_pl.VigilCallback(every=20)], **vigil_pl.trainer_args())
    trainer.fit(model, data, ckpt_path=vigil_pl.resume_checkpoint())

`trainer_args()` makes Lightning join the ranks Vigil (or torchrun) started, with their RANK, WORLD_SIZE,
LOCAL_RANK and NODE_RANK, instead of starting processes of its own: `devices` (LOCAL_WORLD_SIZE),
`num_nodes` and a cluster environment that reads them.

Per optimizer step, on every rank (`on_before_optimizer_step`, after backward and DDP's all-reduce):
this rank's loss (what `training_step` returned) and the gradients' norm go into the step boundary, which
under DDP rides in DDP's own gradient all-reduce (`Run.carry`) and elsewhere is one small all-reduce;
where any rank's step is not finite, every rank drops its gradients and the optimizer leaves the weights
alone. After the step (`on_train_batch_end`) it is reported, every `every` steps a checkpoint
is saved (`trainer.save_checkpoint` into Vigil's folder, sealed with its manifest), and the job's commands
are acted on: a halt waits there; a rollback stops every rank with exit code 5 and Vigil relaunches the
job, `resume_checkpoint()` naming the checkpoint (Lightning's loops cannot be rewound in place).

Outside Vigil the callback reports and saves nothing; the finiteness guard still runs.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
except ImportError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from lightning_fabric.plugins.environments import TorchElasticEnvironment  # type: ignore[no-redef]

from vigil.integrations._guard import StepLoss, drop_gradients, grad_norm, verdict

if TYPE_CHECKING:
    import torch

    from vigil.boundary import Boundary
    from vigil.run import Run

log = logging.getLogger("vigil")

CHECKPOINT_FILE = "lightning.ckpt"  # in Vigil's step_<n> folder


class VigilCallback(pl.Callback):
    """Reports every optimizer step, guards it, saves a checkpoint every `every` steps (None: never) and
    acts on Vigil's commands. `run` defaults to `vigil.init()`."""

    def __init__(self, run: Run | None = None, *, every: int | None = None) -> None:
        if every is not None and every < 1:
            raise ValueError(f"VigilCallback(every={every}): save every N >= 1 steps, or None for never")
        if run is None:
            import vigil

            run = vigil.init()
        self.run = run
        self.every = every
        self.losses = StepLoss()
        self.boundary: Boundary | None = None
        self._step: dict[str, Any] = {}

    # --- where the loss comes from -----------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or getattr(pl_module.training_step, "_vigil", False):
            return
        step_fn = pl_module.training_step

        @functools.wraps(step_fn)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            out = step_fn(*args, **kwargs)
            loss = out.get("loss") if isinstance(out, dict) else out
            if loss is not None and hasattr(loss, "detach"):
                self.losses.add(loss, _tokens(args[0] if args else kwargs.get("batch")))
            return out

        training_step._vigil = True  # type: ignore[attr-defined]
        pl_module.training_step = training_step  # type: ignore[method-assign]
        if self.run.skip_windows:
            log.warning(
                "vigil: data windows %s are to be skipped; Lightning's data loader does not know them",
                self.run.skip_windows,
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # under DDP (wrapped by now), the boundary rides in its gradient all-reduce: no collective of ours
        self.run.carry(trainer.strategy.model, self.losses.peek)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.carry(None)

    # --- the step boundary ---------------------------------------------------------------------------

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        loss_sum, count, tokens = self.losses.take()
        loss_t = loss_sum / count if loss_sum is not None and count else None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = grad_norm(params)  # full gradients, after DDP's all-reduce
        boundary = self.run.agree(verdict(loss_t, norm))  # in DDP's all-reduce, or the step's one sync
        if not boundary.all_finite:
            drop_gradients(params)
        loss = math.nan if loss_t is None else float(loss_t)  # synchronised already: no wait
        self._step = {
            "loss": loss,
            "grad_norm": float(norm) if norm is not None else None,
            "lr": float(optimizer.param_groups[0].get("lr", 0.0)),
            "tokens": tokens,
            "skipped": not boundary.all_finite,
            "local_finite": loss_t is None or math.isfinite(loss),
        }
        self.boundary = boundary

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        boundary, self.boundary = self.boundary, None
        if boundary is None:
            return  # accumulating gradients: no optimizer step in this batch
        next_step = trainer.global_step  # Lightning has counted the step already
        self.run.report(next_step - 1, **self._step)
        if self.every and next_step % self.every == 0 and self.run.active and self.run.checkpoint_root:
            self.run.save_checkpoint(next_step, lambda path: trainer.save_checkpoint(path / CHECKPOINT_FILE))
        after = self.run.after_step(next_step, boundary)  # a halt waits here; a rollback exits
        if after != next_step:
            raise RuntimeError(
                "vigil: Lightning cannot continue from another step in place; "
                "register no rollback loader with VigilCallback (Vigil then relaunches the job)"
            )


def _tokens(batch: Any) -> int:
    """Tokens in a batch that is a tensor of ids, a dict with `input_ids`, or a tuple led by one."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids")
    elif isinstance(batch, list | tuple) and batch:
        batch = batch[0]
    return int(batch.numel()) if hasattr(batch, "numel") and not batch.is_floating_point() else 0


class TorchrunEnvironment(TorchElasticEnvironment):
    """The ranks torchrun or Vigil started: RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK (or GROUP_RANK),
    MASTER_ADDR and MASTER_PORT from the environment; Lightning starts no process of its own."""

    @staticmethod
    def detect() -> bool:
        return {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= os.environ.keys()

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))


def trainer_args() -> dict[str, Any]:
    """`Trainer(**trainer_args())` for the ranks this process belongs to: `devices`, `num_nodes` and the
    environment that reads them; empty when the process was not started as one rank of several."""
    if not TorchrunEnvironment.detect():
        return {}
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local}")
    return {"devices": local, "num_nodes": world // local, "plugins": [TorchrunEnvironment()]}


def resume_checkpoint(run: Run | None = None) -> str | None:
    """The checkpoint file Vigil relaunched this job from, its folder verified against the manifest, for
    `trainer.fit(..., ckpt_path=...)`; None otherwise."""
    if run is None:
        import vigil

        run = vigil.init()
    chosen = run.resume_checkpoint()
    return None if chosen is None else str(Path(chosen.path) / CHECKPOINT_FILE)
