-- Scale: raw per-rank step rows in a table partitioned by time (retention = dropping old partitions;
-- telemetry creates partitions ahead, see vigil_telemetry.partitions), and per-step aggregates across
-- ranks kept for the job's life, maintained by a statement trigger on every insert or COPY.
-- Audit: an append-only record of submit, cancel, halt, rollback and resume with who asked.

-- --- steps, partitioned by occurred_at --------------------------------------------------------------------

ALTER TABLE telemetry_steps RENAME TO telemetry_steps_unpartitioned;
ALTER TABLE telemetry_steps_unpartitioned RENAME CONSTRAINT telemetry_steps_pkey TO telemetry_steps_unpartitioned_pkey;
ALTER INDEX telemetry_steps_job RENAME TO telemetry_steps_unpartitioned_job;

CREATE SEQUENCE telemetry_steps_seq;

CREATE TABLE telemetry_steps (
    event_id            text NOT NULL,
    seq                 bigint NOT NULL DEFAULT nextval('telemetry_steps_seq'),  -- arrival order
    job_id              text NOT NULL,
    attempt             integer NOT NULL,
    step                integer NOT NULL,
    rank                integer NOT NULL,
    node                text NOT NULL,
    loss                double precision NOT NULL,
    grad_norm           double precision,
    lr                  double precision NOT NULL,
    tokens              bigint NOT NULL,
    tokens_per_s        double precision NOT NULL,
    data_time_s         double precision NOT NULL,
    forward_time_s      double precision NOT NULL,
    backward_time_s     double precision NOT NULL,
    comm_time_s         double precision NOT NULL,
    optimizer_time_s    double precision NOT NULL,
    step_time_s         double precision NOT NULL,
    mem_allocated_bytes bigint,
    mem_peak_bytes      bigint,
    skipped             boolean NOT NULL,
    data_position       bigint NOT NULL,
    occurred_at         timestamptz NOT NULL,
    -- A unique key of a partitioned table includes the partition key: a redelivered event carries
    -- the same occurred_at, so it still lands on this key (and in the same partition).
    PRIMARY KEY (event_id, occurred_at)
) PARTITION BY RANGE (occurred_at);
ALTER SEQUENCE telemetry_steps_seq OWNED BY telemetry_steps.seq;
CREATE INDEX telemetry_steps_job ON telemetry_steps (job_id, attempt, step, rank, seq);

-- Rows for a period no partition covers yet (clock skew, an event replayed long after). Retention
-- deletes its old rows; a period's partition is created only while this holds none of its rows.
CREATE TABLE telemetry_steps_default PARTITION OF telemetry_steps DEFAULT;

INSERT INTO telemetry_steps SELECT * FROM telemetry_steps_unpartitioned;
SELECT setval('telemetry_steps_seq', COALESCE((SELECT max(seq) FROM telemetry_steps), 0) + 1, false);
DROP TABLE telemetry_steps_unpartitioned;

-- --- per-step aggregates across ranks, kept for the job's life --------------------------------------------

-- Over the newest event of each rank (a step re-run after a rollback replaces the rank's earlier one):
-- mean loss and grad norm, summed tokens and tokens/s, slowest step and communication times.
CREATE TABLE telemetry_step_aggregates (
    job_id       text NOT NULL,
    attempt      integer NOT NULL,
    step         integer NOT NULL,
    ranks        integer NOT NULL,
    loss         double precision,
    grad_norm    double precision,
    lr           double precision,
    tokens       bigint,
    tokens_per_s double precision,
    step_time_s  double precision,
    comm_time_s  double precision,
    skipped      boolean,
    occurred_at  timestamptz NOT NULL,
    PRIMARY KEY (job_id, attempt, step)
);

-- Recomputes the aggregates of every (job, attempt, step) an INSERT or COPY touched from the raw rows.
-- Telemetry replicas may write ranks of the same step at once: a transaction-scoped advisory lock per
-- job (taken in job order: no deadlock) makes the second wait for the first to commit, and its
-- recompute (a new snapshot per statement under READ COMMITTED) then sees both.
CREATE FUNCTION telemetry_steps_aggregate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('telemetry_steps:' || j.job_id))
    FROM (SELECT DISTINCT job_id FROM new_rows ORDER BY job_id) j;
    INSERT INTO telemetry_step_aggregates AS a
        (job_id, attempt, step, ranks, loss, grad_norm, lr, tokens, tokens_per_s, step_time_s,
         comm_time_s, skipped, occurred_at)
    SELECT job_id, attempt, step, count(*)::int, avg(loss), avg(grad_norm), max(lr), sum(tokens)::bigint,
           sum(tokens_per_s), max(step_time_s), max(comm_time_s), bool_or(skipped), max(occurred_at)
    FROM (
        SELECT DISTINCT ON (s.job_id, s.attempt, s.step, s.rank) s.*
        FROM telemetry_steps s
        JOIN (SELECT DISTINCT job_id, attempt, step FROM new_rows) k
          ON k.job_id = s.job_id AND k.attempt = s.attempt AND k.step = s.step
        ORDER BY s.job_id, s.attempt, s.step, s.rank, s.seq DESC
    ) newest
    GROUP BY job_id, attempt, step
    ON CONFLICT (job_id, attempt, step) DO UPDATE SET
        ranks = EXCLUDED.ranks, loss = EXCLUDED.loss, grad_norm = EXCLUDED.grad_norm, lr = EXCLUDED.lr,
        tokens = EXCLUDED.tokens, tokens_per_s = EXCLUDED.tokens_per_s, step_time_s = EXCLUDED.step_time_s,
        comm_time_s = EXCLUDED.comm_time_s, skipped = EXCLUDED.skipped, occurred_at = EXCLUDED.occurred_at;
    RETURN NULL;
END
$$;

CREATE TRIGGER telemetry_steps_aggregate AFTER INSERT ON telemetry_steps
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION telemetry_steps_aggregate();

-- Steps stored before this migration.
INSERT INTO telemetry_step_aggregates
    (job_id, attempt, step, ranks, loss, grad_norm, lr, tokens, tokens_per_s, step_time_s, comm_time_s,
     skipped, occurred_at)
SELECT job_id, attempt, step, count(*)::int, avg(loss), avg(grad_norm), max(lr), sum(tokens)::bigint,
       sum(tokens_per_s), max(step_time_s), max(comm_time_s), bool_or(skipped), max(occurred_at)
FROM (
    SELECT DISTINCT ON (job_id, attempt, step, rank) * FROM telemetry_steps
    ORDER BY job_id, attempt, step, rank, seq DESC
) newest
GROUP BY job_id, attempt, step;

-- --- audit ------------------------------------------------------------------------------------------------

CREATE TABLE audit_log (
    seq         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    occurred_at timestamptz NOT NULL DEFAULT now(),
    action      text NOT NULL CHECK (action IN ('submit', 'cancel', 'halt', 'rollback', 'resume')),
    job_id      text,
    attempt     integer,
    actor       text NOT NULL,          -- 'token:<fingerprint>' (the API) or 'service:<name>' (the bus)
    event_id    text UNIQUE,            -- the command's event id: a redelivered command is one record
    detail      jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_log_job ON audit_log (job_id, seq);

CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_log is append-only: % refused', TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$;
CREATE TRIGGER audit_log_no_update_or_delete BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION audit_log_append_only();
