-- A step run twice has two histories (issue 32): after an in-place rollback the re-run steps have the same
-- (attempt, rank, step) as the abandoned ones, so each run of an attempt's steps gets its number, the
-- `generation` StepCompleted v3 carries: 0 for the attempt's first run, +1 after each in-place rollback
-- (the rank counts them). A step's key is (job, attempt, rank, step, generation); rows stay keyed by
-- event id (a redelivery is one row; a unique key of the partitioned table would have to hold its
-- partition key `occurred_at`, and so could not refuse a second row of the same step anyway).
-- The per-step aggregate keeps the last run of each step: over the ranks of the step's highest
-- generation (each rank's newest event of it), so an abandoned run that arrives late changes nothing.

ALTER TABLE telemetry_steps ADD COLUMN generation integer NOT NULL DEFAULT 0;
ALTER TABLE telemetry_step_aggregates ADD COLUMN generation integer NOT NULL DEFAULT 0;

DROP INDEX telemetry_steps_job;
CREATE INDEX telemetry_steps_job ON telemetry_steps (job_id, attempt, step, rank, generation, seq);

-- Rows stored before this migration: a row's generation is the number of in-place rollbacks of its
-- attempt (the stored RollbackCompleted events) that completed before it. Every rank stops at the halt
-- before the rollback and steps again only after rank 0 reported it, so this matches what the ranks
-- count now, the steps after the rollback's `from_step` included. Rows of attempts without a stored
-- rollback keep 0.
UPDATE telemetry_steps s SET generation = (
    SELECT count(*) FROM telemetry_status_events r
    WHERE r.job_id = s.job_id AND r.attempt = s.attempt AND r.type = 'rollback.completed'
      AND r.occurred_at < s.occurred_at
)
WHERE EXISTS (
    SELECT 1 FROM telemetry_status_events r
    WHERE r.job_id = s.job_id AND r.attempt = s.attempt AND r.type = 'rollback.completed'
      AND r.occurred_at < s.occurred_at
);

-- Recomputes the aggregates of every (job, attempt, step) an INSERT or COPY touched from the raw rows,
-- as 0009's did, over the step's last run only. The per-job advisory lock is 0009's.
CREATE OR REPLACE FUNCTION telemetry_steps_aggregate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('telemetry_steps:' || j.job_id))
    FROM (SELECT DISTINCT job_id FROM new_rows ORDER BY job_id) j;
    INSERT INTO telemetry_step_aggregates AS a
        (job_id, attempt, step, ranks, loss, grad_norm, lr, tokens, tokens_per_s, step_time_s,
         comm_time_s, skipped, occurred_at, flops_per_token, mfu, micro_batch, generation)
    SELECT job_id, attempt, step, count(*)::int, avg(loss), avg(grad_norm), max(lr), sum(tokens)::bigint,
           sum(tokens_per_s), max(step_time_s), max(comm_time_s), bool_or(skipped), max(occurred_at),
           max(flops_per_token), avg(mfu), min(micro_batch), max(generation)
    FROM (
        SELECT DISTINCT ON (s.job_id, s.attempt, s.step, s.rank) s.*,
               max(s.generation) OVER (PARTITION BY s.job_id, s.attempt, s.step) AS last_generation
        FROM telemetry_steps s
        JOIN (SELECT DISTINCT job_id, attempt, step FROM new_rows) k
          ON k.job_id = s.job_id AND k.attempt = s.attempt AND k.step = s.step
        ORDER BY s.job_id, s.attempt, s.step, s.rank, s.generation DESC, s.seq DESC
    ) newest
    WHERE generation = last_generation
    GROUP BY job_id, attempt, step
    ON CONFLICT (job_id, attempt, step) DO UPDATE SET
        ranks = EXCLUDED.ranks, loss = EXCLUDED.loss, grad_norm = EXCLUDED.grad_norm, lr = EXCLUDED.lr,
        tokens = EXCLUDED.tokens, tokens_per_s = EXCLUDED.tokens_per_s, step_time_s = EXCLUDED.step_time_s,
        comm_time_s = EXCLUDED.comm_time_s, skipped = EXCLUDED.skipped, occurred_at = EXCLUDED.occurred_at,
        flops_per_token = EXCLUDED.flops_per_token, mfu = EXCLUDED.mfu, micro_batch = EXCLUDED.micro_batch,
        generation = EXCLUDED.generation;
    RETURN NULL;
END
$$;

-- The aggregates of the old steps that now have more than one run, recomputed the same way.
INSERT INTO telemetry_step_aggregates AS a
    (job_id, attempt, step, ranks, loss, grad_norm, lr, tokens, tokens_per_s, step_time_s, comm_time_s,
     skipped, occurred_at, flops_per_token, mfu, micro_batch, generation)
SELECT job_id, attempt, step, count(*)::int, avg(loss), avg(grad_norm), max(lr), sum(tokens)::bigint,
       sum(tokens_per_s), max(step_time_s), max(comm_time_s), bool_or(skipped), max(occurred_at),
       max(flops_per_token), avg(mfu), min(micro_batch), max(generation)
FROM (
    SELECT DISTINCT ON (s.job_id, s.attempt, s.step, s.rank) s.*,
           max(s.generation) OVER (PARTITION BY s.job_id, s.attempt, s.step) AS last_generation
    FROM telemetry_steps s
    JOIN (SELECT DISTINCT job_id, attempt, step FROM telemetry_steps WHERE generation > 0) k
      ON k.job_id = s.job_id AND k.attempt = s.attempt AND k.step = s.step
    ORDER BY s.job_id, s.attempt, s.step, s.rank, s.generation DESC, s.seq DESC
) newest
WHERE generation = last_generation
GROUP BY job_id, attempt, step
ON CONFLICT (job_id, attempt, step) DO UPDATE SET
    ranks = EXCLUDED.ranks, loss = EXCLUDED.loss, grad_norm = EXCLUDED.grad_norm, lr = EXCLUDED.lr,
    tokens = EXCLUDED.tokens, tokens_per_s = EXCLUDED.tokens_per_s, step_time_s = EXCLUDED.step_time_s,
    comm_time_s = EXCLUDED.comm_time_s, skipped = EXCLUDED.skipped, occurred_at = EXCLUDED.occurred_at,
    flops_per_token = EXCLUDED.flops_per_token, mfu = EXCLUDED.mfu, micro_batch = EXCLUDED.micro_batch,
    generation = EXCLUDED.generation;
