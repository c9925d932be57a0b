-- Foundation: messages the bus consumers terminated, kept for people to inspect.
CREATE TABLE dead_letters (
    event_id      text PRIMARY KEY,
    stream        text NOT NULL,
    consumer      text NOT NULL,
    subject       text NOT NULL,
    reason        text NOT NULL,
    payload       text NOT NULL,
    num_delivered integer NOT NULL,
    occurred_at   timestamptz NOT NULL,
    recorded_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_letters_occurred_at ON dead_letters (occurred_at DESC);
