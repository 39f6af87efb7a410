-- Completion (sql/ql3_ai/0001_invocations.sql): running -> succeeded | failed | timed_out | lost,
-- the Completion receipt, the usage ledger, replay with re-verification, and bad input.
BEGIN;
\ir lib/invocation_helpers.sql

SELECT plan(84);

-- Fixture: run R1 with model steps S1..S9, each admitted as inv-cN (deadlines far away).
SELECT ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000001');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'model', ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid)
FROM generate_series(1, 9) AS g;

SET ROLE ql3_runtime;
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-c' || g, 'aaaaaaaa-0000-0000-0000-000000000001', ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid, 1
))
FROM generate_series(1, 9) AS g;

-- succeeded, with usage

CREATE TEMP TABLE cmd AS
SELECT tests.completion('inv-c1', 'succeeded', 'ok', tests.usage(100, 20, 1500, 'USD')) AS c;
CREATE TEMP TABLE c1 AS SELECT ql3_ai.complete_invocation(c) AS r FROM cmd;

SELECT is((SELECT r ->> 'status' FROM c1), 'created', 'completing a running invocation is created');
SELECT is(
    (SELECT r ->> 'completion_digest' FROM c1),
    (SELECT ql3.digest('ql3/model-invocation-completion@v1', r -> 'completion') FROM c1),
    'completion_digest is the digest of the record under ql3/model-invocation-completion@v1'
);
SELECT is(
    (SELECT r -> 'completion' ->> 'command_digest' FROM c1),
    (SELECT ql3.digest('ql3/model-invocation-completion-command@v1', c) FROM cmd),
    'command_digest is the digest of the command under ql3/model-invocation-completion-command@v1'
);
SELECT is(
    (SELECT array_agg(k.key ORDER BY k.key) FROM c1, jsonb_object_keys(c1.r -> 'completion') AS k (key)),
    ARRAY[
        'attempt', 'command_digest', 'completed_at', 'dedupe_key', 'event_id', 'invocation_id', 'model',
        'mutation_id', 'outcome', 'output_bytes', 'output_digest', 'output_ref', 'project_id', 'provider',
        'recovered', 'result_code', 'run_event_seq', 'run_id', 'run_version', 'schema', 'start_digest',
        'step_run_id', 'step_run_version', 'trace_id', 'usage'
    ],
    'the completion record has exactly the v1 fields'
);
SELECT results_eq(
    $$SELECT r -> 'completion' ->> 'schema', r -> 'completion' ->> 'outcome', r -> 'completion' ->> 'result_code',
             r -> 'completion' ->> 'output_ref', (r -> 'completion' ->> 'recovered')::boolean,
             r -> 'completion' -> 'usage', r -> 'completion' ->> 'start_digest',
             (r -> 'completion' ->> 'step_run_version')::bigint
      FROM c1$$,
    $$SELECT 'ql3/model-invocation-completion@v1', 'succeeded', 'ok', 'model-invocation:inv-c1', FALSE,
             '{"input_tokens": 100, "output_tokens": 20, "cost_micros": 1500, "currency": "USD"}'::jsonb,
             s.start_digest, 3::bigint
      FROM ql3_ai.model_invocation_starts AS s WHERE s.invocation_id = 'inv-c1'$$,
    'the completion binds outcome, result, output_ref, usage, its start and the new step version'
);
SELECT ok(
    (SELECT r -> 'completion' ->> 'completed_at' ~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z$'
     FROM c1),
    'completed_at is RFC 3339 UTC with six fractional digits'
);
SELECT results_eq(
    $$SELECT status, version, attempt_count, current_invocation_id::text, output_ref, result_code::text
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    $$VALUES ('succeeded', 3::bigint, 1, 'inv-c1', 'model-invocation:inv-c1', 'ok')$$,
    'succeeded: the step stores only output_ref model-invocation:<id> and the result code'
);
SELECT results_eq(
    $$SELECT version, event_seq FROM ql3.runs WHERE run_id = 'aaaaaaaa-0000-0000-0000-000000000001'$$,
    $$VALUES (11::bigint, 10::bigint)$$,
    'completion bumps the run version and its event seq (9 admissions + 1 completion)'
);
SELECT results_eq(
    $$SELECT seq, event_id, event_type, payload ->> 'completion_digest',
             (SELECT array_agg(k ORDER BY k) FROM jsonb_object_keys(payload) AS k)
      FROM ql3.run_events WHERE event_id = ql3.event_id('inv-c1', 'completion')$$,
    $$SELECT 10::bigint, ql3.event_id('inv-c1', 'completion'), 'model_invocation_completed', r ->> 'completion_digest',
             ARRAY['completion_digest', 'from_status', 'invocation_id', 'outcome', 'recovered', 'result_code',
                   'step_run_version', 'to_status']
      FROM c1$$,
    'completion appends run event 10 (ids and digests only, no bodies)'
);
SELECT results_eq(
    $$SELECT mutation_id, dedupe_key, from_status, to_status, from_version, to_version, command_digest
      FROM ql3.step_run_mutations WHERE mutation_id = ql3.mutation_id('inv-c1', 'completion')$$,
    $$SELECT ql3.mutation_id('inv-c1', 'completion'), ql3.dedupe_key('inv-c1', 'completion'), 'running',
             'succeeded', 2::bigint, 3::bigint, r -> 'completion' ->> 'command_digest' FROM c1$$,
    'completion appends one step mutation running -> succeeded with the derived identities'
);
SELECT results_eq(
    $$SELECT c.outcome, c.result_code::text, c.output_bytes, c.output_digest, c.input_tokens, c.output_tokens,
             c.cost_micros, c.currency, c.recovered, c.record::jsonb, c.completion_digest, c.mutation_id, c.event_id,
             c.dedupe_key
      FROM ql3_ai.model_invocation_completions AS c WHERE c.invocation_id = 'inv-c1'$$,
    $$SELECT 'succeeded', 'ok', 2048::bigint, repeat('c', 64), 100::bigint, 20::bigint, 1500::bigint, 'USD', FALSE,
             r -> 'completion', r ->> 'completion_digest', r -> 'completion' ->> 'mutation_id',
             r -> 'completion' ->> 'event_id', r -> 'completion' ->> 'dedupe_key'
      FROM c1$$,
    'the stored completion row agrees with the returned record'
);
SELECT results_eq(
    $$SELECT project_id::text, run_id, provider::text, model::text, input_tokens, output_tokens, cost_micros, currency, outcome,
             completion_digest
      FROM ql3_ai.usage_ledger WHERE invocation_id = 'inv-c1'$$,
    $$SELECT 'proj', 'aaaaaaaa-0000-0000-0000-000000000001'::uuid, 'ollama', 'llama3.1:8b', 100::bigint, 20::bigint,
             1500::bigint, 'USD', 'succeeded', r ->> 'completion_digest' FROM c1$$,
    'usage is projected into usage_ledger in the same transaction'
);

