-- Privileges of the contract core (SPEC 5): the ledger and contract tables of
-- sql/core/0002_contracts.sql and the canonical functions of sql/core/0001_canonical.sql.
--
-- Scope: exactly those tables and functions. Tables and functions of later migrations
-- (runs, step_runs, ...) get their own privilege file; the schema-wide checks at the end
-- (no PUBLIC execute, no SECURITY DEFINER, pinned search_path, ownership) cover them too.
BEGIN;
SELECT plan(194);
SET LOCAL client_min_messages = warning;

\ir lib/privilege_helpers.sql

-- Roles and schema ---------------------------------------------------------------------------

SELECT ok(
    NOT (SELECT r.rolcanlogin FROM pg_roles AS r WHERE r.rolname = g.role),
    format('role %s exists and is NOLOGIN', g.role)
)
FROM unnest(ARRAY['ql3_owner', 'ql3_runtime', 'ql3_relay', 'ql3_operator', 'ql3_reader']) AS g (role);

SELECT schema_owner_is('ql3', 'ql3_owner', 'ql3_owner owns schema ql3');

SELECT schema_privs_are('ql3', g.role, g.privs, format('%s has %s on schema ql3', g.role, g.privs))
FROM (VALUES
    ('ql3_runtime', '{USAGE}'::name []),
    ('ql3_relay', '{USAGE}'),
    ('ql3_operator', '{USAGE}'),
    ('ql3_reader', '{USAGE}'),
    ('public', '{}')
) AS g (role, privs);

-- Tables: one row per table, one column per role --------------------------------------------

CREATE TABLE tests.expected_table_privs AS
SELECT
    t.table_name::name AS table_name,
    g.role::name AS role,
    g.privs::name [] AS privs
