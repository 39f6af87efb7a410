-- Privileges of the contract core (SPEC 5, D46, D47): the ledger and contract tables of
-- sql/core/0002_contracts.sql (project_grants included), the outbox's sequence, the
-- functions of sql/core/0001_canonical.sql and sql/core/0002_contracts.sql, and the
-- row-level security of the contract tables (17_isolation.sql tests what it does).
--
-- One trust boundary (D46): every role reads, and writes only through the functions of its
-- job, which run as ql3_owner (SECURITY DEFINER, search_path pinned with pg_temp last).
-- Scope: exactly those tables and functions. Tables and functions of later migrations
-- (runs, step_runs, ...) get their own privilege file; the schema-wide checks at the end
-- cover them too, and 15b_privilege_catalog.sql holds the exact lists of both schemas.
BEGIN;
SELECT plan(343);
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
    ('contract_outbox', '{}', '{SELECT}', '{SELECT}', '{SELECT}', '{}'),
    -- Project isolation (D47): operators read who may act on what, and change it only
    -- through grant_project and revoke_project.
    ('project_grants', '{}', '{}', '{SELECT}', '{}', '{}')
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
    (29, '_notify_outbox', '{}', '{}'),
    -- Project isolation (D47): every role may ask what it may act on; operators map projects.
    (30, 'may_act_on', '{text}', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'),
    (31, 'visible_projects', '{}', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'),
    (32, 'grant_project', '{name,text}', '{ql3_operator}'),
    (33, 'revoke_project', '{name,text}', '{ql3_operator}'),
    (34, '_may_act', '{text}', '{}'),
    (35, '_refuse_project', '{text,text}', '{}'),
    (36, '_session_is_member', '{name}', '{}'),
    (37, '_refuse_too_large', '{text,jsonb}', '{}'),
    -- Outbox retention (D55).
    (38, 'prune_outbox', '{interval,integer}', '{ql3_operator}')
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

-- SECURITY DEFINER and row-level security (D46, D47) ---------------------------------------
-- The functions that write, the canonical and identity functions, the project functions and
-- the backlog (which counts every project) run as ql3_owner. Every contract table that holds
-- a project's rows has row-level security, not forced (so that the owner's functions read
-- every row), with one SELECT policy for every role: the rows of the projects it may act on.

SELECT set_eq(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.pronamespace = 'ql3'::regnamespace AND p.prosecdef
        AND p.oid NOT IN ('ql3.create_run(text, text, uuid)'::regprocedure,
                          'ql3.add_step_run(uuid, text, uuid)'::regprocedure)$$,
    ARRAY['ql3.jcs(jsonb)', 'ql3.digest(text,jsonb)', 'ql3.parse_json(text)', 'ql3.mutation_id(text,text)',
          'ql3.event_id(text,text)', 'ql3.dedupe_key(text,text)', 'ql3.put_revision(text,text,text,jsonb,text)',
          'ql3.activate_revision(text,text,text,uuid,text,uuid)', 'ql3.revoke_revision(uuid,text,text)',
          'ql3.claim_outbox(integer)', 'ql3.mark_outbox_delivered(bigint[])', 'ql3.mark_outbox_failed(bigint[],text)',
          'ql3.outbox_backlog()', 'ql3.prune_outbox(interval,integer)', 'ql3.may_act_on(text)', 'ql3.visible_projects()', 'ql3.grant_project(name,text)',
          'ql3.revoke_project(name,text)'],
    'exactly these functions of 0001 and 0002 are SECURITY DEFINER'
);

SELECT ok(
    (SELECT c.relrowsecurity AND NOT c.relforcerowsecurity FROM pg_class AS c WHERE c.oid = format('ql3.%I', t.table_name)::regclass),
    format('ql3.%s has row-level security, not forced (its owner reads every row)', t.table_name)
)
FROM (VALUES (1, 'contract_revisions'), (2, 'revision_revocations'), (3, 'active_revisions'), (4, 'contract_outbox'))
    AS t (ord, table_name)
ORDER BY t.ord;
SELECT policies_are('ql3', t.table_name, ARRAY['project_rows'], format('ql3.%s has exactly one policy, project_rows', t.table_name))
FROM (VALUES (1, 'contract_revisions'), (2, 'revision_revocations'), (3, 'active_revisions'), (4, 'contract_outbox'))
    AS t (ord, table_name)
ORDER BY t.ord;
SELECT policy_cmd_is('ql3', t.table_name, 'project_rows', 'SELECT', format('ql3.%s.project_rows is FOR SELECT', t.table_name))
FROM (VALUES (1, 'contract_revisions'), (2, 'revision_revocations'), (3, 'active_revisions'), (4, 'contract_outbox'))
    AS t (ord, table_name)
ORDER BY t.ord;
SELECT ok(
    (SELECT p.polroles = '{0}'::oid [] AND p.polpermissive FROM pg_policy AS p
     WHERE p.polrelid = format('ql3.%I', t.table_name)::regclass AND p.polname = 'project_rows'),
    format('ql3.%s.project_rows is permissive and applies to every role (PUBLIC)', t.table_name)
)
FROM (VALUES (1, 'contract_revisions'), (2, 'revision_revocations'), (3, 'active_revisions'), (4, 'contract_outbox'))
    AS t (ord, table_name)
ORDER BY t.ord;
SELECT ok(
    NOT (SELECT c.relrowsecurity FROM pg_class AS c WHERE c.oid = 'ql3.project_grants'::regclass),
    'ql3.project_grants has no row-level security (only operators read it)'
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
SELECT throws_ok(
    $$SELECT ql3.grant_project('ql3_runtime', 'tap06-rt')$$,
    '42501', NULL, 'ql3_runtime cannot grant itself a project'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.project_grants$$,
    '42501', NULL, 'ql3_runtime cannot read the project grants'
);
SELECT is(
    (SELECT ql3.visible_projects() IS NULL AND ql3.may_act_on('tap06-rt')),
    TRUE,
    'ql3_runtime may act on every project while no project is granted (single tenant, D47)'
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
SELECT lives_ok($$SELECT ql3.visible_projects()$$, 'ql3_relay may ask which projects it may act on');
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
SELECT lives_ok($$SELECT * FROM ql3.project_grants$$, 'ql3_operator reads the project grants');
SELECT throws_ok(
    $$INSERT INTO ql3.project_grants (role_name, project_id, granted_by) VALUES ('ql3_operator', NULL, 'op')$$,
    '42501', NULL, 'ql3_operator cannot grant itself every project by INSERT'
);
SELECT throws_ok(
    $$DELETE FROM ql3.project_grants$$,
    '42501', NULL, 'ql3_operator cannot delete project grants (turning isolation off)'
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
SELECT throws_ok(
    $$SELECT ql3.revoke_project('ql3_reader', NULL)$$,
    '42501', NULL, 'ql3_reader cannot revoke project grants'
);

RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
