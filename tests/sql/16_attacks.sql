-- The attacks of issue 20 (one trust boundary, D46), each run as a LOGIN-less role through
-- SET ROLE, with the SQLSTATE of its refusal and proof that nothing was written:
-- (a) squatting a receipt identity; (b) forging facts by hand; (c) locking tables and rows;
-- (d) the operator writing around its functions; (e) huge inputs; (f) shadowing names in
-- pg_temp; (g) the policy fence in each isolation level, and advisory locks taken by any role,
-- driven over dblink.
BEGIN;
SET LOCAL client_min_messages = warning;
\ir lib/invocation_helpers.sql

SELECT plan(246);

-- Helpers -----------------------------------------------------------------------------------

-- The SQLSTATE a statement fails with ('00000' when it succeeds); its effects are always
-- undone (the subtransaction is rolled back either way).
CREATE FUNCTION tests.sqlstate_of(p_sql text) RETURNS text
LANGUAGE plpgsql
AS $$
BEGIN
    BEGIN
        EXECUTE p_sql;
        RAISE EXCEPTION USING ERRCODE = 'QT000', MESSAGE = 'succeeded';
    EXCEPTION WHEN OTHERS THEN
        RETURN CASE WHEN SQLSTATE = 'QT000' THEN '00000' ELSE SQLSTATE END;
    END;
END;
$$;

-- Milliseconds a statement takes, whether it succeeds or fails.
CREATE FUNCTION tests.elapsed_ms(p_sql text) RETURNS numeric
LANGUAGE plpgsql
AS $$
DECLARE
    t0 timestamptz := clock_timestamp();
BEGIN
    PERFORM tests.sqlstate_of(p_sql);
    RETURN extract(EPOCH FROM clock_timestamp() - t0) * 1000;
END;
$$;

-- Fixture (as the test superuser) ------------------------------------------------------------
-- Project proj: policy_routing/c1 has revision A active and revision B revoked; project other
-- has a revision of its own. Run R1 has model steps S1..S8:
--   S1 inv-run (running), S2 inv-exp1 and S3 inv-exp2 (running, deadline passed),
--   S4 inv-lost (lost, unresolved), S5 inv-exp3 and S6 inv-exp4 (running, deadline passed,
--   admitted after recovery's first pass), S7 inv-run2 (running), S8 ready.

CREATE TEMP TABLE fx (key text PRIMARY KEY, value text NOT NULL);
GRANT SELECT ON fx TO PUBLIC;  -- noqa: CP02
INSERT INTO fx (key, value)
SELECT
    'rev_a' AS key,
    r.revision_id::text AS value
FROM ql3.put_revision('proj', 'policy_routing', 'c1', '{"v": "a"}', 'setup') AS r;
INSERT INTO fx (key, value)
SELECT
    'rev_b' AS key,
    r.revision_id::text AS value
FROM ql3.put_revision('proj', 'policy_routing', 'c1', '{"v": "b"}', 'setup') AS r;
INSERT INTO fx (key, value)
SELECT
    'rev_other' AS key,
    r.revision_id::text AS value
FROM ql3.put_revision('other', 'policy_routing', 'c1', '{"v": "o"}', 'setup') AS r;
SELECT ql3.activate_revision('proj', 'policy_routing', 'c1', value::uuid, 'setup') FROM fx WHERE key = 'rev_a';
SELECT ql3.revoke_revision(value::uuid, 'setup', 'withdrawn') FROM fx WHERE key = 'rev_b';

SELECT ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000016');
SELECT ql3.create_run('proj', 'trace-2', 'aaaaaaaa-0000-0000-0000-000000000026');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000016', 'model', ('bbbbbbbb-0000-0000-0000-00000000001' || g)::uuid)
FROM generate_series(1, 8) AS g;
SELECT ql3_ai.admit_invocation(tests.admission(
    a.inv, 'aaaaaaaa-0000-0000-0000-000000000016', ('bbbbbbbb-0000-0000-0000-00000000001' || a.step)::uuid, 1,
    p_policy => (SELECT jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'c1', 'revision_id',
                                           x.value)
                 FROM fx AS x WHERE x.key = 'rev_a'),
    p_deadline_at => a.deadline))
FROM (VALUES
    (1, 'inv-run', 1, '2999-01-01T00:00:00.000000Z'),
    (2, 'inv-exp1', 2, '2000-01-01T00:00:00.000000Z'),
    (3, 'inv-exp2', 3, '2000-01-02T00:00:00.000000Z'),
    (4, 'inv-lost', 4, '2999-01-01T00:00:00.000000Z'),
    (5, 'inv-run2', 7, '2999-01-01T00:00:00.000000Z')
) AS a (ord, inv, step, deadline)
ORDER BY a.ord;
SELECT ql3_ai.complete_invocation(tests.completion('inv-lost', 'lost', 'outcome_unknown'));

-- (a) Identity squatting ---------------------------------------------------------------------
-- A receipt's identities are public functions of its invocation and phase. Writing a row
-- under the identity of a completion still to come would make that completion (or its
-- recovery) fail on a unique violation. No role may insert such a row.

CREATE TEMP TABLE squats AS
SELECT
    row_number() OVER (ORDER BY i.ord, s.ord) AS ord,
    format(s.statement, i.inv, i.step) AS statement,
    format(s.description, i.inv) AS description
