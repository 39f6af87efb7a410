-- Resolution (sql/ql3_ai/0001_invocations.sql): lost -> ready | failed | cancelled by a human,
-- one per invocation; retry starts a new invocation chain and leaves the old receipts alone.
BEGIN;
\ir lib/invocation_helpers.sql

SELECT plan(104);

-- Fixture: run R1 with model steps S1..S9 admitted as inv-rN; then completions:
-- r1, r2, r3, r8 and the vector invocation on S9 lost; r4 succeeded; r5 still running;
-- r6 failed; r7 timed_out.
SELECT ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000001');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'model', ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid)
FROM generate_series(1, 9) AS g;

SET ROLE ql3_runtime;
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-r' || g, 'aaaaaaaa-0000-0000-0000-000000000001', ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid, 1
))
FROM generate_series(1, 8) AS g;
SELECT ql3_ai.admit_invocation(tests.admission(
    '7b0c6f7e-2d7e-4a53-9a55-0c8f3c1c2a11', 'aaaaaaaa-0000-0000-0000-000000000001',
    'bbbbbbbb-0000-0000-0000-000000000009', 1
));
SELECT ql3_ai.complete_invocation(tests.completion(i, 'lost', 'outcome_unknown'))
FROM unnest(ARRAY['inv-r1', 'inv-r2', 'inv-r3', 'inv-r8', '7b0c6f7e-2d7e-4a53-9a55-0c8f3c1c2a11']) AS i;
SELECT ql3_ai.complete_invocation(tests.completion('inv-r4', 'succeeded', 'ok'));
SELECT ql3_ai.complete_invocation(tests.completion('inv-r6', 'failed', 'provider_error'));
SELECT ql3_ai.complete_invocation(tests.completion('inv-r7', 'timed_out', 'MODEL_DEADLINE_EXCEEDED'));

-- The receipts of inv-r1 as they are before any resolution.
CREATE TEMP TABLE old_receipts AS
SELECT
    s.record AS start_record,
    s.start_digest,
    c.record AS completion_record,
    c.completion_digest
FROM ql3_ai.model_invocation_starts AS s
INNER JOIN ql3_ai.model_invocation_completions AS c ON s.invocation_id = c.invocation_id
WHERE s.invocation_id = 'inv-r1';
GRANT SELECT ON old_receipts TO PUBLIC;  -- noqa: CP02

-- Resolutions are an operator's act.
SET ROLE ql3_operator;

CREATE TEMP TABLE cmd AS SELECT tests.resolution('inv-r1', 'retry', 'alice', 'provider says it never ran') AS c;
GRANT SELECT ON cmd TO PUBLIC;  -- noqa: CP02
CREATE TEMP TABLE r1 AS SELECT ql3_ai.resolve_invocation(c) AS r FROM cmd;
GRANT SELECT ON r1 TO PUBLIC;  -- noqa: CP02

