-- requires: core 0004
-- ql3_ai 0001 on SQLite: durable model invocations (SPEC section 4), the same four
-- immutable receipt tables as sql/ql3_ai/0001_invocations.sql (types as in core 0002).
-- Created only when the store is opened with ai=True; its ledger is
-- ql3_ai_feature_history, never schema_history. The procedures (admission, completion,
-- resolution, recovery) are Python transactions in ql3.edge.invocations.

CREATE TABLE model_invocation_starts (
    invocation_id TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    project_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    step_run_id TEXT NOT NULL REFERENCES step_runs (step_run_id),
    trace_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    policy_contract_family TEXT,
    policy_contract_id TEXT,
    policy_revision_id TEXT,
    request_digest TEXT NOT NULL,
    deadline_at TEXT NOT NULL,
    input_bytes INTEGER NOT NULL,
    command_digest TEXT NOT NULL,
    record TEXT NOT NULL,
    start_digest TEXT NOT NULL,
    mutation_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    dedupe_key TEXT NOT NULL,
    admitted_at TEXT NOT NULL
) STRICT;

-- History, not identity: one step has as many starts as it has attempts.
CREATE INDEX model_invocation_starts_history
ON model_invocation_starts (run_id, step_run_id, admitted_at, invocation_id);

CREATE TABLE model_invocation_completions (
    invocation_id TEXT PRIMARY KEY REFERENCES model_invocation_starts (invocation_id),
    start_digest TEXT NOT NULL,
    project_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    step_run_id TEXT NOT NULL,
    outcome TEXT NOT NULL,
    result_code TEXT NOT NULL,
    output_bytes INTEGER,
    output_digest TEXT,
    input_tokens INTEGER,
    output_tokens INTEGER,
    cost_micros INTEGER,
    currency TEXT,
    recovered INTEGER NOT NULL CHECK (recovered IN (0, 1)),
    command_digest TEXT NOT NULL,
    record TEXT NOT NULL,
    completion_digest TEXT NOT NULL,
    mutation_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    dedupe_key TEXT NOT NULL,
    completed_at TEXT NOT NULL,
    CHECK (
        CASE outcome
            WHEN 'lost' THEN result_code = 'outcome_unknown'
            WHEN 'succeeded' THEN NOT recovered AND result_code <> 'outcome_unknown'
            WHEN 'failed' THEN NOT recovered AND result_code <> 'outcome_unknown'
            WHEN 'timed_out' THEN NOT recovered AND result_code <> 'outcome_unknown'
            ELSE 0
        END
    )
) STRICT;

CREATE INDEX model_invocation_completions_history
ON model_invocation_completions (run_id, step_run_id, completed_at, invocation_id);

-- Lost outcomes wait for a human; this keeps "what is unresolved" cheap.
CREATE INDEX model_invocation_completions_lost
ON model_invocation_completions (completed_at, invocation_id) WHERE outcome = 'lost';

CREATE TABLE model_invocation_resolutions (
    invocation_id TEXT PRIMARY KEY REFERENCES model_invocation_completions (invocation_id),
    completion_digest TEXT NOT NULL,
    run_id TEXT NOT NULL,
    step_run_id TEXT NOT NULL,
    decision TEXT NOT NULL CHECK (decision IN ('retry', 'fail', 'cancel')),
    user_id TEXT NOT NULL,
    reason TEXT,
    command_digest TEXT NOT NULL,
    record TEXT NOT NULL,
    resolution_digest TEXT NOT NULL,
    mutation_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    dedupe_key TEXT NOT NULL,
    resolved_at TEXT NOT NULL
) STRICT;

CREATE TABLE usage_ledger (
    invocation_id TEXT PRIMARY KEY REFERENCES model_invocation_completions (invocation_id),
    project_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    input_tokens INTEGER,
    output_tokens INTEGER,
    cost_micros INTEGER,
    currency TEXT,
    outcome TEXT NOT NULL,
    completion_digest TEXT NOT NULL,
    recorded_at TEXT NOT NULL,
    -- A row exists only for usage that exists; unknown cost stays NULL, never 0.
    CHECK (coalesce(input_tokens, output_tokens, cost_micros) IS NOT NULL OR currency IS NOT NULL)
) STRICT;

CREATE INDEX usage_ledger_project ON usage_ledger (project_id, recorded_at);

CREATE TRIGGER model_invocation_starts_no_update BEFORE UPDATE ON model_invocation_starts
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: model_invocation_starts is immutable (UPDATE refused)');
END;

CREATE TRIGGER model_invocation_starts_no_delete BEFORE DELETE ON model_invocation_starts
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: model_invocation_starts is immutable (DELETE refused)');
END;

CREATE TRIGGER model_invocation_completions_no_update BEFORE UPDATE ON model_invocation_completions
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: model_invocation_completions is immutable (UPDATE refused)');
END;

CREATE TRIGGER model_invocation_completions_no_delete BEFORE DELETE ON model_invocation_completions
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: model_invocation_completions is immutable (DELETE refused)');
END;

CREATE TRIGGER model_invocation_resolutions_no_update BEFORE UPDATE ON model_invocation_resolutions
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: model_invocation_resolutions is immutable (UPDATE refused)');
END;

CREATE TRIGGER model_invocation_resolutions_no_delete BEFORE DELETE ON model_invocation_resolutions
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: model_invocation_resolutions is immutable (DELETE refused)');
END;

CREATE TRIGGER usage_ledger_no_update BEFORE UPDATE ON usage_ledger
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: usage_ledger is immutable (UPDATE refused)');
END;

CREATE TRIGGER usage_ledger_no_delete BEFORE DELETE ON usage_ledger
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: usage_ledger is immutable (DELETE refused)');
END;