-- Replay and conflict.

CREATE TEMP TABLE fp AS SELECT tests.footprint() AS v;
SELECT is(
    (SELECT ql3_ai.complete_invocation(c) FROM cmd), (SELECT jsonb_set(r, '{status}', '"existing"') FROM c1),
    'an exact replay is existing and returns the stored completion'
);
SELECT is(tests.footprint(), (SELECT v FROM fp), 'an exact replay writes nothing');
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c1', 'failed', 'provider_error'))$$,
    'Q3C01', 'completing again with another outcome is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c1', 'succeeded', 'ok', tests.usage(100, 21, 1500, 'USD')))$$,
    'Q3C01', 'completing again with other usage is QL3_CONFLICT'
);

-- The other outcomes and the usage ledger rules.

SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-c2', 'failed', 'provider_error', tests.usage(10, NULL, NULL, NULL)))
    ->> 'status',
    'created', 'failed is created'
);
SELECT results_eq(
    $$SELECT s.status, s.result_code::text, s.output_ref, u.outcome, u.input_tokens, u.output_tokens, u.cost_micros, u.currency
      FROM ql3.step_runs AS s, ql3_ai.usage_ledger AS u
      WHERE s.step_run_id = 'bbbbbbbb-0000-0000-0000-000000000002' AND u.invocation_id = 'inv-c2'$$,
    $$VALUES ('failed', 'provider_error', NULL::text, 'failed', 10::bigint, NULL::bigint, NULL::bigint, NULL::text)$$,
    'failed: the step is failed without output_ref, and the known usage is kept with unknowns NULL'
);
SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-c3', 'timed_out', 'MODEL_DEADLINE_EXCEEDED')) ->> 'status',
    'created', 'timed_out is created'
);
SELECT results_eq(
    $$SELECT status, result_code::text, (SELECT count(*) FROM ql3_ai.usage_ledger WHERE invocation_id = 'inv-c3')
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000003'$$,
    $$VALUES ('timed_out', 'MODEL_DEADLINE_EXCEEDED', 0::bigint)$$,
    'timed_out without usage: the step is timed_out and no ledger row exists'
);
SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-c4', 'succeeded', 'ok', tests.usage(NULL, NULL, NULL, NULL)))
    -> 'completion' -> 'usage',
    '{"input_tokens": null, "output_tokens": null, "cost_micros": null, "currency": null}'::jsonb,
    'a usage object of nulls is kept in the record'
);
SELECT is(
    (SELECT count(*) FROM ql3_ai.usage_ledger WHERE invocation_id = 'inv-c4')::integer, 0,
    'usage with no known field gets no ledger row (no faked zero)'
);
SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-c5', 'succeeded', 'ok', tests.usage(7, 8, NULL, NULL)))
    ->> 'status',
    'created', 'succeeded with tokens but unknown cost is created'
);
SELECT results_eq(
    $$SELECT input_tokens, output_tokens, cost_micros, currency FROM ql3_ai.usage_ledger WHERE invocation_id = 'inv-c5'$$,
    $$VALUES (7::bigint, 8::bigint, NULL::bigint, NULL::text)$$,
    'an unknown cost stays NULL in the ledger, never 0'
);
SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-c6', 'lost', 'outcome_unknown')) ->> 'status',
    'created', 'lost/outcome_unknown is created'
);
SELECT results_eq(
    $$SELECT status, result_code::text, output_ref, current_invocation_id::text, version
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000006'$$,
    $$VALUES ('lost', 'outcome_unknown', NULL::text, 'inv-c6', 3::bigint)$$,
    'lost: the step is lost/outcome_unknown and keeps its invocation for the resolution'
);
SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-c7', 'succeeded', 'ok', tests.usage(NULL, NULL, NULL, 'EUR')))
    ->> 'status',
    'created', 'succeeded with only a currency is created'
);
SELECT results_eq(
    $$SELECT input_tokens, output_tokens, cost_micros, currency FROM ql3_ai.usage_ledger WHERE invocation_id = 'inv-c7'$$,
    $$VALUES (NULL::bigint, NULL::bigint, NULL::bigint, 'EUR')$$,
    'usage with any known field gets its ledger row'
);

