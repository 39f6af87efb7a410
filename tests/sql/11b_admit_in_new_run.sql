-- Admission in a new run (D59): ql3_ai.admit_in_new_run creates the run and the model step
-- its command names and admits, in one transaction; a replay is admit_invocation's replay;
-- any refusal writes nothing, and a command create_run or add_step_run could not take gets
-- admit_invocation's own error.
BEGIN;
\ir lib/invocation_helpers.sql

SELECT plan(38);

CREATE TEMP TABLE cmd AS
SELECT tests.admission(
    'inv-n1', 'cccccccc-0000-0000-0000-000000000001', 'dddddddd-0000-0000-0000-000000000001', 1,
    p_trace_id => 'trace-n1'
) AS c;
GRANT SELECT ON cmd TO PUBLIC;  -- noqa: CP02

SET ROLE ql3_runtime;

CREATE TEMP TABLE n1 AS SELECT ql3_ai.admit_in_new_run(c) AS r FROM cmd;

SELECT is((SELECT r ->> 'status' FROM n1), 'created', 'a new run, step and admission: created');
SELECT is(
    (SELECT r ->> 'start_digest' FROM n1),
    (SELECT ql3.digest('ql3/model-invocation-start@v1', r -> 'start') FROM n1),
    'the start_digest is the digest of the start record, as admit_invocation''s'
);
SELECT results_eq(
    $$SELECT project_id::text, trace_id::text, version, event_seq FROM ql3.runs
      WHERE run_id = 'cccccccc-0000-0000-0000-000000000001'$$,
    $$VALUES ('proj'::text, 'trace-n1'::text, 2::bigint, 1::bigint)$$,
    'the run is the command''s project and trace, with the admission''s event'
);
SELECT results_eq(
    $$SELECT run_id::text, kind, status, version, attempt_count FROM ql3.step_runs
      WHERE step_run_id = 'dddddddd-0000-0000-0000-000000000001'$$,
    $$VALUES ('cccccccc-0000-0000-0000-000000000001', 'model'::text, 'running'::text, 2::bigint, 1)$$,
    'the step is a model step of that run, running attempt 1 at version 2'
);
SELECT is(
    (SELECT count(*)::integer FROM ql3_ai.model_invocation_starts WHERE invocation_id = 'inv-n1'), 1,
    'one Start receipt'
);
SELECT is(
    (SELECT count(*)::integer FROM ql3.step_run_mutations WHERE step_run_id = 'dddddddd-0000-0000-0000-000000000001'),
    1, 'one step mutation (ready -> running)'
);

-- The same record as admit_invocation writes on a run and step created beforehand.
SELECT ql3.create_run('proj', 'trace-n2', 'cccccccc-0000-0000-0000-000000000002');
SELECT ql3.add_step_run('cccccccc-0000-0000-0000-000000000002', 'model', 'dddddddd-0000-0000-0000-000000000002');
CREATE TEMP TABLE n2 AS
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-n2', 'cccccccc-0000-0000-0000-000000000002', 'dddddddd-0000-0000-0000-000000000002', 1,
    p_trace_id => 'trace-n2'
)) AS r;
SELECT is(
    (SELECT (r -> 'start') - '{invocation_id,request_id,run_id,step_run_id,trace_id,request_digest,admitted_at,command_digest,event_id,mutation_id,dedupe_key}'::text []
     FROM n1),
    (SELECT (r -> 'start') - '{invocation_id,request_id,run_id,step_run_id,trace_id,request_digest,admitted_at,command_digest,event_id,mutation_id,dedupe_key}'::text []
     FROM n2),
    'its start record has the fields and values admit_invocation gives on a pre-created step'
);

-- A replay is the admission's replay.
SELECT is(
    (SELECT ql3_ai.admit_in_new_run(c) ->> 'status' FROM cmd), 'existing', 'the same command again is existing'
);
SELECT is(
    (SELECT ql3_ai.admit_in_new_run(c) -> 'start' FROM cmd), (SELECT r -> 'start' FROM n1),
    'and returns the stored start record'
);
SELECT is(
    (SELECT ql3_ai.admit_invocation(c) ->> 'status' FROM cmd), 'existing',
    'admit_invocation of the same command is existing too'
);
SELECT is(
    (SELECT count(*)::integer FROM ql3.step_runs WHERE run_id = 'cccccccc-0000-0000-0000-000000000001'), 1,
    'replays added no step'
);

