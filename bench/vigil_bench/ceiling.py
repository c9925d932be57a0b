"""The ceiling `vigil bench mfu` measures the trainer against: Vigil's own `GPT` in a plain PyTorch loop.

No DeepSpeed, no Vigil: the module the trainer builds (same dims, seed and data), stepped the way a
careful user writes it by hand, as in nanoGPT's `train.py`: bf16 autocast on a GPU that has it (fp32
elsewhere), `torch.optim.AdamW(fused=True)`, gradient clipping, `zero_grad(set_to_none=True)`, and
`torch.compile` where the trainer compiles (`train.compile`, resolved the same way). One synchronisation
per step (`torch.cuda.synchronize()` on a GPU), so each step's wall time is honest.

Run as `python -m vigil_bench.timed_rank --timings FILE --ceiling TRAINER-ARGS...` (one rank).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from vigil_trainer import rank
from vigil_trainer.compile import should_compile
from vigil_trainer.observer import Observer


def ceiling(argv: list[str], observer: Observer) -> int:
    """Step Vigil's GPT in a plain PyTorch loop on the trainer's data; each step's time to `observer`."""
    args: argparse.Namespace = rank.parse_args(argv)
    env = rank.rank_env()
    job = rank.read_job(args, env.world)
    spec, dims = job.spec, job.spec.model.resolved()
    device = torch.device("cuda", 0) if env.cuda else torch.device("cpu")
    if env.cuda:
        torch.cuda.set_device(device)
    tokens = rank.load_data(args, spec)

    from vigil_trainer.data import batch
    from vigil_trainer.model import GPT

    torch.manual_seed(spec.train.seed)
    model = GPT(dims).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": spec.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=spec.train.lr, betas=(0.9, 0.95), fused=True)
    bf16 = env.cuda and torch.cuda.is_bf16_supported() and spec.train.precision in ("auto", "bf16")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    step_model = torch.compile(model) if should_compile(spec.train.compile, device) else model

    train, T = spec.train, dims.seq_len
    for step in range(train.steps):
        t0 = time.perf_counter()
        for micro in range(train.grad_accum):
            x, y = batch(
                tokens,
                seed=train.seed,
                data_position=step,
                rank=env.rank,
                micro=micro,
                micro_batch=train.micro_batch,
                seq_len=T,
            )  # (B, T) each
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                loss = step_model(x, y) / train.grad_accum
            loss.backward()
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if env.cuda:
            torch.cuda.synchronize()  # CPU-GPU sync point: the step's wall time is honest only after one
        observer.on_step_end(step, time.perf_counter() - t0)
    return 0