SELECT is((SELECT r ->> 'status' FROM r1), 'created', 'resolving a lost invocation with retry is created');
SELECT is(
    (SELECT r ->> 'resolution_digest' FROM r1),
    (SELECT ql3.digest('ql3/model-invocation-resolution@v1', r -> 'resolution') FROM r1),
    'resolution_digest is the digest of the record under ql3/model-invocation-resolution@v1'
);
SELECT is(
    (SELECT r -> 'resolution' ->> 'command_digest' FROM r1),
    (SELECT ql3.digest('ql3/model-invocation-resolution-command@v1', c) FROM cmd),
    'command_digest is the digest of the command under ql3/model-invocation-resolution-command@v1'
);
SELECT is(
    (SELECT array_agg(k.key ORDER BY k.key) FROM r1, jsonb_object_keys(r1.r -> 'resolution') AS k (key)),
    ARRAY[
        'attempt', 'command_digest', 'completion_digest', 'decision', 'dedupe_key', 'event_id', 'invocation_id',
        'mutation_id', 'project_id', 'reason', 'resolved_at', 'result_code', 'run_event_seq', 'run_id',
        'run_version', 'schema', 'step_run_id', 'step_run_version', 'to_status', 'trace_id', 'user_id'
    ],
    'the resolution record has exactly the v1 fields'
);
SELECT results_eq(
    $$SELECT r -> 'resolution' ->> 'decision', r -> 'resolution' ->> 'user_id', r -> 'resolution' ->> 'reason',
             r -> 'resolution' ->> 'to_status', r -> 'resolution' ->> 'result_code',
             (r -> 'resolution' ->> 'step_run_version')::bigint, r -> 'resolution' ->> 'completion_digest'
      FROM r1$$,
    $$SELECT 'retry', 'alice', 'provider says it never ran', 'ready', NULL::text, 4::bigint, completion_digest
      FROM old_receipts$$,
    'the resolution binds decision, user, reason, the new state and the completion it settles'
);
SELECT results_eq(
    $$SELECT status, version, attempt_count, current_invocation_id::text, output_ref, result_code::text
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    $$VALUES ('ready', 4::bigint, 1, NULL::text, NULL::text, NULL::text)$$,
    'retry: lost -> ready with the old result fields cleared'
);
SELECT results_eq(
    $$SELECT e.event_type, e.payload ->> 'decision', m.from_status, m.to_status, m.from_version, m.to_version,
             m.dedupe_key, m.command_digest
      FROM ql3.run_events AS e, ql3.step_run_mutations AS m
      WHERE e.event_id = ql3.event_id('inv-r1', 'resolution') AND m.mutation_id = ql3.mutation_id('inv-r1', 'resolution')$$,
    $$SELECT 'model_invocation_resolved', 'retry', 'lost', 'ready', 3::bigint, 4::bigint,
             ql3.dedupe_key('inv-r1', 'resolution'), r -> 'resolution' ->> 'command_digest' FROM r1$$,
    'the resolution appends its run event and step mutation with the derived identities'
);
SELECT results_eq(
    $$SELECT v.completion_digest, v.decision, v.user_id::text, v.reason, v.record::jsonb, v.resolution_digest, v.mutation_id
      FROM ql3_ai.model_invocation_resolutions AS v WHERE v.invocation_id = 'inv-r1'$$,
    $$SELECT r -> 'resolution' ->> 'completion_digest', 'retry', 'alice', 'provider says it never ran',
             r -> 'resolution', r ->> 'resolution_digest', ql3.mutation_id('inv-r1', 'resolution')
      FROM r1$$,
    'the stored resolution row agrees with the returned record'
);

CREATE TEMP TABLE fp AS SELECT tests.footprint() AS v;
SELECT is(
    (SELECT ql3_ai.resolve_invocation(c) FROM cmd), (SELECT jsonb_set(r, '{status}', '"existing"') FROM r1),
    'an exact replay is existing and returns the stored resolution'
);
SELECT is(tests.footprint(), (SELECT v FROM fp), 'an exact replay writes nothing');
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{decision}', '"fail"')) FROM cmd$$,
    'Q3C01', 'a second resolution with another decision is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{user_id}', '"mallory"')) FROM cmd$$,
    'Q3C01', 'a second resolution by another user is QL3_CONFLICT'
);

-- After retry: the old command replays as existing (no second provider call), the old
-- invocation_id cannot start again, and a new invocation is attempt 2.

SET ROLE ql3_runtime;
CREATE TEMP TABLE fp2 AS SELECT tests.footprint() AS v;
SELECT is(
    ql3_ai.admit_invocation(tests.admission(
        'inv-r1', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000001', 1)) ->> 'status',
    'existing', 'after retry the original admission command still replays as existing'
);
SELECT is(tests.footprint(), (SELECT v FROM fp2), 'that replay writes nothing');
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-r1', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000001', 4))$$,
    'Q3C01', 'after retry the old invocation_id cannot be admitted again'
);
CREATE TEMP TABLE r1b AS
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-r1b', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000001', 4
)) AS r;
SELECT is((SELECT r ->> 'status' FROM r1b), 'created', 'after retry a new invocation_id is admitted');
SELECT is((SELECT (r -> 'start' ->> 'attempt')::integer FROM r1b), 2, 'the new start is attempt 2');
SELECT results_eq(
    $$SELECT status, version, attempt_count, current_invocation_id::text
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    $$VALUES ('running', 5::bigint, 2, 'inv-r1b')$$,
    'the step runs the new invocation with attempt_count 2'
);
SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-r1b', 'succeeded', 'ok')) ->> 'status', 'created',
    'the second attempt completes'
);
SELECT results_eq(
    $$SELECT s.record::jsonb, s.start_digest, c.record::jsonb, c.completion_digest
      FROM ql3_ai.model_invocation_starts AS s
      INNER JOIN ql3_ai.model_invocation_completions AS c ON c.invocation_id = s.invocation_id
      WHERE s.invocation_id = 'inv-r1'$$,
    $$SELECT start_record::jsonb, start_digest, completion_record::jsonb, completion_digest FROM old_receipts$$,
    'the first attempt''s start and lost completion are unchanged'
);
SELECT results_eq(
    $$SELECT invocation_id::text, attempt FROM ql3_ai.model_invocation_starts
      WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001' ORDER BY attempt$$,
    $$VALUES ('inv-r1', 1), ('inv-r1b', 2)$$,
    'one step holds both attempts, each its own invocation chain'
);
SET ROLE ql3_operator;
SELECT is(
    (SELECT ql3_ai.resolve_invocation(c) ->> 'status' FROM cmd), 'existing',
    'the old resolution still replays as existing after the step moved on'
);

