-- Steps and data positions are int8 wherever they are stored (issue 31): a rank that numbered its steps
-- past 2^31 overflowed the int4 `step` columns, and the failed insert took whole telemetry batches, other
-- jobs' steps included, with it. The event models bound every step and position below 2^63
-- (vigil_common.events.Step). Bucket numbers (step / width) and their first and last steps grow with
-- the steps. ALTER TABLE on the partitioned `telemetry_steps` changes every partition with it.
ALTER TABLE telemetry_steps ALTER COLUMN step TYPE bigint;
ALTER TABLE telemetry_step_aggregates ALTER COLUMN step TYPE bigint;
ALTER TABLE telemetry_step_buckets
    ALTER COLUMN bucket TYPE bigint,
    ALTER COLUMN first_step TYPE bigint,
    ALTER COLUMN last_step TYPE bigint;
ALTER TABLE telemetry_job_progress ALTER COLUMN last_step TYPE bigint;
ALTER TABLE telemetry_checkpoints ALTER COLUMN step TYPE bigint;
ALTER TABLE telemetry_incidents ALTER COLUMN step TYPE bigint;
ALTER TABLE guardian_incidents ALTER COLUMN step TYPE bigint;
ALTER TABLE scheduler_checkpoints ALTER COLUMN step TYPE bigint;
ALTER TABLE jobs ALTER COLUMN skip_data TYPE bigint[];
