-- Roles and grants of the runs and ql3_ai objects (SPEC section 5, D46, D47): exact privileges
-- of every role on every new table and function, their row-level security, what each role can
-- and cannot do, immutability.
-- Table-driven like 06_privileges.sql: one row per object with what each role holds. One
-- trust boundary: every role only reads; the functions of its job, running as ql3_owner,
-- are its only way to write.
BEGIN;
SET LOCAL client_min_messages = warning;  -- TRUNCATE ... CASCADE below is refused anyway
\ir lib/invocation_helpers.sql
\ir lib/privilege_helpers.sql

SELECT plan(605);

-- Schema and catalogue -----------------------------------------------------------------------

SELECT schema_owner_is('ql3_ai', 'ql3_owner', 'ql3_owner owns schema ql3_ai');
SELECT schema_privs_are('ql3_ai', g.role, g.privs, format('%s has %s on schema ql3_ai', g.role, g.privs))
FROM (VALUES
    (1, 'ql3_runtime', '{USAGE}'::name []),
    (2, 'ql3_relay', '{USAGE}'),  -- and nothing in it (below)
    (3, 'ql3_operator', '{USAGE}'),
    (4, 'ql3_reader', '{USAGE}'),
    (5, 'public', '{}')
) AS g (ord, role, privs)
ORDER BY g.ord;
SELECT tables_are(
    'ql3_ai',
    ARRAY['feature_history', 'model_invocation_starts', 'model_invocation_completions',
          'model_invocation_resolutions', 'usage_ledger', 'resolver_identities'],
    'ql3_ai holds exactly its ledger, the four receipt tables and the resolver identities'
);
SELECT functions_are(
    'ql3_ai',
    ARRAY['admit_invocation', 'admit_in_new_run', 'complete_invocation', 'resolve_invocation', 'recover_expired',
          'usage_summary', '_check_shape', '_checked_digest', '_uuid', '_check_sha256', '_timestamp', '_utc', '_identities',
          '_verify_receipt', '_identity_taken', '_write_completion', '_require_resolution', '_admit',
          '_completion_valid'],
    'ql3_ai holds exactly these functions (each is covered by the privilege matrix below)'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE (p.pronamespace = 'ql3_ai'::regnamespace OR p.oid IN ('ql3.create_run(text, text, uuid)'::regprocedure,
                                                                   'ql3.add_step_run(uuid, text, uuid)'::regprocedure))
        AND (p.proacl IS NULL OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) AS a WHERE a.grantee = 0))$$,
    'PUBLIC may execute none of the new functions'
);
SELECT set_eq(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE (p.pronamespace = 'ql3_ai'::regnamespace OR p.oid IN ('ql3.create_run(text, text, uuid)'::regprocedure,
                                                                   'ql3.add_step_run(uuid, text, uuid)'::regprocedure))
        AND p.prosecdef$$,
    ARRAY['ql3.create_run(text,text,uuid)', 'ql3.add_step_run(uuid,text,uuid)', 'ql3_ai.admit_invocation(jsonb)',
          'ql3_ai.admit_in_new_run(jsonb)', 'ql3_ai.complete_invocation(jsonb)', 'ql3_ai.resolve_invocation(jsonb)',
          'ql3_ai.recover_expired(integer,interval)'],
    'exactly the new functions that write are SECURITY DEFINER: they run as ql3_owner, the only writer (D46)'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.oid IN ('ql3.create_run(text, text, uuid)'::regprocedure, 'ql3.add_step_run(uuid, text, uuid)'::regprocedure,
                      'ql3_ai.admit_invocation(jsonb)'::regprocedure, 'ql3_ai.admit_in_new_run(jsonb)'::regprocedure,
                      'ql3_ai.complete_invocation(jsonb)'::regprocedure,
                      'ql3_ai.resolve_invocation(jsonb)'::regprocedure,
                      'ql3_ai.recover_expired(integer, interval)'::regprocedure)
        AND NOT coalesce(p.proconfig @> ARRAY['search_path=pg_catalog, ql3, pg_temp'], FALSE)$$,
    'every SECURITY DEFINER entry point pins search_path = pg_catalog, ql3, pg_temp (pg_temp last)'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.oid = 'ql3_ai.usage_summary(text, timestamptz, timestamptz)'::regprocedure
        AND NOT coalesce(p.proconfig @> ARRAY['search_path=pg_catalog, ql3'], FALSE)$$,
    'usage_summary (SECURITY INVOKER, it only reads) pins search_path = pg_catalog, ql3'
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
    'ql3_ai', 'model_invocation_starts', 'model_invocation_starts_recent',
    ARRAY['admitted_at', 'invocation_id'], 'starts have an index for the newest-first listing'
);
SELECT has_index(
    'ql3_ai', 'model_invocation_completions', 'model_invocation_completions_history',
    ARRAY['run_id', 'step_run_id', 'completed_at', 'invocation_id'], 'completions have a plain history index'
);