FROM (VALUES
    (1, 'inv-run', 'bbbbbbbb-0000-0000-0000-000000000011'),
    (2, 'inv-exp1', 'bbbbbbbb-0000-0000-0000-000000000012')
) AS i (ord, inv, step)
CROSS JOIN (VALUES
    (1, $$INSERT INTO ql3.step_run_mutations (mutation_id, dedupe_key, step_run_id, from_status, to_status,
                                              from_version, to_version, command_digest)
          VALUES (ql3.mutation_id(%1$L, 'completion'), ql3.dedupe_key(%1$L, 'completion'), %2$L, 'running',
                  'succeeded', 2, 3, repeat('0', 64))$$,
     'squat the completion mutation_id and dedupe_key of %s'),
    (2, $$INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, step_run_id, payload)
          VALUES ('aaaaaaaa-0000-0000-0000-000000000016', 1000, ql3.event_id(%1$L, 'completion'),
                  'model_invocation_completed', %2$L, '{}')$$,
     'squat the completion event_id of %s')
) AS s (ord, statement, description);
GRANT SELECT ON squats TO PUBLIC;  -- noqa: CP02

SET ROLE ql3_runtime;
SELECT tests.rejects(s.statement, '42501', 'the runtime cannot ' || s.description) FROM squats AS s ORDER BY s.ord;
SET ROLE ql3_operator;
SELECT tests.rejects(s.statement, '42501', 'the operator cannot ' || s.description) FROM squats AS s ORDER BY s.ord;
SET ROLE ql3_reader;
SELECT tests.rejects(s.statement, '42501', 'the reader cannot ' || s.description) FROM squats AS s ORDER BY s.ord;
SET ROLE ql3_relay;
SELECT tests.rejects(s.statement, '42501', 'the relay cannot ' || s.description) FROM squats AS s ORDER BY s.ord;

SET ROLE ql3_runtime;
SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-run')) ->> 'status', 'created',
    'after the squatting attempts, the real completion of inv-run is written'
);
SET ROLE ql3_operator;
CREATE TEMP TABLE recovery1 AS SELECT ql3_ai.recover_expired(10, interval '0') AS r;
SELECT is(
    (SELECT jsonb_build_object('count', r -> 'count', 'failed', r -> 'failed',
                               'recovered', jsonb_path_query_array(r, '$.recovered[*].invocation_id'))
     FROM recovery1),
    '{"count": 2, "failed": [], "recovered": ["inv-exp1", "inv-exp2"]}'::jsonb,
    'and recovery settles every expired start, inv-exp1 included'
);
RESET ROLE;

-- Damage only the superuser can do: a squatted identity. Recovery skips that start, reports
-- it under "failed" with its SQLSTATE, and settles the others.
SELECT ql3_ai.admit_invocation(tests.admission(
    a.inv, 'aaaaaaaa-0000-0000-0000-000000000016', ('bbbbbbbb-0000-0000-0000-00000000001' || a.step)::uuid, 1,
    p_deadline_at => '2000-01-03T00:00:00.000000Z'))
FROM (VALUES (1, 'inv-exp3', 5), (2, 'inv-exp4', 6)) AS a (ord, inv, step)
ORDER BY a.ord;
INSERT INTO ql3.step_run_mutations (
    mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version, command_digest
) VALUES (
    ql3.mutation_id('inv-exp3', 'completion'), 'ddp_squatted', 'bbbbbbbb-0000-0000-0000-000000000015', 'running',
    'lost', 99, 100, repeat('0', 64)
);
SET ROLE ql3_operator;
SET LOCAL client_min_messages = error;  -- recovery's WARNING naming the skipped start
CREATE TEMP TABLE recovery2 AS SELECT ql3_ai.recover_expired(10, interval '0') AS r;
SET LOCAL client_min_messages = warning;
SELECT is(
    (SELECT jsonb_build_object('count', r -> 'count',
                               'recovered', jsonb_path_query_array(r, '$.recovered[*].invocation_id'),
                               'failed', jsonb_path_query_array(r, '$.failed[*].invocation_id'),
                               'sqlstates', jsonb_path_query_array(r, '$.failed[*].sqlstate'))
     FROM recovery2),
    '{"count": 1, "recovered": ["inv-exp4"], "failed": ["inv-exp3"], "sqlstates": ["Q3C01"]}'::jsonb,
    'recovery skips a start whose identity was squatted (by the superuser), reports it, and settles the rest'
);
SELECT results_eq(
    $$SELECT step_run_id::text, status FROM ql3.step_runs
      WHERE step_run_id IN ('bbbbbbbb-0000-0000-0000-000000000015', 'bbbbbbbb-0000-0000-0000-000000000016')
      ORDER BY step_run_id$$,
    $$VALUES ('bbbbbbbb-0000-0000-0000-000000000015', 'running'), ('bbbbbbbb-0000-0000-0000-000000000016', 'lost')$$,
    'the skipped start''s step is untouched (its subtransaction rolled back); the other is lost'
);
RESET ROLE;
SET ROLE ql3_runtime;
SELECT throws_like(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-exp3'))$$,
    'QL3_CONFLICT: a receipt identity of the completion of invocation inv-exp3 exists already%',
    'completing the start whose identity was squatted is QL3_CONFLICT naming it, never a raw 23505'
);
SELECT throws_ok(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-exp3'))$$, 'Q3C01', NULL,
    'and its SQLSTATE is Q3C01'
);
RESET ROLE;

-- (b) Forged facts ---------------------------------------------------------------------------
-- Receipts, steps, runs and events written or changed by hand. Every role is refused before
-- any constraint or trigger runs.

