"""A tiny GPT-style model trained by a plain `torch.distributed` DDP loop under Vigil (or alone).

    python ddp_loop.py --steps 30                       # one process
    torchrun --nproc-per-node 2 ddp_loop.py             # two ranks on gloo
    vigil submit examples/byo/ddp_loop.yaml --follow    # under Vigil

The SDK's core API, nothing else: the step boundary before the optimizer step (carried in DDP's own
gradient all-reduce, `run.carry`), a report per step, a checkpoint every `--save-every` steps, and a
loader so that a rollback happens in place. Each step's batch
is drawn from its data position, so the guardian's skipped windows are honoured. The data is random
tokens: nothing is downloaded. An elastic job (`resources.elastic`) relaunched on fewer ranks keeps its
global batch (`run.on_resize`: more micro-steps per rank, each reading a spec-size rank's batch).
`--nan-at K` makes rank 1's loss NaN at step K once, `--crash-at K` kills rank 1 at step K once,
`--startup-delay S` starts every rank of a relaunch S seconds late (faults.py). The last line printed is
JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from faults import add_arguments, crash_if_due, marker_dir, once, start_slowly
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import vigil
import vigil.elastic


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5, help="the spec's checkpoint.every")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default="out/ddp_loop", help="where the fault markers go outside Vigil")
    add_arguments(p)
    return p.parse_args()


class TinyLM(nn.Module):
    """Embedding, two transformer layers, a head: the next-token loss of (B, T+1) token ids."""

    def __init__(self, vocab: int = 256, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        # no dropout: a step's loss is a pure function of the weights and the batch, whatever ran before
        layer = nn.TransformerEncoderLayer(
            dim, nhead=2, dim_feedforward=4 * dim, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, y = ids[:, :-1], ids[:, 1:]  # (B, T) each
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        logits = self.head(self.blocks(self.embed(x), mask=mask, is_causal=True))  # (B, T, vocab)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def batch(position: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    """This rank's (B, T+1) tokens at a data position: the same on every run, whatever came before."""
    g = torch.Generator().manual_seed(position * 1000 + rank)
    return torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=g)


def main() -> None:
    args = parse_args()
    start_slowly(args)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        vigil.init_process_group()  # gloo on CPU; rank 0's store listens on MASTER_ADDR only
    run = vigil.init()
    markers = marker_dir(run, args.out)

    torch.manual_seed(0)  # same initial weights on every rank
    net = TinyLM()
    model = DDP(net) if world > 1 else net
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
    # the step boundary rides in DDP's own gradient all-reduce: no collective of Vigil's per step
    carried: dict[str, torch.Tensor] = {}  # this rank's loss for the step, as the all-reduce starts
    if world > 1:
        run.carry(model, lambda: carried.get("loss"))

    def save(path: Path) -> None:  # every rank holds the same state: rank 0 writes it
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path / "state.pt")

    def load(path: Path) -> None:
        state = torch.load(path / "state.pt", weights_only=True)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    run.on_rollback(load)  # a rollback loads in place; `after_step` then returns the checkpoint's step
    # an elastic job (resources.elastic) relaunched on fewer ranks, or grown back: each rank runs as many
    # micro-steps as keep the global batch, each reading the batch a rank of the spec's size read
    resized: list[vigil.elastic.Resize] = []
    run.on_resize(resized.append, grad_accum=1)
    sources = [resized[0].source(rank, m)[0] for m in range(resized[0].grad_accum)] if resized else [rank]
    step = 0
    if run.resume_from is not None:  # relaunched from a checkpoint
        chosen = run.choose_checkpoint(str(run.resume_from), None)
        load(chosen.path)
        step = chosen.step

    while step < args.steps:
        # --- forward and backward (DDP all-reduces the gradients in backward) ----------------------------
        crash_if_due(args, step, rank, markers)  # the injected faults, each once per job
        position = run.position(step)
        loss = torch.zeros(())
        for m, source in enumerate(sources):  # one micro-step at the spec's size
            last = m == len(sources) - 1  # DDP all-reduces the summed gradients in the last one's backward
            with contextlib.nullcontext() if last or world == 1 else model.no_sync():
                part = model(batch(position, source, args)) / len(sources)
                if args.nan_at == step and source == args.nan_rank and once(markers / f"nan-at-{step}.done"):
                    part = part * float("nan")
                loss = carried["loss"] = loss + part.detach()
                part.backward()
        norm = nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        # --- the step boundary: is every rank's step finite, which commands are there (carried in DDP's
        # all-reduce above; one small all-reduce of its own where it was not) -------------------------------
        ok = run.agree(torch.isfinite(loss) & torch.isfinite(norm))
        if ok.all_finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # --- report, checkpoint, commands ---------------------------------------------------------------
        run.report(step, loss=loss.item(), grad_norm=norm.item(), lr=args.lr, data_position=position,
                   tokens=args.micro_batch * args.seq_len, skipped=not ok.all_finite)  # fmt: skip
        if (step + 1) % args.save_every == 0 and run.active:
            run.save_checkpoint(step + 1, save)
        step = run.after_step(step + 1, ok)  # a halt waits here; a rollback returns the checkpoint's step

    finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    print(json.dumps({"steps": step, "finite_weights": finite}))
    if world > 1:
        dist.destroy_process_group()
    # gloo's C++ threads still outlive the interpreter now and then: "terminate called without an active
    # exception", exit -6, after all the work is done (as in deepspeed_loop.py). Send what Vigil has
    # queued, then leave without the interpreter's teardown.
    run.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
