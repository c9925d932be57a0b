"""How telemetry stores steps (migrations 0003, 0008, 0009, 0013, 0014, 0017), in one place: the columns of
`telemetry_steps`, which the telemetry writer COPYs and the read side selects, and of
`telemetry_step_buckets`, the console's downsampled curves. A test checks both tables against them."""

from __future__ import annotations

# How a StepCompleted (`vigil.events`) is stored: the columns of `telemetry_steps` with their Postgres
# types. The telemetry writer COPYs exactly these, the read model (`vigil_common.readmodel`) and the benches
# take their column lists from here. Every field of the event is stored but STEP_NOT_STORED. (Not in the
# event's module: the SDK that ships the event knows nothing of Postgres.)
STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("event_id", "text"),
    ("job_id", "text"),
    ("attempt", "int"),
    ("step", "int8"),
    ("rank", "int"),
    ("node", "text"),
    ("loss", "float8"),
    ("grad_norm", "float8"),
    ("lr", "float8"),
    ("tokens", "int8"),
    ("tokens_per_s", "float8"),
    ("data_time_s", "float8"),
    ("forward_time_s", "float8"),
    ("backward_time_s", "float8"),
    ("comm_time_s", "float8"),
    ("optimizer_time_s", "float8"),
    ("step_time_s", "float8"),
    ("mem_allocated_bytes", "int8"),
    ("mem_peak_bytes", "int8"),
    ("skipped", "bool"),
    ("data_position", "int8"),
    ("occurred_at", "timestamptz"),
    ("flops_per_token", "float8"),
    ("mfu", "float8"),
    ("micro_batch", "int"),
    ("generation", "int"),
)
STEP_FIELDS: tuple[str, ...] = tuple(name for name, _ in STEP_COLUMNS)
STEP_NOT_STORED = frozenset({"type", "schema_version", "local_finite"})  # the envelope's tag, and a v2 flag

SERIES_METRICS = ("loss", "grad_norm", "lr", "tokens_per_s")

# Downsampled curves kept as steps arrive (`telemetry_step_buckets`, migration 0013; the telemetry writer
# adds each batch): per job, rank and width, one row per `width` consecutive steps (bucket = step //
# width) with, per metric, the sum and count of its finite values, their min and max, and how many were
# not finite. Sums and counts merge, so a shown bucket of k stored ones is one GROUP BY. The widths are
# fixed: one added later would hold only the steps stored after it (a migration must fill it).
BUCKET_WIDTHS = (4, 16, 64, 256, 1024, 4096, 16384, 65536)
BUCKET_PARTS = (("sum", "float8"), ("n", "int"), ("lo", "float8"), ("hi", "float8"), ("bad", "int"))
BUCKET_COLUMNS: tuple[tuple[str, str], ...] = (
    ("job_id", "text"),
    ("width", "int"),
    ("rank", "int"),
    ("bucket", "int8"),
    ("first_step", "int8"),
    ("last_step", "int8"),
    *((f"{m}_{part}", t) for m in SERIES_METRICS for part, t in BUCKET_PARTS),
)
