-- Users who own their jobs: per-user API tokens (only their SHA-256 is kept), teams, GPU quotas per
-- user and per team, and each job's owner and team. The gateway's own token (VIGIL_API_TOKEN) is the
-- admin's and is not stored here.

CREATE TABLE teams (
    name       text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    gpus       integer CHECK (gpus >= 0),         -- devices the team's jobs hold at once; NULL: no limit
    source     text NOT NULL DEFAULT 'api' CHECK (source IN ('api', 'file')),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE users (
    name       text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    team       text CHECK (team ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    admin      boolean NOT NULL DEFAULT false,
    gpus       integer CHECK (gpus >= 0),         -- devices the user's jobs hold at once; NULL: no limit
    source     text NOT NULL DEFAULT 'api' CHECK (source IN ('api', 'file')),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_tokens (
    sha256     text PRIMARY KEY CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    user_name  text NOT NULL REFERENCES users (name) ON DELETE CASCADE,
    source     text NOT NULL DEFAULT 'api' CHECK (source IN ('api', 'file')),
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
CREATE INDEX api_tokens_user ON api_tokens (user_name);

-- Jobs submitted before users existed were submitted with the admin's token.
ALTER TABLE jobs ADD COLUMN owner text NOT NULL DEFAULT 'admin';
ALTER TABLE jobs ADD COLUMN team text;
ALTER TABLE jobs ADD COLUMN queue_reason text;  -- why a queued job waits (a quota), NULL: for devices
CREATE INDEX jobs_owner ON jobs (owner, seq DESC);
CREATE INDEX jobs_team ON jobs (team, seq DESC) WHERE team IS NOT NULL;

-- Creating users, issuing and revoking tokens and setting quotas are audited too.
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check
    CHECK (action IN ('submit', 'cancel', 'halt', 'rollback', 'resume', 'clear_device_mark', 'user', 'token', 'revoke', 'quota'));
