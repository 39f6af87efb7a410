-- Privileges of the contract core (SPEC 5, D46): the ledger and contract tables of
-- sql/core/0002_contracts.sql, the outbox's sequence, and the functions of
-- sql/core/0001_canonical.sql and sql/core/0002_contracts.sql.
--
-- One trust boundary (D46): every role reads, and writes only through the functions of its
-- job, which run as ql3_owner (SECURITY DEFINER, search_path pinned with pg_temp last).
-- Scope: exactly those tables and functions. Tables and functions of later migrations
-- (runs, step_runs, ...) get their own privilege file; the schema-wide checks at the end
-- cover them too, and 15b_privilege_catalog.sql holds the exact lists of both schemas.
BEGIN;
SELECT plan(261);
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
-- Reads only (D46): the functions are the writers, running as ql3_owner. Every role reads
-- the migration ledger.

CREATE TABLE tests.expected_table_privs AS
SELECT
    t.table_name::name AS table_name,
    g.role::name AS role,
    g.privs::name [] AS privs
FROM (VALUES
    ('schema_history', '{SELECT}', '{SELECT}', '{SELECT}', '{SELECT}', '{}'),
    ('contract_families', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    ('contract_revisions', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    ('revision_revocations', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    ('active_revisions', '{SELECT}', '{}', '{SELECT}', '{SELECT}', '{}'),
    ('contract_outbox', '{}', '{SELECT}', '{SELECT}', '{SELECT}', '{}')
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

-- No column-level grant hides behind the table-level ones (the relay's former UPDATE of the
-- outbox delivery columns is gone: mark_outbox_delivered and mark_outbox_failed write them).
SELECT any_column_privs_are(
    'ql3', e.table_name, e.role, tests.column_privs(e.privs, '{}'),
    format('%s has exactly %s on the columns of ql3.%s', e.role, tests.column_privs(e.privs, '{}'), e.table_name)
)
FROM tests.expected_table_privs AS e
ORDER BY e.table_name, e.role;

-- The outbox's sequence: nobody but its owner may use, read or advance it.
SELECT sequence_owner_is(
    'ql3', 'contract_outbox_seq_seq', 'ql3_owner', 'ql3_owner owns sequence ql3.contract_outbox_seq_seq'
);
SELECT sequence_privs_are(
    'ql3', 'contract_outbox_seq_seq', g.role, '{}'::name [],
    format('%s has no privilege on sequence ql3.contract_outbox_seq_seq', g.role)
)
FROM (VALUES
    (1, 'ql3_runtime'::name), (2, 'ql3_relay'), (3, 'ql3_operator'), (4, 'ql3_reader'), (5, 'public')
) AS g (ord, role)
ORDER BY g.ord;

-- Functions: one row per function of 0001_canonical.sql and 0002_contracts.sql -------------
-- with the roles that may execute it. Every `_` helper (trigger functions included: a
-- trigger fires without EXECUTE) is the owner's alone: the public functions that call one
-- run as its owner.

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
    (17, '_jcs_sort_key', '{text}', '{}'),
    (18, '_jcs_number', '{text}', '{}'),
    (19, '_jcs_value', '{jsonb,integer}', '{}'),
    (20, '_framed_digest', '{text,text}', '{}'),
    (21, '_identity', '{text,text,text,text}', '{}'),
    (22, '_uuid_v7', '{}', '{}'),
    (23, '_check_identifier', '{text,text}', '{}'),
    (24, '_check_family', '{text}', '{}'),
    (25, '_lock_pointer', '{text,text,text,text}', '{}'),
    (26, '_revision_of', '{uuid}', '{}'),
    (27, '_reject_mutation', '{}', '{}'),
    (28, '_guard_outbox', '{}', '{}'),
    (29, '_notify_outbox', '{}', '{}')
) AS f (ord, function_name, args, grantees)
CROSS JOIN (VALUES
    (1, 'ql3_runtime'::name), (2, 'ql3_relay'), (3, 'ql3_operator'), (4, 'ql3_reader'), (5, 'public')
) AS g (ord, role)
ORDER BY f.ord, g.ord;

-- Schema-wide rules for every function in ql3 -----------------------------------------------
-- (15b_privilege_catalog.sql holds the exact lists for both schemas.)

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
      WHERE n.nspname = 'ql3' AND p.proacl IS NOT NULL
        AND starts_with(p.proname, '_')
        AND EXISTS (SELECT 1 FROM aclexplode(p.proacl) AS a WHERE a.grantee <> p.proowner)$$,
    'no role but the owner may execute a `_` function in schema ql3'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text
      FROM pg_proc AS p
      INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
      WHERE n.nspname = 'ql3' AND NOT starts_with(p.proname, '_')
        AND NOT coalesce(
            CASE WHEN p.prosecdef THEN 'search_path=pg_catalog, ql3, pg_temp'
                 ELSE 'search_path=pg_catalog, ql3' END = ANY(p.proconfig),
            FALSE)$$,
    'every public function in schema ql3 pins search_path: pg_catalog, ql3, and pg_temp last when SECURITY DEFINER'
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
    'ql3_relay claims outbox rows (through claim_outbox, which runs as the owner)'
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
    $$UPDATE ql3.contract_outbox SET delivered_at = NULL WHERE project_id = 'tap06-relay'$$,
    '42501', NULL, 'ql3_relay cannot update contract_outbox.delivered_at by hand'
);
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