-- fail and cancel

SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('inv-r2', 'fail')) ->> 'status', 'created', 'fail is created'
);
SELECT results_eq(
    $$SELECT status, version, current_invocation_id::text, output_ref, result_code::text
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000002'$$,
    $$VALUES ('failed', 4::bigint, 'inv-r2', NULL::text, 'model_outcome_rejected')$$,
    'fail: lost -> failed with result_code model_outcome_rejected'
);
SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('inv-r3', 'cancel')) ->> 'status', 'created', 'cancel is created'
);
SELECT results_eq(
    $$SELECT status, version, current_invocation_id::text, output_ref, result_code::text
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000003'$$,
    $$VALUES ('cancelled', 4::bigint, 'inv-r3', NULL::text, 'model_outcome_cancelled')$$,
    'cancel: lost -> cancelled with result_code model_outcome_cancelled'
);
SET ROLE ql3_runtime;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-r2b', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000002', 4))$$,
    'Q3C01', 'a step failed by resolution cannot be admitted again'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-r3b', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000003', 4))$$,
    'Q3C01', 'a cancelled step cannot be admitted again'
);
SET ROLE ql3_operator;

-- Only lost/outcome_unknown is resolved.

SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r4', 'retry'))$$,
    'Q3S01', 'resolving a succeeded invocation is QL3_ILLEGAL_TRANSITION'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r5', 'cancel'))$$,
    'Q3S01', 'resolving a running invocation (no completion) is QL3_ILLEGAL_TRANSITION'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r6', 'retry'))$$,
    'Q3S01', 'resolving a failed invocation is QL3_ILLEGAL_TRANSITION'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r7', 'retry'))$$,
    'Q3S01', 'resolving a timed_out invocation is QL3_ILLEGAL_TRANSITION'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-never', 'retry'))$$,
    'Q3N01', 'resolving an invocation that was never admitted is QL3_NOT_FOUND'
);

-- Drift and the v1 resolution command schema, on lost invocation inv-r8 (step version 3).

SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(tests.resolution('inv-r8', 'retry'), '{completion_digest}',
        to_jsonb(repeat('0', 64))))$$,
    'Q3C01', 'a completion_digest other than the completion''s is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(tests.resolution('inv-r8', 'retry'), '{expected_step_run_version}',
        '2'))$$,
    'Q3C01', 'a step version drift is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r8', 'approve'))$$,
    'Q3V01', 'an unknown decision is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r8', 'retry', ''))$$,
    'Q3V01', 'an empty user_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r8', 'retry', repeat('u', 129)))$$,
    'Q3V03', 'a 129-character user_id is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r8', 'retry', 'alice', ''))$$,
    'Q3V01', 'an empty reason is QL3_INVALID_ARGUMENT (null or text)'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r8', 'retry', 'alice', repeat('why ', 7000)))$$,
    'Q3V02', 'a command over 24 KiB of canonical JSON is QL3_RECORD_TOO_LARGE'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r8', 'retry') - 'reason')$$,
    'Q3V01', 'a missing reason field is QL3_INVALID_ARGUMENT: null must be explicit'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r8', 'retry') || '{"force": true}')$$,
    'Q3V01', 'an unknown field is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(tests.resolution('inv-r8', 'retry'), '{expected_step_run_version}',
        '"3"'))$$,
    'Q3V01', 'a string expected_step_run_version is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(tests.resolution('inv-r8', 'retry'), '{schema}',
        '"ql3/model-invocation-resolution@v1"'))$$,
    'Q3V01', 'the record schema name in place of the command schema name is QL3_INVALID_ARGUMENT'
);