-- The v1 completion command schema, on running invocation inv-c8.

SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'cancelled', 'ok'))$$,
    'Q3V01', 'an unknown outcome is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'lost', 'provider_error'))$$,
    'Q3V01', 'lost with a result_code other than outcome_unknown is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'failed', 'outcome_unknown'))$$,
    'Q3V01', 'outcome_unknown with an outcome other than lost is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'failed', 'model_outcome_rejected'))$$,
    'Q3V01', 'a result_code reserved for resolutions is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'failed', 'rate limited: try later'))$$,
    'Q3V01', 'a result_code that is a message, not a code, is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'failed', repeat('e', 129)))$$,
    'Q3V03', 'a 129-character result_code is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'succeeded', 'ok', tests.usage(1, 2, 3, NULL)))$$,
    'Q3V01', 'a cost without a currency is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'succeeded', 'ok', tests.usage(1, 2, 3, 'usd')))$$,
    'Q3V01', 'a currency that is not an ISO 4217 code is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'succeeded', 'ok', tests.usage(-1, 2, 3, 'USD')))$$,
    'Q3V01', 'a negative token count is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'succeeded', 'ok',
        tests.usage(1, 2, 3, 'USD') || '{"prompt_tokens": 1}'))$$,
    'Q3V01', 'an unknown usage field is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8', 'succeeded', 'ok', '{"input_tokens": 1}'))$$,
    'Q3V01', 'a usage object without all four fields is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8') - 'usage')$$,
    'Q3V01', 'a missing usage field is QL3_INVALID_ARGUMENT: null must be explicit'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8') || '{"output": "the answer"}')$$,
    'Q3V01', 'an unknown field is QL3_INVALID_ARGUMENT (and an output body is never stored)'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(jsonb_set(tests.completion('inv-c8'), '{schema}',
        '"ql3/model-invocation-admission@v1"'))$$,
    'Q3V01', 'another command''s schema is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(jsonb_set(tests.completion('inv-c8'), '{output_digest}', '"xyz"'))$$,
    'Q3V01', 'a malformed output_digest is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(jsonb_set(tests.completion('inv-c8'), '{output_bytes}', '"2048"'))$$,
    'Q3V01', 'a string output_bytes is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(jsonb_set(tests.completion('inv-c8'), '{start_digest}', '"abc"'))$$,
    'Q3V01', 'a malformed start_digest is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(jsonb_set(tests.completion('inv-c8'), '{output_digest}',
        to_jsonb(repeat('f', 30000))))$$,
    'Q3V02', 'a command over 24 KiB of canonical JSON is QL3_RECORD_TOO_LARGE'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(jsonb_set(tests.completion('inv-c8'), '{start_digest}', to_jsonb(repeat('0', 64))))$$,
    'Q3C01', 'a start_digest other than the start''s is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-never'))$$,
    'Q3N01', 'completing an invocation that was never admitted is QL3_NOT_FOUND'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(jsonb_set(tests.completion('inv-c8'), '{invocation_id}', '""'))$$,
    'Q3V01', 'an empty invocation_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-c1b', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000001', 3))$$,
    'Q3C01', 'a succeeded step cannot be admitted again (not ready)'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-c6b', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000006', 3))$$,
    'Q3C01', 'a lost step cannot be admitted before a resolution'
);
SELECT is(
    (SELECT array_agg(seq ORDER BY seq) FROM ql3.run_events WHERE run_id = 'aaaaaaaa-0000-0000-0000-000000000001'),
    (SELECT array_agg(g::bigint ORDER BY g) FROM generate_series(1, 16) AS g),
    'run event seqs are 1..n without gaps'
);

