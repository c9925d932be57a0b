-- Scheduler: jobs and their transitions, the transactional outbox, the inventory (nodes, devices),
-- ranks per attempt and the checkpoints a job can resume from.

CREATE TABLE jobs (
    id                 text PRIMARY KEY,
    seq                bigserial UNIQUE,                    -- submission order
    name               text NOT NULL,
    state              text NOT NULL CHECK (state IN ('PENDING', 'SCHEDULED', 'RUNNING', 'HALTED',
                                                      'ROLLING_BACK', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
    priority           integer NOT NULL DEFAULT 0,
    spec               jsonb NOT NULL,
    world_size         integer NOT NULL CHECK (world_size >= 1),
    max_nodes          integer NOT NULL CHECK (max_nodes >= 1),
    attempt            integer NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    queued             boolean NOT NULL DEFAULT true,       -- waiting for a placement of `attempt`
    placement          jsonb,                               -- [{rank, node, device, local_rank}] of `attempt`
    previous_placement jsonb,                               -- the devices the attempt before held
    master_addr        text,
    master_port        integer,
    resume_from        text,
    skip_data          integer[],
    reason             text,                                -- why it failed or was cancelled
    completed_commands text[] NOT NULL DEFAULT '{}',        -- rollbacks seen completed before their command
    trace_context      jsonb NOT NULL DEFAULT '{}',         -- W3C headers of the submit span
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    finished_at        timestamptz
);
CREATE INDEX jobs_queue ON jobs (priority DESC, seq) WHERE queued;
CREATE INDEX jobs_listing ON jobs (seq DESC);

-- Every state change with its cause, written in the same transaction as the change.
CREATE TABLE job_transitions (
    id          bigserial PRIMARY KEY,
    job_id      text NOT NULL REFERENCES jobs (id),
    attempt     integer NOT NULL,
    from_state  text,
    to_state    text NOT NULL,
    cause       text NOT NULL,
    event_id    text NOT NULL UNIQUE,                       -- the JobStateChanged published for it
    occurred_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX job_transitions_job ON job_transitions (job_id, id);

-- Transactional outbox: events written with the state change, published by the relay afterwards
-- with Nats-Msg-Id = event_id (a re-publish after a crash is de-duplicated by JetStream).
CREATE TABLE outbox (
    id           bigserial PRIMARY KEY,
    event_id     text NOT NULL UNIQUE,
    subject      text NOT NULL,
    type         text NOT NULL,
    job_id       text,
    attempt      integer,
    payload      bytea NOT NULL,
    headers      jsonb NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX outbox_unpublished ON outbox (id) WHERE published_at IS NULL;
-- Exactly one launch per attempt of a job.
CREATE UNIQUE INDEX outbox_one_launch_per_attempt ON outbox (job_id, attempt) WHERE type = 'job.launch';

CREATE TABLE nodes (
    name           text PRIMARY KEY,
    address        text NOT NULL,
    started_at     timestamptz NOT NULL,                    -- the worker process's start
    interval_s     double precision NOT NULL,
    last_heartbeat timestamptz NOT NULL,                    -- when the scheduler received it
    alive          boolean NOT NULL DEFAULT true,
    lost_at        timestamptz,
    first_seen     timestamptz NOT NULL DEFAULT now()
);

-- One row per schedulable slot. `job_id` is the one job it is given to, so a device can never
-- belong to two jobs.
CREATE TABLE devices (
    node             text NOT NULL REFERENCES nodes (name) ON DELETE CASCADE,
    index            integer NOT NULL CHECK (index >= 0),
    kind             text NOT NULL,
    name             text NOT NULL,
    uuid             text NOT NULL,
    memory_bytes     bigint NOT NULL DEFAULT 0,
    nvlink_peers     integer[] NOT NULL DEFAULT '{}',
    present          boolean NOT NULL DEFAULT true,         -- in the worker's latest heartbeat
    reported_healthy boolean NOT NULL DEFAULT true,
    reported_free    boolean NOT NULL DEFAULT true,
    job_id           text REFERENCES jobs (id),
    attempt          integer,
    rank             integer,
    PRIMARY KEY (node, index)
);
CREATE INDEX devices_job ON devices (job_id) WHERE job_id IS NOT NULL;

-- Devices the guardian found sick (gpu_health incidents). Kept apart from `devices` so a mark that
-- arrives before the node's first heartbeat is not lost; cleared when the node's worker restarts.
CREATE TABLE device_marks (
    node      text NOT NULL,
    index     integer NOT NULL,
    reason    text NOT NULL,
    marked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, index)
);

CREATE TABLE job_ranks (
    job_id     text NOT NULL REFERENCES jobs (id),
    attempt    integer NOT NULL,
    rank       integer NOT NULL,
    node       text NOT NULL,
    started_at timestamptz,
    exited_at  timestamptz,
    exit_code  integer,
    failure    text,
    PRIMARY KEY (job_id, attempt, rank)
);

-- The checkpoints a requeued job can resume from (from CheckpointSaved on the status subject).
CREATE TABLE scheduler_checkpoints (
    job_id        text NOT NULL REFERENCES jobs (id),
    step          integer NOT NULL,
    path          text NOT NULL,
    data_position bigint NOT NULL,
    attempt       integer NOT NULL,
    valid         boolean NOT NULL DEFAULT true,            -- false once rolled back past or refused
    saved_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, step)
);
