-- A relaunch from a checkpoint (`RestartJob`) is its own action, "restart", apart from an in-place
-- "rollback" (IncidentRaised v2). Incidents keep `action` as text, so no constraint changes for them;
-- the stored relaunches of v1 (action "rollback", evidence `restart` true) are read as v2 reads them, so
-- that the API, the console and the metrics name one action for one thing. Every other row is unchanged.
UPDATE telemetry_incidents SET action = 'restart'
    WHERE action = 'rollback' AND evidence->>'restart' = 'true';

-- A RestartJob seen on the command stream is audited as "restart" (rows written before keep "rollback").
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check
    CHECK (action IN ('submit', 'cancel', 'halt', 'rollback', 'restart', 'resume', 'clear_device_mark', 'user', 'token', 'revoke', 'quota'));
