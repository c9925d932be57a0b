-- Issue 42 §3: a running job's guardian settings changed at run time (`PATCH /api/v1/jobs/{id}/guardian`).
-- The scheduler writes a row per change, in the transaction that changes the job's spec, audits it and
-- puts its `GuardianSettingsChanged` in the outbox; the guardian that judges the job fills in `from_step`,
-- the first step it judged under the change (what the console's curves mark).
CREATE TABLE guardian_settings_changes (
    job_id     text NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    revision   int NOT NULL CHECK (revision >= 1),
    event_id   text NOT NULL UNIQUE,
    actor      text NOT NULL,
    changed    jsonb NOT NULL,
    settings   jsonb NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    from_step  bigint CHECK (from_step >= 0),
    applied_at timestamptz,
    PRIMARY KEY (job_id, revision)
);

ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check
    CHECK (action IN ('submit', 'cancel', 'halt', 'rollback', 'restart', 'resume', 'clear_device_mark', 'user', 'token', 'revoke', 'quota', 'preempt', 'time_limit', 'guardian'));
