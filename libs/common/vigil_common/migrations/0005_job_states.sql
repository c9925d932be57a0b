-- Job states in the database agree with vigil_common.jobstates.JobState: `jobs.state` has had its
-- CHECK since 0002 (jobs_state_check); the transition log gets the same list here. Adding a state
-- means a new migration that drops and re-adds these three constraints with the longer list; a test
-- compares every one of them with the enum.
ALTER TABLE job_transitions
    ADD CONSTRAINT job_transitions_from_state_check CHECK (from_state IN ('PENDING', 'SCHEDULED', 'RUNNING',
        'HALTED', 'ROLLING_BACK', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
    ADD CONSTRAINT job_transitions_to_state_check CHECK (to_state IN ('PENDING', 'SCHEDULED', 'RUNNING',
        'HALTED', 'ROLLING_BACK', 'SUCCEEDED', 'FAILED', 'CANCELLED'));
