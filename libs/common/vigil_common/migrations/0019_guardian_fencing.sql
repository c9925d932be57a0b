-- Guardian fencing: each share's holder takes the next epoch when it takes the share's lock, and every
-- write of that share's state checks it holds the newest (a guardian paused past its lock, then resumed,
-- is refused instead of overwriting its successor's state). Job snapshots carry their share, so that a
-- guardian loads its share's jobs by index (rows saved before this migration have none: the guardian
-- that loads them sets it).
CREATE TABLE IF NOT EXISTS guardian_share_epochs (
    share    integer PRIMARY KEY,
    epoch    bigint NOT NULL,
    holder   text NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE guardian_jobs ADD COLUMN IF NOT EXISTS share integer;
CREATE INDEX IF NOT EXISTS guardian_jobs_share ON guardian_jobs (share, updated_at) WHERE NOT terminal;
