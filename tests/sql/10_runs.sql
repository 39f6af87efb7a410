-- Runs and steps (sql/core/0003_runs.sql): create_run, add_step_run, the history tables.
BEGIN;
SELECT plan(47);

SELECT has_table('ql3', 'runs', 'ql3.runs exists');
SELECT has_table('ql3', 'step_runs', 'ql3.step_runs exists');
SELECT has_table('ql3', 'run_events', 'ql3.run_events exists');
SELECT has_table('ql3', 'step_run_mutations', 'ql3.step_run_mutations exists');
SELECT has_function('ql3', 'create_run', ARRAY['text', 'text', 'uuid'], 'ql3.create_run(text, text, uuid) exists');
SELECT has_function('ql3', 'add_step_run', ARRAY['uuid', 'text', 'uuid'], 'ql3.add_step_run(uuid, text, uuid) exists');
SELECT col_is_pk('ql3', 'run_events', ARRAY['run_id', 'seq'], 'run_events is keyed by (run_id, seq)');
SELECT col_is_unique('ql3', 'run_events', ARRAY['event_id'], 'run_events.event_id is unique');
SELECT col_is_pk('ql3', 'step_run_mutations', ARRAY['mutation_id'], 'step_run_mutations is keyed by mutation_id');
SELECT col_is_unique('ql3', 'step_run_mutations', ARRAY['dedupe_key'], 'step_run_mutations.dedupe_key is unique');
SELECT col_is_unique(
    'ql3', 'step_run_mutations', ARRAY['step_run_id', 'to_version'],
    'one mutation per step version'
);

-- create_run

SELECT is(
    ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000001'),
    'aaaaaaaa-0000-0000-0000-000000000001'::uuid,
    'create_run returns the run_id it was given'
);
SELECT results_eq(
    $$SELECT project_id::text, trace_id::text, status, version, event_seq FROM ql3.runs
      WHERE run_id = 'aaaaaaaa-0000-0000-0000-000000000001'$$,
    $$VALUES ('proj', 'trace-1', 'open', 1::bigint, 0::bigint)$$,
    'a new run is open at version 1 with no events'
);
SELECT is(
    ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000001'),
    'aaaaaaaa-0000-0000-0000-000000000001'::uuid,
    'create_run with the same run_id and content returns it again'
);
SELECT is((SELECT count(*) FROM ql3.runs)::integer, 1, 'the repeated create_run wrote nothing');
SELECT throws_ok(
    $$SELECT ql3.create_run('proj', 'trace-2', 'aaaaaaaa-0000-0000-0000-000000000001')$$,
    'Q3C01', NULL, 'create_run with the same run_id and another trace is QL3_CONFLICT'
);
SELECT throws_ok(
    $$SELECT ql3.create_run('other', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000001')$$,
    'Q3C01', NULL, 'create_run with the same run_id and another project is QL3_CONFLICT'
);
SELECT isnt(ql3.create_run('proj', 'trace-3'), NULL, 'create_run without run_id generates one');
SELECT throws_ok($$SELECT ql3.create_run('', 'trace')$$, 'Q3V01', NULL, 'empty project_id is QL3_INVALID_ARGUMENT');
SELECT throws_ok($$SELECT ql3.create_run('proj', NULL)$$, 'Q3V01', NULL, 'NULL trace_id is QL3_INVALID_ARGUMENT');
SELECT throws_ok(
    $$SELECT ql3.create_run(repeat('p', 129), 'trace')$$,
    'Q3V03', NULL, 'a 129-character project_id is QL3_IDENTIFIER_TOO_LONG'
);
SELECT lives_ok(
    $$SELECT ql3.create_run(repeat('p', 128), repeat('t', 128))$$,
    '128-character project_id and trace_id are accepted'
);
SELECT is((SELECT count(*) FROM ql3.runs)::integer, 3, 'rejected create_run calls wrote nothing');

-- add_step_run

SELECT is(
    ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'model', 'bbbbbbbb-0000-0000-0000-000000000001'),
    'bbbbbbbb-0000-0000-0000-000000000001'::uuid,
    'add_step_run returns the step_run_id it was given'
);
SELECT results_eq(
    $$SELECT run_id, kind, status, version, attempt_count, current_invocation_id::text, output_ref, result_code::text
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    $$VALUES ('aaaaaaaa-0000-0000-0000-000000000001'::uuid, 'model', 'ready', 1::bigint, 0,
              NULL::text, NULL::text, NULL::text)$$,
    'a new step is ready at version 1 with attempt_count 0 and no result'
);
SELECT is(
    ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'model', 'bbbbbbbb-0000-0000-0000-000000000001'),
    'bbbbbbbb-0000-0000-0000-000000000001'::uuid,
    'add_step_run with the same step_run_id and content returns it again'
);
SELECT throws_ok(
    $$SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'tool', 'bbbbbbbb-0000-0000-0000-000000000001')$$,
    'Q3C01', NULL, 'the same step_run_id with another kind is QL3_CONFLICT'
);
SELECT throws_ok(
    $$SELECT ql3.add_step_run(ql3.create_run('proj', 'trace-9'), 'model', 'bbbbbbbb-0000-0000-0000-000000000001')$$,
    'Q3C01', NULL, 'the same step_run_id in another run is QL3_CONFLICT'
);
SELECT throws_ok(
    $$SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-00000000dead', 'model')$$,
    'Q3N01', NULL, 'a step in an unknown run is QL3_NOT_FOUND'
);
SELECT throws_ok(
    $$SELECT ql3.add_step_run(NULL, 'model')$$, 'Q3V01', NULL, 'a NULL run_id is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'Model!')$$,
    'Q3V01', NULL, 'a malformed kind is QL3_INVALID_ARGUMENT'
);
SELECT is(
    (SELECT count(*) FROM ql3.step_runs)::integer, 1, 'rejected add_step_run calls wrote nothing'
);
SELECT isnt(
    ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'tool'), NULL,
    'add_step_run without step_run_id generates one (any well-formed kind)'
);

