-- Issue 32: no job is ever stuck. What a job's current attempt is recovering from, and when it last
-- moved, so that a late event settles a recovery and the scheduler's sweeper ends one that stalled.
--   progress_at: the last transition or rank event of the job (the sweeper's clock);
--   recovery: the HaltJob / RollbackJob the current attempt is under ({"halt": {...}, "rollback": {...},
--             "halted_step": n}), NULL when none;
--   recovery_incidents: the incidents behind its halts and rollbacks, id -> whether the bad step's update
--             was never applied (held, or skipped as non-finite): a rollback of such a step, whose ranks
--             have finished, ends the job SUCCEEDED.
ALTER TABLE jobs ADD COLUMN progress_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE jobs ADD COLUMN recovery jsonb;
ALTER TABLE jobs ADD COLUMN recovery_incidents jsonb NOT NULL DEFAULT '{}';
CREATE INDEX jobs_in_transition ON jobs (progress_at)
    WHERE state IN ('SCHEDULED', 'HALTED', 'ROLLING_BACK');
