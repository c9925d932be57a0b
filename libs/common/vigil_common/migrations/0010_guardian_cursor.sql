-- Guardian: where in VIGIL_JOBS its saved state stands. It reads every job's launch, status and
-- step events through one consumer, in stream order, and saves this sequence in the same
-- transaction as the job state it changed: after a restart, an event at or below it is not judged
-- again (its effect is in the saved state; a step only rebuilds the detector windows).

CREATE TABLE guardian_cursor (
    stream     text PRIMARY KEY,
    seq        bigint NOT NULL CHECK (seq >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);
