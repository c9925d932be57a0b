-- Telemetry: every step, GPU sample, status event, incident and checkpoint, one row per event
-- (event_id is the key: a redelivered event never becomes a second row). Read through
-- vigil_common.readmodel. Floats may be NaN or Infinity (float8 stores them).

CREATE TABLE telemetry_steps (
    event_id            text PRIMARY KEY,
    seq                 bigint GENERATED ALWAYS AS IDENTITY,   -- arrival order (re-run steps after a rollback come later)
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
    occurred_at         timestamptz NOT NULL
);
CREATE INDEX telemetry_steps_job ON telemetry_steps (job_id, attempt, step, rank, seq);

-- The newest step per job, for job listings (last_step, loss).
CREATE TABLE telemetry_job_progress (
    job_id      text PRIMARY KEY,
    attempt     integer NOT NULL,
    last_step   integer NOT NULL,
    loss        double precision,
    occurred_at timestamptz NOT NULL
);

CREATE TABLE telemetry_gpu_samples (
    event_id           text PRIMARY KEY,
    node               text NOT NULL,
    index              integer NOT NULL,
    device_kind        text NOT NULL,
    uuid               text NOT NULL,
    job_id             text,
    utilization_pct    double precision,
    memory_used_bytes  bigint,
    memory_total_bytes bigint,
    temperature_c      double precision,
    power_w            double precision,
    sm_clock_mhz       integer,
    mem_clock_mhz      integer,
    throttle_reasons   text[] NOT NULL DEFAULT '{}',
    ecc_corrected      bigint,
    ecc_uncorrected    bigint,
    xid                integer,
    occurred_at        timestamptz NOT NULL
);
CREATE INDEX telemetry_gpu_samples_device ON telemetry_gpu_samples (node, index, occurred_at DESC, event_id DESC);

-- The newest sample per device, kept beside the history so inventory pages need no scan.
CREATE TABLE telemetry_gpu_latest (
    node        text NOT NULL,
    index       integer NOT NULL,
    event_id    text NOT NULL,
    occurred_at timestamptz NOT NULL,
    sample      jsonb NOT NULL,
    PRIMARY KEY (node, index)
);

-- Every status event (rank started/exited, checkpoint saved, halts, rollbacks, state changes) as it came.
CREATE TABLE telemetry_status_events (
    event_id    text PRIMARY KEY,
    seq         bigint GENERATED ALWAYS AS IDENTITY,
    job_id      text,
    attempt     integer NOT NULL,
    type        text NOT NULL,
    occurred_at timestamptz NOT NULL,
    payload     jsonb NOT NULL
);
CREATE INDEX telemetry_status_events_job ON telemetry_status_events (job_id, seq);

-- One row per checkpoint directory; a re-save of the same step (after a rollback) replaces it.
CREATE TABLE telemetry_checkpoints (
    job_id          text NOT NULL,
    step            integer NOT NULL,
    path            text NOT NULL,
    attempt         integer NOT NULL,
    bytes           bigint NOT NULL,
    manifest_sha256 text NOT NULL,
    data_position   bigint NOT NULL,
    valid           boolean NOT NULL DEFAULT true,   -- false once a rollback went back past it
    event_id        text NOT NULL,
    created_at      timestamptz NOT NULL,
    PRIMARY KEY (job_id, step)
);

CREATE TABLE telemetry_incidents (
    id          text PRIMARY KEY,                     -- the IncidentRaised event_id
    seq         bigint GENERATED ALWAYS AS IDENTITY,
    job_id      text,
    attempt     integer NOT NULL,
    kind        text NOT NULL,
    action      text NOT NULL,
    step        integer,
    rank        integer,
    node        text,
    device      integer,
    message     text NOT NULL,
    evidence    jsonb NOT NULL,
    occurred_at timestamptz NOT NULL
);
CREATE INDEX telemetry_incidents_seq ON telemetry_incidents (seq DESC);
CREATE INDEX telemetry_incidents_job ON telemetry_incidents (job_id, seq DESC);
