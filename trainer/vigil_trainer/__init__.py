"""The rank program: a GPT decoder trained by DeepSpeed, instrumented for Vigil.

A reading order: `rank` (the program: setup, then the loop), `loop` (one step, section by section), and
what the loop calls: `micro` (the micro-steps and the boundary, `execute`), `guard` (the finiteness
guard and command boundary, every rank's loss), `step_judge` (is the step one to hold?), `replay` (hold
it, replay it, skip its data; an update is dropped by the SDK's `vigil.integrations.deepspeed.skip_step`,
as in a DeepSpeed loop of one's own), `oom` (the out-of-memory retry), `report` (the step event),
`checkpoint_collective` (all ranks saving and loading together) over `checkpoint` (files and
manifests), `commands` (halt, rollback, resume). Beside them: `model` (with its AdamW groups), `data`,
`ds_config`, `context` (`RankContext`, `TrainState`), `observer` (timing hooks, no-op by default),
`comm` (time in collectives), `clock`, `mfu`, `memory`, `faults` (injected for tests).
"""