CREATE TEMP TABLE forgeries (ord, statement, description) AS
VALUES
    (1, $$INSERT INTO ql3_ai.model_invocation_completions (
              invocation_id, start_digest, project_id, run_id, step_run_id, outcome, result_code, recovered,
              command_digest, record, completion_digest, mutation_id, event_id, dedupe_key, completed_at)
          VALUES ('inv-run2', repeat('0', 64), 'proj', 'aaaaaaaa-0000-0000-0000-000000000016',
                  'bbbbbbbb-0000-0000-0000-000000000017', 'succeeded', 'ok', FALSE, repeat('1', 64), '{}',
                  repeat('2', 64), 'mut_forged', 'evt_forged', 'ddp_forged', now())$$,
     'insert a completion with junk digests'),
    (2, $$UPDATE ql3.step_runs SET status = 'succeeded', output_ref = 'forged'
          WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000017'$$,
     'mark a running step succeeded'),
    (3, $$UPDATE ql3.step_runs SET status = 'lost', result_code = 'outcome_unknown'
          WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000017'$$,
     'mark a running step lost'),
    (4, $$INSERT INTO ql3.step_runs (step_run_id, run_id, kind, status, version, output_ref, result_code)
          VALUES ('bbbbbbbb-0000-0000-0000-0000000000ff', 'aaaaaaaa-0000-0000-0000-000000000016', 'model',
                  'succeeded', 1, 'forged', 'ok')$$,
     'insert a step born succeeded'),
    (5, $$INSERT INTO ql3_ai.usage_ledger (invocation_id, project_id, run_id, provider, model, input_tokens,
                                           output_tokens, cost_micros, currency, outcome, completion_digest,
                                           recorded_at)
          VALUES ('inv-lost', 'other', 'aaaaaaaa-0000-0000-0000-000000000016', 'ollama', 'llama3.1:8b', 1, 1,
                  1000000, 'USD', 'lost', repeat('0', 64), now())$$,
     'insert a usage row billed to another project'),
    (6, $$INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, step_run_id, payload)
          VALUES ('aaaaaaaa-0000-0000-0000-000000000016', 999, 'evt_forged', 'model_invocation_completed',
                  'bbbbbbbb-0000-0000-0000-000000000017', '{}')$$,
     'insert a run event with seq 999'),
    (7, $$UPDATE ql3.runs SET project_id = 'other' WHERE run_id = 'aaaaaaaa-0000-0000-0000-000000000016'$$,
     'move a run to another project'),
    (8, $$UPDATE ql3.step_runs SET current_invocation_id = NULL
          WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000014'$$,
     'detach a lost step from its invocation (lost -> ready, step 1)'),
    (9, $$UPDATE ql3.step_runs SET run_id = 'aaaaaaaa-0000-0000-0000-000000000026'
          WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000014'$$,
     'move a lost step to another run (lost -> ready, step 2)'),
    (10, $$UPDATE ql3.step_runs SET status = 'ready', result_code = NULL, current_invocation_id = NULL
           WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000014'$$,
     'make a lost step ready without a resolution (lost -> ready, step 3)'),
    (11, $$INSERT INTO ql3_ai.model_invocation_starts (
               invocation_id, request_id, project_id, run_id, step_run_id, trace_id, attempt, provider, model,
               request_digest, deadline_at, input_bytes, command_digest, record, start_digest, mutation_id,
               event_id, dedupe_key, admitted_at)
           VALUES ('inv-fake', 'req-fake', 'proj', 'aaaaaaaa-0000-0000-0000-000000000016',
                   'bbbbbbbb-0000-0000-0000-000000000018', 'trace-1', 99, 'ollama', 'llama3.1:8b', repeat('0', 64),
                   now(), 1, repeat('0', 64), '{}', repeat('0', 64), 'mut_fake', 'evt_fake', 'ddp_fake', now())$$,
     'insert a fake Start with attempt 99');
GRANT SELECT ON forgeries TO PUBLIC;  -- noqa: CP02

SET ROLE ql3_runtime;
SELECT tests.rejects(f.statement, '42501', 'the runtime cannot ' || f.description) FROM forgeries AS f ORDER BY f.ord;
SET ROLE ql3_operator;
SELECT tests.rejects(f.statement, '42501', 'the operator cannot ' || f.description) FROM forgeries AS f ORDER BY f.ord;
SET ROLE ql3_reader;
SELECT tests.rejects(f.statement, '42501', 'the reader cannot ' || f.description) FROM forgeries AS f ORDER BY f.ord;
SET ROLE ql3_relay;
SELECT tests.rejects(f.statement, '42501', 'the relay cannot ' || f.description) FROM forgeries AS f ORDER BY f.ord;
RESET ROLE;

-- (c) Denial of service by locks -------------------------------------------------------------
-- Every lock mode above ACCESS SHARE (which SELECT permits, and which blocks only ACCESS
-- EXCLUSIVE), and every row lock, on every table of both schemas: 42501 for every role.

CREATE TEMP TABLE lock_kinds (ord, kind, statement) AS
VALUES
    (1, 'LOCK IN ROW SHARE MODE', 'LOCK TABLE %s IN ROW SHARE MODE'),
    (2, 'LOCK IN ROW EXCLUSIVE MODE', 'LOCK TABLE %s IN ROW EXCLUSIVE MODE'),
    (3, 'LOCK IN SHARE UPDATE EXCLUSIVE MODE', 'LOCK TABLE %s IN SHARE UPDATE EXCLUSIVE MODE'),
    (4, 'LOCK IN SHARE MODE', 'LOCK TABLE %s IN SHARE MODE'),
    (5, 'LOCK IN SHARE ROW EXCLUSIVE MODE', 'LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE'),
    (6, 'LOCK IN EXCLUSIVE MODE', 'LOCK TABLE %s IN EXCLUSIVE MODE'),
    (7, 'LOCK IN ACCESS EXCLUSIVE MODE', 'LOCK TABLE %s IN ACCESS EXCLUSIVE MODE'),
    (8, 'SELECT ... FOR UPDATE', 'SELECT 1 FROM %s FOR UPDATE'),
    (9, 'SELECT ... FOR NO KEY UPDATE', 'SELECT 1 FROM %s FOR NO KEY UPDATE'),
    (10, 'SELECT ... FOR SHARE', 'SELECT 1 FROM %s FOR SHARE'),
    (11, 'SELECT ... FOR KEY SHARE', 'SELECT 1 FROM %s FOR KEY SHARE');
