"""A tiny GPT-style model trained by a DeepSpeed loop of your own under Vigil (or alone: inert SDK).

    python deepspeed_loop.py --steps 30                       # one process
    torchrun --nproc-per-node 2 deepspeed_loop.py --zero 1    # two ranks (gloo on CPU)
    vigil submit examples/byo/deepspeed_loop.yaml --follow    # under Vigil

A rollback loads the checkpoint in place (`register_rollback`); a relaunch resumes from it (`resume`).
Each step's batch is drawn from its data position, so the guardian's skipped windows are honoured. The
data is random tokens: nothing is downloaded. `--nan-at K` makes rank 1's loss NaN at step K once,
`--crash-at K` kills rank 1 at step K once, `--startup-delay S` starts every rank of a relaunch S seconds late
(faults.py). The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
from faults import add_arguments, crash_if_due, marker_dir, once, start_slowly
from torch import nn

import vigil
from vigil.integrations import deepspeed as vigil_ds
from vigil.integrations import ds_compat


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5, help="the spec's checkpoint.every")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage (0-2)")
    p.add_argument("--out", default="out/deepspeed_loop", help="where the fault markers go outside Vigil")
    add_arguments(p)
    return p.parse_args()


class TinyLM(nn.Module):
    """Embedding, two transformer layers, a head: next-token logits for (B, T) token ids."""

    def __init__(self, vocab: int = 256, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=4 * dim, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, y = ids[:, :-1], ids[:, 1:]  # (B, T-1) each
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        logits = self.head(self.blocks(self.embed(x), mask=mask, is_causal=True))  # (B, T-1, vocab)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def batch(position: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    """This rank's (B, T+1) tokens at a data position: the same on every run, whatever came before."""
    g = torch.Generator().manual_seed(position * 1000 + rank)
    return torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=g)


def main() -> None:
    args = parse_args()
    start_slowly(args)
    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if cpu:
        ds_compat.skip_shm_build()  # DeepSpeed's shared-memory op serves inference only: no JIT build
    vigil.init_process_group()  # DeepSpeed uses the group as it is (its store on MASTER_ADDR only)
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl", timeout=timedelta(minutes=10))
    run = vigil.init()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    markers = marker_dir(run, args.out)

    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyLM()
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "train_batch_size": args.micro_batch * world,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    vigil_ds.register_rollback(engine, run)
    step = vigil_ds.resume(engine, run)
    while step < args.steps:
        crash_if_due(args, step, rank, markers)  # the injected faults, each once per job
        loss = engine(batch(run.position(step), rank, args))
        if args.nan_at == step and rank == args.nan_rank and once(markers / f"nan-at-{step}.done"):
            loss = loss * float("nan")
        engine.backward(loss)
        ok = vigil_ds.step(engine, loss, run)  # instead of engine.step(): agree, then step
        run.report(step, loss=loss.item(), grad_norm=vigil_ds.grad_norm(engine), lr=engine.get_lr()[0],
                   tokens=args.micro_batch * args.seq_len, skipped=not engine.was_step_applied())  # fmt: skip
        if (step + 1) % args.save_every == 0:
            vigil_ds.save(engine, step + 1, run)
        step = run.after_step(step + 1, ok)
    finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    print(json.dumps({"steps": step, "finite_weights": finite}))
    # A C++ thread (gloo's, DeepSpeed's) still outlives the interpreter now and then: "terminate called
    # without an active exception", exit -6, after all the work is done (as in hf_trainer.py). Send what
    # Vigil has queued, then leave without the interpreter's teardown.
    run.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
