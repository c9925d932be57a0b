"""Vigil in the training frameworks a program may already use; each module is imported only when used.

- `vigil.integrations.hf`: the Hugging Face `transformers.Trainer` (plain, DDP, or its DeepSpeed
  integration): `VigilCallback()` and `resume_checkpoint()`.
- `vigil.integrations.lightning`: Lightning's `Trainer`: `VigilCallback(every=...)`, `trainer_args()`
  and `resume_checkpoint()`.
- `vigil.integrations.deepspeed`: a loop of your own around a DeepSpeed engine: `step`, `save`,
  `register_rollback`, `resume`, and `skip_step` (an update dropped on every rank: the one skip the
  built-in trainer uses too; `gate` and `ds_compat` are its parts).

A plain `torch.distributed` loop uses `vigil.init()` and its `Run` directly (examples/byo/ddp_loop.py).

Every integration is inert outside Vigil: the program trains as it did, and a non-finite update is still
skipped on every rank alike. The Trainer and Lightning cannot load a checkpoint in place in the middle of
training, so their callbacks register no loader: a rollback stops every rank (exit code 5) and Vigil
relaunches the job from the checkpoint, which `resume_checkpoint()` hands to `train()` / `fit()`.
"""