GRANT SELECT ON lock_kinds TO PUBLIC;  -- noqa: CP02

-- One test per role and kind: the tables where the statement was NOT refused with 42501.
CREATE FUNCTION tests.lock_escapes(p_kind text) RETURNS text []
LANGUAGE sql
AS $$
    SELECT coalesce(array_agg(c.oid::regclass::text || ' ' || s.state ORDER BY c.oid::regclass::text), '{}')
    FROM pg_class AS c
    INNER JOIN lock_kinds AS k ON k.kind = p_kind
    CROSS JOIN LATERAL (SELECT tests.sqlstate_of(format(k.statement, c.oid::regclass)) AS state) AS s
    WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND c.relkind IN ('r', 'p')
      AND s.state <> '42501';
$$;

SET ROLE ql3_runtime;
SELECT is(tests.lock_escapes(k.kind), '{}', format('the runtime may not %s on any table', k.kind))
FROM lock_kinds AS k ORDER BY k.ord;
SET ROLE ql3_operator;
SELECT is(tests.lock_escapes(k.kind), '{}', format('the operator may not %s on any table', k.kind))
FROM lock_kinds AS k ORDER BY k.ord;
SET ROLE ql3_reader;
SELECT is(tests.lock_escapes(k.kind), '{}', format('the reader may not %s on any table', k.kind))
FROM lock_kinds AS k ORDER BY k.ord;
SET ROLE ql3_relay;
SELECT is(tests.lock_escapes(k.kind), '{}', format('the relay may not %s on any table', k.kind))
FROM lock_kinds AS k ORDER BY k.ord;
RESET ROLE;

-- (d) The operator writing around its functions ---------------------------------------------

CREATE TEMP TABLE bypasses (ord, role, statement, description) AS
VALUES
    (1, 'ql3_operator', $$UPDATE ql3.active_revisions SET active_revision_id = (SELECT value::uuid FROM fx
                                                                                WHERE key = 'rev_b')
                          WHERE project_id = 'proj' AND contract_id = 'c1'$$,
     'the operator cannot point active_revisions at a revoked revision by UPDATE'),
    (2, 'ql3_operator', $$INSERT INTO ql3.contract_outbox (event_type, project_id, contract_family, contract_id,
                                                           new_revision_id, pointer_version)
                          SELECT 'revision_activated', 'proj', 'policy_routing', 'c1', value::uuid, 99
                          FROM fx WHERE key = 'rev_other'$$,
     'the operator cannot insert an outbox row for another project''s revision'),
    (3, 'ql3_operator', $$INSERT INTO ql3_ai.model_invocation_resolutions (
                              invocation_id, completion_digest, run_id, step_run_id, decision, user_id, command_digest,
                              record, resolution_digest, mutation_id, event_id, dedupe_key, resolved_at)
                          VALUES ('inv-lost', repeat('0', 64), 'aaaaaaaa-0000-0000-0000-000000000016',
                                  'bbbbbbbb-0000-0000-0000-000000000014', 'retry', 'mallory', repeat('0', 64), '{}',
                                  repeat('0', 64), 'mut_junk', 'evt_junk', 'ddp_junk', now())$$,
     'the operator cannot insert a resolution with junk digests'),
    (4, 'ql3_operator', $$INSERT INTO ql3.revision_revocations (revision_id, reason, revoked_by)
                          SELECT value::uuid, 'quietly', 'mallory' FROM fx WHERE key = 'rev_a'$$,
     'the operator cannot revoke by INSERT, skipping the pointer and the outbox'),
    (5, 'ql3_operator', $$INSERT INTO ql3.contract_revisions (project_id, contract_family, contract_id, revision_no,
                                                              body, body_hash, created_by)
                          VALUES ('proj', 'policy_routing', 'c1', 9, '{}', repeat('0', 64), 'mallory')$$,
     'the operator cannot insert a revision with a junk body_hash'),
    (6, 'ql3_operator', $$SELECT ql3_ai._write_completion(s, 1, tests.completion('inv-run2'), repeat('0', 64), TRUE)
                          FROM ql3_ai.model_invocation_starts AS s WHERE s.invocation_id = 'inv-run2'$$,
     'the operator cannot call ql3_ai._write_completion'),
    (7, 'ql3_runtime', $$SELECT ql3_ai._write_completion(s, 1, tests.completion('inv-run2'), repeat('0', 64), FALSE)
                         FROM ql3_ai.model_invocation_starts AS s WHERE s.invocation_id = 'inv-run2'$$,
     'the runtime cannot call ql3_ai._write_completion'),
    (8, 'ql3_operator', $$SELECT ql3._lock_pointer('proj', 'policy_routing', 'c1', 'mallory')$$,
     'the operator cannot call ql3._lock_pointer'),
    (9, 'ql3_operator', $$SELECT ql3._now()$$, 'the operator cannot call ql3._now'),
    (10, 'ql3_runtime', $$SELECT ql3._now()$$, 'the runtime cannot call ql3._now'),
    (11, 'ql3_operator', $$SELECT ql3._uuid_v7()$$, 'the operator cannot call ql3._uuid_v7'),
    (12, 'ql3_operator', $$SELECT ql3._revision_of(value::uuid) FROM fx WHERE key = 'rev_a'$$,
     'the operator cannot call ql3._revision_of'),
    (13, 'ql3_runtime', $$SELECT ql3_ai._identities('inv-run2', 'completion')$$,
     'the runtime cannot call ql3_ai._identities'),
    (14, 'ql3_reader', $$SELECT ql3._jcs_value('[1]', 0)$$, 'the reader cannot call ql3._jcs_value'),
    (15, 'ql3_relay', $$UPDATE ql3.contract_outbox SET delivered_at = now()$$,
     'the relay cannot mark outbox rows delivered by UPDATE');
