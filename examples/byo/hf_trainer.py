"""A tiny GPT-2 trained by the Hugging Face Trainer under Vigil (or alone: the callback is then inert).

    python hf_trainer.py --steps 30                      # one process
    torchrun --nproc-per-node 2 hf_trainer.py            # DDP on gloo
    torchrun --nproc-per-node 2 hf_trainer.py --zero 1   # the Trainer's DeepSpeed integration
    vigil submit examples/byo/hf_trainer.yaml --follow   # under Vigil

The model is built from a config and the data is random tokens: nothing is downloaded. `--nan-at K`
makes rank 1's loss NaN at step K once (`--nan-rank R`: rank R's), `--crash-at K` kills rank 1 at step K
once (faults.py: a marker file in the job's checkpoint folder keeps a relaunch from doing it again),
`--startup-delay S` starts every rank of a relaunch S seconds late. The last line printed is JSON: the
steps trained, whether the weights are finite and the step times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from faults import add_arguments, crash_if_due, marker_dir, once, start_slowly
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import vigil
import vigil.elastic
from vigil.integrations import ds_compat
from vigil.integrations.hf import VigilCallback, resume_checkpoint


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5, help="the spec's checkpoint.every")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--zero", type=int, default=None, help="train through DeepSpeed with this ZeRO stage")
    # under Vigil a job's program may write its own HOME and checkpoint folder, not its code folder
    default_out = os.path.join(os.environ.get("HOME") or ".", "out", "hf_trainer")
    p.add_argument("--out", default=default_out, help="the Trainer's output_dir ($HOME/out/hf_trainer)")
    p.add_argument("--no-vigil", action="store_true", help="without the callback (the SDK bench's floor)")
    add_arguments(p)
    return p.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences; the labels are the inputs (the model shifts them)."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Faults(TrainerCallback):
    """The injected faults (faults.py), each once per job: rank 1 dies at step `--crash-at`, and rank
    `--nan-rank`'s (1) loss is NaN at step `--nan-at`."""

    def __init__(self, model: torch.nn.Module, faults: argparse.Namespace, markers: Path) -> None:
        self.faults, self.markers, self.step = faults, markers, -1
        self.rank = int(os.environ.get("RANK", "0"))
        if faults.nan_at is not None and self.rank == faults.nan_rank:
            model.register_forward_hook(self.poison)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.step = state.global_step
        crash_if_due(self.faults, self.step, self.rank, self.markers)

    def poison(self, module, inputs, output):
        due = module.training and self.step == self.faults.nan_at
        if due and once(self.markers / f"nan-at-{self.step}.done"):
            output.loss = output.loss * float("nan")
        return output


class StepClock(TrainerCallback):
    """Wall time from each step's start to the next one's: everything a step costs, callbacks included."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.starts.append(time.perf_counter())

    def step_s(self, warmup: int = 3) -> list[float]:
        """Each step's wall time after the first `warmup` (the last step has no next start)."""
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)][warmup:]


def deepspeed_config(stage: int) -> dict:
    if not torch.cuda.is_available():
        ds_compat.skip_shm_build()  # DeepSpeed's shared-memory op serves inference only: no JIT build
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
    }


def main() -> None:
    args = parse_args()
    start_slowly(args)
    if args.zero is not None and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        vigil.init_process_group()  # Accelerate uses the group as it is (its store on MASTER_ADDR only)
    run = vigil.init()
    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=2,
            vocab_size=256,
            n_positions=args.seq_len,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    # an elastic job (resources.elastic) relaunched on fewer ranks, or grown back: more gradient
    # accumulation keeps the global batch (the Trainer's sampler then deals the samples at the new size)
    resized: list[vigil.elastic.Resize] = []
    run.on_resize(resized.append, grad_accum=1)
    accumulation = resized[0].grad_accum if resized else 1
    spec_world = resized[0].spec_world if resized else world
    data = RandomTokens(args.steps * args.micro_batch * spec_world, args.seq_len, 256)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=args.save_every,
        logging_steps=args.steps,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if world > 1 and not torch.cuda.is_available() else None,
        deepspeed=deepspeed_config(args.zero) if args.zero is not None else None,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
    )
    clock = StepClock()
    callbacks = [clock, Faults(model, args, marker_dir(run, args.out))]
    if not args.no_vigil:
        callbacks.append(VigilCallback(run))
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    result = trainer.train(resume_from_checkpoint=resume_checkpoint(run))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(json.dumps({"steps": trainer.state.global_step, "finite_weights": finite,
                      "train_loss": result.training_loss if math.isfinite(result.training_loss) else None,
                      "median_step_s": statistics.median(clock.step_s() or [math.nan]),
                      "step_s": [round(t, 6) for t in clock.step_s()]}))  # fmt: skip
    if torch.distributed.is_initialized():  # gloo's threads, left running at exit, abort the process
        torch.distributed.destroy_process_group()
    # A C++ thread (gloo's, DeepSpeed's) still outlives the interpreter now and then: "terminate called
    # without an active exception", exit -6, after all the work is done and saved. Send what Vigil has
    # queued, then leave without the interpreter's teardown.
    run.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
