-- Roles and grants of the runs and ql3_ai objects (SPEC section 5): exact privileges of every
-- role on every new table and function, what each role can and cannot do, immutability.
BEGIN;
SET LOCAL client_min_messages = warning;  -- TRUNCATE ... CASCADE below is refused anyway
\ir lib/invocation_helpers.sql

SELECT plan(141);

SELECT schema_privs_are('ql3_ai', 'ql3_runtime', ARRAY['USAGE'], 'ql3_runtime may use schema ql3_ai');
SELECT schema_privs_are('ql3_ai', 'ql3_operator', ARRAY['USAGE'], 'ql3_operator may use schema ql3_ai');
SELECT schema_privs_are('ql3_ai', 'ql3_reader', ARRAY['USAGE'], 'ql3_reader may use schema ql3_ai');
SELECT schema_privs_are('ql3_ai', 'ql3_relay', ARRAY['USAGE'], 'ql3_relay may use schema ql3_ai (and nothing in it)');
SELECT tables_are(
    'ql3_ai',
    ARRAY['feature_history', 'model_invocation_starts', 'model_invocation_completions',
          'model_invocation_resolutions', 'usage_ledger'],
    'ql3_ai holds exactly its ledger and the four receipt tables'
);
SELECT functions_are(
    'ql3_ai',
    ARRAY['admit_invocation', 'complete_invocation', 'resolve_invocation', 'recover_expired', 'usage_summary',
          '_check_shape', '_checked_digest', '_uuid', '_check_sha256', '_timestamp', '_utc', '_identities',
          '_verify_receipt', '_write_completion'],
    'ql3_ai holds exactly these functions (each is covered by the privilege matrix below)'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE (p.pronamespace = 'ql3_ai'::regnamespace OR p.oid IN ('ql3.create_run(text, text, uuid)'::regprocedure,
                                                                   'ql3.add_step_run(uuid, text, uuid)'::regprocedure))
        AND (p.proacl IS NULL OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) AS a WHERE a.grantee = 0))$$,
    'PUBLIC may execute none of the new functions'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE (p.pronamespace = 'ql3_ai'::regnamespace OR p.oid IN ('ql3.create_run(text, text, uuid)'::regprocedure,
                                                                   'ql3.add_step_run(uuid, text, uuid)'::regprocedure))
        AND p.prosecdef$$,
    'every new function is SECURITY INVOKER: the grants are what permit the work'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.oid IN ('ql3.create_run(text, text, uuid)'::regprocedure, 'ql3.add_step_run(uuid, text, uuid)'::regprocedure,
                      'ql3_ai.admit_invocation(jsonb)'::regprocedure, 'ql3_ai.complete_invocation(jsonb)'::regprocedure,
                      'ql3_ai.resolve_invocation(jsonb)'::regprocedure,
                      'ql3_ai.recover_expired(integer, interval)'::regprocedure,
                      'ql3_ai.usage_summary(text, timestamptz, timestamptz)'::regprocedure)
        AND NOT coalesce(p.proconfig @> ARRAY['search_path=pg_catalog, ql3'], FALSE)$$,
    'every public entry point pins search_path = pg_catalog, ql3'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE (p.pronamespace = 'ql3_ai'::regnamespace OR p.oid IN ('ql3.create_run(text, text, uuid)'::regprocedure,
                                                                   'ql3.add_step_run(uuid, text, uuid)'::regprocedure))
        AND obj_description(p.oid, 'pg_proc') IS NULL
      UNION ALL
      SELECT c.oid::regclass::text FROM pg_class AS c
      WHERE c.relkind = 'r' AND obj_description(c.oid, 'pg_class') IS NULL
        AND (c.relnamespace = 'ql3_ai'::regnamespace
             OR c.oid IN ('ql3.runs'::regclass, 'ql3.step_runs'::regclass, 'ql3.run_events'::regclass,
                          'ql3.step_run_mutations'::regclass))$$,
    'every new function and table has a COMMENT'
);
SELECT is(
    (SELECT array_agg(i.indexrelid::regclass::text ORDER BY i.indexrelid::regclass::text) FROM pg_index AS i
     WHERE i.indisunique AND i.indrelid IN ('ql3_ai.model_invocation_starts'::regclass,
                                            'ql3_ai.model_invocation_completions'::regclass)),
    ARRAY['ql3_ai.model_invocation_completions_pkey', 'ql3_ai.model_invocation_starts_pkey'],
    'starts and completions are unique by invocation only: no unique index on (run_id, step_run_id)'
);
SELECT has_index(
    'ql3_ai', 'model_invocation_starts', 'model_invocation_starts_history',
    ARRAY['run_id', 'step_run_id', 'admitted_at', 'invocation_id'], 'starts have a plain history index'
);
SELECT has_index(
    'ql3_ai', 'model_invocation_completions', 'model_invocation_completions_history',
    ARRAY['run_id', 'step_run_id', 'completed_at', 'invocation_id'], 'completions have a plain history index'
);