GRANT SELECT ON bypasses TO PUBLIC;  -- noqa: CP02

SET ROLE ql3_operator;
SELECT tests.rejects(b.statement, '42501', b.description) FROM bypasses AS b WHERE b.role = 'ql3_operator' ORDER BY b.ord;
SET ROLE ql3_runtime;
SELECT tests.rejects(b.statement, '42501', b.description) FROM bypasses AS b WHERE b.role = 'ql3_runtime' ORDER BY b.ord;
SET ROLE ql3_reader;
SELECT tests.rejects(b.statement, '42501', b.description) FROM bypasses AS b WHERE b.role = 'ql3_reader' ORDER BY b.ord;
SET ROLE ql3_relay;
SELECT tests.rejects(b.statement, '42501', b.description) FROM bypasses AS b WHERE b.role = 'ql3_relay' ORDER BY b.ord;
RESET ROLE;

-- (e) Huge inputs ----------------------------------------------------------------------------
-- Refused with Q3V02 by their jsonb size, before any walk of them. The time bounds are
-- generous bounds (a 2-core machine, a loaded CI), not benchmarks.

SET ROLE ql3_operator;
SELECT tests.rejects(
    $$SELECT ql3.put_revision('proj', 'policy_routing', 'c1', jsonb_build_object('s', repeat('x', 5242880)), 'op')$$,
    'Q3V02', 'put_revision refuses a body holding a 5 MB string'
);
SELECT cmp_ok(
    tests.elapsed_ms(
        $$SELECT ql3.put_revision('proj', 'policy_routing', 'c1', jsonb_build_object('s', repeat('x', 5242880)), 'op')$$
    ),
    '<', 100::numeric,
    'and refuses it within 100 ms (a bound, not a benchmark)'
);
SELECT tests.rejects(
    $$SELECT ql3.put_revision('proj', 'policy_routing', 'c1',
                              jsonb_build_object('a', (SELECT jsonb_agg(g) FROM generate_series(1, 300000) AS g)), 'op')$$,
    'Q3V02', 'put_revision refuses a body holding a 300,000-element array'
);
SELECT tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-lost', 'retry') || jsonb_build_object('pad', repeat('x', 300000)))$$,
    'Q3V02', 'resolve_invocation refuses a huge command'
);
-- A body that compresses well, read from a table, is measured compressed; it is refused all
-- the same, by its canonical size.
CREATE TEMP TABLE compressible AS SELECT jsonb_build_object('s', repeat('x', 5242880)) AS body;
SELECT tests.rejects(
    $$SELECT ql3.put_revision('proj', 'policy_routing', 'c1', c.body, 'op') FROM compressible AS c$$,
    'Q3V02', 'put_revision refuses a 5 MB body stored compressed'
);
SET ROLE ql3_runtime;
SELECT tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
          'inv-huge', 'aaaaaaaa-0000-0000-0000-000000000016', 'bbbbbbbb-0000-0000-0000-000000000018', 1)
          || jsonb_build_object('pad', repeat('x', 300000)))$$,
    'Q3V02', 'admit_invocation refuses a huge command'
);
SELECT tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-run2') || jsonb_build_object('pad', repeat('x', 300000)))$$,
    'Q3V02', 'complete_invocation refuses a huge command'
);
SELECT tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(
          tests.admission('inv-huge', 'aaaaaaaa-0000-0000-0000-000000000016', 'bbbbbbbb-0000-0000-0000-000000000018', 1),
          '{request_id}', (SELECT jsonb_agg(g) FROM generate_series(1, 300000) AS g)))$$,
    'Q3V02', 'admit_invocation refuses a command holding a 300,000-element array'
);
RESET ROLE;
SET ROLE ql3_reader;
SELECT is(
    length(ql3.jcs((SELECT jsonb_agg(1) FROM generate_series(1, 200000)))), 400001,
    'ql3.jcs of a flat 200,000-element array is its 400,001 characters'
);
SELECT cmp_ok(
    tests.elapsed_ms($$SELECT length(ql3.jcs((SELECT jsonb_agg(1) FROM generate_series(1, 200000))))$$),
    '<', 1000::numeric,
    'and takes less than 1 s, building the array included (linear; a bound, not a benchmark)'
);
RESET ROLE;