-- Refusals write nothing: not the run, not the step.
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_in_new_run(tests.admission(
        'inv-n3', 'cccccccc-0000-0000-0000-000000000001', 'dddddddd-0000-0000-0000-000000000003', 1,
        p_trace_id => 'other-trace'))$$,
    'Q3C01', 'a run_id that exists with another trace is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_in_new_run(tests.admission(
        'inv-n4', 'cccccccc-0000-0000-0000-000000000004', 'dddddddd-0000-0000-0000-000000000001', 1))$$,
    'Q3C01', 'a step_run_id that exists in another run is QL3_CONFLICT, and the new run is not kept'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_in_new_run(tests.admission(
        'inv-n5', 'cccccccc-0000-0000-0000-000000000005', 'dddddddd-0000-0000-0000-000000000005', 2))$$,
    'Q3C01', 'a new step is at version 1: expecting another is QL3_CONFLICT, and neither run nor step is kept'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_in_new_run(tests.admission(
        'inv-n6', 'cccccccc-0000-0000-0000-000000000006', 'dddddddd-0000-0000-0000-000000000006', 1,
        p_deadline_at => 'tomorrow'))$$,
    'Q3V01', 'a bad deadline is QL3_INVALID_ARGUMENT, and neither run nor step is kept'
);

-- A command the run and step functions could not take gets the admission's own error.
SELECT is(
    tests.failure_of($$SELECT ql3_ai.admit_in_new_run(c - 'run_id') FROM cmd$$),
    tests.failure_of($$SELECT ql3_ai.admit_invocation(c - 'run_id') FROM cmd$$),
    'a missing run_id: the same error as admit_invocation'
);
SELECT is(
    tests.failure_of($$SELECT ql3_ai.admit_in_new_run(jsonb_set(c, '{step_run_id}', '"DDDDDDDD-0000-0000-0000-000000000009"')) FROM cmd$$),
    tests.failure_of($$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{step_run_id}', '"DDDDDDDD-0000-0000-0000-000000000009"')) FROM cmd$$),
    'an uppercase step_run_id: the same error as admit_invocation'
);
SELECT is(
    tests.failure_of($$SELECT ql3_ai.admit_in_new_run(jsonb_set(c, '{project_id}', to_jsonb(repeat('p', 129)))) FROM cmd$$),
    tests.failure_of($$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{project_id}', to_jsonb(repeat('p', 129)))) FROM cmd$$),
    'a 129-character project_id: the same error as admit_invocation'
);
SELECT is(
    tests.failure_of($$SELECT ql3_ai.admit_in_new_run('[]')$$),
    tests.failure_of($$SELECT ql3_ai.admit_invocation('[]')$$),
    'a command that is not an object: the same error as admit_invocation'
);
SELECT is(
    tests.failure_of($$SELECT ql3_ai.admit_in_new_run(NULL)$$),
    tests.failure_of($$SELECT ql3_ai.admit_invocation(NULL)$$),
    'a NULL command: the same error as admit_invocation'
);

-- The policy fence holds in the same transaction.
RESET ROLE;
CREATE TEMP TABLE revs AS
SELECT
    (ql3.put_revision('proj', 'policy_routing', 'router-n', '{"route": "a"}', 'ops')).revision_id AS a,
    (ql3.put_revision('proj', 'policy_routing', 'router-n', '{"route": "b"}', 'ops')).revision_id AS b;
GRANT SELECT ON revs TO PUBLIC;  -- noqa: CP02
SELECT ql3.activate_revision('proj', 'policy_routing', 'router-n', b, 'ops') FROM revs;
SET ROLE ql3_runtime;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_in_new_run(tests.admission(
        'inv-n7', 'cccccccc-0000-0000-0000-000000000007', 'dddddddd-0000-0000-0000-000000000007', 1,
        jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'router-n', 'revision_id', a)))
      FROM revs$$,
    'Q3C02', 'under a revision that is not active: QL3_STALE_REVISION, and neither run nor step is kept'
);
SELECT is(
    (SELECT ql3_ai.admit_in_new_run(tests.admission(
        'inv-n8', 'cccccccc-0000-0000-0000-000000000008', 'dddddddd-0000-0000-0000-000000000008', 1,
        jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'router-n', 'revision_id', b)))
        ->> 'status' FROM revs),
    'created', 'under the active revision: created'
);
RESET ROLE;

