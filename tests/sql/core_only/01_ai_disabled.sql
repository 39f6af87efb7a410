-- Run against a database migrated WITHOUT the AI feature (ql3 migrate, no --with-ai):
-- nothing of ql3_ai exists, the core ledger holds no AI row, and runs still work.
BEGIN;
SELECT plan(12);

SELECT hasnt_schema('ql3_ai', 'there is no ql3_ai schema');
SELECT is_empty(
    $$SELECT n.nspname FROM pg_namespace AS n WHERE n.nspname LIKE '%ai%' AND n.nspname LIKE 'ql3%'$$,
    'no schema of the AI feature exists under any ql3 name'
);
SELECT is_empty(
    $$SELECT c.oid::regclass::text FROM pg_class AS c
      WHERE c.relname IN ('feature_history', 'usage_ledger') OR c.relname LIKE 'model_invocation%'$$,
    'no AI table, index or sequence exists in any schema'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.proname LIKE '%invocation%' OR p.proname IN ('recover_expired', 'usage_summary')$$,
    'no function named *invocation*, recover_expired or usage_summary exists'
);
SELECT is_empty(
    $$SELECT t.typname FROM pg_type AS t WHERE t.typname LIKE '%model_invocation%'$$,
    'no AI row type exists'
);
SELECT is_empty(
    $$SELECT version FROM ql3.schema_history WHERE name ~ '(invocation|usage_ledger|ql3_ai)'$$,
    'the core ledger holds no row of the AI stream'
);
SELECT is(
    (SELECT array_agg(version ORDER BY version) FROM ql3.schema_history),
    (SELECT array_agg(g ORDER BY g) FROM generate_series(1, (SELECT max(version) FROM ql3.schema_history)) AS g),
    'the core ledger is exactly the core versions 1..n'
);
SELECT has_table('ql3', 'runs', 'core runs exist without the AI feature');
SELECT has_table('ql3', 'step_runs', 'core step_runs exist without the AI feature');
SELECT has_table('ql3', 'run_events', 'core run_events exist without the AI feature');
SELECT has_table('ql3', 'step_run_mutations', 'core step_run_mutations exist without the AI feature');
SELECT lives_ok(
    $$SELECT ql3.add_step_run(ql3.create_run('proj', 'trace-1'), 'model')$$,
    'runs and steps can be created without the AI feature'
);

SELECT * FROM finish();
ROLLBACK;