-- Exact table privileges: receipts are SELECT and INSERT at most, for every role.
SELECT table_privs_are('ql3', 'runs', 'ql3_runtime', ARRAY['INSERT', 'SELECT', 'UPDATE'],
    'ql3_runtime has INSERT/SELECT/UPDATE on ql3.runs');
SELECT table_privs_are('ql3', 'runs', 'ql3_operator', ARRAY['SELECT', 'UPDATE'],
    'ql3_operator has SELECT/UPDATE on ql3.runs');
SELECT table_privs_are('ql3', 'runs', 'ql3_reader', ARRAY['SELECT'], 'ql3_reader has SELECT on ql3.runs');
SELECT table_privs_are('ql3', 'runs', 'ql3_relay', ARRAY[]::text [], 'ql3_relay has no privileges on ql3.runs');
SELECT table_privs_are('ql3', 'step_runs', 'ql3_runtime', ARRAY['INSERT', 'SELECT', 'UPDATE'],
    'ql3_runtime has INSERT/SELECT/UPDATE on ql3.step_runs');
SELECT table_privs_are('ql3', 'step_runs', 'ql3_operator', ARRAY['SELECT', 'UPDATE'],
    'ql3_operator has SELECT/UPDATE on ql3.step_runs');
SELECT table_privs_are('ql3', 'step_runs', 'ql3_reader', ARRAY['SELECT'], 'ql3_reader has SELECT on ql3.step_runs');
SELECT table_privs_are('ql3', 'step_runs', 'ql3_relay', ARRAY[]::text [],
    'ql3_relay has no privileges on ql3.step_runs');
SELECT table_privs_are('ql3', 'run_events', 'ql3_runtime', ARRAY['INSERT', 'SELECT'],
    'ql3_runtime has INSERT/SELECT on ql3.run_events');
SELECT table_privs_are('ql3', 'run_events', 'ql3_operator', ARRAY['INSERT', 'SELECT'],
    'ql3_operator has INSERT/SELECT on ql3.run_events');
SELECT table_privs_are('ql3', 'run_events', 'ql3_reader', ARRAY['SELECT'], 'ql3_reader has SELECT on ql3.run_events');
SELECT table_privs_are('ql3', 'run_events', 'ql3_relay', ARRAY[]::text [],
    'ql3_relay has no privileges on ql3.run_events');
SELECT table_privs_are('ql3', 'step_run_mutations', 'ql3_runtime', ARRAY['INSERT', 'SELECT'],
    'ql3_runtime has INSERT/SELECT on ql3.step_run_mutations');
SELECT table_privs_are('ql3', 'step_run_mutations', 'ql3_operator', ARRAY['INSERT', 'SELECT'],
    'ql3_operator has INSERT/SELECT on ql3.step_run_mutations');
SELECT table_privs_are('ql3', 'step_run_mutations', 'ql3_reader', ARRAY['SELECT'],
    'ql3_reader has SELECT on ql3.step_run_mutations');