-- Guards that only a damaged database reaches: tampering needs the superuser and
-- session_replication_role = replica (which skips the immutability triggers).

RESET ROLE;
UPDATE ql3.step_runs SET status = 'failed', version = version + 1 WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000008';
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c8'))$$,
    'Q3S01', 'completing an invocation whose step is not running it is QL3_ILLEGAL_TRANSITION'
);
SET LOCAL session_replication_role = replica;
DELETE FROM ql3_ai.usage_ledger WHERE invocation_id = 'inv-c1';
UPDATE ql3_ai.model_invocation_completions SET record = jsonb_set(record, '{result_code}', '"oops"')
WHERE invocation_id = 'inv-c2';
INSERT INTO ql3_ai.usage_ledger
    (invocation_id, project_id, run_id, provider, model, input_tokens, outcome, completion_digest, recorded_at)
SELECT
    invocation_id,
    project_id,
    run_id,
    'ollama' AS provider,
    'llama3.1:8b' AS model,
    1 AS input_tokens,
    outcome,
    completion_digest,
    now() AS recorded_at
FROM ql3_ai.model_invocation_completions WHERE invocation_id = 'inv-c3';
SET LOCAL session_replication_role = origin;
SELECT throws_ok(
    $$SELECT ql3_ai.complete_invocation(c) FROM cmd$$,
    'Q3C01', NULL, 'a replay re-verifies the ledger: a missing ledger row is QL3_CONFLICT'
);
SELECT throws_ok(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c2', 'failed', 'provider_error',
        tests.usage(10, NULL, NULL, NULL)))$$,
    'Q3C01',
    (SELECT 'QL3_CONFLICT: stored completion record no longer matches its digest ' || completion_digest
     FROM ql3_ai.model_invocation_completions WHERE invocation_id = 'inv-c2'),
    'a replay re-verifies the completion: a record that no longer matches its digest is QL3_CONFLICT'
);
SELECT throws_ok(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c3', 'timed_out', 'MODEL_DEADLINE_EXCEEDED'))$$,
    'Q3C01', NULL, 'a replay re-verifies the ledger: a ledger row for a completion without usage is QL3_CONFLICT'
);

-- The stored digest is checked as well as the record, and under the runtime's own grants.
SET LOCAL session_replication_role = replica;
UPDATE ql3_ai.model_invocation_completions SET completion_digest = repeat('0', 64)
WHERE invocation_id = 'inv-c4';
SET LOCAL session_replication_role = origin;
SET ROLE ql3_runtime;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-c4', 'succeeded', 'ok',
        tests.usage(NULL, NULL, NULL, NULL)))$$,
    'Q3C01', 'a replay whose stored completion_digest was changed is QL3_CONFLICT',
    'QL3_CONFLICT: stored completion record no longer matches its digest ' || repeat('0', 64)
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