FROM (VALUES
    ('schema_history', '{}', '{}', '{}', '{SELECT}', '{}'),
    ('contract_families', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    ('contract_revisions', '{SELECT}', '{}', '{SELECT,INSERT}', '{SELECT}', '{}'),
    ('revision_revocations', '{SELECT}', '{}', '{SELECT,INSERT}', '{SELECT}', '{}'),
    ('active_revisions', '{SELECT}', '{}', '{SELECT,INSERT,UPDATE}', '{SELECT}', '{}'),
    ('contract_outbox', '{}', '{SELECT}', '{SELECT,INSERT}', '{SELECT}', '{}')
) AS t (table_name, runtime, relay, operator, reader, public)
CROSS JOIN LATERAL (VALUES
    (1, 'ql3_runtime', t.runtime),
    (2, 'ql3_relay', t.relay),
    (3, 'ql3_operator', t.operator),
    (4, 'ql3_reader', t.reader),
    (5, 'public', t.public)
) AS g (ord, role, privs)
ORDER BY t.table_name, g.ord;

SELECT table_owner_is('ql3', t.table_name, 'ql3_owner', format('ql3_owner owns ql3.%s', t.table_name))
FROM (SELECT DISTINCT e.table_name FROM tests.expected_table_privs AS e) AS t
ORDER BY t.table_name;

SELECT table_privs_are(
    'ql3', e.table_name, e.role, e.privs,
    format('%s has exactly %s on table ql3.%s', e.role, e.privs, e.table_name)
)
FROM tests.expected_table_privs AS e
ORDER BY e.table_name, e.role;

-- No column-level grant hides behind the table-level ones, except the relay's UPDATE of
-- the outbox delivery columns (checked column by column below).
SELECT any_column_privs_are(
    'ql3', e.table_name, e.role, tests.column_privs(e.privs, c.extra),
    format('%s has exactly %s on the columns of ql3.%s', e.role, tests.column_privs(e.privs, c.extra), e.table_name)
)
FROM tests.expected_table_privs AS e
CROSS JOIN LATERAL (
    VALUES (CASE WHEN (e.table_name, e.role) = ('contract_outbox', 'ql3_relay') THEN '{UPDATE}' ELSE '{}' END::name [])
) AS c (extra)
ORDER BY e.table_name, e.role;

SELECT column_privs_are(
    'ql3', 'contract_outbox', c.column_name, 'ql3_relay', c.privs,
    format('ql3_relay has exactly %s on column ql3.contract_outbox.%s', c.privs, c.column_name)
)
FROM (VALUES
    ('seq', '{SELECT}'::name []),
    ('event_id', '{SELECT}'),
    ('event_type', '{SELECT}'),
    ('project_id', '{SELECT}'),
    ('contract_family', '{SELECT}'),
    ('contract_id', '{SELECT}'),
    ('old_revision_id', '{SELECT}'),
    ('new_revision_id', '{SELECT}'),
    ('pointer_version', '{SELECT}'),
    ('created_at', '{SELECT}'),
    ('delivered_at', '{SELECT,UPDATE}'),
    ('relay_attempts', '{SELECT,UPDATE}'),
    ('last_error', '{SELECT,UPDATE}')
) AS c (column_name, privs);

-- Functions: one row per public function, with the roles that may execute it ---------------

SELECT function_privs_are(
    'ql3', f.function_name, f.args, g.role,
    CASE WHEN g.role = any(f.grantees) THEN '{EXECUTE}'::name [] ELSE '{}'::name [] END,
    format('%s %s execute ql3.%s(%s)', g.role,
           CASE WHEN g.role = any(f.grantees) THEN 'may' ELSE 'may not' END,
           f.function_name, array_to_string(f.args, ', '))
)
FROM (VALUES
    (1, 'jcs', '{jsonb}'::name [], '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'::name []),
    (2, 'digest', '{text,jsonb}', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'),
    (3, 'parse_json', '{text}', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'),
    (4, 'mutation_id', '{text,text}', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'),
    (5, 'event_id', '{text,text}', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'),
    (6, 'dedupe_key', '{text,text}', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'),
    (7, 'put_revision', '{text,text,text,jsonb,text}', '{ql3_operator}'),
    (8, 'activate_revision', '{text,text,text,uuid,text,uuid}', '{ql3_operator}'),
    (9, 'revoke_revision', '{uuid,text,text}', '{ql3_operator}'),
    (10, 'active_revision', '{text,text,text}', '{ql3_runtime,ql3_operator,ql3_reader}'),
    (11, 'active_pointers', '{jsonb}', '{ql3_runtime,ql3_operator,ql3_reader}'),
    (12, 'claim_outbox', '{integer}', '{ql3_relay}'),
    (13, 'mark_outbox_delivered', '{bigint[]}', '{ql3_relay}'),
    (14, 'mark_outbox_failed', '{bigint[],text}', '{ql3_relay}'),
    (15, 'outbox_backlog', '{}', '{ql3_relay,ql3_operator,ql3_reader}'),
    (16, 'wake_relays', '{}', '{ql3_operator}'),
    -- A helper of put_revision and activate_revision only: no runtime-callable function
    -- checks a family against ql3.contract_families, so the runtime has no EXECUTE on it.
    (17, '_check_family', '{text}', '{ql3_operator}'),
    -- The outbox's event_id default: whoever may insert an outbox row must be able to run it.
    (18, '_uuid_v7', '{}', '{ql3_operator}')
) AS f (ord, function_name, args, grantees)
CROSS JOIN (VALUES
    (1, 'ql3_runtime'::name), (2, 'ql3_relay'), (3, 'ql3_operator'), (4, 'ql3_reader')
) AS g (ord, role)
ORDER BY f.ord, g.ord;

-- Schema-wide rules for every function in ql3 -----------------------------------------------

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text
      FROM pg_proc AS p
      INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
      WHERE n.nspname = 'ql3'
        AND (p.proacl IS NULL  -- NULL means the default: EXECUTE for PUBLIC
             OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) AS a
                        WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'))$$,
    'PUBLIC can execute no function in schema ql3'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text
      FROM pg_proc AS p
      INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
      WHERE n.nspname = 'ql3' AND p.prosecdef$$,
    'no function in schema ql3 is SECURITY DEFINER: the grants are what permit the work'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text
      FROM pg_proc AS p
      INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
      WHERE n.nspname = 'ql3' AND NOT starts_with(p.proname, '_')
        AND NOT coalesce('search_path=pg_catalog, ql3' = ANY(p.proconfig), FALSE)$$,
    'every public function in schema ql3 pins search_path = pg_catalog, ql3'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text
      FROM pg_proc AS p
      INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
      WHERE n.nspname = 'ql3' AND p.proowner <> 'ql3_owner'::regrole$$,
    'ql3_owner owns every function in schema ql3'
);

-- Behaviour under each role ------------------------------------------------------------------

-- An undelivered outbox row for the relay, made by the test superuser.
SELECT ql3.activate_revision('tap06-relay', 'policy_routing', 'c1', r.revision_id, 'setup')
FROM ql3.put_revision('tap06-relay', 'policy_routing', 'c1', '{"v": 1}', 'setup') AS r;

SET LOCAL ROLE ql3_runtime;

SELECT throws_ok(
    $$SELECT ql3.put_revision('tap06-rt', 'policy_routing', 'c1', '{"v": 1}', 'rt')$$,
    '42501', NULL, 'ql3_runtime cannot put a revision'
);
SELECT throws_ok(
    $$SELECT ql3.activate_revision('tap06-relay', 'policy_routing', 'c1',
                                   (SELECT revision_id FROM ql3.contract_revisions WHERE project_id = 'tap06-relay'),
                                   'rt')$$,
    '42501', NULL, 'ql3_runtime cannot activate a revision'
);
SELECT throws_ok(
    $$SELECT ql3.revoke_revision(
          (SELECT revision_id FROM ql3.contract_revisions WHERE project_id = 'tap06-relay'), 'rt', 'x')$$,
    '42501', NULL, 'ql3_runtime cannot revoke a revision'
);
SELECT throws_ok(
    $$INSERT INTO ql3.contract_revisions (project_id, contract_family, contract_id, revision_no, body, body_hash,
                                          created_by)
      VALUES ('tap06-rt', 'policy_routing', 'c1', 1, '{}', repeat('0', 64), 'rt')$$,
    '42501', NULL, 'ql3_runtime cannot insert a revision directly'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.contract_revisions FOR UPDATE$$,
    '42501', NULL, 'ql3_runtime cannot lock revisions (no FOR UPDATE on immutable tables)'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.claim_outbox(1)$$,
    '42501', NULL, 'ql3_runtime cannot claim outbox rows'
);
SELECT results_eq(
    $$SELECT revision_id, pointer_version FROM ql3.active_revision('tap06-relay', 'policy_routing', 'c1')$$,
    $$SELECT revision_id, 1::bigint FROM ql3.contract_revisions WHERE project_id = 'tap06-relay'$$,
    'ql3_runtime reads the active revision'
);
SELECT results_eq(
    $$SELECT revision_id, pointer_version FROM ql3.active_pointers('[["tap06-relay", "policy_routing", "c1"]]')$$,
    $$SELECT revision_id, 1::bigint FROM ql3.contract_revisions WHERE project_id = 'tap06-relay'$$,
    'ql3_runtime verifies pointers'
);

RESET ROLE;
SET LOCAL ROLE ql3_relay;

SELECT ok(
    (SELECT count(*) FROM ql3.claim_outbox(10000) AS o WHERE o.project_id = 'tap06-relay') = 1,
    'ql3_relay claims outbox rows (FOR UPDATE with column-level UPDATE only)'
);
SELECT is(
    ql3.mark_outbox_failed(array(SELECT seq FROM ql3.contract_outbox WHERE project_id = 'tap06-relay'), 'redis down'),
    1,
    'ql3_relay marks a row failed'
);
SELECT is(
    ql3.mark_outbox_delivered(array(SELECT seq FROM ql3.contract_outbox WHERE project_id = 'tap06-relay')),
    1,
    'ql3_relay marks a row delivered'
);
SELECT lives_ok($$SELECT * FROM ql3.outbox_backlog()$$, 'ql3_relay reads the backlog');
SELECT throws_ok(
    $$UPDATE ql3.contract_outbox SET project_id = 'elsewhere' WHERE project_id = 'tap06-relay'$$,
    '42501', NULL, 'ql3_relay cannot update contract_outbox.project_id'
);
SELECT throws_ok(
    $$DELETE FROM ql3.contract_outbox WHERE project_id = 'tap06-relay'$$,
    '42501', NULL, 'ql3_relay cannot delete outbox rows, not even delivered ones'
);
SELECT throws_ok(
    $$SELECT ql3.put_revision('tap06-relay', 'policy_routing', 'c1', '{"v": 2}', 'relay')$$,
    '42501', NULL, 'ql3_relay cannot put a revision'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.contract_revisions$$,
    '42501', NULL, 'ql3_relay cannot read revisions'
);

RESET ROLE;
SET LOCAL ROLE ql3_operator;

SELECT lives_ok(
    $$SELECT ql3.put_revision('tap06-op', 'policy_routing', 'c1', '{"v": 1}', 'op')$$,
    'ql3_operator puts a revision'
);
SELECT lives_ok(
    $$SELECT ql3.activate_revision('tap06-op', 'policy_routing', 'c1',
                                   (SELECT revision_id FROM ql3.contract_revisions WHERE project_id = 'tap06-op'),
                                   'op')$$,
    'ql3_operator activates a revision'
);
SELECT lives_ok(
    $$SELECT ql3.revoke_revision(
          (SELECT revision_id FROM ql3.contract_revisions WHERE project_id = 'tap06-op'), 'op', 'rolled back')$$,
    'ql3_operator revokes a revision'
);
SELECT results_eq(
    $$SELECT event_type, pointer_version FROM ql3.contract_outbox WHERE project_id = 'tap06-op' ORDER BY seq$$,
    $$VALUES ('revision_activated', 1::bigint), ('revision_revoked', 2::bigint)$$,
    'the operator''s activation and revocation wrote their outbox rows'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.claim_outbox(1)$$,
    '42501', NULL, 'ql3_operator cannot claim outbox rows'
);
SELECT throws_ok(
    $$UPDATE ql3.contract_outbox SET delivered_at = now() WHERE project_id = 'tap06-op'$$,
    '42501', NULL, 'ql3_operator cannot mark outbox rows delivered'
);
SELECT throws_ok(
    $$UPDATE ql3.contract_revisions SET created_by = 'x' WHERE project_id = 'tap06-op'$$,
    '42501', NULL, 'ql3_operator cannot update revisions (refused before the trigger)'
);

RESET ROLE;
SET LOCAL ROLE ql3_reader;

SELECT is(
    (SELECT count(*) FROM ql3.contract_outbox WHERE project_id = 'tap06-op'),
    2::bigint,
    'ql3_reader reads the outbox'
);
SELECT is_empty(
    $$SELECT * FROM ql3.active_revision('tap06-op', 'policy_routing', 'c1')$$,
    'ql3_reader reads active revisions'
);
SELECT lives_ok($$SELECT * FROM ql3.schema_history$$, 'ql3_reader reads the migration ledger');
SELECT throws_ok(
    $$SELECT ql3.put_revision('tap06-rd', 'policy_routing', 'c1', '{"v": 1}', 'rd')$$,
    '42501', NULL, 'ql3_reader cannot put a revision'
);
SELECT throws_ok(
    $$UPDATE ql3.active_revisions SET pointer_version = pointer_version + 1 WHERE project_id = 'tap06-op'$$,
    '42501', NULL, 'ql3_reader cannot move a pointer'
);

RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
