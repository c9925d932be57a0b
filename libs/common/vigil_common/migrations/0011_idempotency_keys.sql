-- Scheduler: the Idempotency-Key of each submit, per caller, for a day. A client whose submit was cut
-- off (a failover, a dropped connection) sends it again with the same key and gets the job made the
-- first time; the same key with another body is refused.

CREATE TABLE idempotency_keys (
    actor       text NOT NULL,                 -- who submitted (the audit's actor: token:<hash>, ...)
    key         text NOT NULL,
    body_sha256 text NOT NULL,
    job_id      text NOT NULL REFERENCES jobs (id) ON DELETE CASCADE DEFERRABLE INITIALLY DEFERRED,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (actor, key)
);

CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