-- (f) No hijack through pg_temp --------------------------------------------------------------
-- Every role may create temporary objects (PUBLIC's default TEMP on the database). The
-- SECURITY DEFINER functions name pg_temp last in their search_path, and PostgreSQL never
-- looks up functions or operators in pg_temp: a temporary table or function named like a
-- table or a catalogue function changes nothing they do.

SELECT ok(
    has_database_privilege('ql3_runtime', current_database(), 'TEMP'),
    'the runtime may create temporary objects in this database'
);
SET ROLE ql3_runtime;
CREATE TEMP TABLE runs (LIKE ql3.runs);
CREATE TEMP TABLE step_runs (LIKE ql3.step_runs);
CREATE TEMP TABLE active_revisions (LIKE ql3.active_revisions);
CREATE TEMP TABLE model_invocation_starts (LIKE ql3_ai.model_invocation_starts);
CREATE TEMP TABLE run_events (LIKE ql3.run_events);
CREATE FUNCTION pg_temp.hashtext(text) RETURNS integer LANGUAGE sql AS 'SELECT 42';
CREATE FUNCTION pg_temp.now() RETURNS timestamptz LANGUAGE sql AS $$SELECT '1999-01-01 00:00:00+00'::timestamptz$$;
CREATE FUNCTION pg_temp.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$SELECT '\x00'::bytea$$;
CREATE FUNCTION pg_temp.translate(text, text, text) RETURNS text LANGUAGE sql AS $$SELECT ''$$;
SELECT is(
    (SELECT count(*) FROM runs), 0::bigint,
    'in the runtime''s own session an unqualified runs is its empty temporary table'
);
SELECT lives_ok(
    $$SELECT ql3.add_step_run(ql3.create_run('proj', 'trace-f', 'aaaaaaaa-0000-0000-0000-0000000000f6'), 'model',
                              'bbbbbbbb-0000-0000-0000-0000000000f6')$$,
    'create_run and add_step_run run beside the shadowing objects'
);
SELECT is(
    ql3_ai.admit_invocation(tests.admission(
        'inv-shadow', 'aaaaaaaa-0000-0000-0000-0000000000f6', 'bbbbbbbb-0000-0000-0000-0000000000f6', 1,
        p_policy => (SELECT jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'c1',
                                               'revision_id', value)
                     FROM fx WHERE key = 'rev_a'),
        p_trace_id => 'trace-f')) ->> 'status',
    'created',
    'admission under the active policy runs beside them'
);
SELECT results_eq(
    $$SELECT (SELECT count(*) FROM pg_temp.runs) + (SELECT count(*) FROM pg_temp.step_runs)
             + (SELECT count(*) FROM pg_temp.active_revisions) + (SELECT count(*) FROM pg_temp.model_invocation_starts)
             + (SELECT count(*) FROM pg_temp.run_events)$$,
    $$VALUES (0::bigint)$$,
    'nothing reached the temporary tables'
);
SELECT results_eq(
    $$SELECT r.project_id::text, s.status, st.mutation_id = ql3.mutation_id('inv-shadow', 'admission'),
             st.admitted_at > '2000-01-01', e.event_id = ql3.event_id('inv-shadow', 'admission')
      FROM ql3.runs AS r
      INNER JOIN ql3.step_runs AS s ON s.run_id = r.run_id
      INNER JOIN ql3_ai.model_invocation_starts AS st ON st.step_run_id = s.step_run_id
      INNER JOIN ql3.run_events AS e ON e.event_id = st.event_id
      WHERE r.run_id = 'aaaaaaaa-0000-0000-0000-0000000000f6'$$,
    $$VALUES ('proj', 'running', TRUE, TRUE, TRUE)$$,
    'the run, the step, the start and its event are in ql3 and ql3_ai, with the real identities and clock'
);
RESET ROLE;

-- (g) The policy fence in each isolation level, over dblink -----------------------------------
-- Three more sessions, committed: one admits as the runtime, one activates and revokes as the
-- operator, each under a project of its own, and one takes advisory locks as the reader. An
-- admission whose snapshot predates a committed revocation of its policy fails with 40001
-- under REPEATABLE READ and SERIALIZABLE, and with Q3C02 under READ COMMITTED. Under READ
-- COMMITTED nothing waits (D47): an admission in flight is ordered before a revocation that
-- commits meanwhile, and a revocation in flight after an admission that reads the pointer
-- meanwhile. Under REPEATABLE READ an admission in flight holds the revocation off (FOR
-- SHARE). No ql3 writer takes an advisory lock: any role may take any advisory key, the old
-- fence's key included, without stalling a contract. Every session gives up on a lock after
-- lock_timeout, so a wait shows as 55P03.

INSERT INTO fx (key, value) VALUES ('p', 'tap16-' || gen_random_uuid());
INSERT INTO fx (key, value)
VALUES ('dsn', format('host=127.0.0.1 port=%s dbname=%s user=postgres', current_setting('port'), current_database()));
SELECT dblink_connect('tap16_setup', (SELECT value FROM fx WHERE key = 'dsn'));
SELECT dblink_connect('tap16_rt', (SELECT value FROM fx WHERE key = 'dsn'));
SELECT dblink_connect('tap16_op', (SELECT value FROM fx WHERE key = 'dsn'));
SELECT dblink_connect('tap16_adv', (SELECT value FROM fx WHERE key = 'dsn'));
SELECT dblink_exec('tap16_op', 'SET ROLE ql3_operator');
SELECT dblink_exec('tap16_adv', 'SET ROLE ql3_reader');
SELECT dblink_exec(c.name, 'SET lock_timeout = ''500ms''')
FROM (VALUES (1, 'tap16_rt'), (2, 'tap16_op'), (3, 'tap16_adv')) AS c (ord, name)
ORDER BY c.ord;
INSERT INTO fx (key, value)
SELECT
    c.name AS key,
    t.pid::text AS value
FROM (VALUES ('pid_rt', 'tap16_rt'), ('pid_adv', 'tap16_adv')) AS c (name, conn)
CROSS JOIN LATERAL dblink(c.conn, 'SELECT pg_backend_pid()') AS t (pid integer);  -- noqa: ST05

-- One contract, run and step per case (fresh ids: they are committed), committed.
CREATE TEMP TABLE fence AS
SELECT
    c.ord,
    c.isolation,
    c.contract,
    c.run_id,
    c.step_run_id,
    c.expected,
    t.revision_id