-- Step invariants the state machine relies on.

SELECT throws_ok(
    $$UPDATE ql3.step_runs SET status = 'paused' WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    'Q3S01', NULL, 'a status outside the state machine is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$UPDATE ql3.step_runs SET status = 'succeeded' WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    'Q3S01', NULL, 'a direct UPDATE cannot skip a transition (ready -> succeeded), whoever makes it (D33)'
);
-- The runtime holds no UPDATE on step_runs (D46): refused before the trigger. The
-- trigger still refuses the same UPDATE from the owner, whose functions are the writers.
SET ROLE ql3_runtime;
SELECT throws_ok(
    $$UPDATE ql3.step_runs SET status = 'lost' WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    '42501', NULL, 'the runtime cannot make a ready step lost by UPDATE (no UPDATE privilege)'
);
SET ROLE ql3_owner;
SELECT throws_ok(
    $$UPDATE ql3.step_runs SET status = 'lost' WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    'Q3S01', NULL, 'not even the owner can make a ready step lost by UPDATE (QL3_ILLEGAL_TRANSITION)'
);
RESET ROLE;
SELECT throws_ok(
    $$UPDATE ql3.step_runs SET status = 'running' WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    '23514', NULL, 'a running step must name its current invocation'
);
SELECT throws_ok(
    $$UPDATE ql3.step_runs SET output_ref = 'x' WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    '23514', NULL, 'a ready step carries no result'
);

-- The history tables are immutable for every role, the owner included.

INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, step_run_id, payload)
VALUES ('aaaaaaaa-0000-0000-0000-000000000001', 1, 'evt_test', 'test_event',
        'bbbbbbbb-0000-0000-0000-000000000001', '{}');
INSERT INTO ql3.step_run_mutations
    (mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version, command_digest)
VALUES ('mut_test', 'ddp_test', 'bbbbbbbb-0000-0000-0000-000000000001', 'ready', 'running', 1, 2, repeat('0', 64));

SELECT throws_ok($$UPDATE ql3.run_events SET event_type = 'x'$$, 'Q3S01', NULL, 'run_events refuses UPDATE');
SELECT throws_ok($$DELETE FROM ql3.run_events$$, 'Q3S01', NULL, 'run_events refuses DELETE');
SELECT throws_ok($$TRUNCATE ql3.run_events$$, 'Q3S01', NULL, 'run_events refuses TRUNCATE');
SELECT throws_ok(
    $$UPDATE ql3.step_run_mutations SET to_status = 'x'$$, 'Q3S01', NULL, 'step_run_mutations refuses UPDATE'
);
SELECT throws_ok($$DELETE FROM ql3.step_run_mutations$$, 'Q3S01', NULL, 'step_run_mutations refuses DELETE');
SELECT throws_ok($$TRUNCATE ql3.step_run_mutations$$, 'Q3S01', NULL, 'step_run_mutations refuses TRUNCATE');
SELECT throws_ok(
    $$INSERT INTO ql3.step_run_mutations
          (mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version, command_digest)
      VALUES ('mut_other', 'ddp_other', 'bbbbbbbb-0000-0000-0000-000000000001', 'ready', 'running', 1, 2,
              repeat('0', 64))$$,
    '23505', NULL, 'a second mutation of the same step version is refused'
);
SELECT throws_ok(
    $$INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, payload)
      VALUES ('aaaaaaaa-0000-0000-0000-000000000001', 1, 'evt_other', 'test_event', '{}')$$,
    '23505', NULL, 'a run event seq is used once'
);

SELECT * FROM finish();
ROLLBACK;
