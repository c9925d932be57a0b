-- Issue 41: an attempt the scheduler stops on the spot path (`PreemptJob`): preempted for a job of higher
-- priority (`by_job`; the job is requeued and resumes from the step it stopped at), or past its
-- scheduling.time_limit (the job ends FAILED). One row per attempt: one stop in flight per victim, so a
-- placement pass that runs again before the victim's ranks exit sends nothing twice.
CREATE TABLE job_stops (
    job_id       text NOT NULL REFERENCES jobs (id),
    attempt      integer NOT NULL,
    kind         text NOT NULL CHECK (kind IN ('preempt', 'time_limit')),
    by_job       text REFERENCES jobs (id),
    reason       text NOT NULL,
    devices      jsonb NOT NULL DEFAULT '[]',          -- [[node, index], ...] it held: free for by_job once it exits
    requested_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, attempt)
);
CREATE INDEX job_stops_by_job ON job_stops (by_job) WHERE by_job IS NOT NULL;

-- The scheduler's preemption of a job is audited (who preempted whom, and why).
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check
    CHECK (action IN ('submit', 'cancel', 'halt', 'rollback', 'restart', 'resume', 'clear_device_mark', 'user', 'token', 'revoke', 'quota', 'preempt', 'time_limit'));