FROM (VALUES
    (1, 'REPEATABLE READ', 'c-rr', gen_random_uuid(), gen_random_uuid(), '40001'),
    (2, 'SERIALIZABLE', 'c-ser', gen_random_uuid(), gen_random_uuid(), '40001'),
    (3, 'READ COMMITTED', 'c-rc', gen_random_uuid(), gen_random_uuid(), 'Q3C02'),
    (4, 'READ COMMITTED', 'c-rc-admission', gen_random_uuid(), gen_random_uuid(), NULL),
    (5, 'READ COMMITTED', 'c-rc-revocation', gen_random_uuid(), gen_random_uuid(), NULL),
    (6, 'REPEATABLE READ', 'c-rr-hold', gen_random_uuid(), gen_random_uuid(), NULL),
    (7, 'READ COMMITTED', 'c-advisory', gen_random_uuid(), gen_random_uuid(), NULL)
) AS c (ord, isolation, contract, run_id, step_run_id, expected)
CROSS JOIN LATERAL dblink(  -- noqa: ST05
    'tap16_setup',
    format(
        $remote$SELECT r.revision_id, ql3.add_step_run(ql3.create_run(%1$L, 'trace-1', %3$L), 'model', %4$L),
                       (SELECT count(*) FROM ql3.activate_revision(%1$L, 'policy_routing', %2$L, r.revision_id, 'tap16'))
                FROM ql3.put_revision(%1$L, 'policy_routing', %2$L, '{"v": 1}', 'tap16') AS r$remote$,
        (SELECT x.value FROM fx AS x WHERE x.key = 'p'), c.contract, c.run_id, c.step_run_id
    )
) AS t (revision_id uuid, step_run_id uuid, activations bigint);

CREATE FUNCTION tests.fence_admission(p_ord integer) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT format(
        'SELECT ql3_ai.admit_invocation(%L::jsonb)::text',
        tests.admission(
            'inv-fence-' || f.ord || '-' || (SELECT value FROM fx WHERE key = 'p'), f.run_id, f.step_run_id, 1,
            p_policy => jsonb_build_object('contract_family', 'policy_routing', 'contract_id', f.contract,
                                           'revision_id', f.revision_id),
            p_project_id => (SELECT value FROM fx WHERE key = 'p'))
    )
    FROM fence AS f WHERE f.ord = p_ord;
$$;

-- The remote statement that revokes a case's revision, returning the new pointer_version.
CREATE FUNCTION tests.fence_revocation(p_ord integer) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT format('SELECT (ql3.revoke_revision(%L, ''op'', ''incident'')).pointer_version', f.revision_id)
    FROM fence AS f WHERE f.ord = p_ord;
$$;

-- Cases 1-3: the admitting transaction takes its snapshot, then the revocation commits,
-- then the transaction admits under the revoked revision.
CREATE FUNCTION tests.fence_case(p_ord integer) RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    f fence;
    result text;
BEGIN
    SELECT * INTO f FROM fence WHERE fence.ord = p_ord;
    PERFORM dblink_exec('tap16_rt', format('BEGIN ISOLATION LEVEL %s', f.isolation));
    PERFORM dblink_exec('tap16_rt', 'SET LOCAL ROLE ql3_runtime');
    PERFORM * FROM dblink('tap16_rt', 'SELECT count(*) FROM ql3.active_revisions') AS t (n bigint);
    PERFORM * FROM dblink('tap16_op', tests.fence_revocation(p_ord)) AS t (n bigint);
    result := throws_ok(
        format('SELECT * FROM dblink(%L, %L) AS t (r text)', 'tap16_rt', tests.fence_admission(p_ord)),
        f.expected, NULL,
        format('an admission under %s whose snapshot predates the committed revocation of its policy fails with %s',
               f.isolation, f.expected)
    );
    PERFORM dblink_exec('tap16_rt', 'ROLLBACK');
    RETURN result;
END;
$$;

-- What the sessions hold: the advisory locks of a backend, and the active revision of a case.
CREATE FUNCTION tests.advisory_locks(p_pid_key text) RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT count(*) FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.granted AND l.pid = (SELECT x.value::integer FROM fx AS x WHERE x.key = p_pid_key);
$$;

CREATE FUNCTION tests.fence_pointer(p_ord integer) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT coalesce(a.active_revision_id::text, 'none') || '@' || a.pointer_version
    FROM ql3.active_revisions AS a
    INNER JOIN fence AS f ON a.contract_id = f.contract
    WHERE f.ord = p_ord AND a.project_id = (SELECT x.value FROM fx AS x WHERE x.key = 'p')
      AND a.contract_family = 'policy_routing';
$$;

SELECT is(
    (SELECT count(*) FROM fence WHERE revision_id IS NOT NULL), 7::bigint, 'the fence fixture is committed'
);
SELECT tests.fence_case(f.ord) FROM fence AS f WHERE f.ord <= 3 ORDER BY f.ord;
SELECT is(
    (SELECT count(*) FROM ql3_ai.model_invocation_starts AS s
     WHERE s.project_id = (SELECT x.value FROM fx AS x WHERE x.key = 'p')),
    0::bigint,
    'none of the three admissions wrote a start'
);

-- Case 4, READ COMMITTED: an admission in flight does not hold the revocation of its policy
-- off. The revocation commits at once; the admission, which read the pointer before it, is
-- ordered before it and commits too.
SELECT dblink_exec('tap16_rt', 'BEGIN ISOLATION LEVEL READ COMMITTED');
SELECT dblink_exec('tap16_rt', 'SET LOCAL ROLE ql3_runtime');
SELECT is(
    (SELECT t.r::jsonb ->> 'status' FROM dblink('tap16_rt', tests.fence_admission(4)) AS t (r text)),
    'created',
    'READ COMMITTED: an admission under the active policy, not yet committed'
);
SELECT is(tests.advisory_locks('pid_rt'), 0::bigint, 'the admission in flight holds no advisory lock');
SELECT is(
    (SELECT t.n FROM dblink('tap16_op', tests.fence_revocation(4)) AS t (n bigint)),
    2::bigint,
    'READ COMMITTED: the revocation of its policy does not wait for the admission in flight: it commits'
);
SELECT is(dblink_exec('tap16_rt', 'COMMIT'), 'COMMIT', 'and the admission, ordered before it, commits');
SELECT is(
    (SELECT count(*) FROM ql3_ai.model_invocation_starts AS s
     WHERE s.invocation_id = 'inv-fence-4-' || (SELECT x.value FROM fx AS x WHERE x.key = 'p'))
    || ' ' || tests.fence_pointer(4),
    '1 none@2',
    'its start is committed, and the pointer is empty after the revocation'
);