SELECT table_privs_are('ql3', 'step_run_mutations', 'ql3_relay', ARRAY[]::text [],
    'ql3_relay has no privileges on ql3.step_run_mutations');
SELECT table_privs_are('ql3_ai', 'model_invocation_starts', 'ql3_runtime', ARRAY['INSERT', 'SELECT'],
    'ql3_runtime has INSERT/SELECT on ql3_ai.model_invocation_starts');
SELECT table_privs_are('ql3_ai', 'model_invocation_starts', 'ql3_operator', ARRAY['SELECT'],
    'ql3_operator has SELECT on ql3_ai.model_invocation_starts');
SELECT table_privs_are('ql3_ai', 'model_invocation_starts', 'ql3_reader', ARRAY['SELECT'],
    'ql3_reader has SELECT on ql3_ai.model_invocation_starts');
SELECT table_privs_are('ql3_ai', 'model_invocation_starts', 'ql3_relay', ARRAY[]::text [],
    'ql3_relay has no privileges on ql3_ai.model_invocation_starts');
SELECT table_privs_are('ql3_ai', 'model_invocation_completions', 'ql3_runtime', ARRAY['INSERT', 'SELECT'],
    'ql3_runtime has INSERT/SELECT on ql3_ai.model_invocation_completions');
SELECT table_privs_are('ql3_ai', 'model_invocation_completions', 'ql3_operator', ARRAY['INSERT', 'SELECT'],
    'ql3_operator has INSERT/SELECT on ql3_ai.model_invocation_completions');
SELECT table_privs_are('ql3_ai', 'model_invocation_completions', 'ql3_reader', ARRAY['SELECT'],
    'ql3_reader has SELECT on ql3_ai.model_invocation_completions');
SELECT table_privs_are('ql3_ai', 'model_invocation_completions', 'ql3_relay', ARRAY[]::text [],
    'ql3_relay has no privileges on ql3_ai.model_invocation_completions');
SELECT table_privs_are('ql3_ai', 'model_invocation_resolutions', 'ql3_runtime', ARRAY['SELECT'],
    'ql3_runtime has SELECT on ql3_ai.model_invocation_resolutions');
SELECT table_privs_are('ql3_ai', 'model_invocation_resolutions', 'ql3_operator', ARRAY['INSERT', 'SELECT'],
    'ql3_operator has INSERT/SELECT on ql3_ai.model_invocation_resolutions');
SELECT table_privs_are('ql3_ai', 'model_invocation_resolutions', 'ql3_reader', ARRAY['SELECT'],
    'ql3_reader has SELECT on ql3_ai.model_invocation_resolutions');
SELECT table_privs_are('ql3_ai', 'model_invocation_resolutions', 'ql3_relay', ARRAY[]::text [],
    'ql3_relay has no privileges on ql3_ai.model_invocation_resolutions');
SELECT table_privs_are('ql3_ai', 'usage_ledger', 'ql3_runtime', ARRAY['INSERT', 'SELECT'],
    'ql3_runtime has INSERT/SELECT on ql3_ai.usage_ledger');
SELECT table_privs_are('ql3_ai', 'usage_ledger', 'ql3_operator', ARRAY['SELECT'],
    'ql3_operator has SELECT on ql3_ai.usage_ledger');
SELECT table_privs_are('ql3_ai', 'usage_ledger', 'ql3_reader', ARRAY['SELECT'],
    'ql3_reader has SELECT on ql3_ai.usage_ledger');
SELECT table_privs_are('ql3_ai', 'usage_ledger', 'ql3_relay', ARRAY[]::text [],
    'ql3_relay has no privileges on ql3_ai.usage_ledger');

