-- core 0003 on SQLite: runs and steps (SPEC section 3), the same tables as
-- sql/core/0003_runs.sql (types as in 0002). run_events and step_run_mutations are
-- immutable history; runs and step_runs are versioned state.

CREATE TABLE runs (
    run_id TEXT PRIMARY KEY,
    project_id TEXT NOT NULL,
    trace_id TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'open' CHECK (status = 'open'),
    version INTEGER NOT NULL DEFAULT 1,
    event_seq INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
) STRICT;

CREATE TABLE step_runs (
    step_run_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs (run_id),
    kind TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'ready',
    version INTEGER NOT NULL DEFAULT 1,
    attempt_count INTEGER NOT NULL DEFAULT 0,
    current_invocation_id TEXT,
    output_ref TEXT,
    result_code TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    CHECK (
        CASE status
            WHEN 'ready' THEN current_invocation_id IS NULL AND output_ref IS NULL AND result_code IS NULL
            WHEN 'running' THEN current_invocation_id IS NOT NULL AND output_ref IS NULL AND result_code IS NULL
            WHEN 'succeeded' THEN 1
            WHEN 'failed' THEN output_ref IS NULL
            WHEN 'timed_out' THEN output_ref IS NULL
            WHEN 'lost' THEN output_ref IS NULL
            WHEN 'cancelled' THEN output_ref IS NULL
            ELSE 0
        END
    )
) STRICT;

CREATE INDEX step_runs_run ON step_runs (run_id);

CREATE INDEX step_runs_running ON step_runs (step_run_id) WHERE status = 'running';

CREATE TABLE run_events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event_id TEXT NOT NULL UNIQUE,
    event_type TEXT NOT NULL,
    step_run_id TEXT,
    payload TEXT NOT NULL,
    created_at TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
) STRICT;

CREATE TABLE step_run_mutations (
    mutation_id TEXT PRIMARY KEY,
    dedupe_key TEXT NOT NULL UNIQUE,
    step_run_id TEXT NOT NULL,
    from_status TEXT NOT NULL,
    to_status TEXT NOT NULL,
    from_version INTEGER NOT NULL,
    to_version INTEGER NOT NULL CHECK (to_version = from_version + 1),
    command_digest TEXT NOT NULL,
    created_at TEXT NOT NULL,
    UNIQUE (step_run_id, to_version)
) STRICT;

CREATE TRIGGER run_events_no_update BEFORE UPDATE ON run_events
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: run_events is immutable (UPDATE refused)');
END;

CREATE TRIGGER run_events_no_delete BEFORE DELETE ON run_events
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: run_events is immutable (DELETE refused)');
END;

CREATE TRIGGER step_run_mutations_no_update BEFORE UPDATE ON step_run_mutations
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: step_run_mutations is immutable (UPDATE refused)');
END;

CREATE TRIGGER step_run_mutations_no_delete BEFORE DELETE ON step_run_mutations
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: step_run_mutations is immutable (DELETE refused)');
END;