-- Case 5, READ COMMITTED: a revocation in flight does not make an admission wait. The
-- admission reads the pointer as last committed, is ordered before the revocation, commits.
SELECT dblink_exec('tap16_op', 'BEGIN');
SELECT is(
    (SELECT t.n FROM dblink('tap16_op', tests.fence_revocation(5)) AS t (n bigint)),
    2::bigint,
    'READ COMMITTED: a revocation, not yet committed'
);
SELECT is(
    (SELECT t.r::jsonb ->> 'status' FROM dblink('tap16_rt', 'SET ROLE ql3_runtime; ' || tests.fence_admission(5))
        AS t (r text)),
    'created',
    'an admission under the policy it revokes does not wait for it (within lock_timeout): it commits first'
);
SELECT dblink_exec('tap16_rt', 'RESET ROLE');
SELECT is(dblink_exec('tap16_op', 'COMMIT'), 'COMMIT', 'then the revocation commits');
SELECT is(tests.fence_pointer(5), 'none@2', 'and the pointer is empty');

-- Case 6, REPEATABLE READ: an admission in flight holds the pointer FOR SHARE, and with it
-- the revocation of its policy, until it ends.
SELECT dblink_exec('tap16_rt', 'BEGIN ISOLATION LEVEL REPEATABLE READ');
SELECT dblink_exec('tap16_rt', 'SET LOCAL ROLE ql3_runtime');
SELECT is(
    (SELECT t.r::jsonb ->> 'status' FROM dblink('tap16_rt', tests.fence_admission(6)) AS t (r text)),
    'created',
    'REPEATABLE READ: an admission under the active policy, not yet committed'
);
SELECT throws_ok(
    format('SELECT * FROM dblink(%L, %L) AS t (n bigint)', 'tap16_op', tests.fence_revocation(6)),
    '55P03', NULL,
    'REPEATABLE READ: the revocation waits for the admission in flight (here: gives up after lock_timeout)'
);
SELECT dblink_exec('tap16_rt', 'ROLLBACK');
SELECT is(
    (SELECT t.n FROM dblink('tap16_op', tests.fence_revocation(6)) AS t (n bigint)),
    2::bigint,
    'once the admission ended, the revocation commits'
);

-- Case 7: the reader holds, for its whole session, the advisory lock the old fence took on
-- the contract (key 7433267 and the hash of project, family and contract), and others.
-- Admission, activation and revocation of that contract all proceed within lock_timeout.
SELECT is(
    (SELECT t.locked FROM dblink(
        'tap16_adv',
        format($remote$SELECT 'locked' FROM (
                           SELECT pg_advisory_lock(7433267, hashtext(concat_ws(chr(31), %L, 'policy_routing', %L))),
                                  pg_advisory_lock(7433267, 0), pg_advisory_lock(0), pg_advisory_lock_shared(7433267, 1)
                       ) AS l$remote$,
               (SELECT x.value FROM fx AS x WHERE x.key = 'p'), (SELECT f.contract FROM fence AS f WHERE f.ord = 7))
    ) AS t (locked text)),
    'locked',
    'the reader takes the old fence''s advisory lock on a contract, and more keys (any role may)'
);
SELECT is(tests.advisory_locks('pid_adv'), 4::bigint, 'and holds them (pg_locks shows them)');
SELECT is(
    (SELECT t.r::jsonb ->> 'status' FROM dblink('tap16_rt', 'SET ROLE ql3_runtime; ' || tests.fence_admission(7))
        AS t (r text)),
    'created',
    'an admission under that contract''s policy does not wait for the advisory lock'
);
SELECT dblink_exec('tap16_rt', 'RESET ROLE');
SELECT is(
    (SELECT t.n FROM dblink(
        'tap16_op',
        format($remote$SELECT (ql3.activate_revision(%1$L, 'policy_routing', %2$L, r.revision_id, 'op')).pointer_version
                       FROM ql3.put_revision(%1$L, 'policy_routing', %2$L, '{"v": 2}', 'op') AS r$remote$,
               (SELECT x.value FROM fx AS x WHERE x.key = 'p'), (SELECT f.contract FROM fence AS f WHERE f.ord = 7))
    ) AS t (n bigint)),
    2::bigint,
    'nor does the activation of another revision of that contract'
);
SELECT is(
    (SELECT t.n FROM dblink('tap16_op', tests.fence_revocation(7)) AS t (n bigint)),
    2::bigint,
    'nor the revocation of the revision it replaced'
);
SELECT is(
    tests.advisory_locks('pid_adv'), 4::bigint,
    'the reader held its advisory locks throughout: none of the three waited for them'
);
SELECT t.v FROM dblink('tap16_adv', 'SELECT pg_advisory_unlock_all()') AS t (v text);

SELECT dblink_disconnect('tap16_setup');
SELECT dblink_disconnect('tap16_rt');
SELECT dblink_disconnect('tap16_op');
SELECT dblink_disconnect('tap16_adv');

SELECT * FROM finish();
ROLLBACK;
