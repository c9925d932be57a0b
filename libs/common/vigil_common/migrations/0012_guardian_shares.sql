-- Guardian shares: a guardian loads the incidents of its share's jobs (by job id), and keeps one input
-- cursor per share (`guardian_cursor.stream` is `VIGIL_SHARES/<share>`).
CREATE INDEX IF NOT EXISTS guardian_incidents_job ON guardian_incidents (job_id);