-- Tables: one row per table, one column per role --------------------------------------------
-- Reads only: no role but the owner writes, changes or locks a run, a step or a receipt
-- (D46); the functions of each role's job are its writers. Every role reads the ledger.

CREATE TABLE tests.expected_table_privs AS
SELECT
    t.ord AS table_ord,
    t.schema_name::name AS schema_name,
    t.table_name::name AS table_name,
    g.ord AS role_ord,
    g.role::name AS role,
    g.privs::name [] AS privs
FROM (VALUES
    (1, 'ql3', 'runs', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    (2, 'ql3', 'step_runs', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    (3, 'ql3', 'run_events', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    (4, 'ql3', 'step_run_mutations', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    (5, 'ql3_ai', 'feature_history', '{SELECT}', '{SELECT}', '{SELECT}', '{SELECT}', '{}'),
    (6, 'ql3_ai', 'model_invocation_starts', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    (7, 'ql3_ai', 'model_invocation_completions', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    (8, 'ql3_ai', 'model_invocation_resolutions', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    (9, 'ql3_ai', 'usage_ledger', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    -- Who may resolve as whom (D47): the owner's to map, the operators' to read.
    (10, 'ql3_ai', 'resolver_identities', '{}', '{}', '{SELECT}', '{}', '{}')
) AS t (ord, schema_name, table_name, runtime, relay, operator, reader, public)
CROSS JOIN LATERAL (VALUES
    (1, 'ql3_runtime', t.runtime),
    (2, 'ql3_relay', t.relay),
    (3, 'ql3_operator', t.operator),
    (4, 'ql3_reader', t.reader),
    (5, 'public', t.public)
) AS g (ord, role, privs);

SELECT table_owner_is(
    e.schema_name, e.table_name, 'ql3_owner', format('ql3_owner owns %s.%s', e.schema_name, e.table_name)
)
FROM tests.expected_table_privs AS e
WHERE e.role_ord = 1  -- one row per table
ORDER BY e.table_ord;

SELECT table_privs_are(
    e.schema_name, e.table_name, e.role, e.privs,
    format('%s has exactly %s on table %s.%s', e.role, e.privs, e.schema_name, e.table_name)
)
FROM tests.expected_table_privs AS e
ORDER BY e.table_ord, e.role_ord;

-- No column-level grant hides behind the table-level ones (a column-level UPDATE on a
-- receipt would let its holder lock receipt rows).
SELECT any_column_privs_are(
    e.schema_name, e.table_name, e.role, tests.column_privs(e.privs, '{}'),
    format('%s has exactly %s on the columns of %s.%s', e.role, tests.column_privs(e.privs, '{}'), e.schema_name,
           e.table_name)
)
FROM tests.expected_table_privs AS e
ORDER BY e.table_ord, e.role_ord;

-- Functions: one row per function, with the roles that may execute it ----------------------
-- The `_` helpers (trigger functions included: a trigger fires without EXECUTE) are the
-- owner's alone: the functions that call them run as their owner (D46).

SELECT function_privs_are(
    f.schema_name, f.function_name, f.args, g.role,
    CASE WHEN g.role = any(f.grantees) THEN '{EXECUTE}'::name [] ELSE '{}'::name [] END,
    format('%s %s execute %s.%s(%s)', g.role,
           CASE WHEN g.role = any(f.grantees) THEN 'may' ELSE 'may not' END,
           f.schema_name, f.function_name, array_to_string(f.args, ', '))
)
FROM (VALUES
    (1, 'ql3', 'create_run', '{text,text,uuid}'::name [], '{ql3_runtime}'::name []),
    (2, 'ql3', 'add_step_run', '{uuid,text,uuid}', '{ql3_runtime}'),
    (3, 'ql3', '_now', '{}', '{}'),
    (4, 'ql3_ai', 'admit_invocation', '{jsonb}', '{ql3_runtime}'),
    (5, 'ql3_ai', 'complete_invocation', '{jsonb}', '{ql3_runtime}'),
    -- Resolution and recovery are the operator's: the runtime never settles its own outcomes.
    (6, 'ql3_ai', 'resolve_invocation', '{jsonb}', '{ql3_operator}'),
    (7, 'ql3_ai', 'recover_expired', '{integer,interval}', '{ql3_operator}'),
    (8, 'ql3_ai', 'usage_summary', '{text,timestamptz,timestamptz}', '{ql3_runtime,ql3_operator,ql3_reader}'),
    (9, 'ql3_ai', '_check_shape', '{text,jsonb,text,"text[]","text[]"}', '{}'),
    (10, 'ql3_ai', '_checked_digest', '{text,text,jsonb}', '{}'),
    (11, 'ql3_ai', '_uuid', '{text,text}', '{}'),
    (12, 'ql3_ai', '_check_sha256', '{text,text}', '{}'),
    (13, 'ql3_ai', '_timestamp', '{text,text}', '{}'),
    (14, 'ql3_ai', '_utc', '{timestamptz}', '{}'),
    (15, 'ql3_ai', '_identities', '{text,text}', '{}'),
    (16, 'ql3_ai', '_verify_receipt', '{text,text,jsonb,text}', '{}'),
    (17, 'ql3_ai', '_write_completion', '{ql3_ai.model_invocation_starts,bigint,jsonb,text,boolean}', '{}'),
    (18, 'ql3_ai', '_require_resolution', '{}', '{}'),
    (19, 'ql3', '_refuse_step_transition', '{}', '{}'),
    (20, 'ql3_ai', '_identity_taken', '{text,text,text}', '{}'),
    (21, 'ql3_ai', 'admit_in_new_run', '{jsonb}', '{ql3_runtime}'),
    (22, 'ql3_ai', '_admit', '{jsonb,boolean}', '{}'),
    -- The CHECK and WHEN helpers (D67): a constraint or a trigger's WHEN runs them as the
    -- writer, and only the owner's functions write these tables.
    (23, 'ql3', '_step_state_valid', '{text,text,text,text}', '{}'),
    (24, 'ql3', '_step_transition_refused', '{text,text}', '{}'),
    (25, 'ql3_ai', '_completion_valid', '{text,text,boolean}', '{}')
) AS f (ord, schema_name, function_name, args, grantees)
CROSS JOIN (VALUES
    (1, 'ql3_runtime'::name), (2, 'ql3_relay'), (3, 'ql3_operator'), (4, 'ql3_reader'), (5, 'public')
) AS g (ord, role)
ORDER BY f.ord, g.ord;

-- Row-level security (D47) ------------------------------------------------------------------
-- Every table of runs and receipts has row-level security, not forced (the owner's functions
-- read every row), with one permissive SELECT policy for every role; the resolutions record
-- the login that resolved. 17_isolation.sql tests what the policies let each login read.

CREATE TEMP TABLE rls_tables (ord, schema_name, table_name) AS
VALUES
    (1, 'ql3', 'runs'),
    (2, 'ql3', 'step_runs'),
    (3, 'ql3', 'run_events'),
    (4, 'ql3', 'step_run_mutations'),
    (5, 'ql3_ai', 'model_invocation_starts'),
    (6, 'ql3_ai', 'model_invocation_completions'),
    (7, 'ql3_ai', 'model_invocation_resolutions'),
    (8, 'ql3_ai', 'usage_ledger');

SELECT ok(
    (SELECT c.relrowsecurity AND NOT c.relforcerowsecurity FROM pg_class AS c
     WHERE c.oid = format('%I.%I', t.schema_name, t.table_name)::regclass),
    format('%s.%s has row-level security, not forced (its owner reads every row)', t.schema_name, t.table_name)
)
FROM rls_tables AS t ORDER BY t.ord;
SELECT policies_are(
    t.schema_name, t.table_name, ARRAY['project_rows'],
    format('%s.%s has exactly one policy, project_rows', t.schema_name, t.table_name)
)
FROM rls_tables AS t ORDER BY t.ord;
SELECT policy_cmd_is(
    t.schema_name, t.table_name, 'project_rows', 'SELECT',
    format('%s.%s.project_rows is FOR SELECT', t.schema_name, t.table_name)
)
FROM rls_tables AS t ORDER BY t.ord;
SELECT ok(
    (SELECT p.polroles = '{0}'::oid [] AND p.polpermissive FROM pg_policy AS p
     WHERE p.polrelid = format('%I.%I', t.schema_name, t.table_name)::regclass AND p.polname = 'project_rows'),
    format('%s.%s.project_rows is permissive and applies to every role (PUBLIC)', t.schema_name, t.table_name)
)
FROM rls_tables AS t ORDER BY t.ord;
SELECT ok(
    NOT (SELECT c.relrowsecurity FROM pg_class AS c WHERE c.oid = 'ql3_ai.resolver_identities'::regclass),
    'ql3_ai.resolver_identities has no row-level security (only operators read it)'
);
SELECT col_not_null(
    'ql3_ai', 'model_invocation_resolutions', 'resolved_by', 'every resolution records the login that made it'
);
SELECT col_type_is(
    'ql3_ai', 'model_invocation_resolutions', 'resolved_by', 'name', 'resolved_by is a role name'
);

-- Refusals: one row per statement a role's grants must not permit --------------------------
-- Whatever the rows: the privilege check comes first. Locking a row in any mode needs
-- UPDATE, so no role but the owner can lock a run, a step, a receipt or a run event.

CREATE TABLE tests.refusals AS
SELECT
    g.role::name AS role,
    row_number() OVER (PARTITION BY g.role ORDER BY t.ord, s.ord) AS ord,
    format(s.statement, t.schema_name, t.table_name, t.column_name) AS statement,
    format('%s cannot %s %s.%s%s', g.role, s.verb, t.schema_name, t.table_name, s.suffix) AS description
FROM (VALUES
    (1, 'ql3_ai', 'model_invocation_starts', 'invocation_id'),
    (2, 'ql3_ai', 'model_invocation_completions', 'invocation_id'),
    (3, 'ql3_ai', 'model_invocation_resolutions', 'invocation_id'),
    (4, 'ql3_ai', 'usage_ledger', 'invocation_id'),
    (5, 'ql3', 'run_events', 'event_id'),
    (6, 'ql3', 'step_run_mutations', 'mutation_id'),
    (7, 'ql3', 'runs', 'run_id'),
    (8, 'ql3', 'step_runs', 'step_run_id'),
    (9, 'ql3_ai', 'resolver_identities', 'user_id')
) AS t (ord, schema_name, table_name, column_name)
CROSS JOIN (VALUES
    (0, 'INSERT INTO %1$I.%2$I DEFAULT VALUES', 'INSERT into', ''),
    (1, 'UPDATE %1$I.%2$I SET %3$I = %3$I', 'UPDATE', ''),
    (2, 'DELETE FROM %1$I.%2$I', 'DELETE from', ''),
    (3, 'TRUNCATE %1$I.%2$I', 'TRUNCATE', ''),
    (4, 'SELECT 1 FROM %1$I.%2$I FOR UPDATE', 'lock', ' FOR UPDATE'),
    (5, 'SELECT 1 FROM %1$I.%2$I FOR NO KEY UPDATE', 'lock', ' FOR NO KEY UPDATE'),
    (6, 'SELECT 1 FROM %1$I.%2$I FOR SHARE', 'lock', ' FOR SHARE'),
    (7, 'SELECT 1 FROM %1$I.%2$I FOR KEY SHARE', 'lock', ' FOR KEY SHARE')
) AS s (ord, statement, verb, suffix)
CROSS JOIN (VALUES ('ql3_runtime'), ('ql3_relay'), ('ql3_operator'), ('ql3_reader')) AS g (role);
GRANT SELECT ON tests.refusals TO PUBLIC;  -- noqa: CP02

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
SELECT throws_ok(r.statement, '42501', NULL, r.description)
FROM tests.refusals AS r WHERE r.role = 'ql3_runtime' ORDER BY r.ord;

SET ROLE ql3_operator;
SELECT lives_ok(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('inv-1', 'retry', 'alice'))$$, 'the operator resolves'
);
SELECT is(
    (SELECT r.user_id || ' by ' || r.resolved_by FROM ql3_ai.model_invocation_resolutions AS r
     WHERE r.invocation_id = 'inv-1'),
    'alice by ' || session_user,
    'the resolution records the login (session_user, not the role SET ROLE chose) beside the user_id'
);
SELECT is(
    (ql3_ai.recover_expired(10, interval '0') ->> 'count')::integer, 2, 'the operator recovers'
);
SELECT lives_ok(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, NULL)$$, 'the operator reads the usage summary'
);
SELECT lives_ok(
    $$SELECT * FROM ql3_ai.resolver_identities$$, 'the operator reads the resolver identities'
);
SELECT throws_ok(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-9', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000001', 4))$$,
    '42501', NULL, 'the operator does not admit model calls'
);
SELECT throws_ok(r.statement, '42501', NULL, r.description)
FROM tests.refusals AS r WHERE r.role = 'ql3_operator' ORDER BY r.ord;

SET ROLE ql3_reader;
SELECT lives_ok(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, NULL)$$, 'the reader reads the usage summary'
);
SELECT throws_ok(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-2'))$$, '42501', NULL, 'the reader cannot complete'
);
SELECT throws_ok(r.statement, '42501', NULL, r.description)
FROM tests.refusals AS r WHERE r.role = 'ql3_reader' ORDER BY r.ord;

SET ROLE ql3_relay;
SELECT throws_ok(
    $$SELECT count(*) FROM ql3_ai.model_invocation_starts$$, '42501', NULL, 'the relay cannot read receipts'
);
SELECT throws_ok(
    $$SELECT count(*) FROM ql3_ai.resolver_identities$$, '42501', NULL, 'the relay cannot read the resolver identities'
);
SELECT throws_ok(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, NULL)$$, '42501', NULL, 'the relay cannot read usage'
);
SELECT throws_ok(r.statement, '42501', NULL, r.description)
FROM tests.refusals AS r WHERE r.role = 'ql3_relay' ORDER BY r.ord;

-- Receipts are immutable for the owner too.

SET ROLE ql3_owner;
SELECT throws_ok(
    format(s.statement, t.table_name), 'Q3S01', NULL,
    format('ql3_ai.%s refuses %s, even by the owner', t.table_name, s.verb)
)
FROM (VALUES
    (1, 'model_invocation_starts'),
    (2, 'model_invocation_completions'),
    (3, 'model_invocation_resolutions'),
    (4, 'usage_ledger')
) AS t (ord, table_name)
CROSS JOIN (VALUES
    (1, 'UPDATE ql3_ai.%1$I SET invocation_id = invocation_id', 'UPDATE'),
    (2, 'DELETE FROM ql3_ai.%1$I', 'DELETE'),
    -- CASCADE: without it the foreign keys refuse first, and the trigger is what is tested.
    (3, 'TRUNCATE ql3_ai.%1$I CASCADE', 'TRUNCATE')
) AS s (ord, statement, verb)
ORDER BY t.ord, s.ord;

RESET ROLE;
SELECT * FROM finish();
ROLLBACK;
