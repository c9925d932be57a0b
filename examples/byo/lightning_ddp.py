"""A tiny GPT-style model trained by Lightning with DDP under Vigil (or alone: the callback is inert).

    python lightning_ddp.py --steps 30                       # one process
    torchrun --nproc-per-node 2 lightning_ddp.py             # two ranks on gloo
    vigil submit examples/byo/lightning_ddp.yaml --follow    # under Vigil

Lightning starts no process here: it joins the ranks the launcher started (`trainer_args()`). The data is
random tokens: nothing is downloaded. `--nan-at K` makes rank 1's loss NaN at step K once, `--crash-at K`
kills rank 1 at step K once (faults.py: a marker file in the job's checkpoint folder keeps a relaunch from
doing it again), `--startup-delay S` starts every rank of a relaunch S seconds late. The last line printed
is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from faults import add_arguments, crash_if_due, marker_dir, once, start_slowly
from torch import nn

import vigil
from vigil.integrations import lightning as vigil_pl


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5, help="the spec's checkpoint.every")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--out", default="out/lightning_ddp", help="Lightning's default_root_dir")
    add_arguments(p)
    return p.parse_args()


class TinyLM(L.LightningModule):
    """Embedding, two transformer layers, a head: next-token prediction on (B, T) token ids."""

    def __init__(self, faults: argparse.Namespace, markers: Path, vocab: int = 256, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=4 * dim, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(dim, vocab)
        self.faults, self.markers = faults, markers

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        crash_if_due(self.faults, self.trainer.global_step, self.global_rank, self.markers)
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T-1) each
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        logits = self.head(self.blocks(self.embed(x), mask=mask, is_causal=True))  # (B, T-1, vocab)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        if self.poison_now():
            loss = loss * float("nan")
        return loss

    def poison_now(self) -> bool:
        """Rank `--nan-rank` (1) at step `--nan-at`, once per job (the marker file outlives a relaunch)."""
        step = self.trainer.global_step
        if self.faults.nan_at != step or self.global_rank != self.faults.nan_rank:
            return False
        return once(self.markers / f"nan-at-{step}.done")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    args = parse_args()
    start_slowly(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        vigil.init_process_group()  # Lightning uses the group as it is (its store on MASTER_ADDR only)
    run = vigil.init()
    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyLM(args, marker_dir(run, args.out))
    tokens = torch.randint(0, 256, (args.steps * args.micro_batch * world, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    data = torch.utils.data.DataLoader(tokens, batch_size=args.micro_batch, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp" if world > 1 else "auto",
        max_steps=args.steps,
        default_root_dir=args.out,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[vigil_pl.VigilCallback(run, every=args.save_every)],
        **vigil_pl.trainer_args(),
    )
    trainer.fit(model, data, ckpt_path=vigil_pl.resume_checkpoint(run))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(json.dumps({"steps": trainer.global_step, "finite_weights": finite}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # gloo's C++ threads still outlive the interpreter now and then: "terminate called without an active
    # exception", exit -6, after all the work is done (as in the other examples). Send what Vigil has
    # queued, then leave without the interpreter's teardown.
    run.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