-- A new run, step and invocation are written once, in their admitted state (D60): every row
-- is the row create_run, add_step_run and admit_invocation leave (n2 above, same
-- transaction, so the same now()). The rows of run cccccccc-...-n and step dddddddd-...-n,
-- without the columns that name the run, step, invocation or command.
CREATE FUNCTION tests.admitted_rows(p_n integer) RETURNS jsonb
LANGUAGE sql STABLE
AS $$
    SELECT jsonb_build_object(
        'run', (SELECT to_jsonb(r) - '{run_id,trace_id}'::text [] FROM ql3.runs AS r
                WHERE r.run_id = i.run_id),
        'step', (SELECT to_jsonb(s) - '{step_run_id,run_id,current_invocation_id}'::text []
                 FROM ql3.step_runs AS s WHERE s.step_run_id = i.step_run_id),
        'mutations', (SELECT jsonb_agg(to_jsonb(m) - '{mutation_id,dedupe_key,step_run_id,command_digest}'::text [])
                      FROM ql3.step_run_mutations AS m WHERE m.step_run_id = i.step_run_id),
        'events', (SELECT jsonb_agg((to_jsonb(e) - '{run_id,event_id,step_run_id,payload}'::text [])
                                    || jsonb_build_object('payload', e.payload - '{invocation_id,start_digest}'::text []))
                   FROM ql3.run_events AS e WHERE e.run_id = i.run_id))
    FROM (SELECT format('cccccccc-0000-0000-0000-%s', lpad(p_n::text, 12, '0'))::uuid AS run_id,
                 format('dddddddd-0000-0000-0000-%s', lpad(p_n::text, 12, '0'))::uuid AS step_run_id) AS i
$$;
SET ROLE ql3_runtime;
SELECT ok(
    (SELECT bool_and(e.v <> 'null'::jsonb) FROM jsonb_each(tests.admitted_rows(1)) AS e (k, v))
    AND (SELECT bool_and(e.v <> 'null'::jsonb) FROM jsonb_each(tests.admitted_rows(2)) AS e (k, v)),
    'both admissions have a run, a step, a mutation and an event to compare'
);
SELECT is(tests.admitted_rows(1) -> 'run', tests.admitted_rows(2) -> 'run',
          'the run row is the one create_run and admit_invocation leave');
SELECT is(tests.admitted_rows(1) -> 'step', tests.admitted_rows(2) -> 'step',
          'the step row is the one add_step_run and admit_invocation leave');
SELECT is(tests.admitted_rows(1) -> 'mutations', tests.admitted_rows(2) -> 'mutations',
          'and so is its mutation');
SELECT is(tests.admitted_rows(1) -> 'events', tests.admitted_rows(2) -> 'events',
          'and its run event');

-- A run that exists, with a new step: create_run finds it, add_step_run adds the step.
RESET ROLE;
SELECT ql3.create_run('proj', 'trace-n9', 'cccccccc-0000-0000-0000-000000000009');
SET ROLE ql3_runtime;
SELECT is(
    ql3_ai.admit_in_new_run(tests.admission(
        'inv-n9', 'cccccccc-0000-0000-0000-000000000009', 'dddddddd-0000-0000-0000-000000000009', 1,
        p_trace_id => 'trace-n9'
    )) ->> 'status',
    'created', 'a run that exists and a new step: created'
);
SELECT results_eq(
    $$SELECT r.version, r.event_seq, s.status, s.version FROM ql3.runs AS r
      JOIN ql3.step_runs AS s ON s.run_id = r.run_id WHERE r.run_id = 'cccccccc-0000-0000-0000-000000000009'$$,
    $$VALUES (2::bigint, 1::bigint, 'running'::text, 2::bigint)$$,
    'the existing run is moved once, and the step admitted'
);
-- An invocation admitted on another step: admit_invocation's QL3_CONFLICT, and nothing kept.
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_in_new_run(tests.admission(
        'inv-n1', 'cccccccc-0000-0000-0000-000000000010', 'dddddddd-0000-0000-0000-000000000010', 1))$$,
    'Q3C01', 'an invocation_id admitted on another step: QL3_CONFLICT, and neither run nor step is kept',
    (SELECT format('QL3_CONFLICT: invocation inv-n1 was admitted with another command (digest %s)',
                   r -> 'start' ->> 'command_digest') FROM n1)
);
RESET ROLE;

-- Only the runtime may call it.
SET ROLE ql3_operator;
SELECT throws_ok($$SELECT ql3_ai.admit_in_new_run('{}')$$, '42501', NULL, 'ql3_operator may not call it');
RESET ROLE;
SET ROLE ql3_reader;
SELECT throws_ok($$SELECT ql3_ai.admit_in_new_run('{}')$$, '42501', NULL, 'ql3_reader may not call it');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
