-- Issue 44: code packages (`vigil submit --code DIR`), kept in the NATS Object Store bucket VIGIL_CODE by
-- their SHA-256; a job's spec names its pack (`entrypoint.code`). Here: who uploaded which pack, so that a
-- user submits and reads only their own packs or their team's, and the sweep knows which packs no job
-- references (deleted from the bucket after a grace period; a pack a job references is kept with the job).
CREATE TABLE code_uploads (
    sha256      text NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    owner       text NOT NULL,
    team        text,
    bytes       bigint NOT NULL CHECK (bytes >= 0),     -- the pack's bytes (gzipped tar)
    uploaded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sha256, owner)
);
CREATE INDEX code_uploads_uploaded_at ON code_uploads (uploaded_at);

-- The jobs that run a pack (the sweep's question, and a download's).
CREATE INDEX jobs_code ON jobs ((spec -> 'entrypoint' ->> 'code'))
    WHERE spec -> 'entrypoint' ->> 'code' IS NOT NULL;
