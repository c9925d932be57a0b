-- MFU per step (StepCompleted v2): the model FLOPs per token behind a rank's throughput, its model
-- FLOPs utilisation against the device's peak, and the micro-batch the step ran with (half the
-- spec's after an out-of-memory). NULL for steps of senders that did not say.
ALTER TABLE telemetry_steps
    ADD COLUMN flops_per_token double precision,
    ADD COLUMN mfu             double precision,
    ADD COLUMN micro_batch     integer;

-- The newest step's MFU and throughput per job, for `vigil job` and the job object.
ALTER TABLE telemetry_job_progress
    ADD COLUMN mfu          double precision,
    ADD COLUMN tokens_per_s double precision;
