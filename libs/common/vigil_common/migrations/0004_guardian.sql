-- Guardian: its control state per job (policy, attempt, checkpoints, rollbacks, recovery), the
-- incidents it has published (so a restart never publishes one twice), and the devices it found
-- sick. Detector windows are not stored: a restart rebuilds them by replaying the steps stream.

CREATE TABLE guardian_jobs (
    job_id     text PRIMARY KEY,
    state      jsonb NOT NULL,
    terminal   boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX guardian_jobs_active ON guardian_jobs (updated_at) WHERE NOT terminal;

CREATE TABLE guardian_incidents (
    id         text PRIMARY KEY,                  -- the IncidentRaised event_id
    job_id     text,
    kind       text NOT NULL,
    action     text NOT NULL,
    step       integer,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX guardian_incidents_created ON guardian_incidents (created_at);

CREATE TABLE guardian_devices (
    node       text NOT NULL,
    index      integer NOT NULL,
    level      integer NOT NULL,                  -- 1: in trouble (job-caused), 2: unhealthy (hardware)
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, index)
);