-- A completion_digest is 64 lowercase hex digits: a malformed one is QL3_INVALID_ARGUMENT
-- before any lookup, even when it spells the right digest in upper case (which the
-- digest comparison alone would report as a QL3_CONFLICT).
CREATE TEMP TABLE r8 AS SELECT tests.resolution('inv-r8', 'retry') AS c;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{completion_digest}', to_jsonb(upper(c ->> 'completion_digest'))))
      FROM r8$$,
    'Q3V01', 'the completion''s digest in upper case is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{completion_digest}', to_jsonb(left(c ->> 'completion_digest', 63))))
      FROM r8$$,
    'Q3V01', 'a 63-character completion_digest is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{completion_digest}', to_jsonb((c ->> 'completion_digest') || '0')))
      FROM r8$$,
    'Q3V01', 'a 65-character completion_digest is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{completion_digest}',
        to_jsonb(left(c ->> 'completion_digest', 63) || 'g'))) FROM r8$$,
    'Q3V01', 'a completion_digest with a non-hex digit is QL3_INVALID_ARGUMENT'
);

-- expected_step_run_version is an integer >= 1 written without a fraction: 0, -1 and 3.0
-- (the step's own version, 3, with a fraction) are QL3_INVALID_ARGUMENT, not a drift.
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{expected_step_run_version}', '0')) FROM r8$$,
    'Q3V01', 'expected_step_run_version 0 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{expected_step_run_version}', '-1')) FROM r8$$,
    'Q3V01', 'a negative expected_step_run_version is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(c, '{expected_step_run_version}', '3.0')) FROM r8$$,
    'Q3V01', 'an expected_step_run_version written 3.0 is QL3_INVALID_ARGUMENT'
);
SELECT results_eq(
    $$SELECT s.status, s.version, s.current_invocation_id::text, s.result_code::text,
             (SELECT count(*) FROM ql3_ai.model_invocation_resolutions AS v WHERE v.invocation_id = 'inv-r8'),
             (SELECT count(*) FROM ql3.run_events AS e WHERE e.event_id = ql3.event_id('inv-r8', 'resolution'))
      FROM ql3.step_runs AS s WHERE s.step_run_id = 'bbbbbbbb-0000-0000-0000-000000000008'$$,
    $$VALUES ('lost', 3::bigint, 'inv-r8', 'outcome_unknown', 0::bigint, 0::bigint)$$,
    'after every refused resolution inv-r8 is still lost at version 3, with no resolution and no resolution event'
);

-- Identities of the vector invocation across all three phases (tests/vectors/identity.json).

SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('7b0c6f7e-2d7e-4a53-9a55-0c8f3c1c2a11', 'cancel')) ->> 'status',
    'created', 'the vector invocation is resolved'
);
SELECT results_eq(
    $$SELECT c.mutation_id, c.event_id, c.dedupe_key, v.mutation_id, v.event_id, v.dedupe_key
      FROM ql3_ai.model_invocation_completions AS c
      INNER JOIN ql3_ai.model_invocation_resolutions AS v ON v.invocation_id = c.invocation_id
      WHERE c.invocation_id = '7b0c6f7e-2d7e-4a53-9a55-0c8f3c1c2a11'$$,
    $$VALUES ('mut_6a42e8f98d499f1c62987a5d539805775c023274141663caa4e2219279c11362',
              'evt_d6de3fbb7e80da18682d20a745a27f123c7f317235efd1f35a428bc6e36b277d',
              'ddp_d1002227acf1ba22b23356ee7777fe2eb453fbc2aa604abd55d972d53a9c5b22',
              'mut_a4f7bc4fe431a342b8c43627931796f4ba9282cdc452900b0f559a20e0c9e022',
              'evt_cec9e9cdcefc8d5e876022aca079cf509584763f2f9e958a2187a75e787d37bf',
              'ddp_cba320f7ca4aacc29e96df7cc4bd24f425efe23050548559ed6f25360aeb1a68')$$,
    'completion and resolution identities of the vector match identity.json'
);

-- Only a resolution moves a lost step. The runtime holds no UPDATE on step_runs (D46), so
-- its UPDATEs are refused before any trigger; the guard of D33 still refuses the same
-- UPDATEs from the owner, whose functions are the only writers.
CREATE TEMP TABLE lost_step_updates (ord, statement, description) AS
VALUES
    (1, $$UPDATE ql3.step_runs SET status = 'ready', current_invocation_id = NULL, result_code = NULL,
                 version = version + 1
          WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000008'$$,
     'take a lost step back to ready without a resolution'),
    (2, $$UPDATE ql3.step_runs SET status = 'failed', result_code = 'model_outcome_rejected'
          WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000008'$$,
     'settle a lost step as failed without a resolution'),
    (3, $$UPDATE ql3.step_runs SET current_invocation_id = 'inv-r1'
          WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000008'$$,
     'point a lost step at another (resolved) invocation');
