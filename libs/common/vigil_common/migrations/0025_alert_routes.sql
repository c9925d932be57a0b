-- Issue 42 §2: alert routes (`/api/v1/alerts/routes`, `vigil alerts`). A route belongs to its owner (a
-- user, or `admin`) and, when `team` is set, to that team: who sees it is `vigil_common.visibility.sees`
-- on (owner, team), as for jobs. `admin`: made by an admin, so it hears every job's incidents.
CREATE TABLE alert_routes (
    id          text PRIMARY KEY CHECK (id ~ '^r-[0-9a-f]{16}$'),
    name        text NOT NULL,
    url         text NOT NULL,
    format      text NOT NULL CHECK (format IN ('json', 'slack', 'alertmanager')),
    owner       text NOT NULL,
    team        text,
    admin       boolean NOT NULL DEFAULT false,
    filter      jsonb NOT NULL DEFAULT '{}',
    -- a `json` route's signing key (HMAC-SHA256). Unlike a token, which is only checked and so kept as its
    -- SHA-256, a signing key must be used: it is kept as the NATS and Postgres passwords are (only the
    -- services' database role reads it), and shown to the route's maker once.
    secret      text,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX alert_routes_owner ON alert_routes (owner);
CREATE INDEX alert_routes_team ON alert_routes (team) WHERE team IS NOT NULL;

-- The outbox and delivery log: telemetry writes a row per matching route in the transaction that takes
-- the incident off the bus, then posts it (`vigil_telemetry.alerts`); a row is claimed with FOR UPDATE
-- SKIP LOCKED and a lease (`next_at`), so replicas share the work and a crash loses nothing.
CREATE TABLE alert_deliveries (
    id           bigserial PRIMARY KEY,
    route_id     text NOT NULL REFERENCES alert_routes (id) ON DELETE CASCADE,
    incident_id  text NOT NULL,
    job_id       text,
    kind         text NOT NULL,
    occurred_at  timestamptz NOT NULL,          -- the incident's
    phase        text NOT NULL CHECK (phase IN ('firing', 'resolved')),
    url          text NOT NULL,                 -- where it goes (alertmanager: <route url>/api/v2/alerts)
    body         text NOT NULL,                 -- what is posted (signed at each attempt for `json`)
    status       text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts     integer NOT NULL DEFAULT 0,
    last_error   text,
    next_at      timestamptz NOT NULL DEFAULT now(),
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    UNIQUE (route_id, incident_id, phase)
);
CREATE INDEX alert_deliveries_due ON alert_deliveries (next_at) WHERE status = 'pending';
CREATE INDEX alert_deliveries_route ON alert_deliveries (route_id, id DESC);
-- the firing alertmanager deliveries a job's recovery resolves
CREATE INDEX alert_deliveries_job ON alert_deliveries (job_id, phase);

-- a route made or deleted is audited
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check
    CHECK (action IN ('submit', 'cancel', 'halt', 'rollback', 'restart', 'resume', 'clear_device_mark', 'user', 'token', 'revoke', 'quota', 'preempt', 'time_limit', 'guardian', 'alert_route'));
