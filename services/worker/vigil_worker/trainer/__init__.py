"""The rank program: a GPT decoder trained by DeepSpeed, instrumented for Vigil.

A reading order: `rank` (the program: setup, then the loop), `loop` (one step, section by section), and
what the loop calls: `guard` (the finiteness guard and command boundary, `GuardedAdamW`),
`checkpoint_collective` (all ranks saving and loading together) over `checkpoint` (files and
manifests), `commands` (halt, rollback, resume). Beside them: `model`, `data`, `ds_config`, `context`
(`RankContext`, `TrainState`), `telemetry` (the event sink), `observer` (timing hooks, no-op by
default), `comm` (time in collectives), `memory`, `faults` (injected for tests), `exits`.
"""