GRANT SELECT ON lost_step_updates TO ql3_runtime, ql3_owner;
SET ROLE ql3_runtime;
SELECT tests.rejects(u.statement, '42501', 'the runtime cannot ' || u.description || ' (no UPDATE privilege)')
FROM lost_step_updates AS u ORDER BY u.ord;
SET ROLE ql3_owner;
SELECT tests.rejects(u.statement, 'Q3S01', 'not even the owner can ' || u.description)
FROM lost_step_updates AS u ORDER BY u.ord;

-- The step must still be exactly the lost winner: only a damaged database gets here, so
-- the damage disables the guard above (as the superuser).
RESET ROLE;
ALTER TABLE ql3.step_runs DISABLE TRIGGER step_runs_lost_needs_resolution;
UPDATE ql3.step_runs SET status = 'failed' WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000008';
ALTER TABLE ql3.step_runs ENABLE TRIGGER step_runs_lost_needs_resolution;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-r8', 'retry'))$$,
    'Q3S01', 'resolving when the step is no longer the lost winner is QL3_ILLEGAL_TRANSITION'
);

-- An exact replay re-verifies the stored resolution against its digest: a resolution
-- that a damaged database changed is QL3_CONFLICT, never "existing". Tampering needs the
-- superuser and session_replication_role = replica (which skips the immutability triggers).
-- inv-r1 replays its original command (cmd); inv-r3 was resolved at step version 3.
SET LOCAL session_replication_role = replica;
UPDATE ql3_ai.model_invocation_resolutions SET record = jsonb_set(record, '{user_id}', '"mallory"')
WHERE invocation_id = 'inv-r1';
UPDATE ql3_ai.model_invocation_resolutions SET resolution_digest = repeat('0', 64)
WHERE invocation_id = 'inv-r3';
SET LOCAL session_replication_role = origin;
SET ROLE ql3_operator;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(c) FROM cmd$$,
    'Q3C01', 'a replay whose stored resolution record was changed is QL3_CONFLICT',
    (SELECT 'QL3_CONFLICT: stored resolution record no longer matches its digest ' || resolution_digest
     FROM ql3_ai.model_invocation_resolutions WHERE invocation_id = 'inv-r1')
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(jsonb_set(tests.resolution('inv-r3', 'cancel'), '{expected_step_run_version}',
        '3'))$$,
    'Q3C01', 'a replay whose stored resolution_digest was changed is QL3_CONFLICT',
    'QL3_CONFLICT: stored resolution record no longer matches its digest ' || repeat('0', 64)
);
RESET ROLE;

-- Nor can a hand-made UPDATE reuse the resolution of an older attempt of the same step: a
-- step running its second attempt, marked lost by hand under its first (resolved)
-- invocation, cannot leave lost (D33: only a resolution of the step's newest start counts).
-- Only the owner can make such UPDATEs now (D46); the runtime is refused before the guard.
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'model', 'bbbbbbbb-0000-0000-0000-0000000000f1');
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-f1', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-0000000000f1', 1));
SELECT ql3_ai.complete_invocation(tests.completion('inv-f1', 'lost', 'outcome_unknown'));
SELECT ql3_ai.resolve_invocation(tests.resolution('inv-f1', 'retry'));
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-f2', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-0000000000f1', 4));
SET ROLE ql3_owner;
UPDATE ql3.step_runs SET status = 'lost', current_invocation_id = 'inv-f1', result_code = 'outcome_unknown'
WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-0000000000f1';
SET ROLE ql3_runtime;
SELECT * FROM tests.rejects(
    $$UPDATE ql3.step_runs SET status = 'ready', current_invocation_id = NULL, result_code = NULL
      WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-0000000000f1'$$,
    '42501', 'the runtime cannot move a lost step by UPDATE at all (no UPDATE privilege)'
);
SET ROLE ql3_owner;
SELECT * FROM tests.rejects(
    $$UPDATE ql3.step_runs SET status = 'ready', current_invocation_id = NULL, result_code = NULL
      WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-0000000000f1'$$,
    'Q3S01', 'the resolution of an older attempt does not let even the owner move a lost step'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