-- Exact function privileges, helpers included (SECURITY INVOKER: callers need them).
SELECT function_privs_are('ql3', 'create_run', ARRAY['text', 'text', 'uuid'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3.create_run');
SELECT function_privs_are('ql3', 'create_run', ARRAY['text', 'text', 'uuid'], 'ql3_operator', ARRAY[]::text [],
    'ql3_operator may not execute ql3.create_run');
SELECT function_privs_are('ql3', 'create_run', ARRAY['text', 'text', 'uuid'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3.create_run');
SELECT function_privs_are('ql3', 'create_run', ARRAY['text', 'text', 'uuid'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3.create_run');
SELECT function_privs_are('ql3', 'add_step_run', ARRAY['uuid', 'text', 'uuid'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3.add_step_run');
SELECT function_privs_are('ql3', 'add_step_run', ARRAY['uuid', 'text', 'uuid'], 'ql3_operator', ARRAY[]::text [],
    'ql3_operator may not execute ql3.add_step_run');
SELECT function_privs_are('ql3', 'add_step_run', ARRAY['uuid', 'text', 'uuid'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3.add_step_run');
SELECT function_privs_are('ql3', 'add_step_run', ARRAY['uuid', 'text', 'uuid'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3.add_step_run');
SELECT function_privs_are('ql3_ai', 'admit_invocation', ARRAY['jsonb'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai.admit_invocation');
SELECT function_privs_are('ql3_ai', 'admit_invocation', ARRAY['jsonb'], 'ql3_operator', ARRAY[]::text [],
    'ql3_operator may not execute ql3_ai.admit_invocation');
SELECT function_privs_are('ql3_ai', 'admit_invocation', ARRAY['jsonb'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai.admit_invocation');
SELECT function_privs_are('ql3_ai', 'admit_invocation', ARRAY['jsonb'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai.admit_invocation');
SELECT function_privs_are('ql3_ai', 'complete_invocation', ARRAY['jsonb'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai.complete_invocation');
SELECT function_privs_are('ql3_ai', 'complete_invocation', ARRAY['jsonb'], 'ql3_operator', ARRAY[]::text [],
    'ql3_operator may not execute ql3_ai.complete_invocation');
SELECT function_privs_are('ql3_ai', 'complete_invocation', ARRAY['jsonb'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai.complete_invocation');
SELECT function_privs_are('ql3_ai', 'complete_invocation', ARRAY['jsonb'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai.complete_invocation');
SELECT function_privs_are('ql3_ai', 'resolve_invocation', ARRAY['jsonb'], 'ql3_runtime', ARRAY[]::text [],
    'ql3_runtime may not execute ql3_ai.resolve_invocation');
SELECT function_privs_are('ql3_ai', 'resolve_invocation', ARRAY['jsonb'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai.resolve_invocation');
SELECT function_privs_are('ql3_ai', 'resolve_invocation', ARRAY['jsonb'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai.resolve_invocation');
SELECT function_privs_are('ql3_ai', 'resolve_invocation', ARRAY['jsonb'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai.resolve_invocation');
SELECT function_privs_are('ql3_ai', 'recover_expired', ARRAY['integer', 'interval'], 'ql3_runtime', ARRAY[]::text [],
    'ql3_runtime may not execute ql3_ai.recover_expired');
SELECT function_privs_are('ql3_ai', 'recover_expired', ARRAY['integer', 'interval'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai.recover_expired');
SELECT function_privs_are('ql3_ai', 'recover_expired', ARRAY['integer', 'interval'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai.recover_expired');
SELECT function_privs_are('ql3_ai', 'recover_expired', ARRAY['integer', 'interval'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai.recover_expired');
SELECT function_privs_are('ql3_ai', 'usage_summary', ARRAY['text', 'timestamptz', 'timestamptz'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai.usage_summary');
SELECT function_privs_are('ql3_ai', 'usage_summary', ARRAY['text', 'timestamptz', 'timestamptz'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai.usage_summary');
SELECT function_privs_are('ql3_ai', 'usage_summary', ARRAY['text', 'timestamptz', 'timestamptz'], 'ql3_reader', ARRAY['EXECUTE'],
    'ql3_reader may execute ql3_ai.usage_summary');
SELECT function_privs_are('ql3_ai', 'usage_summary', ARRAY['text', 'timestamptz', 'timestamptz'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai.usage_summary');
SELECT function_privs_are('ql3_ai', '_check_shape', ARRAY['text', 'jsonb', 'text', 'text[]', 'text[]'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._check_shape');
SELECT function_privs_are('ql3_ai', '_check_shape', ARRAY['text', 'jsonb', 'text', 'text[]', 'text[]'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai._check_shape');
SELECT function_privs_are('ql3_ai', '_check_shape', ARRAY['text', 'jsonb', 'text', 'text[]', 'text[]'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._check_shape');
SELECT function_privs_are('ql3_ai', '_check_shape', ARRAY['text', 'jsonb', 'text', 'text[]', 'text[]'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._check_shape');
SELECT function_privs_are('ql3_ai', '_checked_digest', ARRAY['text', 'text', 'jsonb'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._checked_digest');
SELECT function_privs_are('ql3_ai', '_checked_digest', ARRAY['text', 'text', 'jsonb'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai._checked_digest');
SELECT function_privs_are('ql3_ai', '_checked_digest', ARRAY['text', 'text', 'jsonb'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._checked_digest');
SELECT function_privs_are('ql3_ai', '_checked_digest', ARRAY['text', 'text', 'jsonb'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._checked_digest');
SELECT function_privs_are('ql3_ai', '_uuid', ARRAY['text', 'text'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._uuid');
SELECT function_privs_are('ql3_ai', '_uuid', ARRAY['text', 'text'], 'ql3_operator', ARRAY[]::text [],
    'ql3_operator may not execute ql3_ai._uuid');
SELECT function_privs_are('ql3_ai', '_uuid', ARRAY['text', 'text'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._uuid');
SELECT function_privs_are('ql3_ai', '_uuid', ARRAY['text', 'text'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._uuid');
SELECT function_privs_are('ql3_ai', '_check_sha256', ARRAY['text', 'text'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._check_sha256');
SELECT function_privs_are('ql3_ai', '_check_sha256', ARRAY['text', 'text'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai._check_sha256');
SELECT function_privs_are('ql3_ai', '_check_sha256', ARRAY['text', 'text'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._check_sha256');
SELECT function_privs_are('ql3_ai', '_check_sha256', ARRAY['text', 'text'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._check_sha256');
SELECT function_privs_are('ql3_ai', '_timestamp', ARRAY['text', 'text'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._timestamp');
SELECT function_privs_are('ql3_ai', '_timestamp', ARRAY['text', 'text'], 'ql3_operator', ARRAY[]::text [],
    'ql3_operator may not execute ql3_ai._timestamp');
SELECT function_privs_are('ql3_ai', '_timestamp', ARRAY['text', 'text'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._timestamp');
SELECT function_privs_are('ql3_ai', '_timestamp', ARRAY['text', 'text'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._timestamp');
SELECT function_privs_are('ql3_ai', '_utc', ARRAY['timestamptz'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._utc');
SELECT function_privs_are('ql3_ai', '_utc', ARRAY['timestamptz'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai._utc');
SELECT function_privs_are('ql3_ai', '_utc', ARRAY['timestamptz'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._utc');
SELECT function_privs_are('ql3_ai', '_utc', ARRAY['timestamptz'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._utc');
SELECT function_privs_are('ql3_ai', '_identities', ARRAY['text', 'text'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._identities');
SELECT function_privs_are('ql3_ai', '_identities', ARRAY['text', 'text'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai._identities');
SELECT function_privs_are('ql3_ai', '_identities', ARRAY['text', 'text'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._identities');
SELECT function_privs_are('ql3_ai', '_identities', ARRAY['text', 'text'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._identities');
SELECT function_privs_are('ql3_ai', '_verify_receipt', ARRAY['text', 'text', 'jsonb', 'text'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._verify_receipt');
SELECT function_privs_are('ql3_ai', '_verify_receipt', ARRAY['text', 'text', 'jsonb', 'text'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai._verify_receipt');
SELECT function_privs_are('ql3_ai', '_verify_receipt', ARRAY['text', 'text', 'jsonb', 'text'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._verify_receipt');
SELECT function_privs_are('ql3_ai', '_verify_receipt', ARRAY['text', 'text', 'jsonb', 'text'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._verify_receipt');
SELECT function_privs_are('ql3_ai', '_write_completion', ARRAY['ql3_ai.model_invocation_starts', 'bigint', 'jsonb', 'text', 'boolean'], 'ql3_runtime', ARRAY['EXECUTE'],
    'ql3_runtime may execute ql3_ai._write_completion');
SELECT function_privs_are('ql3_ai', '_write_completion', ARRAY['ql3_ai.model_invocation_starts', 'bigint', 'jsonb', 'text', 'boolean'], 'ql3_operator', ARRAY['EXECUTE'],
    'ql3_operator may execute ql3_ai._write_completion');
SELECT function_privs_are('ql3_ai', '_write_completion', ARRAY['ql3_ai.model_invocation_starts', 'bigint', 'jsonb', 'text', 'boolean'], 'ql3_reader', ARRAY[]::text [],
    'ql3_reader may not execute ql3_ai._write_completion');
SELECT function_privs_are('ql3_ai', '_write_completion', ARRAY['ql3_ai.model_invocation_starts', 'bigint', 'jsonb', 'text', 'boolean'], 'ql3_relay', ARRAY[]::text [],
    'ql3_relay may not execute ql3_ai._write_completion');

-- The roles at work: the runtime admits and completes, the operator resolves and recovers.

SET ROLE ql3_runtime;
SELECT lives_ok(
    $$SELECT ql3.add_step_run(ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000001'), 'model',
                              ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid)
      FROM generate_series(1, 3) AS g$$,
    'the runtime creates runs and steps'
);
SELECT lives_ok(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-' || g, 'aaaaaaaa-0000-0000-0000-000000000001', ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid, 1,
        p_deadline_at => '2000-01-01T00:00:00.000000Z'))
      FROM generate_series(1, 3) AS g$$,
    'the runtime admits'
);
SELECT lives_ok(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-1', 'lost', 'outcome_unknown', tests.usage(1, 2, 3, 'USD')))$$,
    'the runtime completes (and its usage reaches the ledger)'
);
SELECT lives_ok(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, NULL)$$, 'the runtime reads the usage summary'
);
SELECT throws_ok(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-1', 'retry'))$$,
    '42501', NULL, 'the runtime cannot resolve its own unknown outcome'
);
SELECT throws_ok(
    $$SELECT ql3_ai.recover_expired(10, interval '0')$$, '42501', NULL, 'the runtime cannot run recovery'
);
SELECT throws_ok(
    $$INSERT INTO ql3_ai.model_invocation_resolutions
          (invocation_id, completion_digest, run_id, step_run_id, decision, user_id, command_digest, record,
           resolution_digest, mutation_id, event_id, dedupe_key, resolved_at)
      SELECT invocation_id, completion_digest, run_id, step_run_id, 'retry', 'me', completion_digest, record,
             completion_digest, mutation_id, event_id, dedupe_key, now()
      FROM ql3_ai.model_invocation_completions$$,
    '42501', NULL, 'the runtime cannot write a resolution by hand either'
);
SELECT throws_ok(
    $$UPDATE ql3_ai.model_invocation_starts SET model = 'x'$$, '42501', NULL, 'the runtime cannot UPDATE starts'
);
SELECT throws_ok(
    $$DELETE FROM ql3_ai.model_invocation_completions$$, '42501', NULL, 'the runtime cannot DELETE completions'
);
SELECT throws_ok(
    $$TRUNCATE ql3_ai.usage_ledger$$, '42501', NULL, 'the runtime cannot TRUNCATE the usage ledger'
);
SELECT throws_ok(
    $$UPDATE ql3.run_events SET event_type = 'x'$$, '42501', NULL, 'the runtime cannot UPDATE run events'
);
SELECT throws_ok(
    $$SELECT 1 FROM ql3_ai.model_invocation_starts FOR UPDATE$$,
    '42501', NULL, 'the runtime cannot lock receipts (FOR UPDATE needs UPDATE)'
);

SET ROLE ql3_operator;
SELECT lives_ok(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-1', 'retry', 'alice'))$$, 'the operator resolves'
);
SELECT is(
    (ql3_ai.recover_expired(10, interval '0') ->> 'count')::integer, 2, 'the operator recovers'
);
SELECT lives_ok(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, NULL)$$, 'the operator reads the usage summary'
);
SELECT throws_ok(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-9', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000001', 4))$$,
    '42501', NULL, 'the operator does not admit model calls'
);

SET ROLE ql3_reader;
SELECT lives_ok(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, NULL)$$, 'the reader reads the usage summary'
);
SELECT throws_ok(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-2'))$$, '42501', NULL, 'the reader cannot complete'
);

SET ROLE ql3_relay;
SELECT throws_ok(
    $$SELECT count(*) FROM ql3_ai.model_invocation_starts$$, '42501', NULL, 'the relay cannot read receipts'
);
SELECT throws_ok(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, NULL)$$, '42501', NULL, 'the relay cannot read usage'
);

-- Receipts are immutable for the owner too.

SET ROLE ql3_owner;
SELECT throws_ok(
    $$UPDATE ql3_ai.model_invocation_starts SET model = 'x'$$, 'Q3S01', NULL, 'starts refuse UPDATE, even by the owner'
);
SELECT throws_ok(
    $$DELETE FROM ql3_ai.model_invocation_starts$$, 'Q3S01', NULL, 'starts refuse DELETE, even by the owner'
);
SELECT throws_ok(
    $$TRUNCATE ql3_ai.model_invocation_starts CASCADE$$, 'Q3S01', NULL, 'starts refuse TRUNCATE, even by the owner'
);
SELECT throws_ok(
    $$UPDATE ql3_ai.model_invocation_completions SET result_code = 'x'$$,
    'Q3S01', NULL, 'completions refuse UPDATE, even by the owner'
);
SELECT throws_ok(
    $$DELETE FROM ql3_ai.model_invocation_completions$$, 'Q3S01', NULL, 'completions refuse DELETE, even by the owner'
);
SELECT throws_ok(
    $$TRUNCATE ql3_ai.model_invocation_completions CASCADE$$,
    'Q3S01', NULL, 'completions refuse TRUNCATE, even by the owner'
);
SELECT throws_ok(
    $$UPDATE ql3_ai.model_invocation_resolutions SET decision = 'fail'$$,
    'Q3S01', NULL, 'resolutions refuse UPDATE, even by the owner'
);
SELECT throws_ok(
    $$DELETE FROM ql3_ai.model_invocation_resolutions$$, 'Q3S01', NULL, 'resolutions refuse DELETE, even by the owner'
);
SELECT throws_ok(
    $$TRUNCATE ql3_ai.model_invocation_resolutions$$, 'Q3S01', NULL, 'resolutions refuse TRUNCATE, even by the owner'
);
SELECT throws_ok(
    $$UPDATE ql3_ai.usage_ledger SET cost_micros = 0$$, 'Q3S01', NULL, 'the ledger refuses UPDATE, even by the owner'
);
SELECT throws_ok(
    $$DELETE FROM ql3_ai.usage_ledger$$, 'Q3S01', NULL, 'the ledger refuses DELETE, even by the owner'
);
SELECT throws_ok(
    $$TRUNCATE ql3_ai.usage_ledger$$, 'Q3S01', NULL, 'the ledger refuses TRUNCATE, even by the owner'
);

RESET ROLE;
SELECT * FROM finish();
ROLLBACK;
