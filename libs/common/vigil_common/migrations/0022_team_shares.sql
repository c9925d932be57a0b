-- Issue 41: fair share. Each team's weight in the fair share (`vigil teams set-share TEAM W`): jobs of equal
-- priority are ordered by the team's decayed GPU-hours over its normalised share (Slurm's fair-share
-- factor). 1 unless set.
ALTER TABLE teams ADD COLUMN share double precision NOT NULL DEFAULT 1
    CHECK (share > 0 AND share < 'Infinity'::double precision);

-- The usage query reads the attempts of jobs not finished, or finished within the decay's reach.
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE finished_at IS NOT NULL;
