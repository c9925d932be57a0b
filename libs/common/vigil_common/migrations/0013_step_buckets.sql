-- The console's curves, downsampled as steps arrive: per job, width and rank, one row per `width`
-- consecutive steps (bucket = step / width), with per metric the sum and count of its finite values,
-- their min and max, and how many values were NaN or infinite. The telemetry writer adds every batch of
-- steps it stores (vigil_telemetry.store), so a page of a long run reads about two rows per point
-- instead of every rank-step; the columns are vigil_common.readmodel.BUCKET_COLUMNS (a test compares),
-- the widths readmodel.BUCKET_WIDTHS. Kept for the job's life, like the per-step aggregates.
CREATE TABLE telemetry_step_buckets (
    job_id             text NOT NULL,
    width              integer NOT NULL,
    rank               integer NOT NULL,
    bucket             integer NOT NULL,
    first_step         integer NOT NULL,
    last_step          integer NOT NULL,
    loss_sum           double precision NOT NULL,
    loss_n             integer NOT NULL,
    loss_lo            double precision,
    loss_hi            double precision,
    loss_bad           integer NOT NULL,
    grad_norm_sum      double precision NOT NULL,
    grad_norm_n        integer NOT NULL,
    grad_norm_lo       double precision,
    grad_norm_hi       double precision,
    grad_norm_bad      integer NOT NULL,
    lr_sum             double precision NOT NULL,
    lr_n               integer NOT NULL,
    lr_lo              double precision,
    lr_hi              double precision,
    lr_bad             integer NOT NULL,
    tokens_per_s_sum   double precision NOT NULL,
    tokens_per_s_n     integer NOT NULL,
    tokens_per_s_lo    double precision,
    tokens_per_s_hi    double precision,
    tokens_per_s_bad   integer NOT NULL,
    PRIMARY KEY (job_id, width, rank, bucket)
) WITH (fillfactor = 70);  -- a running job's rows are updated in place every batch: room for HOT updates

-- Bumped by every batch of a job's steps: with the job's row, status events and incidents, what tells
-- the console's job page that it has something new to show (readmodel.job_version).
ALTER TABLE telemetry_job_progress ADD COLUMN revision bigint NOT NULL DEFAULT 0;

-- Steps stored before this migration.
INSERT INTO telemetry_step_buckets
SELECT job_id, width, rank, step / width, min(step), max(step),
       COALESCE(sum(loss), 0), count(loss)::int, min(loss), max(loss), count(*) FILTER (WHERE loss_bad)::int,
       COALESCE(sum(grad_norm), 0), count(grad_norm)::int, min(grad_norm), max(grad_norm),
       count(*) FILTER (WHERE grad_norm_bad)::int,
       COALESCE(sum(lr), 0), count(lr)::int, min(lr), max(lr), count(*) FILTER (WHERE lr_bad)::int,
       COALESCE(sum(tokens_per_s), 0), count(tokens_per_s)::int, min(tokens_per_s), max(tokens_per_s),
       count(*) FILTER (WHERE tokens_per_s_bad)::int
FROM (
    SELECT job_id, rank, step,
           CASE WHEN loss IN ('NaN', 'Infinity', '-Infinity') THEN NULL ELSE loss END AS loss,
           loss IN ('NaN', 'Infinity', '-Infinity') AS loss_bad,
           CASE WHEN grad_norm IN ('NaN', 'Infinity', '-Infinity') THEN NULL ELSE grad_norm END AS grad_norm,
           COALESCE(grad_norm IN ('NaN', 'Infinity', '-Infinity'), false) AS grad_norm_bad,
           CASE WHEN lr IN ('NaN', 'Infinity', '-Infinity') THEN NULL ELSE lr END AS lr,
           lr IN ('NaN', 'Infinity', '-Infinity') AS lr_bad,
           CASE WHEN tokens_per_s IN ('NaN', 'Infinity', '-Infinity') THEN NULL ELSE tokens_per_s END
               AS tokens_per_s,
           tokens_per_s IN ('NaN', 'Infinity', '-Infinity') AS tokens_per_s_bad
    FROM telemetry_steps
) s
CROSS JOIN unnest(ARRAY[4, 16, 64, 256, 1024, 4096, 16384, 65536]) AS w(width)
GROUP BY job_id, width, rank, step / width;
