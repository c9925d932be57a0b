-- Device health is not a job's to decide alone (issue 31, section 3), and a checkpoint that fails to
-- load is marked bad (section 5).
--
-- A device mark now says who made it and how long it holds: `job_id`, the job whose replays (or whose
-- worker's diagnostic) led to it; `expires_at`, after which placement offers the device again (NULL: until
-- cleared); `confirmed`, the worker's own known-answer check failed on it (such a mark never expires).
-- Marks from NVML samples (gpu_health) are the worker's measurements: confirmed, never expiring, as before.
ALTER TABLE device_marks
    ADD COLUMN job_id     text,
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN confirmed  boolean NOT NULL DEFAULT true,
    ADD COLUMN source     text NOT NULL DEFAULT 'gpu_health'
        CHECK (source IN ('gpu_health', 'replay', 'diagnostic'));
CREATE INDEX device_marks_job ON device_marks (job_id) WHERE job_id IS NOT NULL;

-- An operator's clearing of a mark is audited; it names no job.
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check
    CHECK (action IN ('submit', 'cancel', 'halt', 'rollback', 'resume', 'clear_device_mark'));

-- Why a checkpoint was refused when loaded ('hash': it failed its manifest; 'load': it verified and
-- still did not load). `valid` is false for it from then on: no resume or rollback takes it again.
ALTER TABLE scheduler_checkpoints ADD COLUMN refused text CHECK (refused IN ('hash', 'load'));
